"""Operators' view of consumer groups over the Kafka protocol, as ``kafka-consumer-groups.sh`` gives it.

How this works. ``KafkaAdmin`` is a small asyncio Kafka client built on ``codec`` and kio: one
connection per broker, one request in flight per connection. It asks the cluster what any admin
client would (so it works against any listener of a Scroll cluster, and against Kafka itself):
Metadata for the brokers and partition leaders, FindCoordinator for a group's coordinator,
ListGroups of every broker, ConsumerGroupDescribe (KIP-848 groups) or DescribeGroups (classic
groups) for members and assignments (these live in the coordinator's memory, not in the store),
OffsetFetch for committed offsets, ListOffsets (to each partition's leader) for log-end offsets and
offsets by time, OffsetCommit (generation -1, no member) to reset offsets, DeleteGroups.

``describe`` joins them into one row per partition: committed offset, log-end offset, **lag**
(log end - committed; unknown without a committed offset) and the member that owns it.
``plan_reset`` computes new offsets (earliest, latest, an offset clamped to the partition's range,
a shift, a time) and refuses, as Kafka's tool does, while the group has active members;
``commit`` writes a plan. The same report feeds the listener's Prometheus metrics (``metrics.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import re
import struct
from dataclasses import asdict, dataclass, field

from kio.schema.api_versions.v3 import ApiVersionsRequest
from kio.schema.consumer_group_describe.v0 import ConsumerGroupDescribeRequest
from kio.schema.delete_groups.v2 import DeleteGroupsRequest
from kio.schema.describe_groups.v5 import DescribeGroupsRequest
from kio.schema.errors import ErrorCode
from kio.schema.find_coordinator.v4 import FindCoordinatorRequest
from kio.schema.list_groups.v5 import ListGroupsRequest
from kio.schema.list_offsets.v7 import ListOffsetsRequest
from kio.schema.list_offsets.v7.request import ListOffsetsPartition, ListOffsetsTopic
from kio.schema.metadata.v12 import MetadataRequest
from kio.schema.metadata.v12.request import MetadataRequestTopic
from kio.schema.offset_commit.v9 import OffsetCommitRequest
from kio.schema.offset_commit.v9.request import OffsetCommitRequestPartition, OffsetCommitRequestTopic
from kio.schema.offset_delete.v0 import OffsetDeleteRequest
from kio.schema.offset_delete.v0.request import OffsetDeleteRequestPartition, OffsetDeleteRequestTopic
from kio.schema.offset_fetch.v8 import OffsetFetchRequest
from kio.schema.offset_fetch.v8.request import OffsetFetchRequestGroup

from ..security.client_security import ClientAuthError, KafkaClientConfig
from ..wire import codec

log = logging.getLogger(__name__)

TP = tuple[str, int]
EARLIEST, LATEST = -2, -1
_RETRIABLE_GROUP = {ErrorCode.coordinator_not_available, ErrorCode.coordinator_load_in_progress,
                    ErrorCode.not_coordinator}


class AdminError(Exception):
    """A failure to report to the operator as is (bad input, a refused operation, an error code)."""


# ---------------------------------------------------------------- the connection and the client
class Connection:
    def __init__(self, host: str, port: int, timeout_s: float, client_id: str,
                 security: KafkaClientConfig | None = None):
        self.host, self.port, self.timeout_s, self.client_id = host, port, timeout_s, client_id
        self.security = security or KafkaClientConfig()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def call(self, body):
        async with self._lock:
            try:
                return await asyncio.wait_for(self._call(body), self.timeout_s)
            except ClientAuthError as exc:
                await self.close()
                raise AdminError(str(exc)) from exc
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                await self.close()
                raise AdminError(f"{self.host}:{self.port}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, body):
        if self._writer is None:
            self._reader, self._writer = await self.security.open(self.host, self.port)
        cid = next(self._ids)
        self._writer.write(codec.encode_request(body, cid, self.client_id))
        await self._writer.drain()
        (size,) = struct.unpack(">i", await self._reader.readexactly(4))
        got, resp = codec.decode_response(await self._reader.readexactly(size), body.__api_key__, body.__version__)
        if got != cid:
            raise AdminError(f"{self.host}:{self.port}: correlation id {got}, expected {cid}")
        return resp

    async def close(self) -> None:
        w, self._writer, self._reader = self._writer, None, None
        if w is not None:
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()


def parse_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for item in bootstrap.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise AdminError(f"bootstrap server {item!r} is not host:port")
        out.append((host, int(port)))
    return out


@dataclass
class MemberView:
    member_id: str
    client_id: str
    host: str
    instance_id: str | None
    assignment: list[TP] = field(default_factory=list)


@dataclass
class PartitionRow:
    topic: str
    partition: int
    committed: int | None
    log_end: int | None
    lag: int | None
    member_id: str | None = None
    client_id: str | None = None
    host: str | None = None


@dataclass
class GroupView:
    group: str
    group_type: str  # classic | consumer
    state: str
    protocol_type: str
    assignor: str
    coordinator: int
    members: list[MemberView]
    partitions: list[PartitionRow]

    @property
    def lag(self) -> int:
        return sum(r.lag for r in self.partitions if r.lag is not None)

    def as_json(self) -> dict:
        d = asdict(self)
        d["lag"] = self.lag
        return d


@dataclass(frozen=True)
class GroupListing:
    group: str
    group_type: str
    state: str
    protocol_type: str
    coordinator: int


class KafkaAdmin:
    def __init__(self, bootstrap: str, timeout_s: float = 15.0, client_id: str = "scroll-groups",
                 security: KafkaClientConfig | None = None):
        self.bootstrap = parse_bootstrap(bootstrap)
        self.security = security
        self.timeout_s = timeout_s
        self.client_id = client_id
        self._by_addr: dict[tuple[str, int], Connection] = {}
        self.brokers: dict[int, tuple[str, int]] = {}
        self.api_versions: dict[int, tuple[int, int]] = {}

    async def __aenter__(self) -> KafkaAdmin:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for c in self._by_addr.values():
            await c.close()
        self._by_addr.clear()

    def _conn(self, addr: tuple[str, int]) -> Connection:
        c = self._by_addr.get(addr)
        if c is None:
            c = self._by_addr[addr] = Connection(addr[0], addr[1], self.timeout_s, self.client_id, self.security)
        return c

    async def any_call(self, body):
        """Send to the first bootstrap server that answers."""
        last: Exception | None = None
        for addr in self.bootstrap:
            try:
                return await self._conn(addr).call(body)
            except AdminError as exc:
                last = exc
        raise AdminError(f"no bootstrap server answered: {last}")

    async def node_call(self, node: int, body):
        if node not in self.brokers:
            await self.metadata([])
        if node not in self.brokers:
            raise AdminError(f"broker {node} is not in the cluster's metadata")
        return await self._conn(self.brokers[node]).call(body)

    async def versions(self) -> dict[int, tuple[int, int]]:
        if not self.api_versions:
            r = await self.any_call(ApiVersionsRequest(client_software_name="scroll", client_software_version="1"))
            self.api_versions = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
        return self.api_versions

    async def metadata(self, topics: list[str] | None) -> dict[str, dict[int, int]]:
        """Refresh brokers; ``topics`` (None: all) -> {topic: {partition: leader}} (unknown ones left out)."""
        req = MetadataRequest(topics=None if topics is None else tuple(
            MetadataRequestTopic(topic_id=None, name=t) for t in topics),
            allow_auto_topic_creation=False, include_topic_authorized_operations=False)
        r = await self.any_call(req)
        self.brokers = {b.node_id: (b.host, b.port) for b in r.brokers}
        return {t.name: {p.partition_index: p.leader_id for p in t.partitions}
                for t in r.topics if t.error_code == ErrorCode.none and t.name is not None}

    async def coordinator(self, group: str) -> int:
        for attempt in range(10):
            r = await self.any_call(FindCoordinatorRequest(key_type=0, coordinator_keys=(group,)))
            c = r.coordinators[0]
            if c.error_code == ErrorCode.none:
                self.brokers[c.node_id] = (c.host, c.port)
                return c.node_id
            if c.error_code not in _RETRIABLE_GROUP:
                raise AdminError(f"FindCoordinator for group {group!r}: {c.error_code.name} {c.error_message or ''}")
            await asyncio.sleep(0.1 * (attempt + 1))
        raise AdminError(f"no coordinator for group {group!r}: {c.error_code.name}")

    # ------------------------------------------------------------ list / describe
    async def list_groups(self) -> list[GroupListing]:
        await self.metadata([])
        out: dict[str, GroupListing] = {}
        for node in sorted(self.brokers):
            r = await self.node_call(node, ListGroupsRequest(states_filter=(), types_filter=()))
            if r.error_code != ErrorCode.none:
                raise AdminError(f"ListGroups on broker {node}: {r.error_code.name}")
            for g in r.groups:
                out[g.group_id] = GroupListing(g.group_id, g.group_type or "classic", g.group_state, g.protocol_type,
                                               node)
        return [out[k] for k in sorted(out)]

    async def committed(self, group: str, node: int | None = None) -> dict[TP, int]:
        node = await self.coordinator(group) if node is None else node
        r = await self.node_call(node, OffsetFetchRequest(groups=(OffsetFetchRequestGroup(group_id=group, topics=None),),
                                                          require_stable=False))
        g = r.groups[0]
        if g.error_code != ErrorCode.none:
            raise AdminError(f"OffsetFetch for group {group!r}: {g.error_code.name}")
        return {(t.name, p.partition_index): p.committed_offset for t in g.topics for p in t.partitions
                if p.error_code == ErrorCode.none and p.committed_offset >= 0}

    async def list_offsets(self, tps: list[TP], timestamp: int) -> dict[TP, int]:
        """The offset of each partition at ``timestamp`` (-1 latest, -2 earliest, else the first
        record at or after it; -1 when there is none), asked of each partition's leader."""
        if not tps:
            return {}
        leaders = await self.metadata(sorted({t for t, _ in tps}))
        by_node: dict[int, list[TP]] = {}
        for t, p in tps:
            node = leaders.get(t, {}).get(p)
            if node is None:
                raise AdminError(f"unknown topic or partition {t} {p}")
            by_node.setdefault(node, []).append((t, p))
        out: dict[TP, int] = {}
        for node, parts in by_node.items():
            topics: dict[str, list[int]] = {}
            for t, p in parts:
                topics.setdefault(t, []).append(p)
            r = await self.node_call(node, ListOffsetsRequest(replica_id=-1, isolation_level=0, topics=tuple(
                ListOffsetsTopic(name=t, partitions=tuple(ListOffsetsPartition(partition_index=p, timestamp=timestamp)
                                                          for p in ps)) for t, ps in topics.items())))
            for t in r.topics:
                for p in t.partitions:
                    if p.error_code != ErrorCode.none:
                        raise AdminError(f"ListOffsets {t.name} {p.partition_index}: {p.error_code.name}")
                    out[(t.name, p.partition_index)] = p.offset
        return out

    async def describe(self, group: str) -> GroupView:
        node = await self.coordinator(group)
        view = None
        if codec.API_CONSUMER_GROUP_DESCRIBE in await self.versions():
            r = await self.node_call(node, ConsumerGroupDescribeRequest(group_ids=(group,),
                                                                        include_authorized_operations=False))
            d = r.groups[0]
            if d.error_code == ErrorCode.none:
                members = [MemberView(m.member_id, m.client_id, m.client_host, m.instance_id,
                                      sorted((t.topic_name, p) for t in m.assignment.topic_partitions for p in t.partitions))
                           for m in d.members]
                view = GroupView(group, "consumer", d.group_state, "consumer", d.assignor_name, node, members, [])
            elif d.error_code not in (ErrorCode.group_id_not_found, ErrorCode.unsupported_version):
                raise AdminError(f"ConsumerGroupDescribe of {group!r}: {d.error_code.name} {d.error_message or ''}")
        if view is None:
            r = await self.node_call(node, DescribeGroupsRequest(groups=(group,), include_authorized_operations=False))
            d = r.groups[0]
            if d.error_code != ErrorCode.none:
                raise AdminError(f"DescribeGroups of {group!r}: {d.error_code.name}")
            members = [MemberView(m.member_id, m.client_id, m.client_host, m.group_instance_id,
                                  decode_assignment(m.member_assignment) if d.protocol_type == "consumer" else [])
                       for m in d.members]
            view = GroupView(group, "classic", d.group_state, d.protocol_type, d.protocol_data, node, members, [])
        committed = await self.committed(group, node)
        if view.state == "Dead" and not committed:
            raise AdminError(f"Consumer group '{group}' does not exist.")
        owner = {tp: m for m in view.members for tp in m.assignment}
        tps = sorted(set(committed) | set(owner))
        ends = await self._log_ends(tps)
        for t, p in tps:
            c, e, m = committed.get((t, p)), ends.get((t, p)), owner.get((t, p))
            view.partitions.append(PartitionRow(t, p, c, e, max(0, e - c) if c is not None and e is not None else None,
                                                m.member_id if m else None, m.client_id if m else None,
                                                m.host if m else None))
        return view

    async def _log_ends(self, tps: list[TP]) -> dict[TP, int]:
        """Log-end offsets; partitions of topics deleted meanwhile are left out."""
        leaders = await self.metadata(sorted({t for t, _ in tps}))
        known = [(t, p) for t, p in tps if p in leaders.get(t, {})]
        return await self.list_offsets(known, LATEST)

    # ------------------------------------------------------------ reset / delete
    async def plan_reset(self, group: str, topics: list[str] | None, *, to: str, value: int | None = None
                         ) -> dict[TP, int]:
        """New offsets for a reset: ``to`` is earliest | latest | offset | shift | timestamp (``value``:
        the offset, the shift or the time in ms). Refused while the group has active members."""
        view = await self.describe_or_empty(group)
        if view.members:
            raise AdminError(f"Assignments can only be reset if the group '{group}' is inactive, but the current "
                             f"state is {view.state}.")
        tps = await self._reset_partitions(group, topics)
        if not tps:
            raise AdminError(f"no partitions to reset for group '{group}' (name topics with --topic, or "
                             f"--all-topics for the topics it has offsets for)")
        earliest = await self.list_offsets(tps, EARLIEST)
        latest = await self.list_offsets(tps, LATEST)

        def clamp(tp: TP, o: int) -> int:
            return min(max(o, earliest[tp]), latest[tp])

        if to == "earliest":
            return dict(earliest)
        if to == "latest":
            return dict(latest)
        if to == "offset":
            return {tp: clamp(tp, value) for tp in tps}
        if to == "shift":
            committed = await self.committed(group)
            return {tp: clamp(tp, committed.get(tp, latest[tp]) + value) for tp in tps}
        if to == "timestamp":
            at = await self.list_offsets(tps, value)
            return {tp: (at[tp] if at[tp] >= 0 else latest[tp]) for tp in tps}
        raise AdminError(f"unknown reset {to!r}")

    async def describe_or_empty(self, group: str) -> GroupView:
        try:
            return await self.describe(group)
        except AdminError as exc:
            if "does not exist" not in str(exc):
                raise
            return GroupView(group, "classic", "Dead", "", "", -1, [], [])

    async def _reset_partitions(self, group: str, topics: list[str] | None) -> list[TP]:
        if topics is None:  # --all-topics: those the group has committed offsets for
            return sorted(await self.committed(group))
        names = [spec.partition(":")[0] for spec in topics]
        leaders = await self.metadata(sorted(set(names)))
        out: list[TP] = []
        for spec in topics:
            name, _, parts = spec.partition(":")
            if name not in leaders:
                raise AdminError(f"unknown topic {name!r}")
            if parts:
                try:
                    wanted = [int(p) for p in parts.split(",")]
                except ValueError:
                    raise AdminError(f"--topic {spec!r}: partitions must be numbers, e.g. {name}:0,2") from None
                bad = [p for p in wanted if p not in leaders[name]]
                if bad:
                    raise AdminError(f"topic {name!r} has no partition {bad[0]} (it has {len(leaders[name])})")
                out += [(name, p) for p in wanted]
            else:
                out += [(name, p) for p in sorted(leaders[name])]
        return sorted(set(out))

    async def commit(self, group: str, offsets: dict[TP, int]) -> None:
        node = await self.coordinator(group)
        topics: dict[str, list[tuple[int, int]]] = {}
        for (t, p), o in sorted(offsets.items()):
            topics.setdefault(t, []).append((p, o))
        r = await self.node_call(node, OffsetCommitRequest(
            group_id=group, generation_id_or_member_epoch=-1, member_id="", group_instance_id=None, topics=tuple(
                OffsetCommitRequestTopic(name=t, partitions=tuple(OffsetCommitRequestPartition(
                    partition_index=p, committed_offset=o, committed_leader_epoch=-1, committed_metadata="")
                    for p, o in ps)) for t, ps in topics.items())))
        errors = [(t.name, p.partition_index, p.error_code) for t in r.topics for p in t.partitions
                  if p.error_code != ErrorCode.none]
        if errors:
            t, p, code = errors[0]
            raise AdminError(f"OffsetCommit for group {group!r} failed for {len(errors)} partitions, e.g. "
                             f"{t} {p}: {code.name}")

    async def delete_offsets(self, group: str, topics: list[str]) -> dict[TP, str | None]:
        """OffsetDelete (KIP-496) for the named partitions: {partition: None, or the error name}."""
        tps = await self._reset_partitions(group, topics)
        by_topic: dict[str, list[int]] = {}
        for t, p in tps:
            by_topic.setdefault(t, []).append(p)
        node = await self.coordinator(group)
        r = await self.node_call(node, OffsetDeleteRequest(group_id=group, topics=tuple(
            OffsetDeleteRequestTopic(name=t, partitions=tuple(OffsetDeleteRequestPartition(partition_index=p)
                                                              for p in ps)) for t, ps in by_topic.items())))
        if r.error_code == ErrorCode.group_id_not_found:
            raise AdminError(f"Consumer group '{group}' does not exist.")
        if r.error_code != ErrorCode.none:
            raise AdminError(f"OffsetDelete for group {group!r}: {r.error_code.name}")
        return {(t.name, p.partition_index): (None if p.error_code == ErrorCode.none else p.error_code.name)
                for t in r.topics for p in t.partitions}

    async def delete_group(self, group: str) -> None:
        node = await self.coordinator(group)
        r = await self.node_call(node, DeleteGroupsRequest(groups_names=(group,)))
        code = r.results[0].error_code
        if code == ErrorCode.group_id_not_found:
            raise AdminError(f"Consumer group '{group}' does not exist.")
        if code == ErrorCode.non_empty_group:
            raise AdminError(f"Consumer group '{group}' is not empty (it has active members): not deleted.")
        if code != ErrorCode.none:
            raise AdminError(f"DeleteGroups of {group!r}: {code.name}")


