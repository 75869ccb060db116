"""Conformance with Apache Kafka's rules where other clients' own test suites found us differing.
Each test names the Kafka rule it checks (the code carries the rule and its source)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic
from kio.schema.errors import ErrorCode

from compat_kafka.admin import InvalidReplicaAssignment, check_new_partition_assignments
from compat_kafka.groups.coordinator import PREPARING, STABLE, SyncResult
from compat_kafka.transactions.coordinator import (
    COMPLETE_COMMIT,
    ONGOING,
    PREPARE_ABORT,
    PREPARE_COMMIT,
    TxnMeta,
    check_txn_offset_commit,
)
from tests.kafka.test_coordinator import Harness


# ---------------------------------------------------------------- 1. static members (KIP-345)
def static_group(h: Harness, v9: bool = False) -> dict[str, str]:
    """Two static members (instances i1, i2) through the first rebalance and the leader's sync:
    instance -> member id. Each member's assignment is its member id."""
    t1 = h.join(instance="i1", client="a")
    t2 = h.join(instance="i2", client="b")
    h.advance(0.2)
    j1, j2 = h.answers[t1], h.answers[t2]
    assert j1.error == j2.error == ErrorCode.none and j1.generation == j2.generation == 1
    ids = {"i1": j1.member_id, "i2": j2.member_id}
    leader = j1.leader
    for inst, mid in ids.items():
        h.sync(mid, 1, {m: m.encode() for m in ids.values()} if mid == leader else None, instance=inst)
    assert h.g.state == STABLE
    return ids


def join_v9(h: Harness, instance: str, client: str, protocols=None) -> str:
    token = f"join-v9-{instance}-{h.now}"
    h.collect(h.g.join(h.now, token, member_id="", instance_id=instance, protocol_type="consumer",
                       protocols=protocols or (("range", b"r-meta"), ("roundrobin", b"rr-meta")),
                       session_timeout_ms=1000, rebalance_timeout_ms=2000, require_known_member_id=True,
                       client_id=client, supports_skip_assignment=True))
    return token


def test_static_follower_rejoining_stable_group_gets_old_assignment_without_rebalance():
    h = Harness()
    ids = static_group(h)
    leader = h.g.leader
    follower_inst = next(i for i, m in ids.items() if m != leader)
    old = ids[follower_inst]
    t = h.join(instance=follower_inst, client="a" if follower_inst == "i1" else "b")
    r = h.answers[t]  # answered at once: no join barrier
    assert r.error == ErrorCode.none and r.member_id != old
    assert r.generation == 1 and r.leader == leader and r.members == () and not r.skip_assignment
    assert h.g.state == STABLE and h.g.generation == 1
    s = h.sync(r.member_id, 1, instance=follower_inst)
    assert h.answers[s] == SyncResult(ErrorCode.none, old.encode(), "consumer", "range")  # the old assignment
    # the other member is not asked to rejoin
    assert h.g.heartbeat(h.now, member_id=leader, generation=1, instance_id=None) == ErrorCode.none


def test_static_leader_rejoining_before_v9_is_told_the_old_leader_id():
    """Before JoinGroup v9 the answer names the leader as it was before the replacement, so the
    restarted leader takes itself for a follower and does not run the assignor."""
    h = Harness()
    ids = static_group(h)
    old_leader = h.g.leader
    inst = next(i for i, m in ids.items() if m == old_leader)
    t = h.join(instance=inst, client="a" if inst == "i1" else "b")
    r = h.answers[t]
    assert r.error == ErrorCode.none and r.generation == 1 and r.leader == old_leader != r.member_id
    assert r.members == () and h.g.state == STABLE and h.g.leader == r.member_id
    s = h.sync(r.member_id, 1, instance=inst)
    assert h.answers[s].assignment == old_leader.encode()


def test_static_leader_rejoining_v9_gets_members_and_skip_assignment():
    h = Harness()
    ids = static_group(h)
    old_leader = h.g.leader
    inst = next(i for i, m in ids.items() if m == old_leader)
    r = h.answers[join_v9(h, inst, "a" if inst == "i1" else "b")]
    assert r.error == ErrorCode.none and r.generation == 1 and r.leader == r.member_id and r.skip_assignment
    assert {m for m, _i, _md in r.members} == {r.member_id, *(m for m in ids.values() if m != old_leader)}
    assert h.g.state == STABLE
    s = h.sync(r.member_id, 1, instance=inst)  # SkipAssignment: no assignments sent
    assert h.answers[s].assignment == old_leader.encode()


def test_static_rejoin_changing_the_selected_protocol_rebalances():
    h = Harness()
    static_group(h)
    t = h.join(instance="i1", client="a", protocols=(("roundrobin", b"rr"),))  # range no longer common
    assert t not in h.answers and h.g.state == PREPARING and h.g.generation == 1


