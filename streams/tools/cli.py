"""The ``scroll`` command line.

Every command that talks to a cluster takes ``--metadata URL`` (or ``SCROLL_METADATA``; default
``etcd://127.0.0.1:2379``). Output is a human table by default and JSON with ``--json``. Towards
secured bookies, the global options ``--tls-ca``, ``--tls-cert``/``--tls-key`` and ``--token-file``
(or ``SCROLL_TLS_CA``, ``SCROLL_TLS_CERT``, ``SCROLL_TLS_KEY``, ``SCROLL_TOKEN_FILE``) come before
the command: ``scroll --tls-ca ca.pem --token-file t stream list``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

import click

from fragments import aioloop
from fragments.security import redact_url

DEFAULT_METADATA = "etcd://127.0.0.1:2379"
metadata_option = click.option(
    "--metadata", envvar="SCROLL_METADATA", default=DEFAULT_METADATA, show_default=True,
    help="Metadata store URL (etcd://host:port).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


class _LazyGroup(click.Group):
    """A group whose heavy commands (the bookie server's options, the plugins' commands: the Kafka
    listener, standalone) are built only when named or listed in ``--help``: ``scroll stream list``
    does not import the bookie server, gRPC's server side or the Kafka protocol."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, Callable[[], click.Command]] = {}

    def add_lazy(self, name: str, build: Callable[[], click.Command]) -> None:
        self.lazy[name] = build

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        build = self.lazy.pop(cmd_name, None)
        if build is not None and cmd_name not in self.commands:
            self.add_command(build(), cmd_name)
        return self.commands.get(cmd_name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--tls-ca", envvar="SCROLL_TLS_CA", type=click.Path(dir_okay=False), default=None,
              help="CA bundle the bookies' certificates chain to: talk TLS to them.")
@click.option("--tls-cert", envvar="SCROLL_TLS_CERT", type=click.Path(dir_okay=False), default=None,
              help="Client certificate for mutual TLS with the bookies (with --tls-key).")
@click.option("--tls-key", envvar="SCROLL_TLS_KEY", type=click.Path(dir_okay=False), default=None,
              help="Private key of --tls-cert.")
@click.option("--token-file", envvar="SCROLL_TOKEN_FILE", type=click.Path(dir_okay=False), default=None,
              help="File holding the bookie token (its first line).")
@click.pass_context
def main(ctx: click.Context, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
         token_file: str | None = None) -> None:
    """Scroll: unbounded replicated streams with terms and truncate-on-take-over.

    Positions are record offsets: dense from 0 per stream (per topic partition), as in Kafka.

    \b
    Examples:
      scroll stream create orders --ensemble 3 --write-quorum 3 --ack-quorum 2
      printf 'a\\nb\\n' | scroll produce orders
      scroll consume orders --from earliest
      scroll topic create clicks --partitions 4
      printf 'x\\n' | scroll produce clicks --key user-7
      scroll fragments orders
      scroll --tls-ca ca.pem --token-file token stream list   # secured bookies
    """
    _exit_with_parent()
    ctx.obj = {"security_options": {"tls.ca": tls_ca, "tls.cert": tls_cert, "tls.key": tls_key,
                                    "token.file": token_file}}


def _security():
    """The ``ClientSecurity`` of the global options (None when none was given)."""
    from fragments.security import ClientSecurity, SecurityConfigError

    ctx = click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    options = (root.obj or {}).get("security_options", {}) if root is not None else {}
    if not any(v is not None for v in options.values()):
        return None
    try:
        return ClientSecurity.from_options(options)
    except SecurityConfigError as exc:
        raise click.UsageError(str(exc)) from exc


PARENT_PID_ENV = "SCROLL_PARENT_PID"


def _exit_with_parent() -> None:
    """A server started by ``scroll standalone`` or ``LocalCluster`` (which set ``SCROLL_PARENT_PID``)
    stops when that parent is gone, even if it was SIGKILLed: it notices it was re-parented and
    SIGTERMs itself, which runs its clean shutdown. Nothing is left holding ports and data."""
    raw = os.environ.pop(PARENT_PID_ENV, None)  # not for our own children
    if not raw or not raw.isdigit():
        return
    parent = int(raw)

    def watch() -> None:
        try:  # a pidfd turns readable when the parent exits: no periodic wake-up while it lives
            fd = os.pidfd_open(parent)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            if os.getppid() == parent:  # (re-parented before the pidfd was opened: already gone)
                p = select.poll()
                p.register(fd, select.POLLIN)
                p.poll()
            os.close(fd)
        while os.getppid() == parent:
            time.sleep(0.5)
        logging.getLogger("scroll").warning("parent process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        os._exit(1)  # the clean shutdown did not finish

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _client(metadata: str):
    from ..errors import ScrollError
    from ..sync import connect

    security = _security()
    try:
        return connect(metadata, security=security)
    except ScrollError as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the metadata store is down: say so clearly
        raise click.ClickException(f"cannot reach the metadata store at {redact_url(metadata)}: {exc}") from exc


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(f"{type(exc).__name__}: {exc}")


def _console():
    """Tables on stdout; piped (no terminal, no COLUMNS) they get 160 columns rather than rich's 80."""
    from rich.console import Console

    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=160) if wide else Console()


def _meta_dict(meta) -> dict:
    d = asdict(meta)
    d["status"] = meta.status.value
    return d


# ---------------------------------------------------------------------------------------- streams
@main.group()
def stream() -> None:
    """Create, list, describe and delete streams."""


def _stream_options(fn):
    """Replication and rollover options shared by ``stream create`` and ``topic create``."""
    for opt in reversed([
        click.option("--ensemble", "-e", default=3, show_default=True, help="Bookies per fragment (E)."),
        click.option("--write-quorum", "-w", default=3, show_default=True, help="Copies of each entry (WQ)."),
        click.option("--ack-quorum", "-a", default=2, show_default=True,
                     help="Copies before an append is acknowledged (AQ)."),
        click.option("--fragment-bytes", default=64 << 20, show_default=True, help="Seal a fragment at this many bytes."),
        click.option("--fragment-entries", default=1_000_000, show_default=True, help="... or at this many entries."),
        click.option("--retention-max-age", type=float, help="Retention: remove sealed fragments older than this (s)."),
        click.option("--retention-max-bytes", type=int, help="Retention: keep at most this many bytes."),
    ]):
        fn = opt(fn)
    return fn


def _tier_options(fn):
    """The tier policy's options (Kafka's remote.storage.enable and local.retention.*, KIP-405), for
    ``stream create`` and ``retention set``."""
    for opt in reversed([
        click.option("--remote-storage/--no-remote-storage", "remote_storage", default=None,
                     help="Offload sealed fragments to the object store (Kafka remote.storage.enable). "
                          "Once on it stays on."),
        click.option("--local-retention", metavar="DURATION",
                     help="Keep offloaded fragments on bookies this long (e.g. 1h; -2: as long as retention "
                          "keeps them, the default; -1: no limit)."),
        click.option("--local-retention-bytes", metavar="SIZE",
                     help="Keep the newest this much on bookies (e.g. 1GiB; -2: as retention, the default; -1: "
                          "no limit)."),
        click.option("--offload-lag", metavar="DURATION",
                     help="Offload a sealed fragment once its newest record is this old (e.g. 10m; default 0)."),
    ]):
        fn = opt(fn)
    return fn


