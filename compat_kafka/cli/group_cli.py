"""``scroll kafka groups list|describe|reset-offsets|delete``: consumer groups as ``kafka-consumer-groups.sh``
shows them, through the Kafka protocol to a running listener (``group_admin.KafkaAdmin``).

Tables by default, JSON with ``--json``. Errors (a refused reset, an unknown group, a listener that
does not answer) are printed as ``Error: ...`` with exit status 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import click

from fragments import aioloop

from ..groups.group_admin import AdminError, KafkaAdmin, parse_datetime_ms, parse_duration_ms
from ..security.client_security import KafkaClientConfig

bootstrap_option = click.option("--bootstrap", "--bootstrap-server", "bootstrap", envvar="SCROLL_KAFKA_BOOTSTRAP",
                                default="127.0.0.1:9092", show_default=True,
                                help="a Kafka listener (host:port[,host:port...])")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
command_config_option = click.option(
    "--command-config", "command_config", envvar="SCROLL_KAFKA_COMMAND_CONFIG", default=None,
    type=click.Path(exists=True, dir_okay=False), expose_value=False,
    callback=lambda ctx, _param, value: ctx.meta.__setitem__("scroll.command_config", value),
    help="client properties for a secured listener (security.protocol, ssl.ca.location, sasl.mechanism, "
         "sasl.username, sasl.password), e.g. the client.properties of `scroll standalone --secure`")
timeout_option = click.option("--timeout", default=15.0, show_default=True, type=click.FloatRange(0.5, 300),
                              help="seconds per request")


def _run(bootstrap: str, timeout: float, fn: Callable[[KafkaAdmin], Awaitable]):
    path = click.get_current_context().meta.get("scroll.command_config")
    try:
        security = KafkaClientConfig.from_properties(path) if path else None
    except (OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--command-config") from None

    async def main():
        async with KafkaAdmin(bootstrap, timeout_s=timeout, security=security) as admin:
            return await fn(admin)

    try:
        return aioloop.run(main())
    except AdminError as exc:
        raise click.ClickException(str(exc)) from None


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [["-" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


@click.group("groups")
def groups_command() -> None:
    """Consumer groups: members, assignments, committed offsets and lag; offset resets.

    \b
    Examples:
      scroll kafka groups list --bootstrap 127.0.0.1:9092
      scroll kafka groups describe orders-app
      scroll kafka groups reset-offsets orders-app --topic orders --to-earliest --execute
      scroll kafka groups delete-offsets orders-app --topic old-topic
      scroll kafka groups delete orders-app
    """


@groups_command.command("list")
@bootstrap_option
@command_config_option
@timeout_option
@json_option
def list_cmd(bootstrap: str, timeout: float, as_json: bool) -> None:
    """Every consumer group of the cluster: type (classic or consumer), state, protocol type."""
    groups = _run(bootstrap, timeout, lambda a: a.list_groups())
    if as_json:
        click.echo(json.dumps([{"group": g.group, "type": g.group_type, "state": g.state,
                                "protocol_type": g.protocol_type, "coordinator": g.coordinator} for g in groups]))
        return
    click.echo(_table(["GROUP", "TYPE", "STATE", "PROTOCOL-TYPE", "COORDINATOR"],
                      [[g.group, g.group_type, g.state, g.protocol_type, g.coordinator] for g in groups]))


@groups_command.command("describe")
@click.argument("groups", nargs=-1)
@bootstrap_option
@command_config_option
@timeout_option
@json_option
@click.option("--all-groups", is_flag=True, help="every group of the cluster")
@click.option("--members", "members_only", is_flag=True, help="one row per member instead of per partition")
def describe_cmd(groups: tuple[str, ...], bootstrap: str, timeout: float, as_json: bool, all_groups: bool,
                 members_only: bool) -> None:
    """Per partition: committed offset, log-end offset, lag and the member consuming it."""
    if bool(groups) == all_groups:
        raise click.UsageError("name groups, or give --all-groups")

    async def fn(admin: KafkaAdmin):
        names = groups or [g.group for g in await admin.list_groups()]
        return [await admin.describe(g) for g in names]

    views = _run(bootstrap, timeout, fn)
    if as_json:
        click.echo(json.dumps([v.as_json() for v in views]))
        return
    for i, v in enumerate(views):
        if i:
            click.echo("")
        click.echo(f"Group {v.group} ({v.group_type}, {v.state}, assignor {v.assignor or '-'}, "
                   f"coordinator {v.coordinator}): {len(v.members)} members, total lag {v.lag}")
        if members_only:
            click.echo(_table(["CONSUMER-ID", "HOST", "CLIENT-ID", "#PARTITIONS", "ASSIGNMENT"], [
                [m.member_id, m.host or "-", m.client_id, len(m.assignment),
                 ",".join(f"{t}:{p}" for t, p in m.assignment) or "-"] for m in v.members]))
            continue
        click.echo(_table(["TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG", "CONSUMER-ID", "HOST",
                           "CLIENT-ID"],
                          [[r.topic, r.partition, r.committed, r.log_end, r.lag, r.member_id, r.host or None,
                            r.client_id] for r in v.partitions]))


@groups_command.command("reset-offsets")
@click.argument("group")
@bootstrap_option
@command_config_option
@timeout_option
@json_option
@click.option("--topic", "topics", multiple=True, help="TOPIC or TOPIC:P,P,... (repeatable)")
@click.option("--all-topics", is_flag=True, help="every topic the group has committed offsets for")
@click.option("--to-earliest", "to", flag_value="earliest", help="the partitions' first offsets")
@click.option("--to-latest", "to", flag_value="latest", help="the partitions' log-end offsets")
@click.option("--to-offset", type=int, default=None, help="this offset (clamped to each partition's range)")
@click.option("--shift-by", type=int, default=None, help="the committed offset plus N (N may be negative)")
@click.option("--to-datetime", default=None, help="the first offset at or after this ISO 8601 time (UTC by default)")
@click.option("--to-timestamp", type=int, default=None, help="the first offset at or after this time (ms since epoch)")
@click.option("--by-duration", default=None, help="the first offset at or after now minus this ISO 8601 duration (PT1H)")
@click.option("--dry-run", is_flag=True, help="only show the new offsets (the default)")
@click.option("--execute", is_flag=True, help="commit the new offsets")
def reset_cmd(group: str, bootstrap: str, timeout: float, as_json: bool, topics: tuple[str, ...], all_topics: bool,
              to: str | None, to_offset: int | None, shift_by: int | None, to_datetime: str | None,
              to_timestamp: int | None, by_duration: str | None, dry_run: bool, execute: bool) -> None:
    """Reset GROUP's committed offsets; refused while the group has active members (as Kafka's tool)."""
    chosen = [(name, v) for name, v in (("earliest", to), ("offset", to_offset), ("shift", shift_by),
                                         ("datetime", to_datetime), ("timestamp", to_timestamp),
                                         ("duration", by_duration)) if v is not None]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --to-earliest, --to-latest, --to-offset, --shift-by, "
                               "--to-datetime, --to-timestamp, --by-duration")
    if bool(topics) == all_topics:
        raise click.UsageError("give --topic (repeatable) or --all-topics")
    if dry_run and execute:
        raise click.UsageError("--dry-run and --execute exclude each other")
    kind, value = chosen[0]
    if kind == "earliest":
        kind, value = to, None
    elif kind in ("datetime", "duration"):
        try:
            value = parse_datetime_ms(value) if kind == "datetime" else int(time.time() * 1000) - parse_duration_ms(value)
        except AdminError as exc:
            raise click.UsageError(str(exc)) from None
        kind = "timestamp"

    async def fn(admin: KafkaAdmin):
        plan = await admin.plan_reset(group, list(topics) if topics else None, to=kind, value=value)
        if execute:
            await admin.commit(group, plan)
        return plan

    plan = _run(bootstrap, timeout, fn)
    rows = [{"group": group, "topic": t, "partition": p, "new_offset": o} for (t, p), o in sorted(plan.items())]
    if as_json:
        click.echo(json.dumps({"executed": execute, "offsets": rows}))
        return
    click.echo(_table(["GROUP", "TOPIC", "PARTITION", "NEW-OFFSET"],
                      [[r["group"], r["topic"], r["partition"], r["new_offset"]] for r in rows]))
    if not execute:
        click.echo("(dry run: nothing was committed; add --execute to commit these offsets)", err=True)


@groups_command.command("delete-offsets")
@click.argument("group")
@bootstrap_option
@command_config_option
@timeout_option
@json_option
@click.option("--topic", "topics", multiple=True, required=True, help="TOPIC or TOPIC:P,P,... (repeatable)")
def delete_offsets_cmd(group: str, bootstrap: str, timeout: float, as_json: bool, topics: tuple[str, ...]) -> None:
    """Delete GROUP's committed offsets of some partitions (OffsetDelete): refused per partition for
    topics an active member subscribes to (GROUP_SUBSCRIBED_TO_TOPIC)."""
    results = _run(bootstrap, timeout, lambda a: a.delete_offsets(group, list(topics)))
    rows = [{"topic": t, "partition": p, "error": e} for (t, p), e in sorted(results.items())]
    if as_json:
        click.echo(json.dumps(rows))
    else:
        click.echo(_table(["TOPIC", "PARTITION", "STATUS"],
                          [[r["topic"], r["partition"], r["error"] or "Successful"] for r in rows]))
    if any(r["error"] for r in rows):
        raise SystemExit(1)


@groups_command.command("delete")
@click.argument("groups", nargs=-1, required=True)
@bootstrap_option
@command_config_option
@timeout_option
@json_option
def delete_cmd(groups: tuple[str, ...], bootstrap: str, timeout: float, as_json: bool) -> None:
    """Delete groups with no active members (their committed offsets go with them)."""
    async def fn(admin: KafkaAdmin):
        out = {}
        for g in groups:
            try:
                await admin.delete_group(g)
                out[g] = None
            except AdminError as exc:
                out[g] = str(exc)
        return out

    results = _run(bootstrap, timeout, fn)
    if as_json:
        click.echo(json.dumps([{"group": g, "deleted": e is None, "error": e} for g, e in results.items()]))
    else:
        for g, e in results.items():
            click.echo(f"Deleted consumer group '{g}'." if e is None else f"Error: {e}")
    if any(e is not None for e in results.values()):
        raise SystemExit(1)