# ---------------------------------------------------------------- 2. rebalance timeouts (KAFKA-12890)
def test_initial_rebalance_waits_the_delay_even_with_rebalance_timeout_0():
    h = Harness()
    t1 = h.new_member(client="a", rebalance_ms=0)
    h.advance(0.05)  # within the 100 ms initial delay: a second member still makes the first generation
    t2 = h.new_member(client="b", rebalance_ms=0)
    assert t1 not in h.answers and t2 not in h.answers
    h.advance(0.1)
    assert h.answers[t1].generation == h.answers[t2].generation == 1


def test_follower_that_never_syncs_is_removed_at_the_rebalance_timeout_even_once_stable():
    h = Harness()
    ta, tb = h.new_member(client="a"), h.new_member(client="b")
    h.advance(0.2)
    ja, jb = h.answers[ta], h.answers[tb]
    leader = ja.leader
    follower = jb.member_id if ja.member_id == leader else ja.member_id
    h.sync(leader, 1, {leader: b"l", follower: b"f"})
    assert h.g.state == STABLE
    for _ in range(3):  # both heartbeat (session 1 s); the follower never syncs
        h.advance(0.5)
        assert h.g.state == STABLE
        for mid in (leader, follower):
            assert h.g.heartbeat(h.now, member_id=mid, generation=1, instance_id=None) == ErrorCode.none
    h.advance(0.6)  # past 2 s (the rebalance timeout) after the join barrier
    assert follower not in h.g.members and leader in h.g.members and h.g.state == PREPARING


def test_rebalance_timeout_0_is_taken_literally():
    """Kafka takes a v1+ rebalance timeout of 0 as sent: the pending-sync timer fires as soon as the
    join barrier completes, so the member is gone before its SyncGroup (Kafka does the same; only
    JoinGroup v0, which has no rebalance timeout, uses the session timeout)."""
    h = Harness()
    t = h.new_member(client="a", rebalance_ms=0)
    h.advance(0.1)  # the initial delay, then at once the pending-sync timeout
    j = h.answers[t]
    assert j.error == ErrorCode.none and j.generation == 1
    s = h.sync(j.member_id, 1, {j.member_id: b"x"})
    assert h.answers[s].error == ErrorCode.unknown_member_id
    t = h.join(v4=False, rebalance_ms=-1)  # v0: the session timeout (1 s) stands in
    h.advance(0.1)
    j = h.answers[t]
    s = h.sync(j.member_id, j.generation, {j.member_id: b"x"})
    assert h.answers[s] == SyncResult(ErrorCode.none, b"x", "consumer", "range")


# ---------------------------------------------------------------- 3. CreatePartitions assignments
@pytest.mark.parametrize(("added", "assignments", "message"), [
    (2, [[0]], "Attempted to add 2 additional partition(s), but only 1 assignment(s) were specified."),
    (1, [[]], "The manual partition assignment includes an empty replica list."),
    (1, [[7]], "The manual partition assignment includes broker 7, but no such broker is registered."),
    (1, [[0, 0]], "The manual partition assignment includes the broker 0 more than once."),
    (1, [[0, 1]], "The manual partition assignment includes a partition with 2 replica(s), but this is not "
                  "consistent with previous partitions, which have 1 replica(s)."),
])
def test_create_partitions_assignment_rules(added, assignments, message):
    with pytest.raises(InvalidReplicaAssignment) as ei:
        check_new_partition_assignments(added, assignments, {0, 1})
    assert str(ei.value) == message and ei.value.code == ErrorCode.invalid_replica_assignment


def test_create_partitions_valid_assignment_passes():
    check_new_partition_assignments(2, [[1], [0]], {0, 1})
    check_new_partition_assignments(2, None, {0})


@pytest.mark.process
def test_create_partitions_naming_an_unknown_broker_is_refused(shim, topic):
    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=20)
    broker = admin.describe_cluster().result(timeout=20).nodes[0].id
    fut = admin.create_partitions([NewPartitions(topic, 2, replica_assignment=[[broker + 1000]])])[topic]
    with pytest.raises(KafkaException) as ei:
        fut.result(timeout=20)
    assert ei.value.args[0].code() == KafkaError.INVALID_REPLICA_ASSIGNMENT
    assert f"broker {broker + 1000}, but no such broker is registered" in ei.value.args[0].str()
    assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 1  # nothing added
    admin.create_partitions([NewPartitions(topic, 2, replica_assignment=[[broker]])])[topic].result(timeout=20)
    assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 2