def _tier_dict(remote_storage, local_retention, local_retention_bytes, offload_lag) -> dict:
    """The tier settings given on the command line, as ``LedgerMeta.retention`` keys (Kafka's units)."""
    from fragments.retention import InvalidPolicy, parse_duration, parse_size

    def special(text: str) -> int | None:
        return int(text.strip()) if text.strip() in ("-1", "-2") else None

    out: dict = {}
    try:
        if remote_storage is not None:
            out["remote_storage_enable"] = remote_storage
        if local_retention is not None:
            v = special(local_retention)
            out["local_retention_ms"] = v if v is not None else round(parse_duration(local_retention) * 1000)
        if local_retention_bytes is not None:
            v = special(local_retention_bytes)
            out["local_retention_bytes"] = v if v is not None else parse_size(local_retention_bytes)
        if offload_lag is not None:
            out["offload_lag_ms"] = round(parse_duration(offload_lag) * 1000)
    except InvalidPolicy as exc:
        raise click.BadParameter(str(exc)) from exc
    return out


def _tier_policy(retention: dict) -> dict:
    from fragments.tier import TierPolicy

    try:
        return TierPolicy.from_dict(retention).to_dict()
    except ValueError as exc:
        return {"invalid": str(exc)}


def _retention_dict(max_age, max_bytes) -> dict | None:
    retention = {}
    if max_age is not None:
        retention["max_age_s"] = max_age
    if max_bytes is not None:
        retention["max_bytes"] = max_bytes
    return retention or None


@stream.command("create")
@click.argument("name")
@_stream_options
@_tier_options
@metadata_option
@json_option
def stream_create(name, ensemble, write_quorum, ack_quorum, fragment_bytes, fragment_entries, retention_max_age,
                  retention_max_bytes, remote_storage, local_retention, local_retention_bytes, offload_lag, metadata,
                  as_json):
    """Create a stream (a one-partition topic of the same name, readable by Kafka clients).

    \b
    Example (tiered: offload after 10 minutes, keep 1 hour or 1 GiB on bookies):
      scroll stream create clicks --retention-max-age 604800 --remote-storage \\
        --local-retention 1h --local-retention-bytes 1GiB --offload-lag 10m
    """
    from ..errors import ScrollError

    retention = {**(_retention_dict(retention_max_age, retention_max_bytes) or {}),
                 **_tier_dict(remote_storage, local_retention, local_retention_bytes, offload_lag)}
    with _client(metadata) as c:
        try:
            info = c.create_stream(name, ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum,
                                   fragment_bytes_max=fragment_bytes, fragment_entries_max=fragment_entries,
                                   retention=retention or None)
        except ScrollError as exc:
            raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps(_meta_dict(info.meta)))
    else:
        click.echo(f"created stream {name!r} (ledger {info.meta.ledger_id}) on {', '.join(info.fragments[0].ensemble)}")


@stream.command("list")
@metadata_option
@json_option
def stream_list(metadata, as_json):
    """List streams (every partition of every topic is one)."""
    with _client(metadata) as c:
        metas = c.list_streams()
    if as_json:
        click.echo(json.dumps([_meta_dict(m) for m in metas]))
        return
    from rich.table import Table

    t = Table("stream", "ledger", "status", "term", "E/WQ/AQ", "fragments")
    for m in metas:
        cfg = m.config
        t.add_row(m.name, str(m.ledger_id), m.status.value, str(m.term),
                  f"{cfg.ensemble_size}/{cfg.write_quorum}/{cfg.ack_quorum}",
                  str(m.last_fragment_index - m.first_fragment_index + 1))
    _console().print(t)


async def _offsets_of(client, name: str) -> tuple[int, int]:
    """(earliest offset, end offset) of a stream: the first record retention kept, and one past
    the last readable record (the offset the next append gets)."""
    c = await client.consumer(name, start="latest")
    return await c.earliest_offset(), c.position


async def _describe_with_offsets(c, name: str):
    """(StreamInfo, earliest offset, end offset) of one stream."""
    info = await c.describe_stream(name)
    earliest, end = await _offsets_of(c, name)
    return info, earliest, end


@stream.command("describe")
@click.argument("name")
@metadata_option
@json_option
def stream_describe(name, metadata, as_json):
    """Show a stream's configuration, term, status and offsets."""

    info, earliest, end = _arun(metadata, lambda c: _describe_with_offsets(c, name))
    d = _meta_dict(info.meta)
    d.update(earliest_offset=earliest, end_offset=end, records=end - earliest, fragments=len(info.fragments),
             bytes_in_sealed_fragments=info.bytes, tier=_tier_policy(info.meta.retention))
    if as_json:
        click.echo(json.dumps(d))
    else:
        for k, v in d.items():
            click.echo(f"{k:>28}: {v}")


@stream.command("delete")
@click.argument("name")
@metadata_option
def stream_delete(name, metadata):
    """Delete a stream's metadata (bookies reclaim its data in garbage collection)."""
    from ..errors import ScrollError

    with _client(metadata) as c:
        try:
            c.delete_stream(name)
        except ScrollError as exc:
            raise _fail(exc) from exc
    click.echo(f"deleted stream {name!r}")


# ---------------------------------------------------------------------------------------- topics
@main.group()
def topic() -> None:
    """Create, list, describe and delete topics (named sets of partition streams).

    Partition 0 of topic T is the stream T, partition P > 0 the stream T:P. Kafka clients see the
    same topics; a stream created alone is a one-partition topic.

    \b
    Examples:
      scroll topic create clicks --partitions 4 --ensemble 3
      scroll topic describe clicks
      printf 'x\\n' | scroll produce clicks --key user-7
      scroll consume clicks --partition 2 --from earliest
    """


@topic.command("create")
@click.argument("name")
@click.option("--partitions", "-p", default=1, show_default=True, type=click.IntRange(1), help="Partition streams.")
@click.option("--config", "configs", multiple=True, metavar="KEY=VALUE", help="A topic config (repeatable).")
@_stream_options
@metadata_option
@json_option
def topic_create(name, partitions, configs, ensemble, write_quorum, ack_quorum, fragment_bytes, fragment_entries,
                 retention_max_age, retention_max_bytes, metadata, as_json):
    """Create a topic of N partition streams."""
    cfg = dict(_pair(c, "--config") for c in configs)

    async def go(c):
        return await c.create_topic(name, partitions, cfg, ensemble=ensemble, write_quorum=write_quorum,
                                    ack_quorum=ack_quorum, fragment_bytes_max=fragment_bytes,
                                    fragment_entries_max=fragment_entries,
                                    retention=_retention_dict(retention_max_age, retention_max_bytes))

    t = _arun(metadata, go)
    if as_json:
        click.echo(json.dumps(_topic_dict(t)))
    else:
        click.echo(f"created topic {name!r} with {t.partitions} partition{'s' if t.partitions != 1 else ''} "
                   f"(streams {', '.join(t.streams()[:4])}{', ...' if t.partitions > 4 else ''})")


def _pair(text: str, option: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}", param_hint=option)
    return k, v


def _topic_dict(t) -> dict:
    return {"name": t.name, "partitions": t.partitions, "topic_id": str(t.topic_id), "configs": t.configs,
            "streams": t.streams()}


@topic.command("alter")
@click.argument("name")
@click.option("--config", "configs", multiple=True, metavar="KEY=VALUE",
              help="Set a topic config (repeatable; Kafka's names, e.g. cleanup.policy=compact, segment.ms=60000).")
@click.option("--delete-config", "deletes", multiple=True, metavar="KEY", help="Remove a topic config (repeatable).")
@metadata_option
@json_option
def topic_alter(name, configs, deletes, metadata, as_json):
    """Change a topic's configs; the ones that act (retention.*, cleanup.policy and the compaction
    settings, segment.bytes / segment.ms) are applied to every partition stream."""
    cfg = dict(_pair(c, "--config") for c in configs)
    if not cfg and not deletes:
        raise click.UsageError("nothing to change: give --config KEY=VALUE or --delete-config KEY")
    t = _arun(metadata, lambda c: c.alter_topic_configs(name, cfg, list(deletes)))
    if as_json:
        click.echo(json.dumps(_topic_dict(t)))
    else:
        click.echo(f"topic {name!r} configs: " + (", ".join(f"{k}={v}" for k, v in sorted(t.configs.items())) or "-"))


