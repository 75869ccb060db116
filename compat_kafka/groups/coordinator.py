"""Consumer groups: the group coordinator, committed offsets, and the retention floor they set.

How this works. Two layers. ``Group`` is the coordinator state machine of one group, sans-IO: every
method takes the time (``now``, seconds) and returns the answers it can give now. A JoinGroup or
SyncGroup that must wait (for the join barrier, for the leader's assignment) leaves an opaque
*token* with the group; a later event (another member joining, a timer, a leave) returns
``(token, result)`` completions. ``GroupCoordinator`` is the asyncio layer: one future per waiting
request is the token, a timer task calls ``Group.tick`` at the earliest deadline of any group, and
the Kafka API handlers translate kio requests into ``Group`` calls and results back into responses.

The state machine is Kafka's classic GroupCoordinator:

- **Empty** (no members) -> a JoinGroup -> **PreparingRebalance**. The first rebalance of an empty
  group waits ``initial_rebalance_delay_ms`` (``group.initial.rebalance.delay.ms``) and extends the
  wait by that much again while new members keep arriving, up to the rebalance timeout. A later
  rebalance completes as soon as every known member has rejoined (and no member id handed out with
  MEMBER_ID_REQUIRED is still outstanding), or at the rebalance timeout, when members that did not
  rejoin are removed.
- Completing the join barrier bumps the generation, picks the protocol by vote (each member votes
  for its most preferred protocol among those every member supports), answers every JoinGroup
  (the leader also gets the members and their metadata for that protocol) and moves to
  **CompletingRebalance** (or **Empty** when nobody is left).
- SyncGroup waits for the leader's; the leader's carries the assignments: every waiting member gets
  its own and the group is **Stable**. A member that does not sync within the rebalance timeout is
  removed and the group rebalances.
- Heartbeat answers REBALANCE_IN_PROGRESS while PreparingRebalance (the member must rejoin);
  UNKNOWN_MEMBER_ID / ILLEGAL_GENERATION / FENCED_INSTANCE_ID as Kafka does. A member with no
  request waiting whose last heartbeat (or commit, or join/sync) is older than its session timeout
  is removed, which rebalances the group. LeaveGroup removes members at once.
- JoinGroup v4+ without a member id answers MEMBER_ID_REQUIRED with a generated id (the member is
  *pending* until it rejoins with it, or its session timeout passes). Static members
  (``group.instance.id``) skip that step; a static member rejoining with a new member id replaces
  (fences) its old id; a request naming an instance id with someone else's member id gets
  FENCED_INSTANCE_ID.
- **Dead**: a deleted group (DeleteGroups). Requests then get COORDINATOR_NOT_AVAILABLE.

Group membership lives in memory (after a shim restart members get UNKNOWN_MEMBER_ID and rejoin,
exactly what a Kafka client does when its coordinator moves). Committed offsets are durable, one key
per group, topic and partition in the metadata store::

    kafka/groups/<group, percent-encoded>/offsets/<topic>/<partition>
        -> {"offset": N, "leader_epoch": E, "metadata": "...", "commit_timestamp_ms": T}

OffsetCommit is accepted from the current generation's members (Stable or PreparingRebalance,
counting as a heartbeat) and, with generation -1, for a group with no members (simple consumers
that ``assign`` partitions). Only the shim that coordinates a group (``Broker.is_coordinator``)
serves it; the others answer NOT_COORDINATOR.

``retention_floor(client, meta)`` (entry point ``scroll.retention_floors``) tells the retention job
the lowest record offset any group still needs on a partition's stream: the lowest committed offset
(Kafka offsets are the streams' record offsets). It runs anywhere (not only on the shim owning the
partition) and reads only the committed offsets in the metadata store, never the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from kio.schema.errors import ErrorCode

from streams.topics import TopicMeta, stream_partition, topic_key

from ..transactions.coordinator import mark_unstable
from ..wire import codec
from ..wire.codec import ZERO_MS, build, nested
from ..wire.errors import code_for
from .consumer_groups import ConsumerGroup, ConsumerGroupConfig
from .records import Committed, GroupKind

log = logging.getLogger(__name__)

GROUPS_PREFIX = "kafka/groups/"

EMPTY = "Empty"
PREPARING = "PreparingRebalance"
COMPLETING = "CompletingRebalance"
STABLE = "Stable"
DEAD = "Dead"
STATES = (EMPTY, PREPARING, COMPLETING, STABLE, DEAD)

_TXN_PUTS = 100  # keys written or deleted per metadata transaction (etcd allows 128 operations)


@dataclass(frozen=True)
class GroupConfig:
    initial_rebalance_delay_ms: int = 300  # group.initial.rebalance.delay.ms (Kafka: 3000)
    min_session_timeout_ms: int = 1000  # group.min.session.timeout.ms (Kafka: 6000)
    max_session_timeout_ms: int = 1_800_000  # group.max.session.timeout.ms
    max_group_size: int = 1000  # group.max.size
    max_metadata_bytes: int = 4096  # offset.metadata.max.bytes
    consumer: ConsumerGroupConfig = field(default_factory=ConsumerGroupConfig)  # KIP-848 groups

    def __post_init__(self):
        if self.initial_rebalance_delay_ms < 0 or self.max_group_size < 1 or self.max_metadata_bytes < 0:
            raise ValueError(f"invalid group config {self}")
        if not 1 <= self.min_session_timeout_ms <= self.max_session_timeout_ms:
            raise ValueError("need 1 <= min_session_timeout_ms <= max_session_timeout_ms")


# ---------------------------------------------------------------- the sans-IO state machine
@dataclass(frozen=True)
class JoinResult:
    error: ErrorCode
    member_id: str
    generation: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    members: tuple[tuple[str, str | None, bytes], ...] = ()  # (member id, instance id, metadata): leader only
    skip_assignment: bool = False  # JoinGroup v9+: the leader must not run the assignor (a static rejoin)


@dataclass(frozen=True)
class SyncResult:
    error: ErrorCode
    assignment: bytes = b""
    protocol_type: str | None = None
    protocol_name: str | None = None


Completion = tuple[Any, JoinResult | SyncResult]


@dataclass
class Member:
    member_id: str
    instance_id: str | None
    client_id: str
    client_host: str
    session_timeout_s: float
    rebalance_timeout_s: float
    protocol_type: str
    protocols: tuple[tuple[str, bytes], ...]  # (name, metadata), most preferred first
    last_heartbeat: float
    assignment: bytes = b""
    join_waiter: Any = None
    sync_waiter: Any = None
    is_new: bool = True

    def metadata_for(self, protocol: str | None) -> bytes:
        return next((md for name, md in self.protocols if name == protocol), b"")

    @property
    def waiting(self) -> bool:
        return self.join_waiter is not None or self.sync_waiter is not None


def new_member_id(client_id: str) -> str:
    return f"{client_id or 'member'}-{uuid.uuid4()}"


class Group:
    """One consumer group's coordinator state (sans-IO; times in seconds from any monotonic clock)."""

    def __init__(self, group_id: str, config: GroupConfig, member_ids: Callable[[str], str] = new_member_id):
        self.group_id = group_id
        self.config = config
        self.member_ids = member_ids
        self.state = EMPTY
        self.generation = 0
        self.protocol_type: str | None = None
        self.protocol_name: str | None = None
        self.leader: str | None = None
        self.members: dict[str, Member] = {}
        self.static: dict[str, str] = {}  # group instance id -> member id
        self.pending: dict[str, float] = {}  # member ids handed out with MEMBER_ID_REQUIRED -> expiry
        self.join_deadline: float | None = None
        self.join_initial = False  # the first rebalance of an empty group: a delay, not a barrier
        self.join_started = 0.0
        self.new_member_joined = False
        self.sync_deadline: float | None = None
        # members of the generation that have not sent their SyncGroup yet (Kafka's pending sync
        # members, KAFKA-12890): removed when the rebalance timeout passes, even once Stable
        self.pending_sync: set[str] = set()

    # ------------------------------------------------------------ queries
    @property
    def is_idle(self) -> bool:
        """Nothing in memory worth keeping (an empty group forgets nothing its offsets do not hold)."""
        return self.state in (EMPTY, DEAD) and not self.members and not self.pending

    def _rebalance_timeout(self) -> float:
        return max((m.rebalance_timeout_s for m in self.members.values()), default=0.0)

    def next_deadline(self) -> float | None:
        ds = list(self.pending.values())
        ds += [m.last_heartbeat + m.session_timeout_s for m in self.members.values() if not m.waiting]
        if self.state == PREPARING and self.join_deadline is not None:
            ds.append(self.join_deadline)
        if self.state in (COMPLETING, STABLE) and self.sync_deadline is not None and self.pending_sync:
            ds.append(self.sync_deadline)
        return min(ds, default=None)

    def _fenced(self, member_id: str, instance_id: str | None) -> bool:
        """A static member's request carrying another member id than the instance's current one."""
        return instance_id is not None and instance_id in self.static and self.static[instance_id] != member_id

    def _supports(self, protocol_type: str, names: set[str]) -> bool:
        if not self.members:
            return True
        if protocol_type != self.protocol_type:
            return False
        return bool(names & self._candidates())

    def _candidates(self, members=None) -> set[str]:
        sets = [{n for n, _ in m.protocols} for m in (members if members is not None else self.members.values())]
        return set.intersection(*sets) if sets else set()

    def _vote(self) -> str | None:
        candidates = self._candidates()
        if not candidates:
            return None
        votes = Counter(next(n for n, _ in m.protocols if n in candidates) for m in self.members.values())
        best = max(votes.values())
        leader = self.members.get(self.leader or "") or next(iter(self.members.values()))
        return next(n for n, _ in leader.protocols if votes.get(n) == best)

    # ------------------------------------------------------------ JoinGroup
    def join(self, now: float, token: Any, *, member_id: str, instance_id: str | None, protocol_type: str,
             protocols: tuple[tuple[str, bytes], ...], session_timeout_ms: int, rebalance_timeout_ms: int,
             require_known_member_id: bool, client_id: str = "", client_host: str = "",
             supports_skip_assignment: bool = False) -> list[Completion]:
        def fail(code: ErrorCode, mid: str = member_id) -> list[Completion]:
            return [(token, JoinResult(code, mid))]

        c = self.config
        if self.state == DEAD:
            return fail(ErrorCode.coordinator_not_available)
        if not protocol_type or not protocols:
            return fail(ErrorCode.inconsistent_group_protocol)
        if not c.min_session_timeout_ms <= session_timeout_ms <= c.max_session_timeout_ms:
            return fail(ErrorCode.invalid_session_timeout)
        if not self._supports(protocol_type, {n for n, _ in protocols}):
            return fail(ErrorCode.inconsistent_group_protocol)
        rebalance_timeout_ms = session_timeout_ms if rebalance_timeout_ms < 0 else rebalance_timeout_ms
        spec = dict(instance_id=instance_id, client_id=client_id, client_host=client_host,
                    session_timeout_s=session_timeout_ms / 1000, rebalance_timeout_s=rebalance_timeout_ms / 1000,
                    protocol_type=protocol_type, protocols=tuple(protocols))
        if member_id == "":
            if instance_id is not None:
                return self._join_static_new(now, token, spec, supports_skip_assignment)
            if len(self.members) + len(self.pending) >= c.max_group_size:
                return fail(ErrorCode.group_max_size_reached)
            mid = self.member_ids(client_id)
            if require_known_member_id:
                self.pending[mid] = now + spec["session_timeout_s"]
                return fail(ErrorCode.member_id_required, mid)
            return self._add_member(now, token, mid, spec)
        if self._fenced(member_id, instance_id):
            return fail(ErrorCode.fenced_instance_id)
        if member_id in self.pending:
            del self.pending[member_id]
            return self._add_member(now, token, member_id, spec)
        m = self.members.get(member_id)
        if m is None:
            return fail(ErrorCode.unknown_member_id)
        if self.state == PREPARING:
            return self._update_and_wait(now, token, m, spec)
        if self.state == COMPLETING and spec["protocols"] == m.protocols:
            return [(token, self._join_result(m))]  # a resent JoinGroup: answer the current generation
        if self.state == STABLE and member_id != self.leader and spec["protocols"] == m.protocols:
            return [(token, self._join_result(m))]
        return self._update_and_wait(now, token, m, spec)  # changed metadata, or the leader rejoins

    def _join_static_new(self, now: float, token: Any, spec: dict, supports_skip_assignment: bool = False
                         ) -> list[Completion]:
        """A static member joining without a member id.

        Kafka's rule (KIP-345; Kafka 3.9 ``GroupCoordinator.updateStaticMemberAndRebalance``, 4.x
        ``GroupMetadataManager.updateStaticMemberThenRebalanceOrCompleteJoin``): a known instance id
        gets a new member id that replaces (fences) the old one, keeping its assignment, and its
        metadata and timeouts are updated. Then, by group state:

        - Stable: if the protocol the group would select for the next generation is the current one,
          there is *no* rebalance: the JoinGroup is answered at once with the current generation
          (before JoinGroup v9 with the leader id as it was before the replacement, so a rejoining
          leader does not think it leads and run the assignor; from v9 with the current leader, and
          the leader gets the members and ``SkipAssignment`` set). The following SyncGroup of the
          current generation returns the member's assignment. If the selected protocol would change,
          the group rebalances.
        - CompletingRebalance: rebalance (the leader may have been sent the old member id).
        - PreparingRebalance: the member waits for the join barrier like the others.
        """
        instance_id = spec["instance_id"]
        old = self.static.get(instance_id)
        if old is None:
            if len(self.members) + len(self.pending) >= self.config.max_group_size:
                return [(token, JoinResult(ErrorCode.group_max_size_reached, ""))]
            return self._add_member(now, token, self.member_ids(spec["client_id"]), spec)
        # the instance restarted: its new member id replaces (fences) the old one
        current_leader = self.leader
        out = []
        m = self.members.pop(old)
        for waiter in (m.join_waiter, m.sync_waiter):
            if waiter is not None:
                out.append((waiter, JoinResult(ErrorCode.fenced_instance_id, old) if waiter is m.join_waiter
                            else SyncResult(ErrorCode.fenced_instance_id)))
        m.join_waiter = m.sync_waiter = None
        m.member_id = self.member_ids(spec["client_id"])
        self.members[m.member_id] = m
        self.static[instance_id] = m.member_id
        if self.leader == old:
            self.leader = m.member_id
        if old in self.pending_sync:
            self.pending_sync.discard(old)
            self.pending_sync.add(m.member_id)
        if self.state == STABLE:
            previous = m.protocols
            m.protocols = spec["protocols"]
            if self._vote() == self.protocol_name:
                for k in ("client_id", "client_host", "session_timeout_s", "rebalance_timeout_s"):
                    setattr(m, k, spec[k])
                m.last_heartbeat = now
                log.info("group=%s: static member %s rejoined as %s (Stable, generation %d kept)", self.group_id,
                         instance_id, m.member_id, self.generation)
                if supports_skip_assignment:
                    lead = m.member_id == self.leader
                    members = tuple((x.member_id, x.instance_id, x.metadata_for(self.protocol_name))
                                    for x in self.members.values()) if lead else ()
                    result = JoinResult(ErrorCode.none, m.member_id, self.generation, self.protocol_type,
                                        self.protocol_name, self.leader or "", members, skip_assignment=lead)
                else:
                    result = JoinResult(ErrorCode.none, m.member_id, self.generation, self.protocol_type,
                                        self.protocol_name, current_leader or "")
                return out + [(token, result)]
            m.protocols = previous  # _update_and_wait sets them again, then rebalances
        return out + self._update_and_wait(now, token, m, spec)

    def _add_member(self, now: float, token: Any, member_id: str, spec: dict) -> list[Completion]:
        m = Member(member_id=member_id, last_heartbeat=now, **spec)
        m.join_waiter = token
        self.members[member_id] = m
        if m.instance_id is not None:
            self.static[m.instance_id] = member_id
        if self.leader is None:
            self.leader = member_id
        if self.protocol_type is None or len(self.members) == 1:
            self.protocol_type = m.protocol_type
        if self.state == PREPARING:
            self.new_member_joined = True
            return self._maybe_complete_join(now)
        return self._prepare_rebalance(now)

    def _update_and_wait(self, now: float, token: Any, m: Member, spec: dict) -> list[Completion]:
        out = []
        if m.join_waiter is not None and m.join_waiter is not token:  # an older JoinGroup still open
            out.append((m.join_waiter, JoinResult(ErrorCode.rebalance_in_progress, m.member_id)))
        for k in ("client_id", "client_host", "session_timeout_s", "rebalance_timeout_s", "protocols"):
            setattr(m, k, spec[k])
        m.join_waiter = token
        m.last_heartbeat = now
        if self.state == PREPARING:
            return out + self._maybe_complete_join(now)
        return out + self._prepare_rebalance(now)

    def _prepare_rebalance(self, now: float) -> list[Completion]:
        out: list[Completion] = []
        if self.state == COMPLETING:  # assignments of the half-done generation are void
            for m in self.members.values():
                m.assignment = b""
                if m.sync_waiter is not None:
                    out.append((m.sync_waiter, SyncResult(ErrorCode.rebalance_in_progress)))
                    m.sync_waiter = None
                    m.last_heartbeat = now  # its session runs again from the answer
        initial = self.state == EMPTY
        self.state = PREPARING
        self.sync_deadline = None
        self.pending_sync.clear()
        self.join_started = now
        self.new_member_joined = False
        self.join_initial = initial
        timeout = self._rebalance_timeout()
        if initial:
            # Kafka (3.9 GroupCoordinator.prepareRebalance's InitialDelayedJoin, 4.x
            # GroupMetadataManager.prepareRebalance): the first rebalance of an empty group waits the
            # whole group.initial.rebalance.delay.ms, whatever the rebalance timeout (even 0); only
            # the extensions while new members keep arriving are bounded by it (see tick)
            self.join_deadline = now + self.config.initial_rebalance_delay_ms / 1000
        else:
            self.join_deadline = now + timeout
        return out + self._maybe_complete_join(now)

    def _maybe_complete_join(self, now: float) -> list[Completion]:
        if self.state != PREPARING or self.join_initial:
            return []
        if self.pending or any(m.join_waiter is None for m in self.members.values()):
            return []
        return self._complete_join(now)

    def _complete_join(self, now: float) -> list[Completion]:
        out: list[Completion] = []
        for m in [m for m in self.members.values() if m.join_waiter is None]:  # did not rejoin in time
            out += self._forget(m)
        self.generation += 1
        self.join_deadline = None
        self.join_initial = False
        if not self.members:
            self.state, self.protocol_name, self.leader = EMPTY, None, None
            log.info("group=%s generation %d: empty", self.group_id, self.generation)
            return out
        if self.leader not in self.members:
            self.leader = next(iter(self.members))
        self.protocol_name = self._vote()
        self.state = COMPLETING
        # Kafka's pending-sync timeout (KAFKA-12890; 3.9 GroupCoordinator.schedulePendingSync, 4.x
        # GroupMetadataManager.schedulePendingSync): the group's rebalance timeout (the largest of its
        # members', taken as sent: JoinGroup v0 has none and uses the session timeout, v1+ even 0)
        # after the join barrier, members that have not sent SyncGroup are removed and the group
        # rebalances, in CompletingRebalance and also once Stable. With a rebalance timeout of 0 that
        # is at once: Kafka too loses such members before their SyncGroup.
        self.sync_deadline = now + self._rebalance_timeout()
        self.pending_sync = set(self.members)
        for m in self.members.values():
            out.append((m.join_waiter, self._join_result(m)))
            m.join_waiter = None
            m.is_new = False
            m.last_heartbeat = now
        log.info("group=%s generation %d: %d members, protocol %s, leader %s", self.group_id, self.generation,
                 len(self.members), self.protocol_name, self.leader)
        return out

    def _join_result(self, m: Member) -> JoinResult:
        members = ()
        if m.member_id == self.leader:
            members = tuple((x.member_id, x.instance_id, x.metadata_for(self.protocol_name))
                            for x in self.members.values())
        return JoinResult(ErrorCode.none, m.member_id, self.generation, self.protocol_type, self.protocol_name,
                          self.leader or "", members)

    # ------------------------------------------------------------ SyncGroup
    def sync(self, now: float, token: Any, *, member_id: str, generation: int, instance_id: str | None,
             assignments: dict[str, bytes], protocol_type: str | None = None,
             protocol_name: str | None = None) -> list[Completion]:
        def fail(code: ErrorCode) -> list[Completion]:
            return [(token, SyncResult(code))]

        if self.state == DEAD:
            return fail(ErrorCode.coordinator_not_available)
        if self._fenced(member_id, instance_id):
            return fail(ErrorCode.fenced_instance_id)
        m = self.members.get(member_id)
        if m is None:
            return fail(ErrorCode.unknown_member_id)
        if generation != self.generation:
            return fail(ErrorCode.illegal_generation)
        if (protocol_type is not None and protocol_type != self.protocol_type) or (
                protocol_name is not None and protocol_name != self.protocol_name):
            return fail(ErrorCode.inconsistent_group_protocol)
        if self.state == PREPARING:
            return fail(ErrorCode.rebalance_in_progress)
        m.last_heartbeat = now
        self.pending_sync.discard(member_id)
        if self.state == STABLE:
            return [(token, self._sync_result(m))]
        out: list[Completion] = []
        if m.sync_waiter is not None and m.sync_waiter is not token:
            out.append((m.sync_waiter, SyncResult(ErrorCode.rebalance_in_progress)))
        m.sync_waiter = token
        if member_id != self.leader:
            return out
        for x in self.members.values():
            x.assignment = assignments.get(x.member_id, b"")
        self.state = STABLE
        if not self.pending_sync:
            self.sync_deadline = None
        for x in self.members.values():
            if x.sync_waiter is not None:
                out.append((x.sync_waiter, self._sync_result(x)))
                x.sync_waiter = None
                x.last_heartbeat = now
        return out

    def _sync_result(self, m: Member) -> SyncResult:
        return SyncResult(ErrorCode.none, m.assignment, self.protocol_type, self.protocol_name)

    # ------------------------------------------------------------ Heartbeat, LeaveGroup, commits
    def heartbeat(self, now: float, *, member_id: str, generation: int, instance_id: str | None) -> ErrorCode:
        if self.state == DEAD:
            return ErrorCode.coordinator_not_available
        if self._fenced(member_id, instance_id):
            return ErrorCode.fenced_instance_id
        m = self.members.get(member_id)
        if m is None:
            return ErrorCode.unknown_member_id
        if generation != self.generation:
            return ErrorCode.illegal_generation
        m.last_heartbeat = now
        return ErrorCode.rebalance_in_progress if self.state == PREPARING else ErrorCode.none

    def leave(self, now: float, members: list[tuple[str, str | None]]) -> tuple[list[ErrorCode], list[Completion]]:
        """Remove members given as (member id, instance id): a code per member, and completions."""
        codes: list[ErrorCode] = []
        out: list[Completion] = []
        for member_id, instance_id in members:
            if self.state == DEAD:
                codes.append(ErrorCode.coordinator_not_available)
                continue
            mid = member_id
            if instance_id is not None:
                mid = self.static.get(instance_id)
                if mid is None:
                    codes.append(ErrorCode.unknown_member_id)
                    continue
                if member_id and member_id != mid:
                    codes.append(ErrorCode.fenced_instance_id)
                    continue
            if mid in self.pending:
                del self.pending[mid]
                codes.append(ErrorCode.none)
                out += self._maybe_complete_join(now)
                continue
            if mid not in self.members:
                codes.append(ErrorCode.unknown_member_id)
                continue
            codes.append(ErrorCode.none)
            out += self.remove(now, mid, "left")
        return codes, out

    def remove(self, now: float, member_id: str, why: str) -> list[Completion]:
        m = self.members.get(member_id)
        if m is None:
            return []
        log.info("group=%s member %s removed (%s)", self.group_id, member_id, why)
        out = self._forget(m)
        if self.state in (STABLE, COMPLETING):
            out += self._prepare_rebalance(now)
        else:
            out += self._maybe_complete_join(now)
        return out

    def _forget(self, m: Member) -> list[Completion]:
        out: list[Completion] = []
        if m.join_waiter is not None:
            out.append((m.join_waiter, JoinResult(ErrorCode.unknown_member_id, m.member_id)))
        if m.sync_waiter is not None:
            out.append((m.sync_waiter, SyncResult(ErrorCode.unknown_member_id)))
        del self.members[m.member_id]
        self.pending_sync.discard(m.member_id)
        if m.instance_id is not None and self.static.get(m.instance_id) == m.member_id:
            del self.static[m.instance_id]
        if self.leader == m.member_id:
            joined = [x.member_id for x in self.members.values() if x.join_waiter is not None]
            self.leader = (joined or list(self.members) or [None])[0]
        return out

    def check_commit(self, now: float, *, member_id: str, generation: int, instance_id: str | None) -> ErrorCode:
        """Whether an OffsetCommit with these credentials may write (it counts as a heartbeat)."""
        if self.state == DEAD:
            return ErrorCode.coordinator_not_available
        if self._fenced(member_id, instance_id):
            return ErrorCode.fenced_instance_id
        if generation < 0 and self.state == EMPTY:
            return ErrorCode.none  # a simple consumer: no group management
        m = self.members.get(member_id)
        if m is None:
            return ErrorCode.unknown_member_id
        if generation != self.generation:
            return ErrorCode.illegal_generation
        if self.state == COMPLETING:
            return ErrorCode.rebalance_in_progress
        m.last_heartbeat = now
        return ErrorCode.none

    def delete(self) -> list[Completion]:
        """DeleteGroups (the caller checked the group is empty): Dead from now on."""
        out: list[Completion] = []
        for m in list(self.members.values()):
            out += self._forget(m)
        self.pending.clear()
        self.state = DEAD
        return out

    # ------------------------------------------------------------ timers
    def tick(self, now: float) -> list[Completion]:
        out: list[Completion] = []
        for mid, expiry in list(self.pending.items()):
            if expiry <= now:
                del self.pending[mid]
                out += self._maybe_complete_join(now)
        for m in list(self.members.values()):
            if m.member_id in self.members and not m.waiting and m.last_heartbeat + m.session_timeout_s <= now:
                out += self.remove(now, m.member_id, f"no heartbeat for {m.session_timeout_s:g}s")
        if self.state == PREPARING and self.join_deadline is not None and self.join_deadline <= now:
            remaining = self.join_started + self._rebalance_timeout() - now
            if self.join_initial and self.new_member_joined and remaining > 0:
                self.new_member_joined = False  # new members came: wait one more delay
                self.join_deadline = now + min(self.config.initial_rebalance_delay_ms / 1000, remaining)
            else:
                out += self._complete_join(now)
        if self.state in (COMPLETING, STABLE) and self.sync_deadline is not None and self.sync_deadline <= now:
            self.sync_deadline = None
            late = [self.members[mid] for mid in list(self.pending_sync) if mid in self.members]
            if late:
                for m in late:
                    out += self._forget(m)
                log.info("group=%s: %d members did not sync in time", self.group_id, len(late))
                out += self._prepare_rebalance(now)
        return out

    # ------------------------------------------------------------ DescribeGroups
    def describe(self) -> tuple[str, str, str, list[tuple[Member, bytes, bytes]]]:
        """(state, protocol type, protocol name, [(member, metadata, assignment)]): metadata and
        assignments only when Stable, as Kafka answers."""
        stable = self.state == STABLE
        members = [(m, m.metadata_for(self.protocol_name) if stable else b"", m.assignment if stable else b"")
                   for m in self.members.values()]
        return self.state, self.protocol_type or "", (self.protocol_name or "") if stable else "", members


