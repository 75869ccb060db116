"""The KIP-848 consumer group protocol: ConsumerGroupHeartbeat's state machine and its assignors.

How this works. ``ConsumerGroup`` is one group's coordinator state, sans-IO like ``groups.Group``:
``heartbeat(now, request, topics)`` takes the time, the member's heartbeat (``Heartbeat``, topics by
name: the asyncio layer maps topic ids) and the cluster's topics, and returns the answer at once
(nothing ever waits: a member learns of changes from its next heartbeat).

- **Group epoch.** Every change the assignment depends on (a member joins or leaves, a member's
  subscription or preferred assignor changes, a subscribed topic gains partitions or a topic
  matching a regex appears) bumps the group epoch. The **target assignment** is then computed at
  once by the group's assignor (``uniform``, the default, or ``range``: the one most members ask
  for in ``server_assignor``) and carries the group epoch as its *assignment epoch*.
- **Reconciliation** (Kafka's CurrentAssignmentBuilder). A member whose epoch is behind the
  assignment epoch first keeps the partitions it owns that stay in its target and is told to
  *revoke* the others (state ``UNREVOKED_PARTITIONS``: its epoch does not move). Once a heartbeat
  reports its owned partitions without them, they are released, the member's epoch moves to the
  assignment epoch and it gets the partitions of its target that no other member still holds
  (assigned or revoking); partitions still held elsewhere come later (``UNRELEASED_PARTITIONS``).
  So a partition is only ever given to a member after its previous owner acknowledged revoking it
  (or left, or was removed): no two members consume one partition at once.
- A heartbeat's epoch must be the member's (or its previous epoch, with owned partitions within
  its assignment: the answer that bumped it may have been lost), else FENCED_MEMBER_EPOCH, and the
  member rejoins with epoch 0. Epoch -1 leaves. A static member (``instance_id``) leaving with -2
  keeps its assignment for its session timeout and a member joining with the same instance id
  takes it over; a second live member with the same instance id gets UNRELEASED_INSTANCE_ID.
- A member that does not heartbeat for the session timeout, or does not revoke within its
  rebalance timeout, is removed (its partitions are released and the group epoch bumps).
- Subscriptions: topic names, or a regular expression (``subscribed_topic_regex``) matched against
  whole topic names. Kafka uses RE2/J; we use Python's ``re`` (``fullmatch``): the common syntax is
  the same, and a pattern Python cannot compile gets INVALID_REGULAR_EXPRESSION.

Group states as Kafka names them: Empty, Assigning (target behind the group epoch: transient
here, since targets are computed at once), Reconciling (some member not at the assignment epoch or
with partitions to revoke or to receive), Stable.

Membership lives in memory, like the classic groups'; committed offsets are durable (groups.py).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kio.schema.errors import ErrorCode

log = logging.getLogger(__name__)

TP = tuple[str, int]  # (topic name, partition)

EMPTY = "Empty"
ASSIGNING = "Assigning"
RECONCILING = "Reconciling"
STABLE = "Stable"
DEAD = "Dead"

MEMBER_STABLE = "stable"
UNREVOKED = "unrevoked_partitions"
UNRELEASED = "unreleased_partitions"

LEAVE_EPOCH = -1
STATIC_LEAVE_EPOCH = -2

ASSIGNORS = ("uniform", "range")


# ---------------------------------------------------------------- assignors
def _eligible(subscriptions: Mapping[str, frozenset[str]], partitions: Mapping[str, int]) -> dict[TP, list[str]]:
    """Every partition of a subscribed topic -> the members subscribed to its topic (sorted)."""
    by_topic: dict[str, list[str]] = {}
    for mid in sorted(subscriptions):
        for t in subscriptions[mid]:
            if partitions.get(t, 0) > 0:
                by_topic.setdefault(t, []).append(mid)
    return {(t, p): mids for t, mids in sorted(by_topic.items()) for p in range(partitions[t])}


def assign_uniform(subscriptions: Mapping[str, frozenset[str]], partitions: Mapping[str, int],
                   current: Mapping[str, frozenset[TP]] | None = None) -> dict[str, frozenset[TP]]:
    """Kafka's ``uniform`` assignor in spirit: every partition of a subscribed topic goes to exactly
    one member subscribed to it, as evenly as the subscriptions allow (with the same subscriptions
    everywhere, member counts differ by at most one), keeping partitions where they are (``current``,
    the previous target) as far as balance allows."""
    eligible = _eligible(subscriptions, partitions)
    owner: dict[TP, str] = {}
    counts = Counter({mid: 0 for mid in subscriptions})
    # sticky first: every partition stays with its current member while that member may have it
    for mid in sorted(current or {}):
        if mid not in subscriptions:
            continue
        for tp in sorted(current[mid]):
            if tp in eligible and tp not in owner and mid in eligible[tp]:
                owner[tp] = mid
                counts[mid] += 1
    # the rest: the most constrained partitions first, each to its least loaded eligible member
    for tp in sorted((tp for tp in eligible if tp not in owner), key=lambda tp: (len(eligible[tp]), tp)):
        mid = min(eligible[tp], key=lambda m: (counts[m], m))
        owner[tp] = mid
        counts[mid] += 1
    # balance: move a partition to an eligible member with at least two fewer (sum of squares falls)
    moved = True
    while moved:
        moved = False
        for tp in sorted(owner):
            mid = owner[tp]
            best = min(eligible[tp], key=lambda m: (counts[m], m))
            if counts[best] < counts[mid] - 1:
                owner[tp] = best
                counts[mid] -= 1
                counts[best] += 1
                moved = True
    out: dict[str, set[TP]] = {mid: set() for mid in subscriptions}
    for tp, mid in owner.items():
        out[mid].add(tp)
    return {mid: frozenset(tps) for mid, tps in out.items()}


def assign_range(subscriptions: Mapping[str, frozenset[str]], partitions: Mapping[str, int],
                 current: Mapping[str, frozenset[TP]] | None = None) -> dict[str, frozenset[TP]]:
    """Kafka's ``range`` assignor: per topic, its subscribers (by member id) get contiguous ranges
    of partitions, the first ``n % k`` one more than the others; members subscribing to the same
    topics get the same partition numbers of each (co-partitioning)."""
    out: dict[str, set[TP]] = {mid: set() for mid in subscriptions}
    by_topic: dict[str, list[str]] = {}
    for mid in sorted(subscriptions):
        for t in subscriptions[mid]:
            by_topic.setdefault(t, []).append(mid)
    for t, mids in by_topic.items():
        n = partitions.get(t, 0)
        if n <= 0:
            continue
        q, r = divmod(n, len(mids))
        start = 0
        for i, mid in enumerate(mids):
            size = q + (1 if i < r else 0)
            out[mid].update((t, p) for p in range(start, start + size))
            start += size
    return {mid: frozenset(tps) for mid, tps in out.items()}


ASSIGNOR_FUNCS: dict[str, Callable] = {"uniform": assign_uniform, "range": assign_range}


# ---------------------------------------------------------------- the state machine
@dataclass(frozen=True)
class Heartbeat:
    """One ConsumerGroupHeartbeat, topics by name. None: "unchanged since the last heartbeat"."""

    member_id: str
    member_epoch: int
    instance_id: str | None = None
    rack_id: str | None = None
    rebalance_timeout_ms: int = -1
    subscribed_topic_names: tuple[str, ...] | None = None
    subscribed_topic_regex: str | None = None
    server_assignor: str | None = None
    owned: frozenset[TP] | None = None  # the partitions the member owns
    client_id: str = ""
    client_host: str = ""


@dataclass(frozen=True)
class HeartbeatResult:
    error: ErrorCode
    message: str | None = None
    member_id: str | None = None
    member_epoch: int = 0
    assignment: frozenset[TP] | None = None  # None: unchanged (the answer carries no assignment)


@dataclass
class ConsumerMember:
    member_id: str
    instance_id: str | None = None
    rack_id: str | None = None
    client_id: str = ""
    client_host: str = ""
    subscribed_names: tuple[str, ...] = ()
    subscribed_regex: str | None = None
    server_assignor: str | None = None
    rebalance_timeout_s: float = 300.0
    epoch: int = 0
    previous_epoch: int = -1
    state: str = MEMBER_STABLE
    assigned: frozenset[TP] = frozenset()
    revoking: frozenset[TP] = frozenset()
    last_heartbeat: float = 0.0
    revoke_deadline: float | None = None
    left_static: bool = False  # left with epoch -2: kept for its session timeout

    def subscribes(self, topic: str) -> bool:
        if topic in self.subscribed_names:
            return True
        return self.subscribed_regex is not None and _compiled(self.subscribed_regex).fullmatch(topic) is not None


_REGEX_CACHE: dict[str, re.Pattern] = {}
MAX_REGEX_CHARS = 1000
MAX_REGEX_REPEATS = 3  # unbounded repetitions in one pattern: matching stays polynomial of low degree


def _compiled(pattern: str) -> re.Pattern:
    rx = _REGEX_CACHE.get(pattern)
    if rx is None:
        check_regex(pattern)
        if len(_REGEX_CACHE) > 1000:
            _REGEX_CACHE.clear()
        rx = _REGEX_CACHE[pattern] = re.compile(pattern)
    return rx


def check_regex(pattern: str) -> None:
    """Refuse (``re.error``) what RE2 refuses and what would make Python's backtracking ``re`` take
    exponential time on a topic name (a client must not be able to stall the listener):
    backreferences, lookaround, conditionals, a repetition of something that itself repeats or
    alternates (``(a+)+``, ``(a|aa)*``), and more than ``MAX_REGEX_REPEATS`` repetitions
    (``.*a.*a.*a.*b``); ``(a|b)-.*`` and ``x.*y.*`` are fine."""
    if len(pattern) > MAX_REGEX_CHARS:
        raise re.error(f"longer than {MAX_REGEX_CHARS} characters")
    from re import _constants as c
    from re import _parser

    repeats_seen = 0

    def walk(items, in_repeat: bool) -> None:
        nonlocal repeats_seen
        for op, av in items:
            if op in (c.GROUPREF, c.GROUPREF_EXISTS, c.ASSERT, c.ASSERT_NOT):
                raise re.error("backreferences, lookaround and conditionals are not supported (as in RE2)")
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                lo, hi, sub = av
                repeats = hi > 1
                if repeats and in_repeat:
                    raise re.error("a repetition inside a repetition is refused here (Python's re backtracks)")
                repeats_seen += repeats
                if repeats_seen > MAX_REGEX_REPEATS:
                    raise re.error(f"more than {MAX_REGEX_REPEATS} repetitions are refused here "
                                   "(Python's re backtracks)")
                walk(sub, in_repeat or repeats)
            elif op == c.BRANCH:
                if in_repeat:
                    raise re.error("an alternation inside a repetition is refused here (Python's re backtracks)")
                for branch in av[1]:
                    walk(branch, in_repeat)
            elif op in (c.SUBPATTERN, c.ATOMIC_GROUP):
                walk(av[-1], in_repeat)

    walk(_parser.parse(pattern).data, False)


@dataclass(frozen=True)
class ConsumerGroupConfig:
    session_timeout_ms: int = 45_000  # group.consumer.session.timeout.ms
    heartbeat_interval_ms: int = 5_000  # group.consumer.heartbeat.interval.ms
    max_size: int = 1000  # group.consumer.max.size
    assignors: tuple[str, ...] = ASSIGNORS  # group.consumer.assignors: the first is the default

    def __post_init__(self):
        if not 0 < self.heartbeat_interval_ms < self.session_timeout_ms:
            raise ValueError("need 0 < heartbeat_interval_ms < session_timeout_ms")
        if not self.assignors or any(a not in ASSIGNOR_FUNCS for a in self.assignors):
            raise ValueError(f"assignors must be among {sorted(ASSIGNOR_FUNCS)}")


class ConsumerGroup:
    """One KIP-848 consumer group (sans-IO; times in seconds from any monotonic clock)."""

    def __init__(self, group_id: str, config: ConsumerGroupConfig,
                 member_ids: Callable[[], str] = lambda: str(uuid.uuid4())):
        self.group_id = group_id
        self.config = config
        self.member_ids = member_ids
        self.group_epoch = 0
        self.assignment_epoch = 0
        self.assignor = config.assignors[0]
        self.members: dict[str, ConsumerMember] = {}
        self.static: dict[str, str] = {}  # instance id -> member id
        self.target: dict[str, frozenset[TP]] = {}
        self.subscribed_partitions: dict[str, int] = {}  # topic -> partitions, of subscribed topics
        self._resolved_for: Mapping[str, int] | None = None  # the topics map subscribed_partitions came from
        self.dead = False

    # ------------------------------------------------------------ queries
    @property
    def state(self) -> str:
        if self.dead:
            return DEAD
        if not self.members:
            return EMPTY
        if self.assignment_epoch < self.group_epoch:
            return ASSIGNING
        if any(m.epoch != self.assignment_epoch or m.state != MEMBER_STABLE for m in self.members.values()):
            return RECONCILING
        return STABLE

    @property
    def is_idle(self) -> bool:
        return not self.members

    def subscribed_topics(self) -> set[str]:
        return set(self.subscribed_partitions)

    def owner_of(self, tp: TP) -> str | None:
        for m in self.members.values():
            if tp in m.assigned or tp in m.revoking:
                return m.member_id
        return None

    def next_deadline(self) -> float | None:
        ds = [m.last_heartbeat + self.config.session_timeout_ms / 1000 for m in self.members.values()]
        ds += [m.revoke_deadline for m in self.members.values() if m.revoke_deadline is not None]
        return min(ds, default=None)

    # ------------------------------------------------------------ heartbeats
    def heartbeat(self, now: float, hb: Heartbeat, topics: Mapping[str, int]) -> HeartbeatResult:
        """Answer one heartbeat; ``topics``: every topic of the cluster -> its partition count."""
        if self.dead:
            return HeartbeatResult(ErrorCode.coordinator_not_available, "the group is being deleted")
        err = self._check_request(hb)
        if err is not None:
            return err
        if hb.member_epoch == LEAVE_EPOCH or hb.member_epoch == STATIC_LEAVE_EPOCH:
            return self._leave(now, hb)
        returning = False
        if hb.member_epoch == 0:
            res = self._join(now, hb)
            if isinstance(res, HeartbeatResult):
                return res
            m = res
            returning = m.epoch > 0  # a static member taking its place back: no new epoch unless it changed
        else:
            m = self.members.get(hb.member_id)
            if m is None or m.left_static:
                return HeartbeatResult(ErrorCode.unknown_member_id, f"member {hb.member_id} is not in the group")
            if hb.member_epoch > m.epoch or (hb.member_epoch < m.epoch and not (
                    hb.member_epoch == m.previous_epoch and hb.owned is not None and hb.owned <= m.assigned)):
                return HeartbeatResult(ErrorCode.fenced_member_epoch,
                                       f"epoch {hb.member_epoch} is not the member's epoch {m.epoch}")
        before = m.assigned
        m.last_heartbeat = now
        m.client_id, m.client_host = hb.client_id or m.client_id, hb.client_host or m.client_host
        if hb.rack_id is not None:
            m.rack_id = hb.rack_id
        if hb.rebalance_timeout_ms >= 0:
            m.rebalance_timeout_s = hb.rebalance_timeout_ms / 1000
        changed = hb.member_epoch == 0 and not returning
        if hb.subscribed_topic_names is not None and tuple(sorted(hb.subscribed_topic_names)) != m.subscribed_names:
            m.subscribed_names, changed = tuple(sorted(hb.subscribed_topic_names)), True
        if hb.subscribed_topic_regex is not None and (hb.subscribed_topic_regex or None) != m.subscribed_regex:
            m.subscribed_regex, changed = hb.subscribed_topic_regex or None, True
        if hb.server_assignor is not None and hb.server_assignor != m.server_assignor:
            m.server_assignor, changed = hb.server_assignor, True
        self.refresh(now, topics, force=changed)
        self._reconcile(now, m, hb.owned)
        full = hb.member_epoch == 0 or (hb.rebalance_timeout_ms >= 0 and hb.owned is not None and (
            hb.subscribed_topic_names is not None or hb.subscribed_topic_regex is not None))
        return HeartbeatResult(ErrorCode.none, None, m.member_id, m.epoch,
                               m.assigned if full or m.assigned != before else None)

    def _check_request(self, hb: Heartbeat) -> HeartbeatResult | None:
        def bad(msg: str) -> HeartbeatResult:
            return HeartbeatResult(ErrorCode.invalid_request, msg)

        if hb.member_epoch < STATIC_LEAVE_EPOCH:
            return bad(f"member epoch {hb.member_epoch} is invalid")
        if hb.member_epoch == STATIC_LEAVE_EPOCH and hb.instance_id is None:
            return bad("member epoch -2 (static leave) needs an instance id")
        if hb.member_epoch == 0:
            if hb.rebalance_timeout_ms < 0:
                return bad("RebalanceTimeoutMs must be given when joining (member epoch 0)")
            if hb.subscribed_topic_names is None and hb.subscribed_topic_regex is None:
                return bad("SubscribedTopicNames or SubscribedTopicRegex must be given when joining")
            if hb.owned:
                return bad("TopicPartitions must be empty when joining (member epoch 0)")
        elif not hb.member_id:
            return bad("MemberId can't be empty")
        if hb.server_assignor is not None and hb.server_assignor not in self.config.assignors:
            return HeartbeatResult(ErrorCode.unsupported_assignor,
                                   f"assignor {hb.server_assignor!r} is not one of {list(self.config.assignors)}")
        if hb.subscribed_topic_regex:
            try:
                _compiled(hb.subscribed_topic_regex)
            except re.error as exc:
                return HeartbeatResult(ErrorCode.invalid_regular_expression,
                                       f"SubscribedTopicRegex {hb.subscribed_topic_regex!r}: {exc}")
        return None

    def _join(self, now: float, hb: Heartbeat) -> ConsumerMember | HeartbeatResult:
        member_id = hb.member_id or self.member_ids()
        old = self.members.get(member_id)
        if old is not None:  # the member lost its state and joins again: it starts afresh
            self._remove(now, old, "rejoined with epoch 0")
        if hb.instance_id is not None and hb.instance_id in self.static:
            prev = self.members[self.static[hb.instance_id]]
            if not prev.left_static:
                return HeartbeatResult(ErrorCode.unreleased_instance_id,
                                       f"instance {hb.instance_id} is still used by member {prev.member_id}")
            # the static member comes back: it takes over its previous assignment and epoch
            old_id = prev.member_id
            del self.members[old_id]
            prev.member_id, prev.left_static = member_id, False
            self.members[member_id] = prev
            self.static[hb.instance_id] = member_id
            self.target = {(member_id if k == old_id else k): v for k, v in self.target.items()}
            log.info("group=%s static member %s (instance %s) is back as %s", self.group_id, old_id,
                     hb.instance_id, member_id)
            return prev
        if len(self.members) >= self.config.max_size:
            return HeartbeatResult(ErrorCode.group_max_size_reached, f"the group has {len(self.members)} members")
        m = ConsumerMember(member_id=member_id, instance_id=hb.instance_id, last_heartbeat=now)
        self.members[member_id] = m
        if hb.instance_id is not None:
            self.static[hb.instance_id] = member_id
        log.info("group=%s member %s joined (instance %s)", self.group_id, member_id, hb.instance_id)
        return m

    def _leave(self, now: float, hb: Heartbeat) -> HeartbeatResult:
        m = self.members.get(hb.member_id)
        if m is None and hb.instance_id is not None:
            m = self.members.get(self.static.get(hb.instance_id, ""))
        if m is None:
            return HeartbeatResult(ErrorCode.unknown_member_id, f"member {hb.member_id} is not in the group")
        if hb.member_epoch == STATIC_LEAVE_EPOCH and m.instance_id is not None:
            m.left_static = True  # its partitions stay its own until it returns or its session ends
            m.last_heartbeat = now
            log.info("group=%s static member %s (instance %s) left for now", self.group_id, m.member_id, m.instance_id)
        else:
            self._remove(now, m, "left")
        return HeartbeatResult(ErrorCode.none, None, hb.member_id, hb.member_epoch)

    def _remove(self, now: float, m: ConsumerMember, why: str) -> None:
        log.info("group=%s member %s removed (%s); it held %d partitions", self.group_id, m.member_id, why,
                 len(m.assigned | m.revoking))
        del self.members[m.member_id]
        if m.instance_id is not None and self.static.get(m.instance_id) == m.member_id:
            del self.static[m.instance_id]
        self.target.pop(m.member_id, None)
        self._resolved_for = None  # its subscription may have been the only one to some topic
        self._bump()
        self._compute_target()

    def refresh(self, now: float, topics: Mapping[str, int], force: bool = False) -> None:
        """Recompute the subscribed topics' partitions; a change (or ``force``) bumps the group
        epoch and computes a new target assignment. Nothing to do for the same ``topics`` object
        (the caller passes one map per topics snapshot) when nothing else changed."""
        if topics is self._resolved_for and not force:
            return
        self._resolved_for = topics
        wanted: dict[str, int] = {}
        for m in self.members.values():
            for t in m.subscribed_names:
                if t in topics:
                    wanted[t] = topics[t]
            if m.subscribed_regex is not None:
                rx = _compiled(m.subscribed_regex)
                for t, n in topics.items():
                    if rx.fullmatch(t):
                        wanted[t] = n
        if wanted != self.subscribed_partitions or force:
            self.subscribed_partitions = wanted
            self._bump()
            self._compute_target()

    def _bump(self) -> None:
        self.group_epoch += 1

    def _compute_target(self) -> None:
        live = {mid: m for mid, m in self.members.items()}
        votes = Counter(m.server_assignor for m in live.values() if m.server_assignor)
        self.assignor = votes.most_common(1)[0][0] if votes else self.config.assignors[0]
        subscriptions = {mid: frozenset(t for t in self.subscribed_partitions if m.subscribes(t))
                         for mid, m in live.items()}
        self.target = ASSIGNOR_FUNCS[self.assignor](subscriptions, self.subscribed_partitions, self.target)
        self.assignment_epoch = self.group_epoch
        log.info("group=%s epoch %d: target assignment by %s over %d members and %d partitions", self.group_id,
                 self.group_epoch, self.assignor, len(live), sum(self.subscribed_partitions.values()))

    # ------------------------------------------------------------ reconciliation
    def _reconcile(self, now: float, m: ConsumerMember, owned: frozenset[TP] | None) -> None:
        if m.state == UNREVOKED:
            if owned is None or owned & m.revoking:
                return  # still revoking
            m.revoking, m.revoke_deadline, m.state = frozenset(), None, MEMBER_STABLE
        if m.state == MEMBER_STABLE and m.epoch == self.assignment_epoch:
            return
        target = self.target.get(m.member_id, frozenset())
        revoke = m.assigned - target
        if revoke:
            m.assigned, m.revoking, m.state = m.assigned & target, revoke, UNREVOKED
            m.revoke_deadline = now + m.rebalance_timeout_s
            return
        wanted = target - m.assigned
        free = frozenset(tp for tp in wanted if self.owner_of(tp) in (None, m.member_id))
        m.assigned = m.assigned | free
        if m.epoch != self.assignment_epoch:
            m.previous_epoch, m.epoch = m.epoch, self.assignment_epoch
        m.state = UNRELEASED if free != wanted else MEMBER_STABLE

    # ------------------------------------------------------------ timers, commits, describe
    def tick(self, now: float) -> None:
        session = self.config.session_timeout_ms / 1000
        for m in list(self.members.values()):
            if m.last_heartbeat + session <= now:
                self._remove(now, m, f"no heartbeat for {session:g}s")
            elif m.revoke_deadline is not None and m.revoke_deadline <= now:
                self._remove(now, m, f"did not revoke {len(m.revoking)} partitions within {m.rebalance_timeout_s:g}s")

    def check_commit(self, member_id: str, epoch: int, api_version: int) -> ErrorCode:
        """OffsetCommit rules for a consumer group (Kafka's ConsumerGroup.validateOffsetCommit)."""
        if epoch < 0 and not self.members:
            return ErrorCode.none  # an admin or a consumer that assigns partitions itself
        m = self.members.get(member_id)
        if m is None or m.left_static:
            return ErrorCode.unknown_member_id
        if api_version < 9:
            return ErrorCode.unsupported_version  # members of consumer groups commit with v9+
        if epoch > m.epoch:
            return ErrorCode.fenced_member_epoch
        if epoch < m.epoch:
            return ErrorCode.stale_member_epoch
        return ErrorCode.none

    def check_fetch(self, member_id: str | None, epoch: int) -> ErrorCode:
        """OffsetFetch v9 rules: an admin (no member id, epoch -1) may always read."""
        if member_id is None and epoch < 0:
            return ErrorCode.none
        m = self.members.get(member_id or "")
        if m is None:
            return ErrorCode.unknown_member_id
        if epoch != m.epoch:
            return ErrorCode.stale_member_epoch
        return ErrorCode.none

    def delete(self) -> None:
        self.members.clear()
        self.static.clear()
        self.target = {}
        self.dead = True


def by_topic(tps: Iterable[TP]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for t, p in sorted(tps):
        out.setdefault(t, []).append(p)
    return out