def _stream_policy(meta) -> dict:
    """What a stream's record says of its retention, compaction and rollover."""
    from fragments.compaction import CompactionPolicy

    r = {k: v for k, v in meta.retention.items() if k not in ("deleting", "compaction")}
    try:
        compaction = asdict(CompactionPolicy.from_dict(r))
    except ValueError as exc:
        compaction = {"invalid": str(exc)}
    return {"retention": {k: v for k, v in r.items() if k in ("max_age_s", "max_bytes", "keep_from",
                                                              "respect_consumers")},
            "compaction": compaction,
            "tier": _tier_policy(r),
            "fragment_bytes_max": meta.config.fragment_bytes_max,
            "fragment_entries_max": meta.config.fragment_entries_max,
            "fragment_age_max_ms": meta.config.fragment_age_max_ms}


@topic.command("list")
@metadata_option
@json_option
def topic_list(metadata, as_json):
    """List topics (streams created alone are one-partition topics)."""

    async def go(c):
        return await c.list_topics()

    topics = _arun(metadata, go)
    if as_json:
        click.echo(json.dumps([_topic_dict(t) for t in topics]))
        return
    from rich.table import Table

    t = Table("topic", "partitions", "topic id", "configs")
    for m in topics:
        t.add_row(m.name, str(m.partitions), str(m.topic_id),
                  ", ".join(f"{k}={v}" for k, v in sorted(m.configs.items())) or "-")
    _console().print(t)


@topic.command("describe")
@click.argument("name")
@metadata_option
@json_option
def topic_describe(name, metadata, as_json):
    """A topic's partitions: stream, earliest and end offsets, term, ensemble of the open fragment."""

    async def go(c):
        t = await c.describe_topic(name)
        parts = []
        policy = None
        for p, s in enumerate(t.streams()):
            info = await c.describe_stream(s)
            if policy is None:
                policy = _stream_policy(info.meta)
            earliest, end = await _offsets_of(c, s)
            parts.append({"partition": p, "stream": s, "earliest_offset": earliest, "end_offset": end,
                          "term": info.meta.term, "status": info.meta.status.value,
                          "fragments": len(info.fragments),
                          "ensemble": list(info.fragments[-1].ensemble) if info.fragments else []})
        return t, parts, policy

    t, parts, policy = _arun(metadata, go)
    d = {**_topic_dict(t), "stream_policy": policy, "partition_info": parts}
    if as_json:
        click.echo(json.dumps(d))
        return
    from rich.table import Table

    click.echo(f"topic {t.name!r}  id {t.topic_id}  partitions {t.partitions}  configs "
               + (", ".join(f"{k}={v}" for k, v in sorted(t.configs.items())) or "-"))
    if policy is not None:
        c = policy["compaction"]
        click.echo(f"cleanup.policy {c.get('cleanup_policy')}  compaction {c}  retention {policy['retention'] or '-'}  "
                   f"fragments roll at {_size(policy['fragment_bytes_max'])} / {policy['fragment_entries_max']} entries"
                   f" / {policy['fragment_age_max_ms'] if policy['fragment_age_max_ms'] else 'no'} ms age")
        tier = policy["tier"]
        click.echo("tier " + ("off" if not tier.get("remote_storage_enable") else
                              ", ".join(f"{k}={v}" for k, v in tier.items())))
    tb = Table("partition", "stream", "earliest", "end", "records", "term", "status", "fragments", "ensemble")
    for p in parts:
        tb.add_row(str(p["partition"]), p["stream"], str(p["earliest_offset"]), str(p["end_offset"]),
                   str(p["end_offset"] - p["earliest_offset"]), str(p["term"]), p["status"], str(p["fragments"]),
                   ", ".join(p["ensemble"]))
    _console().print(tb)


@topic.command("delete")
@click.argument("name")
@metadata_option
def topic_delete(name, metadata):
    """Delete a topic and its partition streams (bookies reclaim the data in garbage collection)."""

    async def go(c):
        t = await c.describe_topic(name)
        await c.delete_topic(name)
        return t

    t = _arun(metadata, go)
    click.echo(f"deleted topic {name!r} ({t.partitions} partition{'s' if t.partitions != 1 else ''})")


# ---------------------------------------------------------------------------------------- data
def _target(name: str, partition: int | None) -> str:
    from ..topics import partition_stream

    if partition is None:
        return name
    if ":" in name:
        raise click.UsageError(f"{name!r} is a partition stream already; --partition goes with a topic name")
    return partition_stream(name, partition)


@main.command()
@click.argument("stream_name", metavar="NAME")
@click.option("--file", "files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Append each file as one record (instead of stdin lines).")
@click.option("--key", default=None, help="Key for every record (a topic's partition is chosen by it).")
@click.option("--header", "headers", multiple=True, metavar="NAME=VALUE", help="A header for every record (repeatable).")
@click.option("--partition", "-p", type=click.IntRange(0), default=None,
              help="Write this partition of topic NAME (default: by key, as Kafka's partitioner).")
@metadata_option
@json_option
def produce(stream_name, files, key, headers, partition, metadata, as_json):
    """Append stdin lines (or files) to NAME, one record each, and print their offsets.

    NAME is a stream or a topic; the records go out in batches (many records per entry). On a
    topic of several partitions each record goes to the partition of its key (murmur2, as Kafka
    clients do), or to one partition for keyless records, unless --partition is given.
    """
    hdrs = [(k, v.encode()) for k, v in (_pair(h, "--header") for h in headers)]
    values = [open(f, "rb").read() for f in files] if files else [ln.rstrip(b"\n") for ln in sys.stdin.buffer]
    kb = key.encode() if key is not None else None
    target = _target(stream_name, partition)

    async def go(c):
        p = await (c.producer(target) if partition is None else c.producer(stream_name, partition=partition))
        try:
            got = await p.append_many([(v, kb, hdrs, None) for v in values])
        finally:
            await p.close()
        return got

    got = _arun(metadata, go)
    pairs = [g if isinstance(g, tuple) else (partition or 0, g) for g in got]  # a topic's producer says which
    offsets = [o for _, o in pairs]
    parts = sorted({p for p, _ in pairs})
    if as_json:
        d = {"stream": target, "offsets": offsets}
        if got and isinstance(got[0], tuple):
            d["partitions"] = [p for p, _ in pairs]
        click.echo(json.dumps(d))
        return
    if not offsets:
        click.echo(f"appended 0 records to {target!r}", err=True)
    elif len(parts) == 1:
        where = f"partition {parts[0]} of " if got and isinstance(got[0], tuple) else ""
        click.echo(f"appended {len(offsets)} records to {where}{target!r} at offsets {offsets[0]}..{offsets[-1]}",
                   err=True)
    else:
        click.echo(f"appended {len(offsets)} records to {target!r} across partitions "
                   f"{', '.join(map(str, parts))}", err=True)


@main.command()
@click.argument("stream_name", metavar="NAME")
@click.option("--from", "start", default="earliest", show_default=True,
              help="earliest, latest or a record offset.")