# ---------------------------------------------------------------- committed offsets in the store
def group_prefix(group: str) -> str:
    return f"{GROUPS_PREFIX}{quote(group, safe='')}/"


def offset_key(group: str, topic: str, partition: int) -> str:
    return f"{group_prefix(group)}offsets/{topic}/{partition}"


def kind_key(group: str) -> str:
    return f"{group_prefix(group)}kind"


def _parse_offset_key(key: str) -> tuple[str, str, int] | None:
    """(group, topic, partition) of an offset key, or None for another key under kafka/groups/."""
    parts = key[len(GROUPS_PREFIX):].split("/")
    if len(parts) != 4 or parts[1] != "offsets":
        return None
    try:
        return unquote(parts[0]), parts[2], int(parts[3])
    except ValueError:
        return None


class OffsetStore:
    def __init__(self, store):
        self.store = store

    async def commit(self, group: str, offsets: dict[tuple[str, int], Committed]) -> None:
        items = [(offset_key(group, t, p), c.encode()) for (t, p), c in offsets.items()]
        for i in range(0, len(items), _TXN_PUTS):
            await self.store.txn({}, dict(items[i:i + _TXN_PUTS]))

    async def fetch_topic(self, group: str, topic: str) -> dict[int, Committed]:
        out = {}
        for key, v in await self.store.list_prefix(f"{group_prefix(group)}offsets/{topic}/"):
            parsed = _parse_offset_key(key)
            if parsed is not None and parsed[1] == topic:
                out[parsed[2]] = Committed.decode(v.value)
        return out

    async def fetch_group(self, group: str) -> dict[tuple[str, int], Committed]:
        out = {}
        for key, v in await self.store.list_prefix(f"{group_prefix(group)}offsets/"):
            parsed = _parse_offset_key(key)
            if parsed is not None:
                out[(parsed[1], parsed[2])] = Committed.decode(v.value)
        return out

    async def committed_sums(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(topic, partition) -> (the sum of every group's committed offset, how many groups
        committed one): one listing of all groups' keys."""
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for k, v in await self.store.list_prefix(GROUPS_PREFIX):
            p = _parse_offset_key(k)
            if p is not None:
                total, n = out.get((p[1], p[2]), (0, 0))
                out[(p[1], p[2])] = (total + Committed.decode(v.value).offset, n + 1)
        return out

    async def groups(self) -> set[str]:
        """Every group with at least one committed offset, or a recorded kind."""
        out = set()
        for k, _ in await self.store.list_prefix(GROUPS_PREFIX):
            p = _parse_offset_key(k)
            if p is not None:
                out.add(p[0])
            elif k.endswith("/kind"):
                out.add(unquote(k[len(GROUPS_PREFIX):].split("/")[0]))
        return out

    async def kind(self, group: str) -> GroupKind | None:
        rec = await self.store.get(kind_key(group))
        if rec is None:
            return None
        try:
            return GroupKind.decode(rec.value)
        except (ValueError, KeyError, TypeError):
            log.warning("group=%s: unreadable kind %r", group, rec.value[:100])
            return None

    async def set_kind(self, group: str, kind: GroupKind) -> None:
        await self.store.txn({}, {kind_key(group): kind.encode()})

    async def delete_offsets(self, group: str, partitions: list[tuple[str, int]]) -> None:
        keys = [offset_key(group, t, p) for t, p in partitions]
        for i in range(0, len(keys), _TXN_PUTS):
            await self.store.txn({}, {}, tuple(keys[i:i + _TXN_PUTS]))

    async def delete_group(self, group: str) -> int:
        keys = [k for k, _ in await self.store.list_prefix(group_prefix(group))]
        for i in range(0, len(keys), _TXN_PUTS):
            await self.store.txn({}, {}, tuple(keys[i:i + _TXN_PUTS]))
        return len(keys)


# ---------------------------------------------------------------- the asyncio coordinator
class GroupCoordinator:
    """The group APIs of one shim. ``broker`` gives the store, topic metadata and coordinator ownership."""

    def __init__(self, broker, config: GroupConfig | None = None):
        self.broker = broker
        self.config = config or GroupConfig()
        self.offsets = OffsetStore(broker.store)
        self.groups: dict[str, Group] = {}
        self._kinds: dict[str, GroupKind] = {}  # recorded in the store (cache of what we wrote or read)
        self.consumer_groups: dict[str, ConsumerGroup] = {}  # KIP-848 groups (consumer_group_apis.py)
        from .consumer_group_apis import ConsumerGroupApis

        self.consumer_apis = ConsumerGroupApis(self)
        self._timer: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    def handlers(self) -> dict[int, Callable]:
        return {
            codec.API_FIND_COORDINATOR: self.find_coordinator,
            codec.API_JOIN_GROUP: self.join_group,
            codec.API_SYNC_GROUP: self.sync_group,
            codec.API_HEARTBEAT: self.heartbeat,
            codec.API_LEAVE_GROUP: self.leave_group,
            codec.API_OFFSET_COMMIT: self.offset_commit,
            codec.API_OFFSET_FETCH: self.offset_fetch,
            codec.API_LIST_GROUPS: self.list_groups,
            codec.API_DESCRIBE_GROUPS: self.describe_groups,
            codec.API_DELETE_GROUPS: self.delete_groups,
            codec.API_OFFSET_DELETE: self.offset_delete,
            codec.API_CONSUMER_GROUP_HEARTBEAT: self.consumer_apis.heartbeat,
            codec.API_CONSUMER_GROUP_DESCRIBE: self.consumer_apis.describe,
        }

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._timer
            self._timer = None
        for gid in list(self.groups):  # answer whoever still waits: the coordinator is going away
            self._abandon(gid)

    def _abandon(self, group_id: str) -> None:
        """Forget a group this shim no longer coordinates; its waiting requests get NOT_COORDINATOR
        (the members find the new coordinator and rejoin there)."""
        self._kinds.pop(group_id, None)  # the other coordinator may delete the group meanwhile
        if self.consumer_groups.pop(group_id, None) is not None:
            log.info("group=%s: no longer coordinated here; dropping its consumer group state", group_id)
        g = self.groups.pop(group_id, None)
        if g is None:
            return
        log.info("group=%s: no longer coordinated here; dropping its %d members", group_id, len(g.members))
        for m in g.members.values():
            for w in (m.join_waiter, m.sync_waiter):
                if w is not None and not w.done():
                    w.set_result(JoinResult(ErrorCode.not_coordinator, m.member_id) if w is m.join_waiter
                                 else SyncResult(ErrorCode.not_coordinator))

    # ------------------------------------------------------------ plumbing
    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _kick(self) -> None:
        if self._timer is None or self._timer.done():
            self._wake = asyncio.Event()
            self._timer = asyncio.ensure_future(self._run_timers())
        self._wake.set()

    def _deliver(self, completions: list[Completion]) -> None:
        for fut, result in completions:
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def _run_timers(self) -> None:
        while True:
            self._wake.clear()
            now = self._now()
            for gid, g in list(self.groups.items()):
                d = g.next_deadline()
                try:
                    if d is not None and d <= now:
                        self._deliver(g.tick(now))
                except Exception:  # a bug in one group must not stop every group's timers
                    log.exception("group=%s: timer failed; dropping the group's state", gid)
                    self._abandon(gid)
                    continue
                if g.is_idle:
                    del self.groups[gid]
            for gid, cg in list(self.consumer_groups.items()):
                d = cg.next_deadline()
                try:
                    if d is not None and d <= now:
                        cg.tick(now)
                except Exception:
                    log.exception("group=%s: timer failed; dropping the group's state", gid)
                    self._abandon(gid)
                    continue
                if cg.is_idle:
                    del self.consumer_groups[gid]
            deadline = min((d for g in [*self.groups.values(), *self.consumer_groups.values()]
                            if (d := g.next_deadline()) is not None), default=None)
            timeout = None if deadline is None else max(0.0, deadline - self._now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _group(self, group_id: str, create: bool) -> Group | None:
        g = self.groups.get(group_id)
        if g is None and create:
            g = self.groups[group_id] = Group(group_id, self.config)
        return g

    async def _group_error(self, group_id: str | None, need_id: bool = True) -> ErrorCode | None:
        """INVALID_GROUP_ID / NOT_COORDINATOR, or None when this shim serves the group."""
        if group_id is None or (need_id and group_id == ""):
            return ErrorCode.invalid_group_id
        try:
            if not await self.broker.is_coordinator(0, group_id):
                self._abandon(group_id)  # it moved to another shim (our lease lapsed, say)
                return ErrorCode.not_coordinator
        except Exception as exc:
            log.warning("group=%s: coordinator check failed: %r", group_id, exc)
            return ErrorCode.coordinator_not_available
        return None

    async def remember_kind(self, group_id: str, kind: GroupKind) -> None:
        """Record the group's kind in the store once (best effort: a failure is retried on the next
        join; the kind only serves ListGroups/DescribeGroups of Empty groups)."""
        if self._kinds.get(group_id) == kind:
            return
        try:
            await self.offsets.set_kind(group_id, kind)
            self._kinds[group_id] = kind
        except Exception as exc:
            log.warning("group=%s: could not record its kind %s: %r", group_id, kind, exc)

    async def stored_kind(self, group_id: str) -> GroupKind | None:
        kind = self._kinds.get(group_id)
        if kind is None:
            kind = await self.offsets.kind(group_id)
            if kind is not None:
                self._kinds[group_id] = kind
        return kind

    # ------------------------------------------------------------ FindCoordinator
    async def find_coordinator(self, req, resp_cls):
        version = resp_cls.__version__
        key_type = getattr(req, "key_type", 0)
        keys = list(req.coordinator_keys) if version >= 4 else [req.key]
        results = []
        for key in keys:
            node, host, port, err, msg = -1, "", -1, ErrorCode.none, None
            try:
                if key_type not in (0, 1):
                    raise ValueError(f"key type {key_type} is not served (0: group, 1: transaction)")
                node, host, port = await self.broker.coordinator_node(key_type, key)
            except ValueError as exc:
                err, msg = ErrorCode.invalid_request, str(exc)
            except Exception as exc:
                log.warning("find_coordinator key=%s: %r", key, exc)
                err, msg = ErrorCode.coordinator_not_available, str(exc)
            results.append((key, node, host, port, err, msg))
        if version >= 4:
            coord_cls = nested(resp_cls, "Coordinator")
            return build(resp_cls, throttle_time=ZERO_MS, coordinators=tuple(
                build(coord_cls, key=k, node_id=n, host=h, port=p, error_code=e, error_message=m)
                for k, n, h, p, e, m in results))
        _, n, h, p, e, m = results[0]
        return build(resp_cls, throttle_time=ZERO_MS, error_code=e, error_message=m, node_id=n, host=h, port=p)

    # ------------------------------------------------------------ JoinGroup / SyncGroup / Heartbeat / LeaveGroup
    async def join_group(self, req, resp_cls):
        version = resp_cls.__version__
        err = await self._group_error(req.group_id)
        cg = self.consumer_groups.get(req.group_id)
        if err is None and cg is not None and cg.members:
            err = ErrorCode.inconsistent_group_protocol  # a consumer (KIP-848) group: not for JoinGroup
        if err is None:
            g = self._group(req.group_id, create=True)
            fut = asyncio.get_running_loop().create_future()
            rebalance_ms = req.rebalance_timeout.total_seconds() * 1000 if version >= 1 else -1
            self._deliver(g.join(
                self._now(), fut, member_id=req.member_id, instance_id=getattr(req, "group_instance_id", None),
                protocol_type=req.protocol_type, protocols=tuple((p.name, p.metadata) for p in req.protocols),
                session_timeout_ms=int(req.session_timeout.total_seconds() * 1000),
                rebalance_timeout_ms=int(rebalance_ms), require_known_member_id=version >= 4,
                client_id=codec.current_client_id() or "", client_host=codec.current_client_host(),
                supports_skip_assignment=version >= 9))
            self._kick()
            result: JoinResult = await fut
            if result.error == ErrorCode.none:
                await self.remember_kind(req.group_id, GroupKind("classic", result.protocol_type or ""))
        else:
            result = JoinResult(err, req.member_id)
        member_cls = nested(resp_cls, "JoinGroupResponseMember")
        return build(resp_cls, throttle_time=ZERO_MS, error_code=result.error, generation_id=result.generation,
                     protocol_type=result.protocol_type, protocol_name=result.protocol_name or "",
                     leader=result.leader, skip_assignment=result.skip_assignment, member_id=result.member_id,
                     members=tuple(build(member_cls, member_id=mid, group_instance_id=iid, metadata=md)
                                   for mid, iid, md in result.members))

    async def sync_group(self, req, resp_cls):
        err = await self._group_error(req.group_id)
        g = self._group(req.group_id, create=False) if err is None else None
        if err is None and g is None:
            err = ErrorCode.unknown_member_id
        if err is None:
            fut = asyncio.get_running_loop().create_future()
            self._deliver(g.sync(
                self._now(), fut, member_id=req.member_id, generation=req.generation_id,
                instance_id=getattr(req, "group_instance_id", None),
                assignments={a.member_id: a.assignment for a in req.assignments},
                protocol_type=getattr(req, "protocol_type", None), protocol_name=getattr(req, "protocol_name", None)))
            self._kick()
            result: SyncResult = await fut
        else:
            result = SyncResult(err)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=result.error, protocol_type=result.protocol_type,
                     protocol_name=result.protocol_name, assignment=result.assignment)

    async def heartbeat(self, req, resp_cls):
        err = await self._group_error(req.group_id)
        if err is None:
            g = self._group(req.group_id, create=False)
            err = ErrorCode.unknown_member_id if g is None else g.heartbeat(
                self._now(), member_id=req.member_id, generation=req.generation_id,
                instance_id=getattr(req, "group_instance_id", None))
            self._kick()
        return build(resp_cls, throttle_time=ZERO_MS, error_code=err)

    async def leave_group(self, req, resp_cls):
        version = resp_cls.__version__
        who = ([(m.member_id, m.group_instance_id) for m in req.members] if version >= 3
               else [(req.member_id, None)])
        err = await self._group_error(req.group_id)
        codes = [err] * len(who)
        if err is None:
            g = self._group(req.group_id, create=False)
            if g is None:
                codes = [ErrorCode.unknown_member_id] * len(who)
            else:
                codes, completions = g.leave(self._now(), who)
                self._deliver(completions)
                self._kick()
        if version < 3:
            return build(resp_cls, throttle_time=ZERO_MS, error_code=codes[0])
        member_cls = nested(resp_cls, "MemberResponse")
        return build(resp_cls, throttle_time=ZERO_MS, error_code=err or ErrorCode.none, members=tuple(
            build(member_cls, member_id=mid, group_instance_id=iid, error_code=c) for (mid, iid), c in zip(who, codes)))

    # ------------------------------------------------------------ OffsetCommit / OffsetFetch
    async def offset_commit(self, req, resp_cls):
        topic_cls = nested(resp_cls, "OffsetCommitResponseTopic")
        part_cls = nested(resp_cls, "OffsetCommitResponsePartition")
        group_id = req.group_id
        err = await self._group_error(group_id, need_id=False)
        if err is None:
            g = self._group(group_id, create=False)
            cg = self.consumer_groups.get(group_id)
            generation = req.generation_id_or_member_epoch
            if cg is not None and (cg.members or generation >= 0):
                err = cg.check_commit(req.member_id, generation, resp_cls.__version__)
                err = None if err == ErrorCode.none else err
            elif g is not None:
                err = g.check_commit(self._now(), member_id=req.member_id, generation=generation,
                                     instance_id=getattr(req, "group_instance_id", None))
                err = None if err == ErrorCode.none else err
            elif generation >= 0:
                err = ErrorCode.illegal_generation  # no such generation here (e.g. after a coordinator restart)
        codes: dict[tuple[str, int], ErrorCode] = {}
        todo: dict[tuple[str, int], Committed] = {}
        now_ms = int(time.time() * 1000)
        partitions: dict[str, int | None] = {}
        for t in req.topics:
            if err is None and t.name not in partitions:
                meta = await self.broker.topic(t.name)
                partitions[t.name] = meta.partitions if meta is not None else None
            for p in t.partitions:
                key = (t.name, p.partition_index)
                if err is not None:
                    codes[key] = err
                elif partitions[t.name] is None or not 0 <= p.partition_index < partitions[t.name]:
                    codes[key] = ErrorCode.unknown_topic_or_partition
                elif p.committed_metadata is not None and \
                        len(p.committed_metadata.encode()) > self.config.max_metadata_bytes:
                    codes[key] = ErrorCode.offset_metadata_too_large
                else:
                    todo[key] = Committed(p.committed_offset, getattr(p, "committed_leader_epoch", -1),
                                          p.committed_metadata or "", now_ms)
        if todo:
            try:
                await self.offsets.commit(group_id, todo)
                codes.update(dict.fromkeys(todo, ErrorCode.none))
            except Exception as exc:
                log.warning("group=%s: offset commit failed: %r", group_id, exc)
                codes.update(dict.fromkeys(todo, _store_error(exc)))
        return build(resp_cls, throttle_time=ZERO_MS, topics=tuple(
            topic_cls(name=t.name, partitions=tuple(
                build(part_cls, partition_index=p.partition_index, error_code=codes[(t.name, p.partition_index)])
                for p in t.partitions))
            for t in req.topics))

    async def offset_fetch(self, req, resp_cls):
        version = resp_cls.__version__
        if version >= 8:
            group_cls = nested(resp_cls, "OffsetFetchResponseGroup")
            topic_cls = nested(resp_cls, "OffsetFetchResponseTopics")
            part_cls = nested(resp_cls, "OffsetFetchResponsePartitions")
            groups = []
            for rg in req.groups:
                cg = self.consumer_groups.get(rg.group_id)
                member_err = cg.check_fetch(getattr(rg, "member_id", None), getattr(rg, "member_epoch", -1)) \
                    if cg is not None and cg.members else ErrorCode.none
                if member_err != ErrorCode.none:
                    groups.append(build(group_cls, group_id=rg.group_id, topics=(), error_code=member_err))
                    continue
                err, topics = await self._fetch_group(rg.group_id, rg.topics, topic_cls, part_cls)
                if req.require_stable and err == ErrorCode.none:  # offsets pending in a transaction
                    topics = await mark_unstable(self.broker.store, rg.group_id, topics, topic_cls, part_cls)
                groups.append(build(group_cls, group_id=rg.group_id, topics=topics, error_code=err))
            return build(resp_cls, throttle_time=ZERO_MS, groups=tuple(groups))
        topic_cls = nested(resp_cls, "OffsetFetchResponseTopic")
        part_cls = nested(resp_cls, "OffsetFetchResponsePartition")
        err, topics = await self._fetch_group(req.group_id, req.topics, topic_cls, part_cls)
        if getattr(req, "require_stable", False) and err == ErrorCode.none:  # offsets pending in a transaction
            topics = await mark_unstable(self.broker.store, req.group_id, topics, topic_cls, part_cls)
        if version < 2 and err != ErrorCode.none:  # v0-1 carry errors per partition only
            topics = tuple(topic_cls(name=t.name, partitions=tuple(
                build(part_cls, partition_index=i, committed_offset=-1, metadata="", error_code=err)
                for i in t.partition_indexes)) for t in req.topics or ())
        return build(resp_cls, throttle_time=ZERO_MS, topics=topics, error_code=err)

    async def _fetch_group(self, group_id: str, wanted, topic_cls, part_cls) -> tuple[ErrorCode, tuple]:
        err = await self._group_error(group_id, need_id=False)
        if err is not None:
            return err, ()
        try:
            if wanted is None:  # every committed offset of the group
                by_topic: dict[str, dict[int, Committed]] = {}
                for (t, p), c in sorted((await self.offsets.fetch_group(group_id)).items()):
                    by_topic.setdefault(t, {})[p] = c
                wanted_parts = [(t, list(ps)) for t, ps in by_topic.items()]
            else:
                by_topic = {}
                for t in wanted:
                    if t.name not in by_topic:
                        by_topic[t.name] = await self.offsets.fetch_topic(group_id, t.name)
                wanted_parts = [(t.name, list(t.partition_indexes)) for t in wanted]
        except Exception as exc:
            log.warning("group=%s: offset fetch failed: %r", group_id, exc)
            return _store_error(exc), ()
        topics = []
        for name, parts in wanted_parts:
            rows = []
            for i in parts:
                c = by_topic.get(name, {}).get(i)
                rows.append(build(part_cls, partition_index=i, committed_offset=c.offset if c else -1,
                                  committed_leader_epoch=c.leader_epoch if c else -1,
                                  metadata=c.metadata if c else "", error_code=ErrorCode.none))
            topics.append(topic_cls(name=name, partitions=tuple(rows)))
        return ErrorCode.none, tuple(topics)

    # ------------------------------------------------------------ ListGroups / DescribeGroups / DeleteGroups
    async def _known_groups(self) -> dict[str, Group | None]:
        """Groups this shim coordinates: those in memory, and those with committed offsets."""
        known: dict[str, Group | None] = {gid: g for gid, g in self.groups.items() if g.state != DEAD}
        for gid in self.consumer_groups:
            known.setdefault(gid, None)
        for gid in await self.offsets.groups():
            known.setdefault(gid, None)
        out = {}
        for gid, g in known.items():
            if await self.broker.is_coordinator(0, gid):
                out[gid] = g
        return out

    async def list_groups(self, req, resp_cls):
        listed_cls = nested(resp_cls, "ListedGroup")
        try:
            known = await self._known_groups()
        except Exception as exc:
            log.warning("list_groups: %r", exc)
            return build(resp_cls, throttle_time=ZERO_MS, error_code=_store_error(exc), groups=())
        states = {s.lower() for s in getattr(req, "states_filter", ())}
        types = {s.lower() for s in getattr(req, "types_filter", ())}
        rows = []
        try:
            for gid, g in sorted(known.items()):
                row = await self._listing(gid, g)
                if (states and row[1].lower() not in states) or (types and row[2] not in types):
                    continue
                rows.append(build(listed_cls, group_id=gid, protocol_type=row[0], group_state=row[1],
                                  group_type=row[2]))
        except Exception as exc:
            log.warning("list_groups: %r", exc)
            return build(resp_cls, throttle_time=ZERO_MS, error_code=_store_error(exc), groups=())
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, groups=tuple(rows))

    async def _listing(self, gid: str, g: Group | None) -> tuple[str, str, str]:
        """(protocol type, state, group type) of a group as ListGroups shows it. An Empty group keeps
        the protocol type its members used (recorded in the store), as Kafka's does."""
        if g is not None and g.members:
            return g.protocol_type or "", g.state, "classic"
        cg = self.consumer_groups.get(gid)
        if cg is not None and cg.members:
            return "consumer", cg.state, "consumer"
        kind = await self.stored_kind(gid) or GroupKind("classic", g.protocol_type or "" if g else "")
        return kind.protocol_type, EMPTY, kind.group_type

    async def describe_groups(self, req, resp_cls):
        group_cls = nested(resp_cls, "DescribedGroup")
        member_cls = nested(resp_cls, "DescribedGroupMember")
        out = []
        for gid in req.groups:
            err = await self._group_error(gid)
            state, ptype, pname, members = DEAD, "", "", []
            if err is None:
                g = self.groups.get(gid)
                if g is not None and g.state != DEAD and g.members:
                    state, ptype, pname, members = g.describe()
                else:
                    try:
                        kind = await self.stored_kind(gid)
                        cg = self.consumer_groups.get(gid)
                        if cg is not None and cg.members:
                            pass  # a consumer (KIP-848) group: Dead to DescribeGroups v0-5, as in Kafka
                        elif kind is not None and kind.group_type == "classic":
                            state, ptype = EMPTY, kind.protocol_type
                        elif kind is None and await self.offsets.fetch_group(gid):
                            state = EMPTY
                    except Exception as exc:
                        err = _store_error(exc)
            out.append(build(
                group_cls, error_code=err or ErrorCode.none, error_message=None, group_id=gid, group_state=state,
                protocol_type=ptype, protocol_data=pname, authorized_operations=-2147483648,
                members=tuple(build(member_cls, member_id=m.member_id, group_instance_id=m.instance_id,
                                    client_id=m.client_id, client_host=m.client_host, member_metadata=md,
                                    member_assignment=asg) for m, md, asg in members)))
        return build(resp_cls, throttle_time=ZERO_MS, groups=tuple(out))

    async def delete_groups(self, req, resp_cls):
        result_cls = nested(resp_cls, "DeletableGroupResult")
        out = []
        for gid in req.groups_names:
            err = await self._group_error(gid)
            if err is None:
                g = self.groups.get(gid)
                cg = self.consumer_groups.get(gid)
                if (g is not None and g.state not in (EMPTY, DEAD)) or (cg is not None and cg.members):
                    err = ErrorCode.non_empty_group
                else:
                    try:
                        deleted = await self.offsets.delete_group(gid)
                        self._kinds.pop(gid, None)
                        if cg is not None:
                            cg.delete()
                            del self.consumer_groups[gid]
                        if deleted == 0 and (g is None or g.state == DEAD):
                            err = ErrorCode.group_id_not_found
                        elif g is not None:
                            self._deliver(g.delete())
                            del self.groups[gid]
                        log.info("group=%s deleted (%d offsets)", gid, deleted)
                    except Exception as exc:
                        log.warning("group=%s: delete failed: %r", gid, exc)
                        err = _store_error(exc)
            out.append(build(result_cls, group_id=gid, error_code=err or ErrorCode.none))
        return build(resp_cls, throttle_time=ZERO_MS, results=tuple(out))


    # ------------------------------------------------------------ OffsetDelete (KIP-496)
    async def offset_delete(self, req, resp_cls):
        """Delete a group's committed offsets for some partitions, as Kafka's coordinator does: the
        whole request fails with GROUP_ID_NOT_FOUND for a group with neither members nor offsets
        and NON_EMPTY_GROUP for an active group of another protocol type than ``consumer``; for an
        active consumer group, the partitions of topics its members subscribe to get
        GROUP_SUBSCRIBED_TO_TOPIC and the others are deleted. Unknown topics or partitions get
        UNKNOWN_TOPIC_OR_PARTITION; a partition without an offset is NONE (nothing to delete)."""
        topic_cls = nested(resp_cls, "OffsetDeleteResponseTopic")
        part_cls = nested(resp_cls, "OffsetDeleteResponsePartition")

        def failed(code: ErrorCode):
            return build(resp_cls, error_code=code, throttle_time=ZERO_MS, topics=())

        gid = req.group_id
        err = await self._group_error(gid)
        if err is not None:
            return failed(err)
        try:
            subscribed = self.subscribed_topics(gid)  # None: no active members
            if subscribed is None and not await self.offsets.fetch_group(gid) \
                    and await self.stored_kind(gid) is None:
                return failed(ErrorCode.group_id_not_found)
        except Exception as exc:
            return failed(_store_error(exc))
        if subscribed is False:
            return failed(ErrorCode.non_empty_group)
        codes: dict[tuple[str, int], ErrorCode] = {}
        todo: list[tuple[str, int]] = []
        metas: dict[str, TopicMeta | None] = {}
        for t in req.topics:
            if t.name not in metas:
                metas[t.name] = await self.broker.topic(t.name)
            for p in t.partitions:
                key = (t.name, p.partition_index)
                meta = metas[t.name]
                if meta is None or not 0 <= p.partition_index < meta.partitions:
                    codes[key] = ErrorCode.unknown_topic_or_partition
                elif subscribed and t.name in subscribed:
                    codes[key] = ErrorCode.group_subscribed_to_topic
                else:
                    todo.append(key)
        if todo:
            try:
                await self.offsets.delete_offsets(gid, todo)
            except Exception as exc:
                log.warning("group=%s: offset delete failed: %r", gid, exc)
                return failed(_store_error(exc))
            codes.update(dict.fromkeys(todo, ErrorCode.none))
            log.info("group=%s: deleted the committed offsets of %d partitions", gid, len(todo))
        return build(resp_cls, error_code=ErrorCode.none, throttle_time=ZERO_MS, topics=tuple(
            topic_cls(name=t.name, partitions=tuple(
                part_cls(partition_index=p.partition_index, error_code=codes[(t.name, p.partition_index)])
                for p in t.partitions)) for t in req.topics))

    def subscribed_topics(self, group_id: str) -> set[str] | bool | None:
        """The topics the active members of a group subscribe to; None when it has no members;
        False for an active classic group whose protocol type is not ``consumer`` (Kafka cannot
        tell its topics)."""
        cg = self.consumer_groups.get(group_id)
        if cg is not None and cg.members:
            return cg.subscribed_topics()
        g = self.groups.get(group_id)
        if g is None or not g.members or g.state == DEAD:
            return None
        if g.protocol_type != "consumer":
            return False
        out: set[str] = set()
        for m in g.members.values():
            out |= subscription_topics(m.metadata_for(g.protocol_name) if g.protocol_name
                                       else (m.protocols[0][1] if m.protocols else b""))
        return out


