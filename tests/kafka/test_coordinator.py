"""The group coordinator state machine (``compat_kafka.groups.coordinator.Group``), driven with a fake clock.

Each JoinGroup/SyncGroup passes a token; a test collects the completions every call returns, as the
asyncio layer does with futures."""

from __future__ import annotations

import itertools

import pytest
from kio.schema.errors import ErrorCode

from compat_kafka.groups.coordinator import (
    COMPLETING,
    DEAD,
    EMPTY,
    PREPARING,
    STABLE,
    Group,
    GroupConfig,
    JoinResult,
    SyncResult,
    _parse_offset_key,
    offset_key,
)
from streams.topics import partition_stream, stream_partition

CFG = GroupConfig(initial_rebalance_delay_ms=100, min_session_timeout_ms=100)
RANGE = (("range", b"r-meta"), ("roundrobin", b"rr-meta"))


class Harness:
    """A group plus the answers its waiting requests got."""

    def __init__(self, config: GroupConfig = CFG):
        ids = itertools.count(1)
        self.g = Group("g", config, member_ids=lambda client: f"{client}-{next(ids)}")
        self.now = 0.0
        self.answers: dict[str, JoinResult | SyncResult] = {}
        self._tokens = itertools.count(1)

    def collect(self, completions):
        for token, result in completions:
            assert token not in self.answers, f"{token} answered twice"
            self.answers[token] = result

    def join(self, member_id="", protocols=RANGE, session_ms=1000, rebalance_ms=2000, instance=None,
             v4=True, client="c") -> str:
        token = f"join{next(self._tokens)}"
        self.collect(self.g.join(self.now, token, member_id=member_id, instance_id=instance, protocol_type="consumer",
                                 protocols=protocols, session_timeout_ms=session_ms, rebalance_timeout_ms=rebalance_ms,
                                 require_known_member_id=v4, client_id=client))
        return token

    def sync(self, member_id, generation, assignments=None, instance=None) -> str:
        token = f"sync{next(self._tokens)}"
        self.collect(self.g.sync(self.now, token, member_id=member_id, generation=generation, instance_id=instance,
                                 assignments=assignments or {}))
        return token

    def advance(self, seconds: float) -> None:
        """Move the clock, firing deadlines in order as a timer would."""
        end = self.now + seconds
        while True:
            d = self.g.next_deadline()
            if d is None or d > end:
                break
            self.now = max(self.now, d)
            self.collect(self.g.tick(self.now))
        self.now = end

    def new_member(self, client="c", **kw) -> str:
        """JoinGroup v4+: MEMBER_ID_REQUIRED, then the rejoin with the id (left waiting): the token."""
        t = self.join(client=client, **kw)
        r = self.answers[t]
        assert r.error == ErrorCode.member_id_required and r.member_id.startswith(client)
        return self.join(member_id=r.member_id, client=client, **kw)


def stable_group(h: Harness, n: int) -> list[str]:
    """n members through the initial delayed join and the leader's sync: their member ids."""
    tokens = [h.new_member(client=f"c{i}") for i in range(n)]
    assert h.g.state == PREPARING and not any(t in h.answers for t in tokens)
    h.advance(0.2)
    joins = [h.answers[t] for t in tokens]
    assert {j.error for j in joins} == {ErrorCode.none}
    gen = joins[0].generation
    leader = joins[0].leader
    ids = [j.member_id for j in joins]
    syncs = {mid: h.sync(mid, gen, {m: m.encode() for m in ids} if mid == leader else None) for mid in ids}
    assert h.g.state == STABLE
    for mid, t in syncs.items():
        assert h.answers[t] == SyncResult(ErrorCode.none, mid.encode(), "consumer", "range")
    return ids


def test_initial_join_waits_the_delay_then_leader_gets_members():
    h = Harness()
    t1 = h.new_member(client="a")
    h.advance(0.05)
    t2 = h.new_member(client="b")  # a new member inside the delay extends it once more
    h.advance(0.07)
    assert t1 not in h.answers and h.g.state == PREPARING
    h.advance(0.2)
    j1, j2 = h.answers[t1], h.answers[t2]
    assert j1.error == j2.error == ErrorCode.none
    assert j1.generation == j2.generation == 1 and j1.protocol_name == "range"
    assert j1.leader == j1.member_id == "a-1"
    assert [(m, md) for m, _, md in j1.members] == [("a-1", b"r-meta"), ("b-2", b"r-meta")]
    assert j2.members == ()  # only the leader gets the member list
    assert h.g.state == COMPLETING


