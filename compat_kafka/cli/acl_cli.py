"""`scroll kafka acl add|remove|list`: Kafka ACLs edited in the metadata store directly (the same
bindings CreateAcls/DeleteAcls make; listeners with `--acls` apply changes within about a second)."""

from __future__ import annotations

import click

from fragments import aioloop

from ..security.acls import AclBinding, AclFilter, InvalidAcl, Operation, PatternType, Permission, ResourceType
from ..security.authorizer import Authorizer

_TYPES = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "cluster": ResourceType.CLUSTER,
          "transactional-id": ResourceType.TRANSACTIONAL_ID}
_OPS = {o.name.lower().replace("_", "-"): o for o in Operation if o not in (Operation.UNKNOWN, Operation.ANY)}


def _run(metadata_url: str, fn):
    from fragments.stores import open_store

    async def main():
        store = await open_store(metadata_url)
        try:
            return await fn(Authorizer(store))
        finally:
            await store.close()

    return aioloop.run(main())


def _show(b: AclBinding) -> str:
    return (f"{b.resource_type.name}\t{b.pattern_type.name}\t{b.name}\t{b.principal}\t{b.host}\t"
            f"{b.operation.name}\t{b.permission.name}")


_metadata = click.option("--metadata", "metadata_url", required=True, envvar="SCROLL_METADATA",
                         help="metadata store URL, e.g. etcd://127.0.0.1:2379 (or SCROLL_METADATA)")


@click.group("acl")
def acl_command() -> None:
    """Kafka ACLs of the listeners run with --acls (also managed by Kafka admin clients)."""


@acl_command.command("add")
@click.option("--resource-type", "rtype", type=click.Choice(sorted(_TYPES)), required=True)
@click.option("--name", default=None, help="resource name ('*': every one; the cluster's is kafka-cluster)")
@click.option("--prefixed", is_flag=True, help="every resource whose name starts with --name")
@click.option("--principal", required=True, help="e.g. User:alice, User:*")
@click.option("--host", default="*", show_default=True)
@click.option("--operation", "operations", type=click.Choice(sorted(_OPS)), multiple=True, required=True)
@click.option("--deny", is_flag=True, help="a DENY (default: ALLOW)")
@_metadata
def acl_add(rtype: str, name: str | None, prefixed: bool, principal: str, host: str, operations: tuple[str, ...],
            deny: bool, metadata_url: str) -> None:
    """Add ACL bindings (one per operation)."""
    if name is None:
        name = "kafka-cluster" if rtype == "cluster" else None
    if name is None:
        raise click.BadParameter("--name is required (except for the cluster)")
    try:
        bindings = [AclBinding.make(_TYPES[rtype], name, PatternType.PREFIXED if prefixed else PatternType.LITERAL,
                                    principal, host, _OPS[op], Permission.DENY if deny else Permission.ALLOW)
                    for op in operations]
    except InvalidAcl as exc:
        raise click.BadParameter(str(exc)) from exc

    async def add(az: Authorizer):
        for b in bindings:
            await az.create(b)

    _run(metadata_url, add)
    for b in bindings:
        click.echo(f"added\t{_show(b)}")


def _filter(rtype, name, pattern, principal) -> AclFilter:
    return AclFilter.make(_TYPES[rtype] if rtype else ResourceType.ANY, name,
                          PatternType[pattern.upper()] if pattern else PatternType.ANY, principal, None,
                          Operation.ANY, Permission.ANY)


_filter_options = [
    click.option("--resource-type", "rtype", type=click.Choice(sorted(_TYPES)), default=None),
    click.option("--name", default=None),
    click.option("--pattern", type=click.Choice(["literal", "prefixed", "match"]), default=None),
    click.option("--principal", default=None),
]


def _with_filter(fn):
    for opt in reversed(_filter_options):
        fn = opt(fn)
    return fn


@acl_command.command("remove")
@_with_filter
@_metadata
def acl_remove(rtype, name, pattern, principal, metadata_url: str) -> None:
    """Remove the bindings matching the filter (at least one filter option)."""
    if not any((rtype, name, pattern, principal)):
        raise click.UsageError("give at least one of --resource-type, --name, --pattern, --principal")
    gone = _run(metadata_url, lambda az: az.delete_matching(_filter(rtype, name, pattern, principal)))
    for b in gone:
        click.echo(f"removed\t{_show(b)}")
    if not gone:
        raise click.ClickException("no ACL matches")


@acl_command.command("list")
@_with_filter
@_metadata
def acl_list(rtype, name, pattern, principal, metadata_url: str) -> None:
    """The bindings matching the filter (all without one)."""
    async def listing(az: Authorizer):
        await az.reload()
        return az.acls.matching(_filter(rtype, name, pattern, principal))

    for b in _run(metadata_url, listing):
        click.echo(_show(b))