@click.option("--partition", "-p", type=click.IntRange(0), default=None,
              help="Read this partition of topic NAME (default: every partition).")
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new records (Ctrl-C stops).")
@click.option("--max", "max_records", type=int, default=None, help="Stop after this many records.")
@metadata_option
@json_option
def consume(stream_name, start, partition, follow, max_records, metadata, as_json):
    """Print records of NAME (value per line; --json adds offset, partition, key, headers, timestamp).

    A record offset past the end is an error (as Kafka's out-of-range) unless --follow, which
    waits for it. An offset below what retention kept is an error naming the earliest offset.
    """
    import asyncio

    from ..errors import DataRemovedError, NoSuchTopic

    if start in ("earliest", "latest"):
        start_at = start
    else:
        try:
            start_at = int(start)
        except ValueError:
            raise click.BadParameter(f"{start!r} is not earliest, latest or an offset", param_hint="--from") from None
        if start_at < 0:
            raise click.BadParameter("an offset is >= 0", param_hint="--from")

    async def go(c):
        if partition is not None or ":" in stream_name:
            names = [(partition or 0, _target(stream_name, partition))]
        else:
            try:
                names = list(enumerate((await c.describe_topic(stream_name)).streams()))
            except NoSuchTopic:
                raise click.ClickException(f"no stream or topic named {stream_name!r}") from None
            if len(names) > 1 and isinstance(start_at, int):
                raise click.UsageError(f"topic {stream_name!r} has {len(names)} partitions: give --partition "
                                       "with an offset")
        consumers = []
        for p, s in names:
            try:
                cons = await c.consumer(s, start=start_at)
            except DataRemovedError as exc:
                raise click.ClickException(f"offset {start_at} of {s!r} was removed by retention; the earliest "
                                           f"is {exc.earliest}") from exc
            if isinstance(start_at, int) and not follow:
                end = await cons.end_position()
                if start_at > end:  # as Kafka's OFFSET_OUT_OF_RANGE: say so instead of printing nothing
                    raise click.ClickException(
                        f"offset {start_at} is past the end of {s!r} (the next record will be at offset {end}); "
                        "use --follow to wait for it")
            consumers.append((p, cons))
        seen = 0
        wait = (1.0 if len(consumers) == 1 else 0.2) if follow else 0.0
        done = set()
        while (max_records is None or seen < max_records) and len(done) < len(consumers):
            for p, cons in consumers:
                if p in done or (max_records is not None and seen >= max_records):
                    continue
                want = 500 if max_records is None else min(500, max_records - seen)
                batch = await cons.read(want, timeout_s=wait)
                if not batch and not follow:
                    done.add(p)
                    continue
                for r in batch:
                    seen += 1
                    if as_json:
                        click.echo(json.dumps({
                            "offset": r.offset, "partition": p, "timestamp_ms": r.timestamp_ms,
                            "key": r.key.decode(errors="replace") if r.key is not None else None,
                            "headers": {k: (v.decode(errors="replace") if v is not None else None)
                                        for k, v in r.headers},
                            "value": r.value.decode(errors="replace") if r.value is not None else None}))
                    else:
                        sys.stdout.buffer.write((r.value or b"") + b"\n")
                sys.stdout.flush()
            await asyncio.sleep(0)

    try:
        _arun(metadata, go)
    except KeyboardInterrupt:
        pass


@main.command()
@metadata_option
@json_option
def bookies(metadata, as_json):
    """The live bookies (registered under a lease)."""
    with _client(metadata) as c:
        regs = c.live_bookies()
    if as_json:
        click.echo(json.dumps([r.to_dict() if hasattr(r, "to_dict") else asdict(r) for r in regs]))
        return
    from rich.table import Table

    t = Table("bookie", "address", "rack", "free", "used", "read-only")
    for r in regs:
        t.add_row(r.bookie_id, r.address, r.rack or "-", _size(r.free_bytes), _size(r.used_bytes), "yes" if r.read_only else "no")
    _console().print(t)


@main.command()
@click.argument("stream_name", metavar="STREAM")
@metadata_option
@json_option
def fragments(stream_name, metadata, as_json):
    """Fragments of STREAM: ensemble, first record offset, entry range, bytes; the ledger's term and status."""

    async def go(c):
        info = await c.describe_stream(stream_name)
        cons = await c.consumer(stream_name, start="latest")
        return info, [await cons.first_offset_of(f) for f in info.fragments], cons.position

    info, firsts, end = _arun(metadata, go)
    m = info.meta
    if as_json:
        frags = []
        for f, first in zip(info.fragments, firsts):
            d = json.loads(f.to_json())
            d["first_offset"] = first  # learnt from the entries when the record does not have it
            frags.append(d)
        click.echo(json.dumps({"stream": m.name, "ledger": m.ledger_id, "term": m.term, "status": m.status.value,
                               "end_offset": end, "fragments": frags}))
        return
    from rich.table import Table

    t = Table("fragment", "first offset", "records", "entries", "ensemble", "bytes", "created in term",
              title=f"{m.name} (ledger {m.ledger_id}) term {m.term} {m.status.value}, offsets up to {end}")
    for i, f in enumerate(info.fragments):
        nxt = firsts[i + 1] if i + 1 < len(firsts) else end
        t.add_row(str(f.index), str(firsts[i]), str(nxt - firsts[i]),
                  f"{f.first_entry_id}..{f.last_entry_id if f.sealed else '(open)'}",
                  ", ".join(f.ensemble), _size(f.size_bytes) if f.size_bytes is not None else "-", str(f.created_term))
    _console().print(t)


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@main.command()
@click.option("--seeds", default=50, show_default=True, help="How many simulator seeds to run.")
@click.option("--first-seed", default=1, show_default=True)
def demo(seeds: int, first_seed: int) -> None:
    """Run the deterministic cluster simulator (from a source checkout) and print what it checked."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "tests" / "sim").is_dir():
        raise click.ClickException("the simulator lives in tests/sim of a source checkout")
    sys.path.insert(0, str(root))
    from tests.sim.__main__ import run_cli

    raise SystemExit(run_cli(["--seeds", str(seeds), "--first-seed", str(first_seed)]))


# ---------------------------------------------------------------------------------------- admin helpers
def _arun(metadata: str, fn):
    """Connect the async client, run ``fn(client)`` and close; errors become one clear line."""

    from fragments.retention import InvalidPolicy
    from fragments.store import MetadataError

    from ..client import connect
    from ..errors import ScrollError

    security = _security()

    async def go():
        try:
            client = await connect(metadata, security=security)
        except ScrollError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the metadata store is down: say so clearly
            raise click.ClickException(f"cannot reach the metadata store at {redact_url(metadata)}: {exc}") from exc
        try:
            return await fn(client)
        finally:
            await client.close()

    try:
        return aioloop.run(go())
    except (ScrollError, InvalidPolicy) as exc:
        raise _fail(exc) from exc
    except MetadataError as exc:
        raise click.ClickException(f"metadata store {redact_url(metadata)}: {exc}") from exc


class _Bar:
    """A rich progress bar on stderr (stdout stays clean for --json); a no-op when disabled."""

    def __init__(self, label: str, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 console=Console(stderr=True), transient=True, disable=not enabled)
        self.label = label
        self.task = None

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task(self.label, total=None)
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def update(self, what: str, done: int, total: int) -> None:
        self.progress.update(self.task, total=total, completed=done, description=f"{self.label} {what}".strip())


def _span(indexes: list[int]) -> str:
    if not indexes:
        return "-"
    return str(indexes[0]) if len(indexes) == 1 else f"{indexes[0]}..{indexes[-1]} ({len(indexes)})"


# ---------------------------------------------------------------------------------------- retention
@main.group()
def retention() -> None:
    """Per-stream retention policies and the job that removes old sealed fragments.

    \b
    Examples:
      scroll retention set orders --max-age 7d --max-bytes 10GiB
      scroll retention run --dry-run
      scroll retention show orders
    """


@retention.command("run")
@click.option("--stream", "stream_name", default=None, help="Only this stream (default: every stream).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@metadata_option
@json_option
def retention_run(stream_name, dry_run, metadata, as_json):
    """Remove the sealed fragments that every stream's policy lets go (crash-safe, two-phase)."""
    from .retention import run_retention

    with _Bar("retention", enabled=not as_json) as bar:
        def progress(stage, name, done, total):
            bar.update(f"{stage} {name}" if stage != "done" else "", done, total)

        report = _arun(metadata, lambda c: run_retention(c, stream_name, dry_run, progress))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    from rich.table import Table

    verb = "would remove" if dry_run else "removed"
    t = Table("stream", "fragments", "offsets", "records", "entries", "bytes", "new earliest", "note",
              title=f"retention {'(dry run) ' if dry_run else ''}— {verb}")
    for s in report.streams:
        note = s.skipped or ("pending deletion finished" if s.completed_pending else "") or f"kept: {s.kept_because}"
        if s.pending and not s.skipped:
            note = f"pending deletion below offset {s.pending.get('below_offset')}"
        offsets = "-"
        if s.fragments:
            offsets = f"{s.first_offset}..{s.new_earliest - 1}" if None not in (s.first_offset, s.new_earliest) else "?"
        t.add_row(s.stream, _span(s.fragments), offsets, str(s.records) if s.fragments else "-",
                  f"{s.first_entry}..{s.last_entry}" if s.fragments else "-", _size(s.bytes) if s.fragments else "-",
                  str(s.new_earliest) if s.fragments else "-", note,
                  style="yellow" if s.skipped else None)
    _console().print(t)
    click.echo(f"{verb} {report.fragments} fragments, {report.records} records ({report.entries} entries), "
               f"{_size(report.bytes)} (per replica; bookies reclaim the space in their GC)")


