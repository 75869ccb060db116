"""The ``scroll`` command line.

Every command that talks to a cluster takes ``--metadata URL`` (or ``SCROLL_METADATA``; default
``etcd://127.0.0.1:2379``). Output is a human table by default and JSON with ``--json``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

DEFAULT_METADATA = "etcd://127.0.0.1:2379"
metadata_option = click.option(
    "--metadata", envvar="SCROLL_METADATA", default=DEFAULT_METADATA, show_default=True,
    help="Metadata store URL (etcd://host:port).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Scroll: unbounded replicated streams with terms and truncate-on-take-over.

    \b
    Examples:
      scroll stream create orders --ensemble 3 --write-quorum 3 --ack-quorum 2
      printf 'a\\nb\\n' | scroll produce orders
      scroll consume orders --from earliest
      scroll fragments orders
    """


def _client(metadata: str):
    from .errors import ScrollError
    from .sync import connect

    try:
        return connect(metadata)
    except ScrollError as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - e.g. the metadata store is down: say so clearly
        raise click.ClickException(f"cannot reach the metadata store at {metadata}: {exc}") from exc


def _fail(exc: Exception) -> click.ClickException:
    return click.ClickException(f"{type(exc).__name__}: {exc}")


def _console():
    from rich.console import Console

    return Console()


def _meta_dict(meta) -> dict:
    d = asdict(meta)
    d["status"] = meta.status.value
    return d


# ---------------------------------------------------------------------------------------- streams
@main.group()
def stream() -> None:
    """Create, list, describe and delete streams."""


@stream.command("create")
@click.argument("name")
@click.option("--ensemble", "-e", default=3, show_default=True, help="Bookies per fragment (E).")
@click.option("--write-quorum", "-w", default=3, show_default=True, help="Copies of each entry (WQ).")
@click.option("--ack-quorum", "-a", default=2, show_default=True, help="Copies before an append is acknowledged (AQ).")
@click.option("--fragment-bytes", default=64 << 20, show_default=True, help="Seal a fragment at this many bytes.")
@click.option("--fragment-entries", default=1_000_000, show_default=True, help="... or at this many entries.")
@click.option("--retention-max-age", type=float, help="Retention: remove sealed fragments older than this (s).")
@click.option("--retention-max-bytes", type=int, help="Retention: keep at most this many bytes.")
@metadata_option
@json_option
def stream_create(name, ensemble, write_quorum, ack_quorum, fragment_bytes, fragment_entries, retention_max_age,
                  retention_max_bytes, metadata, as_json):
    """Create a stream."""
    from .errors import ScrollError

    retention = {}
    if retention_max_age is not None:
        retention["max_age_s"] = retention_max_age
    if retention_max_bytes is not None:
        retention["max_bytes"] = retention_max_bytes
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
    """List streams."""
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


@stream.command("describe")
@click.argument("name")
@metadata_option
@json_option
def stream_describe(name, metadata, as_json):
    """Show a stream's configuration, term and status."""
    from .errors import ScrollError

    with _client(metadata) as c:
        try:
            info = c.describe_stream(name)
            end = c.consumer(name, start="latest").position
        except ScrollError as exc:
            raise _fail(exc) from exc
    d = _meta_dict(info.meta)
    d.update(end_position=end, earliest_position=info.fragments[0].first_entry_id if info.fragments else 0,
             fragments=len(info.fragments), bytes_in_sealed_fragments=info.bytes)
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
    from .errors import ScrollError

    with _client(metadata) as c:
        try:
            c.delete_stream(name)
        except ScrollError as exc:
            raise _fail(exc) from exc
    click.echo(f"deleted stream {name!r}")