def test_protocol_is_chosen_by_vote_among_common_ones():
    h = Harness()
    ta = h.new_member(client="a", protocols=(("roundrobin", b"1"), ("range", b"2")))
    tb = h.new_member(client="b", protocols=(("range", b"3"), ("sticky", b"4")))
    tc = h.new_member(client="c", protocols=(("sticky", b"5"), ("range", b"6"), ("roundrobin", b"7")))
    h.advance(1)
    # common: range only (b lacks roundrobin, a lacks sticky)
    assert {h.answers[t].protocol_name for t in (ta, tb, tc)} == {"range"}
    assert [md for _, _, md in h.answers[ta].members] == [b"2", b"3", b"6"]


def test_member_without_common_protocol_is_refused():
    h = Harness()
    stable_group(h, 1)
    t = h.join(protocols=(("other", b""),))
    assert h.answers[t].error == ErrorCode.inconsistent_group_protocol


def test_session_timeout_bounds():
    h = Harness()
    assert h.answers[h.join(session_ms=50)].error == ErrorCode.invalid_session_timeout
    assert h.answers[h.join(session_ms=10**8)].error == ErrorCode.invalid_session_timeout


def test_follower_waits_for_leader_sync():
    h = Harness()
    t1, t2 = h.new_member(client="a"), h.new_member(client="b")
    h.advance(0.2)
    leader, follower = h.answers[t1].member_id, h.answers[t2].member_id
    ts = h.sync(follower, 1)
    assert ts not in h.answers  # waits
    assert h.g.heartbeat(h.now, member_id=follower, generation=1, instance_id=None) == ErrorCode.none
    h.sync(leader, 1, {leader: b"L", follower: b"F"})
    assert h.answers[ts].assignment == b"F" and h.g.state == STABLE


def test_rejoin_barrier_completes_when_all_members_rejoin_and_heartbeat_says_rebalance():
    h = Harness()
    a, b = stable_group(h, 2)
    t3 = h.new_member(client="n")  # a third member: rebalance
    assert h.g.state == PREPARING
    assert h.g.heartbeat(h.now, member_id=a, generation=1, instance_id=None) == ErrorCode.rebalance_in_progress
    ta = h.join(member_id=a)
    assert ta not in h.answers and t3 not in h.answers
    tb = h.join(member_id=b)  # the last one: no delay for a group that was not empty
    assert {h.answers[t].generation for t in (ta, tb, t3)} == {2}
    assert h.g.state == COMPLETING
    # an old-generation heartbeat / sync is refused
    assert h.g.heartbeat(h.now, member_id=a, generation=1, instance_id=None) == ErrorCode.illegal_generation
    assert h.answers[h.sync(a, 1)].error == ErrorCode.illegal_generation


def test_member_that_does_not_rejoin_is_removed_at_rebalance_timeout():
    h = Harness()
    a, b = stable_group(h, 2)
    assert h.g.leave(h.now, [("nobody", None)])[0] == [ErrorCode.unknown_member_id]
    ta = h.join(member_id=a, protocols=(("range", b"changed"), ("roundrobin", b"")))  # new metadata: rebalance
    assert h.g.state == PREPARING
    # b keeps heartbeating but never rejoins: removed when the rebalance timeout (2 s) passes
    for _ in range(5):
        h.advance(0.3)
        h.g.heartbeat(h.now, member_id=b, generation=1, instance_id=None)
    assert ta not in h.answers
    h.advance(1.0)
    j = h.answers[ta]
    assert j.error == ErrorCode.none and j.generation == 2 and [m for m, _, _ in j.members] == [a]
    assert b not in h.g.members


def test_session_expiry_removes_member_and_rebalances():
    h = Harness()
    a, b = stable_group(h, 2)
    for _ in range(4):  # a heartbeats, b is silent
        h.advance(0.3)
        h.g.heartbeat(h.now, member_id=a, generation=1, instance_id=None)
    assert b not in h.g.members and h.g.state == PREPARING  # 1 s session timeout passed for b
    assert h.g.heartbeat(h.now, member_id=a, generation=1, instance_id=None) == ErrorCode.rebalance_in_progress
    assert h.g.heartbeat(h.now, member_id=b, generation=1, instance_id=None) == ErrorCode.unknown_member_id
    ta = h.join(member_id=a)
    assert h.answers[ta].generation == 2 and h.answers[ta].leader == a