@retention.command("set")
@click.argument("stream_name", metavar="STREAM")
@click.option("--max-age", help="Remove sealed fragments whose newest record is older than this (e.g. 12h, 7d).")
@click.option("--max-bytes", help="Keep at least this much, remove older fragments beyond it (e.g. 500MB, 10GiB).")
@click.option("--keep-from", type=click.IntRange(0),
              help="Remove sealed fragments whose records are all below this record offset.")
@click.option("--ignore-consumers/--respect-consumers", "ignore_consumers", default=None,
              help="Whether floors of layers above (Kafka consumer groups) may hold data back (default: respect).")
@click.option("--clear", is_flag=True,
              help="Drop every retention setting first (then apply the ones given; the tier policy is kept).")
@_tier_options
@metadata_option
@json_option
def retention_set(stream_name, max_age, max_bytes, keep_from, ignore_consumers, clear, remote_storage,
                  local_retention, local_retention_bytes, offload_lag, metadata, as_json):
    """Set STREAM's retention policy and tier policy (settings not given are kept).

    \b
    Example: offload to the object store, keep 1 hour on bookies
      scroll retention set clicks --remote-storage --local-retention 1h"""
    from fragments.retention import InvalidPolicy, Policy, parse_duration, parse_size
    from fragments.tier import TierPolicy

    from .retention import set_policy

    changes: dict = {k: None for k in ("max_age_s", "max_bytes", "keep_from", "respect_consumers")} if clear else {}
    try:
        if max_age is not None:
            changes["max_age_s"] = parse_duration(max_age)
        if max_bytes is not None:
            changes["max_bytes"] = parse_size(max_bytes)
    except InvalidPolicy as exc:
        raise click.BadParameter(str(exc)) from exc
    if keep_from is not None:
        changes["keep_from"] = keep_from
    if ignore_consumers is not None:
        changes["respect_consumers"] = not ignore_consumers
    tier_default = TierPolicy().to_dict()
    for k, v in _tier_dict(remote_storage, local_retention, local_retention_bytes, offload_lag).items():
        changes[k] = None if v == tier_default[k] else v  # a default is stored as no setting
    meta = _arun(metadata, lambda c: set_policy(c, stream_name, changes))
    policy = Policy.from_dict({k: v for k, v in meta.retention.items() if k != "deleting"}).to_dict()
    tier = _tier_policy(meta.retention)
    if as_json:
        click.echo(json.dumps({"stream": stream_name, "retention": policy, "tier": tier}))
    else:
        click.echo(f"retention of {stream_name!r}: " + ", ".join(f"{k}={v}" for k, v in policy.items()))
        click.echo(f"tier of {stream_name!r}: " + ", ".join(f"{k}={v}" for k, v in tier.items()))


# ---------------------------------------------------------------------------------------- compaction
@main.group()
def compaction() -> None:
    """Log compaction (Kafka's cleanup.policy=compact): keep the latest record of every key.

    \b
    Examples:
      scroll compaction run --dry-run
      scroll compaction run --stream _schemas --force
    """


@compaction.command("run")
@click.option("--stream", "stream_name", default=None, help="Only this stream (default: every compacted stream).")
@click.option("--dry-run", is_flag=True, help="Say which streams are due and why; change nothing.")
@click.option("--force", is_flag=True, help="Compact whatever the dirty ratio says.")
@metadata_option
@json_option
def compaction_run(stream_name, dry_run, force, metadata, as_json):
    """Compact the sealed fragments of every stream whose policy compacts (crash-safe, one CAS switch)."""
    from .compaction import run_compaction

    report = _arun(metadata, lambda c: run_compaction(c, stream_name, dry_run, force=force))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    from rich.table import Table

    t = Table("stream", "due", "dirty ratio", "cleanable", "rewritten", "records in/out", "bytes in/out",
              "cleaned to", "note", title=f"compaction {'(dry run)' if dry_run else ''}")
    for s in report.streams:
        t.add_row(s.stream, "yes" if s.due else "no", f"{s.dirty_ratio:.2f}", _span(s.cleanable_fragments),
                  _span(s.rewritten_fragments), f"{s.records_in}/{s.records_out}",
                  f"{_size(s.bytes_in)}/{_size(s.bytes_out)}", "-" if s.cleaned_to is None else str(s.cleaned_to),
                  s.skipped or s.why, style="yellow" if s.skipped else None)
    _console().print(t)
    click.echo(f"reclaimed {_size(report.bytes_reclaimed)} (per replica)")


# ---------------------------------------------------------------------------------------- tier
@main.group()
def tier() -> None:
    """Tiered storage: sealed fragments offloaded to the object store (Kafka's remote.storage.enable).

    \b
    Examples:
      scroll tier run --dry-run
      scroll tier run --stream orders
      scroll tier status
    """


@tier.command("run")
@click.option("--stream", "stream_name", default=None, help="Only this stream (default: every stream with remote storage on).")
@click.option("--dry-run", is_flag=True, help="Say what would be offloaded and released; change nothing.")
@metadata_option
@json_option
def tier_run(stream_name, dry_run, metadata, as_json):
    """Offload sealed fragments, release bookie copies the local policy lets go, sweep orphan objects."""
    from .tier import run_tier

    report = _arun(metadata, lambda c: run_tier(c, stream_name, dry_run))
    if as_json:
        click.echo(json.dumps(report.to_dict()))
        return
    if not report.configured:
        raise click.ClickException("the cluster has no object store configured (scroll standalone runs one; "
                                   "a cluster names its own with `scroll tier configure`)")
    from rich.table import Table

    t = Table("stream", "to offload", "offloaded", "to release", "released", "bytes offloaded", "note",
              title=f"tier {'(dry run)' if dry_run else ''}")
    for s in report.streams:
        t.add_row(s.stream, _span(s.to_offload), _span(s.offloaded + s.adopted), _span(s.to_release),
                  _span(s.released), _size(s.bytes_offloaded), s.skipped or "", style="yellow" if s.skipped else None)
    _console().print(t)
    if report.swept:
        click.echo(f"swept {len(report.swept)} unreferenced object(s)")