def decode_assignment(raw: bytes) -> list[TP]:
    """The partitions of a ConsumerProtocolAssignment (int16 version, [topic: int16 string,
    [int32 partition]], user data...); an unreadable one gives none."""
    out: list[TP] = []
    try:
        (n,) = struct.unpack_from(">i", raw, 2)
        pos = 6
        for _ in range(max(0, n)):
            (size,) = struct.unpack_from(">h", raw, pos)
            topic = raw[pos + 2:pos + 2 + size].decode()
            pos += 2 + size
            (k,) = struct.unpack_from(">i", raw, pos)
            pos += 4
            parts = struct.unpack_from(f">{max(0, k)}i", raw, pos)
            pos += 4 * max(0, k)
            out += [(topic, p) for p in parts]
    except (struct.error, UnicodeDecodeError):
        return []
    return sorted(out)


_DURATION = re.compile(r"P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?")


def parse_duration_ms(text: str) -> int:
    """``--by-duration``: an ISO 8601 duration as Kafka's tool takes it, ``PnDTnHnMnS`` (e.g.
    ``PT1H30M``, ``P1D``), in milliseconds."""
    m = _DURATION.fullmatch(text.strip().upper())
    if m is None or not any(m.groups()) or text.strip().upper().endswith("T"):
        raise AdminError(f"--by-duration {text!r} is not a duration like PT1H30M or P1DT2H")
    d, h, mi, sec = (float(g) if g else 0.0 for g in m.groups())
    return int(((d * 24 + h) * 60 + mi) * 60_000 + sec * 1000)


def parse_datetime_ms(text: str) -> int:
    """``--to-datetime``: ISO 8601 (``2026-11-24T14:00:00``, ``...Z``, ``...+01:00``, or a date);
    without a zone it is UTC (Kafka's tool takes the local zone; an operator's UTC is less surprising
    on servers). Milliseconds since the epoch."""
    try:
        dt = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise AdminError(f"--to-datetime {text!r} is not an ISO 8601 time, e.g. 2026-11-24T14:00:00Z") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.UTC)
    return int(dt.timestamp() * 1000)