# ---------------------------------------------------------------------------------------- data
@main.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--file", "files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Append each file as one record (instead of stdin lines).")
@click.option("--key", default=None, help="Key for every record.")
@metadata_option
@json_option
def produce(stream_name, files, key, metadata, as_json):
    """Append stdin lines (or files) to STREAM, one record each."""
    from .errors import ScrollError

    values = [open(f, "rb").read() for f in files] if files else [ln.rstrip(b"\n") for ln in sys.stdin.buffer]
    with _client(metadata) as c:
        try:
            with c.producer(stream_name) as p:
                kb = key.encode() if key is not None else None
                positions = p.append_many(values) if kb is None else [p.append(v, key=kb) for v in values]
        except ScrollError as exc:
            raise _fail(exc) from exc
    if as_json:
        click.echo(json.dumps({"stream": stream_name, "positions": positions}))
    else:
        click.echo(f"appended {len(positions)} records to {stream_name!r}"
                   + (f" at {positions[0]}..{positions[-1]}" if positions else ""), err=True)


@main.command()
@click.argument("stream_name", metavar="STREAM")
@click.option("--from", "start", default="earliest", show_default=True, help="earliest, latest or a position.")
@click.option("--follow", "-f", is_flag=True, help="Keep waiting for new records (Ctrl-C stops).")
@click.option("--max", "max_records", type=int, default=None, help="Stop after this many records.")
@metadata_option
@json_option
def consume(stream_name, start, follow, max_records, metadata, as_json):
    """Print records of STREAM (value per line; --json for key, headers, position)."""
    from .errors import ScrollError

    start_at = start if start in ("earliest", "latest") else int(start)
    seen = 0
    with _client(metadata) as c:
        try:
            cons = c.consumer(stream_name, start=start_at)
            while max_records is None or seen < max_records:
                want = 500 if max_records is None else min(500, max_records - seen)
                batch = cons.read(want, timeout_s=1.0 if follow else 0.0)
                if not batch and not follow:
                    break
                for r in batch:
                    seen += 1
                    if as_json:
                        click.echo(json.dumps({
                            "position": r.position, "timestamp_ms": r.timestamp_ms,
                            "key": r.key.decode(errors="replace") if r.key is not None else None,
                            "headers": {k: (v.decode(errors="replace") if v is not None else None) for k, v in r.headers},
                            "value": r.value.decode(errors="replace")}))
                    else:
                        sys.stdout.buffer.write(r.value + b"\n")
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except ScrollError as exc:
            raise _fail(exc) from exc


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
    """Fragments of STREAM: ensemble, entry range, bytes; and the ledger's term and status."""
    from .errors import ScrollError

    with _client(metadata) as c:
        try:
            info = c.describe_stream(stream_name)
        except ScrollError as exc:
            raise _fail(exc) from exc
    m = info.meta
    if as_json:
        click.echo(json.dumps({"stream": m.name, "ledger": m.ledger_id, "term": m.term, "status": m.status.value,
                               "fragments": [json.loads(f.to_json()) for f in info.fragments]}))
        return
    from rich.table import Table

    t = Table("fragment", "first", "last", "ensemble", "bytes", "created in term",
              title=f"{m.name} (ledger {m.ledger_id}) term {m.term} {m.status.value}")
    for f in info.fragments:
        t.add_row(str(f.index), str(f.first_entry_id), str(f.last_entry_id) if f.sealed else "(open)",
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

    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "tests" / "sim").is_dir():
        raise click.ClickException("the simulator lives in tests/sim of a source checkout")
    sys.path.insert(0, str(root))
    from tests.sim.__main__ import run_cli

    raise SystemExit(run_cli(["--seeds", str(seeds), "--first-seed", str(first_seed)]))


from bookie.cli import bookie_command  # noqa: E402  (registered last: the bookie is its own package)

main.add_command(bookie_command, "bookie")


def _plugins() -> None:
    """Commands of packages that sit above streams (the Kafka shim, the Spark connector) register
    through the ``scroll.commands`` entry-point group, so streams never imports them."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="scroll.commands"):
        main.add_command(ep.load(), ep.name)


_plugins()

if __name__ == "__main__":
    main()