@tier.command("status")
@click.option("--stream", "stream_name", default=None, help="Only this stream.")
@metadata_option
@json_option
def tier_status(stream_name, metadata, as_json):
    """Per stream: fragments and bytes on bookies only, offloaded (still local), remote only, uploading."""
    from .tier import tier_status as status

    rows = _arun(metadata, lambda c: status(c, stream_name))
    if as_json:
        click.echo(json.dumps(rows))
        return
    from rich.table import Table

    t = Table("stream", "remote storage", "local only", "offloaded+local", "remote only", "uploading",
              "bytes on bookies", "bytes in objects", title="tier")
    for r in rows:
        t.add_row(r["stream"], "on" if r["remote_storage_enable"] else "off", str(r["local_only"]),
                  str(r["offloaded_local"]), str(r["remote_only"]), str(r["uploading"]),
                  _size(r["bytes_local"]), _size(r["bytes_remote"]))
    _console().print(t)


@tier.command("configure")
@click.option("--endpoint", required=True, help="The S3 endpoint URL (http://host:port or https://...).")
@click.option("--bucket", required=True)
@click.option("--prefix", default="scroll", show_default=True, help="Every object key starts with PREFIX/.")
@click.option("--region", default="us-east-1", show_default=True)
@click.option("--credentials-file", default=None,
              help="A file with the access key id and secret (two lines, or JSON). Default: the environment "
                   "(SCROLL_S3_ACCESS_KEY_ID/SCROLL_S3_SECRET_ACCESS_KEY or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY). "
                   "Every process that offloads or reads needs it: it is never stored in the metadata.")
@click.option("--ca-file", default=None, help="A PEM CA for an https endpoint with a private CA.")
@metadata_option
def tier_configure(endpoint, bucket, prefix, region, credentials_file, ca_file, metadata):
    """Name the cluster's object store (checked first: wrong credentials or a missing bucket fail here)."""
    from ..tier.objstore import ObjectStore, ObjectStoreError, TierConfig
    from .tier import save_tier_config

    cfg = TierConfig(endpoint=endpoint, bucket=bucket, prefix=prefix, region=region,
                     credentials_file=credentials_file, ca_file=ca_file)

    async def go(c):
        try:
            await ObjectStore(cfg).check()
        except ObjectStoreError as exc:
            raise click.ClickException(str(exc)) from None
        await save_tier_config(c.cluster.store, cfg)

    _arun(metadata, go)
    click.echo(f"object store set: {endpoint} bucket {bucket} prefix {prefix}/")


@retention.command("show")
@click.argument("stream_name", metavar="STREAM")
@metadata_option
@json_option
def retention_show(stream_name, metadata, as_json):
    """Show STREAM's retention policy, earliest offset and any deletion in progress."""
    from fragments.retention import Policy

    info, earliest, end = _arun(metadata, lambda c: _describe_with_offsets(c, stream_name))
    m = info.meta
    d = {"stream": m.name, "retention": Policy.from_dict({k: v for k, v in m.retention.items() if k != "deleting"}).to_dict(),
         "tier": _tier_policy(m.retention),
         "deleting": m.retention.get("deleting"), "earliest_offset": earliest, "end_offset": end,
         "earliest_entry": info.fragments[0].first_entry_id if info.fragments else 0,
         "first_fragment_index": m.first_fragment_index, "fragments": len(info.fragments),
         "bytes_in_sealed_fragments": info.bytes}
    if as_json:
        click.echo(json.dumps(d))
        return
    for k, v in d.items():
        click.echo(f"{k:>26}: {v}")


# ---------------------------------------------------------------------------------------- admin
@main.group()
def ledger() -> None:
    """Inspect a stream's ledger (metadata, fragments)."""


@ledger.command("show")
@click.argument("stream_name", metavar="STREAM")
@metadata_option
@json_option
def ledger_show(stream_name, metadata, as_json):
    """Metadata, term, status, config and every fragment (ensemble, range, size, created term)."""
    from .admin import ledger_show as show

    d = _arun(metadata, lambda c: show(c, stream_name))
    if as_json:
        click.echo(json.dumps(d))
        return
    from rich.table import Table

    cfg = d["config"]
    click.echo(f"stream {d['name']!r}  ledger {d['ledger_id']}  term {d['term']}  status {d['status']}  "
               f"version {d['version']}")
    click.echo(f"E/WQ/AQ {cfg['ensemble_size']}/{cfg['write_quorum']}/{cfg['ack_quorum']}  "
               f"fragment caps {_size(cfg['fragment_bytes_max'])} / {cfg['fragment_entries_max']} entries")
    click.echo(f"offsets {d['earliest_offset']}..{d['end_offset'] - 1} (next {d['end_offset']})  "
               f"entries {d['earliest_entry']}..{d['lac']} (LAC {d['lac']})  fragments {d['first_fragment_index']}.."
               f"{d['last_fragment_index']}  retention {d['retention'] or '-'}  extra {d['extra'] or '-'}")
    t = Table("fragment", "first offset", "records", "first entry", "last entry", "entries", "ensemble", "bytes",
              "created in term")
    for f in d["fragments"]:
        t.add_row(str(f["index"]), str(f["first_offset"]) + ("" if f["first_offset_recorded"] else " (learnt)"),
                  str(f["records"]), str(f["first_entry_id"]),
                  str(f["last_entry_id"]) if f["sealed"] else "(open)", str(f["entries"]), ", ".join(f["ensemble"]),
                  _size(f["size_bytes"]), str(f["created_term"]))
    _console().print(t)


@main.command("read")
@click.argument("stream_name", metavar="STREAM")
@click.option("--from", "first", type=click.IntRange(0), default=None, help="First entry id (not a record offset).")
@click.option("--to", "last", type=click.IntRange(0), default=None, help="Last entry id (default: --from).")
@click.option("--force-recovery", is_flag=True,
              help="First take the stream over (fence, recover, truncate no-op) and close it; prints the new term and LAC.")
@metadata_option
@json_option
def read_cmd(stream_name, first, last, force_recovery, metadata, as_json):
    """Entries of STREAM as each replica of their write set holds them (mismatches highlighted).

    This is a protocol tool: --from/--to are entry ids (each entry is one record batch; its first
    record offset and record count are shown), see `scroll fragments` for which entries hold which
    offsets.
    """
    from .admin import force_recovery as recover
    from .admin import read_replicas

    if first is None and not force_recovery:
        raise click.UsageError("give --from (and --to), or --force-recovery")

    async def go(c):
        out = {}
        if force_recovery:
            out["recovery"] = await recover(c, stream_name)
        if first is not None:
            out.update(await read_replicas(c, stream_name, first, first if last is None else last))
        return out

    d = _arun(metadata, go)
    if as_json:
        click.echo(json.dumps(d))
        return
    if "recovery" in d:
        r = d["recovery"]
        click.echo(f"recovered {stream_name!r}: term {r['previous_term']} -> {r['term']}, LAC entry {r['lac']}, "
                   f"next offset {r['end_offset']}")
    if first is None:
        return
    from rich.table import Table

    t = Table("entry", "fragment", "offsets", "replicas (term stamp)", "size", "missing on", "preview",
              title=f"{stream_name} (ledger {d['ledger']}, term {d['term']}, WQ {d['write_quorum']})")
    for e in d["entries"]:
        if "error" in e:
            t.add_row(str(e["entry_id"]), "-", "", e["error"], "", "", "", style="yellow")
            continue
        reps = ", ".join(f"{b}:{r['term']}" for b, r in e["replicas"].items() if "term" in r)
        style = "bold red" if e["mismatch"] else ("yellow" if e["missing"] else None)
        offs = "-" if e["first_offset"] is None else (
            str(e["first_offset"]) if e["records"] == 1 else f"{e['first_offset']}..{e['first_offset'] + e['records'] - 1}")
        t.add_row(str(e["entry_id"]), str(e["fragment"]), offs, reps + ("  MISMATCH" if e["mismatch"] else ""),
                  str(e["size"]), ", ".join(e["missing"]) or "-", e["preview"] or "", style=style)
    _console().print(t)