def subscription_topics(metadata: bytes) -> set[str]:
    """The topic names of a ConsumerProtocolSubscription (any version: int16 version, then an array
    of int16-length strings); an unreadable one names none."""
    try:
        (n,) = struct.unpack_from(">i", metadata, 2)
        pos, out = 6, set()
        for _ in range(max(0, n)):
            (size,) = struct.unpack_from(">h", metadata, pos)
            out.add(metadata[pos + 2:pos + 2 + size].decode())
            pos += 2 + size
        return out
    except (struct.error, UnicodeDecodeError):
        return set()


def _store_error(exc: BaseException) -> ErrorCode:
    """A metadata-store failure behind a group API: retriable COORDINATOR_NOT_AVAILABLE (the client
    looks the coordinator up again and retries), unless the error has a more precise Kafka code."""
    code = code_for(exc)
    return ErrorCode.coordinator_not_available if code in (ErrorCode.unknown_server_error,
                                                          ErrorCode.request_timed_out) else code


# ---------------------------------------------------------------- the retention floor
async def retention_floor(client, meta) -> int | None:
    """The lowest record offset of stream ``meta`` that must stay for Kafka consumer groups: the
    lowest offset any group has committed for the topic partition the stream is
    (``streams.topics.stream_partition``); None when no group committed one, or the stream is not a
    partition of an existing topic. Retention keeps the fragment holding that offset and all after;
    it never removes a stream's last fragment, so the writer can always recover its next offset."""
    topic, partition = stream_partition(meta.name)
    cluster = getattr(client, "cluster", client)
    rec = await cluster.store.get(topic_key(topic))
    partitions = TopicMeta.decode(topic, rec.value).partitions if rec is not None else 1  # a stream alone: 1
    if not 0 <= partition < partitions:
        return None
    lowest = None
    for key, v in await cluster.store.list_prefix(GROUPS_PREFIX):
        parsed = _parse_offset_key(key)
        if parsed is None or parsed[1] != topic or parsed[2] != partition:
            continue
        try:
            offset = Committed.decode(v.value).offset
        except (ValueError, KeyError, TypeError):
            log.warning("%s: unreadable committed offset %r", key, v.value[:100])
            continue
        if offset >= 0 and (lowest is None or offset < lowest):
            lowest = offset
    log.debug("stream=%s (topic %s partition %d): retention floor %s", meta.name, topic, partition, lowest)
    return lowest