# ---------------------------------------------------------------- 4. DescribeConfigs of the broker
@pytest.mark.process
def test_broker_configs_name_the_listeners_and_the_replication_factor_metadata_shows(shim, topic):
    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2)])[topic].result(timeout=20)  # the default factor
    md = admin.list_topics(topic, timeout=10)
    broker = next(iter(md.brokers.values()))
    res = ConfigResource(ConfigResource.Type.BROKER, str(broker.id))
    configs = admin.describe_configs([res])[res].result(timeout=20)
    assert configs["advertised.listeners"].value == f"PLAINTEXT://{broker.host}:{broker.port}"
    assert configs["listeners"].value == f"PLAINTEXT://127.0.0.1:{shim.port}"
    replicas = {len(p.replicas) for p in md.topics[topic].partitions.values()}
    assert replicas == {int(configs["default.replication.factor"].value)} == {1}


# ---------------------------------------------------------------- 5. TxnOffsetCommit
def test_txn_offset_commit_rules():
    """Kafka 3.9's verification answers, in order (see ``check_txn_offset_commit``)."""
    meta = TxnMeta("tx", 5, 2, ONGOING, groups=frozenset({"g"}))
    assert check_txn_offset_commit(meta, "tx", "g", 5, 2) is meta
    for bad, producer, epoch, group, code in [
        (None, 5, 2, "g", ErrorCode.invalid_producer_id_mapping),  # an unknown transactional id
        (meta, 6, 2, "g", ErrorCode.invalid_producer_id_mapping),
        (meta, 5, 1, "g", ErrorCode.producer_fenced),
        (replace(meta, state=PREPARE_COMMIT), 5, 2, "g", ErrorCode.concurrent_transactions),
        (replace(meta, state=PREPARE_ABORT), 5, 2, "g", ErrorCode.concurrent_transactions),
        (meta, 5, 2, "other", ErrorCode.invalid_txn_state),  # no AddOffsetsToTxn for this group
        (replace(meta, state=COMPLETE_COMMIT), 5, 2, "g", ErrorCode.invalid_txn_state),
    ]:
        with pytest.raises(Exception) as ei:
            check_txn_offset_commit(bad, "tx", group, producer, epoch)
        assert ei.value.code == code, (bad, producer, epoch, group)


@pytest.mark.process
def test_txn_offset_commit_with_an_unknown_transactional_id_is_refused_as_kafka_3_9_does(shim, topic):
    from kio.schema.txn_offset_commit.v3.request import (
        TxnOffsetCommitRequest,
        TxnOffsetCommitRequestPartition,
        TxnOffsetCommitRequestTopic,
    )

    from tests.kafka.shimproc import RawConnection

    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=20)
    with RawConnection(shim.port) as conn:
        r = conn.call(TxnOffsetCommitRequest(
            transactional_id=f"never-initialised-{topic}", group_id=f"g-{topic}", producer_id=12345,
            producer_epoch=0, generation_id=-1, member_id="", group_instance_id=None,
            topics=(TxnOffsetCommitRequestTopic(name=topic, partitions=(TxnOffsetCommitRequestPartition(
                partition_index=0, committed_offset=1, committed_leader_epoch=-1, committed_metadata=""),)),)))
    assert r.topics[0].partitions[0].error_code == ErrorCode.invalid_producer_id_mapping


def test_a_restarted_static_member_of_a_classic_group_rejoins_without_a_rebalance(shim, topic):
    """KIP-345 with a real classic-protocol client (librdkafka): a static member that restarts gets
    its partitions back and the other member sees no rebalance at all (no revoke, no new assign)."""
    import time

    from confluent_kafka import Consumer

    admin = AdminClient({"bootstrap.servers": shim.bootstrap})  # kept alive: its futures die with it
    admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
    group = f"static-{topic}"
    events: dict[str, list] = {"a": [], "b": [], "b2": []}

    def member(name: str, instance: str) -> Consumer:
        c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": group, "group.instance.id": instance,
                      "session.timeout.ms": 45000, "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        c.subscribe([topic], on_assign=lambda _c, ps: events[name].append(("assign", sorted(p.partition for p in ps))),
                    on_revoke=lambda _c, ps: events[name].append(("revoke", sorted(p.partition for p in ps))))
        return c

    def poll_until(cs, cond, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, events
            for c in cs:
                c.poll(0.1)

    def assigned(name):
        got = [ps for kind, ps in events[name] if kind == "assign"]
        return got[-1] if got else None

    a, b = member("a", "ia"), member("b", "ib")
    b2 = None
    try:
        poll_until([a, b], lambda: assigned("a") and assigned("b")
                   and sorted(assigned("a") + assigned("b")) == [0, 1, 2, 3])
        before_a = list(events["a"])
        theirs = assigned("b")
        b.close()  # a static member leaves no LeaveGroup behind: the group waits for it
        b = None
        b2 = member("b2", "ib")
        poll_until([a, b2], lambda: assigned("b2") is not None)
        assert assigned("b2") == theirs
        for _ in range(20):  # a keeps polling a while: nothing may reach it
            a.poll(0.1)
        assert events["a"] == before_a, events
    finally:
        a.close()
        for c in (b, b2):
            if c is not None:
                c.close()