@main.command()
@click.option("--records", "--entries", "-n", "records", default=1000, show_default=True, type=click.IntRange(1),
              help="Records to write.")
@click.option("--size", default=100, show_default=True, type=click.IntRange(8), help="Bytes per record.")
@click.option("--ensemble", "-e", default=3, show_default=True)
@click.option("--wq", "-w", "write_quorum", default=3, show_default=True)
@click.option("--aq", "-a", "ack_quorum", default=2, show_default=True)
@metadata_option
@json_option
def simpletest(records, size, ensemble, write_quorum, ack_quorum, metadata, as_json):
    """Write and read back N records on a temporary stream; verify values and offsets; print latency and throughput."""
    from .admin import simpletest as run

    console = _console()
    if as_json:
        d = _arun(metadata, lambda c: run(c, records, ensemble, write_quorum, ack_quorum, size))
        click.echo(json.dumps(d))
    else:
        with console.status(f"writing {records} records of {size} bytes (E/WQ/AQ {ensemble}/{write_quorum}/{ack_quorum})"):
            d = _arun(metadata, lambda c: run(c, records, ensemble, write_quorum, ack_quorum, size))
        from rich.table import Table

        t = Table("", "", title=f"simpletest on {', '.join(d['bookies'])}")
        t.add_row("records written / read back", f"{d['records']} / {d['read_back']}")
        t.add_row("entries (record batches)", str(d["entries"]))
        t.add_row("verified (values and offsets)", "[green]yes[/green]" if d["verified"] else "[bold red]NO[/bold red]")
        t.add_row("take-over (open)", f"{d['open_s'] * 1000:.1f} ms")
        t.add_row("write", f"{d['write_s']:.3f} s, {d['write_records_per_s']:.0f} records/s")
        t.add_row("append latency p50 / p99 / max",
                  f"{d['latency_ms']['p50']:.2f} / {d['latency_ms']['p99']:.2f} / {d['latency_ms']['max']:.2f} ms")
        t.add_row("read", f"{d['read_s']:.3f} s, {d['read_records_per_s']:.0f} records/s")
        console.print(t)
    if not d["verified"]:
        sys.exit(1)


@main.command()
@click.option("--fix", is_flag=True, help="Re-replicate sealed fragments that are under the write quorum.")
@click.option("--stream", "stream_name", default=None, help="Only this stream.")
@metadata_option
@json_option
def check(fix, stream_name, metadata, as_json):
    """Find fragments with entries under the write quorum (exit 1 if any remain)."""
    from .admin import check as run

    with _Bar("check", enabled=not as_json) as bar:
        found = _arun(metadata, lambda c: run(c, fix, stream_name, bar.update))
    remaining = [f for f in found if not (f["action"].startswith("re-replicated") and not f["error"])]
    if as_json:
        click.echo(json.dumps({"fragments": found, "ok": not remaining}))
    else:
        from rich.table import Table

        t = Table("stream", "fragment", "entries", "ensemble", "under WQ", "missing", "gone", "action",
                  title="under-replicated fragments" if found else "every fragment has its write quorum")
        for f in found:
            rng = f"{f['first_entry_id']}..{f['last_entry_id'] if f['sealed'] else '(open)'}"
            t.add_row(f["stream"], str(f["fragment"]), rng, ", ".join(f["ensemble"]), str(f["under_replicated"]),
                      ", ".join(f"{b}:{n}" for b, n in f["missing"].items()), ", ".join(f["gone"]) or "-",
                      f["error"] or f["action"] + (f" -> {', '.join(f['new_ensemble'])}" if f["new_ensemble"] else ""),
                      style="red" if f["error"] else ("green" if f in found and f not in remaining else "yellow"))
        _console().print(t)
    if remaining:
        sys.exit(1)


# ---------------------------------------------------------------------------------------- autorecovery
@main.group(invoke_without_command=True)
@click.option("--lost-bookie-delay", "lost_bookie_delay_s", default=30.0, show_default=True,
              type=click.FloatRange(0), help="Seconds a bookie must be gone before its fragments are re-replicated.")
@click.option("--open-grace", "open_ledger_grace_s", default=60.0, show_default=True, type=click.FloatRange(0),
              help="Seconds after a bookie loss before a stream whose open fragment names it is taken over.")
@click.option("--max-bytes-per-s", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Throttle: bytes copied per second by this instance (default: unthrottled).")
@click.option("--max-in-flight", "max_fragments_in_flight", default=2, show_default=True, type=click.IntRange(1),
              help="Fragments this instance repairs at once.")
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="Serve Prometheus metrics on 127.0.0.1:PORT.")
@metadata_option
@click.pass_context
def autorecovery(ctx, lost_bookie_delay_s, open_ledger_grace_s, max_bytes_per_s, max_fragments_in_flight,
                 metrics_port, metadata):
    """Re-replicate the fragments of lost bookies (an auditor elected among the instances, and a
    replication worker in each). Runs in the foreground until Ctrl-C; run one or more per cluster.

    \b
    Examples:
      scroll autorecovery --lost-bookie-delay 60 --max-bytes-per-s 50000000
      scroll autorecovery status --json
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = {**(ctx.obj or {}), "metadata": metadata}
        return
    import asyncio
    import signal as _signal

    from .autorecovery import AutoRecovery, AutoRecoveryConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = AutoRecoveryConfig(lost_bookie_delay_s=lost_bookie_delay_s, open_ledger_grace_s=open_ledger_grace_s,
                                max_bytes_per_s=max_bytes_per_s, max_fragments_in_flight=max_fragments_in_flight)
    registry = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from fragments.metrics_http import serve_metrics

        registry = CollectorRegistry()
        serve_metrics(metrics_port, "127.0.0.1", registry)

    async def go(client):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (_signal.SIGINT, _signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        ar = AutoRecovery(client, config, registry=registry)
        click.echo(f"{ar.id}: autorecovery running (lost-bookie delay {lost_bookie_delay_s:g} s); Ctrl-C stops")
        await ar.run(stop)

    _arun(metadata, go)


@autorecovery.command("status")
@metadata_option
@json_option
@click.pass_context
def autorecovery_status(ctx, metadata, as_json):
    """The auditor, lost bookies and since when, the to-do list and progress."""
    from .autorecovery import status

    parent = (ctx.parent.obj or {}).get("metadata") if ctx.parent is not None else None
    if parent and ctx.get_parameter_source("metadata") is click.core.ParameterSource.DEFAULT:
        metadata = parent
    d = _arun(metadata, status)
    if as_json:
        click.echo(json.dumps(d))
        return
    aud = d["auditor"]
    click.echo(f"auditor: {aud['id']} (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(aud['since']))})"
               if aud else "auditor: none (no autorecovery instance is running)")
    click.echo(f"live bookies: {', '.join(d['live_bookies']) or '-'}")
    for b, rec in d["lost_bookies"].items():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["since"]))
        click.echo(f"lost: {b} since {when} ({time.time() - rec['since']:.0f} s ago), "
                   + (f"{rec.get('fragments', 0)} fragments marked" if rec["marked"] else "not marked yet"))
    from rich.table import Table

    t = Table("stream", "fragment", "lost bookies", "open", "claimed by", "attempts", "error",
              title=f"under-replicated fragments: {len(d['underreplicated'])}")
    for it in d["underreplicated"]:
        t.add_row(it["stream"], str(it["fragment"]), ", ".join(it["bookies"]), "yes" if it["open"] else "",
                  it["claimed_by"] or "-", str(it.get("attempts", 0)), it.get("error") or "")
    _console().print(t)
    p = d["progress"]
    click.echo(f"progress: {p.get('repaired', 0)} fragments repaired, {p.get('bytes', 0)} bytes copied, "
               f"{p.get('takeovers', 0)} take-overs")


# ---------------------------------------------------------------------------------------- bookie
def _bookie_group() -> click.Group:
    """``scroll bookie [OPTIONS]`` runs a bookie (unchanged); ``scroll bookie decommission ID``
    manages one. The server's options are those of ``bookie.cli.bookie_command``."""
    import copy

    from bookie.cli import bookie_command

    params = []
    for p in bookie_command.params:
        q = copy.copy(p)
        if q.name == "data_dir":
            q.required = False
        params.append(q)

    @click.pass_context
    def run(ctx, **kw):
        if ctx.invoked_subcommand is not None:
            return
        if kw.get("data_dir") is None:
            raise click.UsageError("Missing option '--data-dir' (to run a bookie), or a command (decommission).")
        ctx.invoke(bookie_command, **kw)

    group = click.Group(
        "bookie", params=params, callback=run, invoke_without_command=True,
        help="Run one bookie (storage server): scroll bookie --data-dir D --port P ...\n\n"
             "Or manage bookies: scroll bookie decommission BOOKIE_ID; scroll bookie scrub --all --wait.",
        short_help="Run a bookie, decommission one, or scrub.",
    )
    group.add_command(decommission, "decommission")
    group.add_command(bookie_scrub, "scrub")
    return group