def test_leave_rebalances_and_last_leave_empties_group():
    h = Harness()
    a, b = stable_group(h, 2)
    codes, comps = h.g.leave(h.now, [(a, None)])
    assert codes == [ErrorCode.none] and h.g.state == PREPARING and h.g.leader == b
    tb = h.join(member_id=b)
    assert h.answers[tb].generation == 2 and h.answers[tb].leader == b
    h.sync(b, 2, {b: b"all"})
    h.g.leave(h.now, [(b, None)])
    assert h.g.state == EMPTY and h.g.generation == 3 and h.g.is_idle


def test_leader_not_syncing_is_removed_and_followers_told_to_rejoin():
    h = Harness()
    t1, t2 = h.new_member(client="a"), h.new_member(client="b")
    h.advance(0.2)
    leader, follower = h.answers[t1].member_id, h.answers[t2].member_id
    ts = h.sync(follower, 1)
    h.advance(1.5)  # the leader neither syncs nor heartbeats: its session (1 s) expires
    assert leader not in h.g.members
    assert h.answers[ts].error == ErrorCode.rebalance_in_progress
    tf = h.join(member_id=follower)
    assert h.answers[tf].leader == follower and h.answers[tf].generation == 2


def test_commit_rules():
    h = Harness()
    assert h.g.check_commit(0, member_id="", generation=-1, instance_id=None) == ErrorCode.none  # simple consumer
    a, b = stable_group(h, 2)
    assert h.g.check_commit(h.now, member_id="", generation=-1, instance_id=None) == ErrorCode.unknown_member_id
    assert h.g.check_commit(h.now, member_id=a, generation=1, instance_id=None) == ErrorCode.none
    assert h.g.check_commit(h.now, member_id=a, generation=7, instance_id=None) == ErrorCode.illegal_generation
    assert h.g.check_commit(h.now, member_id="x", generation=1, instance_id=None) == ErrorCode.unknown_member_id


def test_v3_join_gets_member_id_without_member_id_required():
    h = Harness()
    t = h.join(v4=False, client="old")
    assert t not in h.answers
    h.advance(0.2)
    assert h.answers[t].error == ErrorCode.none and h.answers[t].member_id == "old-1"


def test_pending_member_that_never_rejoins_expires_and_unblocks_rebalance():
    h = Harness()
    a, = stable_group(h, 1)
    h.join(client="ghost")  # MEMBER_ID_REQUIRED, never comes back
    assert h.g.pending
    ta = h.join(member_id=a, protocols=(("range", b"new"),))  # a rebalance: waits for the pending id too
    assert ta not in h.answers
    h.advance(1.1)  # the pending id's session timeout
    assert h.answers[ta].error == ErrorCode.none and h.answers[ta].generation == 2


def test_static_member_rejoin_fences_old_member_id():
    h = Harness()
    t = h.join(instance="inst-1", client="s")  # static: no MEMBER_ID_REQUIRED round
    h.advance(0.2)
    old = h.answers[t].member_id
    h.sync(old, 1, {old: b"x"})
    t2 = h.join(instance="inst-1", client="s")  # restarted with no member id: replaces the old one
    new = h.answers[t2].member_id
    assert new != old and h.answers[t2].error == ErrorCode.none
    assert h.g.heartbeat(h.now, member_id=old, generation=h.g.generation, instance_id="inst-1") == \
        ErrorCode.fenced_instance_id
    assert h.g.leave(h.now, [(old, "inst-1")])[0] == [ErrorCode.fenced_instance_id]
    assert h.g.leave(h.now, [("", "inst-1")])[0] == [ErrorCode.none] and not h.g.members


def test_deleted_group_is_dead():
    h = Harness()
    h.g.delete()
    assert h.g.state == DEAD
    assert h.answers[h.join()].error == ErrorCode.coordinator_not_available


@pytest.mark.parametrize("group", ["plain", "with/slash", "100%", "sp ace", ""])
def test_offset_keys_round_trip_any_group_name(group):
    key = offset_key(group, "orders.v1", 17)
    assert _parse_offset_key(key) == (group, "orders.v1", 17)
    assert key.count("/") == 5  # kafka/groups/<g>/offsets/<t>/<p>: the group cannot add a level


def test_stream_names_of_kafka_partitions():
    """A Kafka topic name reads back one way only: ``orders-3`` is the topic orders-3, never partition
    3 of ``orders``; partitions after the first are ``<topic>:<p>`` (':' is not legal in topic names)."""
    assert partition_stream("orders-3", 0) == "orders-3" and stream_partition("orders-3") == ("orders-3", 0)
    assert partition_stream("my-topic", 12) == "my-topic:12" and stream_partition("my-topic:12") == ("my-topic", 12)
    assert stream_partition("plainstream") == ("plainstream", 0)
