"""The KIP-848 state machine and assignors (compat_kafka/groups/consumer_groups.py) without IO: the
assignors' invariants under hypothesis, and reconciliation driven by hand-made heartbeats with a
fake clock, including a model-based run in which no partition is ever owned by two members."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from compat_kafka.groups.consumer_groups import (
    ConsumerGroup,
    ConsumerGroupConfig,
    Heartbeat,
    assign_range,
    assign_uniform,
)

CONFIG = ConsumerGroupConfig(session_timeout_ms=3000, heartbeat_interval_ms=200)
TOPICS = {"a": 4, "b": 3, "c": 1}

topic_names = st.sampled_from(sorted(TOPICS))
subscriptions = st.dictionaries(st.text("mnopq", min_size=1, max_size=3),
                                st.frozensets(topic_names, min_size=1), min_size=1, max_size=6)
partition_counts = st.fixed_dictionaries({t: st.integers(0, 8) for t in TOPICS})


def _check_exactly_once(subs, parts, out):
    wanted = {(t, p) for ts in subs.values() for t in ts for p in range(parts.get(t, 0))}
    owned = [tp for tps in out.values() for tp in tps]
    assert sorted(owned) == sorted(wanted)  # every subscribed partition exactly once
    for mid, tps in out.items():
        assert all(t in subs[mid] for t, _ in tps)  # only to a member subscribed to its topic


@settings(max_examples=200, deadline=None)
@given(subscriptions, partition_counts, st.data())
def test_uniform_assigns_each_subscribed_partition_once_and_balances_equal_subscriptions(subs, parts, data):
    current = data.draw(st.none() | st.just(assign_uniform(subs, {t: max(0, n - 1) for t, n in parts.items()})))
    out = assign_uniform(subs, parts, current)
    _check_exactly_once(subs, parts, out)
    same = {mid: frozenset(TOPICS) for mid in subs}
    even = assign_uniform(same, parts, current)
    counts = [len(v) for v in even.values()]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(subscriptions, partition_counts)
def test_uniform_is_sticky_when_nothing_changes(subs, parts):
    first = assign_uniform(subs, parts)
    assert assign_uniform(subs, parts, first) == first


@settings(max_examples=200, deadline=None)
@given(subscriptions, partition_counts)
def test_range_gives_contiguous_ranges_per_topic_in_member_order(subs, parts):
    out = assign_range(subs, parts)
    _check_exactly_once(subs, parts, out)
    for t, n in parts.items():
        members = sorted(m for m in subs if t in subs[m])
        if not members:
            continue
        ranges = [sorted(p for tt, p in out[m] if tt == t) for m in members]
        flat = [p for r in ranges for p in r]
        assert flat == list(range(n))  # in member order, contiguous
        sizes = [len(r) for r in ranges]
        assert sizes == sorted(sizes, reverse=True) and (not sizes or sizes[0] - sizes[-1] <= 1)


# ---------------------------------------------------------------- reconciliation
class Driver:
    """Members that behave like a client: revoke what the answer leaves out, report what they own."""

    def __init__(self):
        self.g = ConsumerGroup("g", CONFIG, member_ids=iter(f"m{i}" for i in itertools.count()).__next__)
        self.now = 0.0
        self.epoch: dict[str, int] = {}
        self.owned: dict[str, frozenset] = {}

    def join(self, mid: str, topics=("a",), assignor=None):
        r = self.g.heartbeat(self.now, Heartbeat(mid, 0, rebalance_timeout_ms=5000, subscribed_topic_names=topics,
                                                 server_assignor=assignor, owned=frozenset()), TOPICS)
        assert r.error == ErrorCode.none, r
        self._apply(mid, r)
        return r

    def beat(self, mid: str):
        r = self.g.heartbeat(self.now, Heartbeat(mid, self.epoch[mid], owned=self.owned[mid]), TOPICS)
        assert r.error == ErrorCode.none, r
        self._apply(mid, r)
        return r

    def _apply(self, mid, r):
        self.epoch[mid] = r.member_epoch
        if r.assignment is not None:
            self.owned[mid] = r.assignment
        self.check_no_double_ownership()

    def check_no_double_ownership(self):
        seen: dict = {}
        for mid, tps in self.owned.items():
            if mid not in self.g.members:
                continue
            for tp in tps:
                assert tp not in seen, f"{tp} owned by {seen[tp]} and {mid}"
                seen[tp] = mid

    def settle(self, rounds: int = 6):
        for _ in range(rounds):
            for mid in list(self.g.members):
                self.beat(mid)


def test_a_joiner_gets_partitions_only_after_their_owner_revoked_them():
    d = Driver()
    d.join("x")
    assert d.owned["x"] == {("a", p) for p in range(4)} and d.g.state == "Stable"
    d.join("y")
    assert d.owned["y"] == frozenset()  # nothing is free yet: x still owns everything
    assert d.g.state == "Reconciling"
    r = d.beat("x")  # x is told to revoke two; its epoch stays until it acknowledges
    assert len(r.assignment) == 2 and r.member_epoch == 1
    assert d.beat("y").assignment is None  # x has not acknowledged: y still waits
    r = d.beat("x")  # x reports owning only its two: the revocation is acknowledged
    assert r.member_epoch == d.g.assignment_epoch
    r = d.beat("y")
    assert len(r.assignment) == 2 and not r.assignment & d.owned["x"]
    d.settle()
    assert d.g.state == "Stable"


def test_epochs_fence_stale_members_and_accept_a_lost_answer():
    d = Driver()
    d.join("x")
    e = d.epoch["x"]
    bad = d.g.heartbeat(d.now, Heartbeat("x", e + 1, owned=d.owned["x"]), TOPICS)
    assert bad.error == ErrorCode.fenced_member_epoch
    d.join("y")
    d.settle()
    # x's previous epoch with owned partitions within its assignment is accepted (lost answer)
    prev = d.g.members["x"].previous_epoch
    ok = d.g.heartbeat(d.now, Heartbeat("x", prev, owned=d.owned["x"]), TOPICS)
    assert ok.error == ErrorCode.none
    assert d.g.heartbeat(d.now, Heartbeat("nobody", 3), TOPICS).error == ErrorCode.unknown_member_id
    assert d.g.check_commit("x", d.epoch["x"], 9) == ErrorCode.none
    assert d.g.check_commit("x", d.epoch["x"] - 1, 9) == ErrorCode.stale_member_epoch
    assert d.g.check_commit("x", d.epoch["x"], 8) == ErrorCode.unsupported_version
    assert d.g.check_commit("zz", 1, 9) == ErrorCode.unknown_member_id


def test_session_timeout_and_revocation_timeout_remove_members():
    d = Driver()
    d.join("x")
    d.join("y")
    d.now += 2.0
    d.beat("x")
    d.now += 1.5
    d.g.tick(d.now)  # y's session (3 s) expired
    assert set(d.g.members) == {"x"}

    d = Driver()
    d.join("x")
    everything = d.owned["x"]
    d.join("y")
    assert len(d.beat("x").assignment) == 2  # x is told to revoke two
    for _ in range(5):  # x keeps heartbeating but never gives them up
        d.now += 1.0
        assert d.g.heartbeat(d.now, Heartbeat("x", d.epoch["x"], owned=everything), TOPICS).error == ErrorCode.none
        d.beat("y")
        assert d.owned["y"] == frozenset()  # never given a partition x still holds
        d.g.tick(d.now)
    assert set(d.g.members) == {"y"}  # removed at its rebalance timeout (5 s)
    d.beat("y")
    assert d.owned["y"] == everything


def test_static_member_returning_keeps_its_partitions_and_a_duplicate_is_refused():
    d = Driver()
    r = d.g.heartbeat(0, Heartbeat("s1", 0, instance_id="i", rebalance_timeout_ms=5000,
                                   subscribed_topic_names=("a",), owned=frozenset()), TOPICS)
    mine = r.assignment
    dup = d.g.heartbeat(0, Heartbeat("s2", 0, instance_id="i", rebalance_timeout_ms=5000,
                                     subscribed_topic_names=("a",), owned=frozenset()), TOPICS)
    assert dup.error == ErrorCode.unreleased_instance_id
    left = d.g.heartbeat(0, Heartbeat("s1", -2, instance_id="i"), TOPICS)
    assert left.error == ErrorCode.none and left.member_epoch == -2
    back = d.g.heartbeat(1, Heartbeat("s3", 0, instance_id="i", rebalance_timeout_ms=5000,
                                      subscribed_topic_names=("a",), owned=frozenset()), TOPICS)
    assert back.error == ErrorCode.none and back.assignment == mine and set(d.g.members) == {"s3"}
    assert back.member_epoch == r.member_epoch == d.g.group_epoch  # no rebalance for a returning member


def test_bad_heartbeats_get_clear_errors():
    g = ConsumerGroup("g", CONFIG)
    no_subs = g.heartbeat(0, Heartbeat("m", 0, rebalance_timeout_ms=1000, owned=frozenset()), TOPICS)
    assert no_subs.error == ErrorCode.invalid_request and "Subscribed" in no_subs.message
    rx = g.heartbeat(0, Heartbeat("m", 0, rebalance_timeout_ms=1000, subscribed_topic_regex="(", owned=frozenset()),
                     TOPICS)
    assert rx.error == ErrorCode.invalid_regular_expression
    slow = g.heartbeat(0, Heartbeat("m", 0, rebalance_timeout_ms=1000, subscribed_topic_regex="(a+)+$",
                                    owned=frozenset()), TOPICS)  # exponential in Python's re: refused
    assert slow.error == ErrorCode.invalid_regular_expression and "repetition" in slow.message
    asg = g.heartbeat(0, Heartbeat("m", 0, rebalance_timeout_ms=1000, subscribed_topic_names=("a",),
                                   server_assignor="sticky", owned=frozenset()), TOPICS)
    assert asg.error == ErrorCode.unsupported_assignor


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "beat", "leave", "tick"]), st.integers(0, 4)), max_size=40))
def test_no_partition_is_ever_owned_by_two_members(steps):
    """Random joins, heartbeats, leaves and clock moves: members that act on every answer never
    own one partition together, and once everyone heartbeats enough the group is Stable with every
    partition assigned."""
    d = Driver()
    for op, i in steps:
        mid = f"c{i}"
        if op == "join" and mid not in d.g.members:
            d.join(mid, topics=("a", "b"))
        elif op == "beat" and mid in d.g.members:
            d.beat(mid)
        elif op == "leave" and mid in d.g.members:
            d.g.heartbeat(d.now, Heartbeat(mid, -1), TOPICS)
            d.owned.pop(mid)
        elif op == "tick":
            d.now += 0.5
            d.g.tick(d.now)
            for gone in set(d.owned) - set(d.g.members):
                d.owned.pop(gone)
        d.check_no_double_ownership()
    if d.g.members:
        d.settle(rounds=8)
        assert d.g.state == "Stable"
        assert sorted(tp for m in d.g.members for tp in d.owned[m]) == sorted(
            [("a", p) for p in range(4)] + [("b", p) for p in range(3)])