main.add_lazy("bookie", _bookie_group)


@click.command("decommission")
@click.argument("bookie_id")
@click.option("--no-takeover", is_flag=True,
              help="Leave open fragments that name the bookie alone (by default such streams are taken over).")
@metadata_option
@json_option
def decommission(bookie_id, no_takeover, metadata, as_json):
    """Move every fragment off BOOKIE_ID (stop the bookie first to also move open fragments)."""
    from .admin import decommission as run

    with _Bar(f"decommission {bookie_id}", enabled=not as_json) as bar:
        d = _arun(metadata, lambda c: run(c, bookie_id, takeover=not no_takeover, progress=bar.update))
    if as_json:
        click.echo(json.dumps(d))
    else:
        from rich.table import Table

        t = Table("stream", "fragment", "moved to", "entries copied", "note", title=f"decommission {bookie_id}")
        for m in d["moved"]:
            t.add_row(m["stream"], str(m["fragment"]), m["to"] or "-", str(m["entries"]), m.get("note", ""))
        for m in d["left"]:
            t.add_row(m["stream"], str(m["fragment"]), "-", "-", m["reason"], style="yellow")
        for m in d["errors"]:
            t.add_row(m["stream"], str(m["fragment"]), "-", "-", m["error"], style="red")
        _console().print(t)
        for r in d["takeovers"]:
            click.echo(f"took over {r['stream']!r}: term {r['previous_term']} -> {r['term']}")
        click.echo(f"{bookie_id}: " + ("no fragment names it any more" if d["done"] else "NOT done (see above)"))
    if not d["done"]:
        sys.exit(1)


@click.command("scrub")
@click.option("--bookie", "bookie_ids", multiple=True, metavar="BOOKIE_ID",
              help="This bookie (its id, as `scroll bookies` shows it); repeatable.")
@click.option("--all", "all_bookies", is_flag=True, help="Every live bookie.")
@click.option("--status", "status_only", is_flag=True,
              help="Only show each bookie's scrub status (every live bookie unless --bookie); start nothing.")
@click.option("--wait", is_flag=True, help="Wait until the pass each bookie runs has ended.")
@click.option("--repair", is_flag=True,
              help="Then copy the bad copies found back from good replicas (check --fix on their streams).")
@click.option("--timeout", "timeout_s", default=3600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds --wait waits for the passes.")
@metadata_option
@json_option
def bookie_scrub(bookie_ids, all_bookies, status_only, wait, repair, timeout_s, metadata, as_json):
    """Start a scrub pass on bookies (each reads its stored entries back and verifies them; a bad
    copy is removed, not served) and show their scrub status. Exit 1 when a bad copy found is not
    repaired yet.

    \b
    Examples:
      scroll bookie scrub --all --wait --repair
      scroll bookie scrub --bookie bookie-0
      scroll bookie scrub --status --json
    """
    if not (bookie_ids or all_bookies or status_only):
        raise click.UsageError("say which bookies: --bookie BOOKIE_ID (repeatable) or --all (or --status)")
    if bookie_ids and all_bookies:
        raise click.UsageError("--bookie and --all exclude each other")
    from .bookiescrub import scrub_bookies

    d = _arun(metadata, lambda c: scrub_bookies(c, list(bookie_ids) or None, start=not status_only,
                                                wait=wait, repair=repair, timeout_s=timeout_s))
    if as_json:
        click.echo(json.dumps(d))
    else:
        from rich.table import Table

        def when(t):
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"

        t = Table("bookie", "started", "running", "passes", "last pass (start .. end)", "pass under way",
                  "entries checked", "bad copies", "repaired", "awaiting repair", title="scrub")
        for b in d["bookies"]:
            if "error" in b:
                t.add_row(b["bookie"], *["-"] * 9, style="red")
                continue
            under = "-"
            if b["pass_started"]:
                pos = b["position"]
                under = f"since {when(b['pass_started'])}, {b['pass_entries']} entries" + (
                    f", at ledger {pos[0]} entry {pos[1]}" if pos else "")
            t.add_row(b["bookie"], "yes" if b["started"] else "no", "yes" if b["running"] else "no", str(b["passes"]),
                      f"{when(b['last_pass_start'])} .. {when(b['last_pass_end'])}", under, str(b["entries"]),
                      str(b["corrupt"]), str(b["repaired"]), str(b["awaiting_repair"]),
                      style="red" if b["awaiting_repair"] else None)
        _console().print(t)
        for b in d["bookies"]:
            if "error" in b:
                click.echo(f"{b['bookie']}: no answer: {b['error']}")
            for f in b.get("findings", ()):
                click.echo(f"{b['bookie']}: bad copy ledger={f['ledger']} entry={f['entry']} ({f['found_by']}, "
                           f"{when(f['at'])}): {f['reason']}" + ("" if f["removed"] else " [kept: above the LAC]"))
        for r in d["repairs"]:
            click.echo(f"repaired {r['stream']!r} fragment {r['fragment']}: {r['copied']} entries copied"
                       + (f" ERROR {r['error']}" if r["error"] else ""))
    if not d["ok"]:
        sys.exit(1)


def _plugins() -> None:
    """Commands of packages that sit above streams (the Kafka shim, the Spark connector) register
    through the ``scroll.commands`` entry-point group, so streams never imports them; each is loaded
    when it is named."""
    from importlib.metadata import entry_points

    def loader(ep) -> Callable[[], click.Command]:
        def load() -> click.Command:
            try:
                return ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not take `scroll bookie` down with it
                return _broken_plugin(ep.name, ep.value, exc)

        return load

    for ep in entry_points(group="scroll.commands"):
        main.add_lazy(ep.name, loader(ep))


def _broken_plugin(name: str, value: str, exc: Exception) -> click.Command:
    @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
                   help=f"(cannot be loaded: {exc!r})", add_help_option=False)
    def broken() -> None:
        raise click.ClickException(f"the {name!r} command ({value}) cannot be loaded: {exc!r}")

    return broken


_plugins()

if __name__ == "__main__":
    main()
