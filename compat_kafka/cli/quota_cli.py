"""`scroll kafka quotas describe|alter`: Kafka client quotas in the metadata store, through the same
code as DescribeClientQuotas/AlterClientQuotas (``quotas.py``); every listener applies a change
within about a second."""

from __future__ import annotations

import click

from fragments import aioloop

from .. import quotas

_TYPES = {"users": quotas.USER, "clients": quotas.CLIENT_ID}
_metadata = click.option("--metadata", "metadata_url", required=True, envvar="SCROLL_METADATA",
                         help="metadata store URL, e.g. etcd://127.0.0.1:2379 (or SCROLL_METADATA)")


def _run(metadata_url: str, fn):
    from fragments.stores import open_store

    async def main():
        store = await open_store(metadata_url)
        try:
            return await fn(store)
        finally:
            await store.close()

    return aioloop.run(main())


def _entity(types: tuple[str, ...], names: tuple[str, ...], defaults: bool) -> list[tuple[str, str | None]]:
    """Kafka's kafka-configs.sh pairing: each --entity-type takes the next --entity-name, or is the
    default (--entity-default) once the names run out."""
    if not types:
        raise click.UsageError("--entity-type is required")
    if len(names) > len(types) or (not defaults and len(names) < len(types)):
        raise click.UsageError("give one --entity-name (or --entity-default) per --entity-type")
    return [(_TYPES[t], names[i] if i < len(names) else None) for i, t in enumerate(types)]


def _configs(spec: str) -> list[tuple[str, float]]:
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        k, eq, v = item.partition("=")
        try:
            out.append((k.strip(), float(v)))
        except ValueError:
            raise click.BadParameter(f"--add-config takes key=value,..., not {item!r}") from None
        if not eq:
            raise click.BadParameter(f"--add-config takes key=value,..., not {item!r}")
    return out


@click.group("quotas")
def quotas_command() -> None:
    """Kafka client quotas: producer_byte_rate, consumer_byte_rate, request_percentage per user,
    client id, user + client id, or their defaults."""


_entity_options = [
    click.option("--entity-type", "types", type=click.Choice(sorted(_TYPES)), multiple=True,
                 help="users or clients (twice: a user + client id entity)"),
    click.option("--entity-name", "names", multiple=True, help="the entity's name (one per --entity-type)"),
    click.option("--entity-default", "default", is_flag=True, help="the default entity (for the types left unnamed)"),
]


def _with_entity(f):
    for opt in reversed(_entity_options):
        f = opt(f)
    return f


@quotas_command.command("describe")
@_with_entity
@_metadata
def quotas_describe(types, names, default, metadata_url) -> None:
    """The quotas of the entities matching (every one without --entity-type)."""
    if len(names) > len(types):
        raise click.UsageError("an --entity-name needs its --entity-type")
    comps = [(_TYPES[t], quotas.MATCH_EXACT if i < len(names) else
              quotas.MATCH_DEFAULT if default else quotas.MATCH_ANY, names[i] if i < len(names) else None)
             for i, t in enumerate(types)]

    async def fn(store):
        return quotas.describe(await quotas.load(store), comps, False)

    try:
        found = _run(metadata_url, fn)
    except quotas.QuotaError as exc:
        raise click.ClickException(str(exc)) from exc
    for entity, values in found:
        shown = ",".join(f"{k}={int(v) if k != quotas.REQUEST and v == int(v) else v}" for k, v in sorted(values.items()))
        click.echo(f"{quotas.show_entity(entity)}\t{shown}")


@quotas_command.command("alter")
@_with_entity
@click.option("--add-config", "add", default="", help="e.g. producer_byte_rate=1048576,consumer_byte_rate=2097152")
@click.option("--delete-config", "delete", default="", help="e.g. producer_byte_rate,request_percentage")
@click.option("--validate-only", is_flag=True, help="check, change nothing")
@_metadata
def quotas_alter(types, names, default, add, delete, validate_only, metadata_url) -> None:
    """Set (--add-config) or remove (--delete-config) quotas of one entity."""
    entity = _entity(types, names, default)
    ops = [(k, v, False) for k, v in _configs(add)]
    ops += [(k.strip(), 0.0, True) for k in delete.split(",") if k.strip()]
    if not ops:
        raise click.UsageError("nothing to change: --add-config and/or --delete-config")
    [(code, msg)] = _run(metadata_url, lambda store: quotas.alter(store, [(entity, ops)], validate_only))
    if msg is not None:
        raise click.ClickException(f"{code.name.upper()}: {msg}")
    shown = quotas.show_entity(quotas.entity_of(entity))
    click.echo(f"{'valid' if validate_only else 'altered'}: {shown}")
