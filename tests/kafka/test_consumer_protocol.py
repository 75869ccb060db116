"""The KIP-848 consumer group protocol with confluent-kafka's ``group.protocol=consumer`` over real
TCP against the shim: server-side assignment, partitions moving when members join, leave or crash
without two members consuming a partition at once, describe/list through the AdminClient, the
``range`` assignor, regex subscriptions, and (raw requests) the member-epoch rules of OffsetCommit
and OffsetFetch and the separation of classic and consumer groups."""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from confluent_kafka import Consumer, ConsumerGroupType, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from kio.schema.consumer_group_heartbeat.v1 import ConsumerGroupHeartbeatRequest
from kio.schema.describe_groups.v5 import DescribeGroupsRequest
from kio.schema.errors import ErrorCode
from kio.schema.join_group.v9 import JoinGroupRequest
from kio.schema.join_group.v9.request import JoinGroupRequestProtocol
from kio.schema.offset_commit.v8 import OffsetCommitRequest as OffsetCommitRequestV8
from kio.schema.offset_commit.v8.request import OffsetCommitRequestPartition as PartV8
from kio.schema.offset_commit.v8.request import OffsetCommitRequestTopic as TopicV8
from kio.schema.offset_commit.v9 import OffsetCommitRequest
from kio.schema.offset_commit.v9.request import OffsetCommitRequestPartition, OffsetCommitRequestTopic
from kio.schema.offset_fetch.v9 import OffsetFetchRequest
from kio.schema.offset_fetch.v9.request import OffsetFetchRequestGroup

from compat_kafka.wire import codec

from .test_bad_input import recv_frame
from .test_groups import assignment, consumer, create_topic, poll_until, produce

pytestmark = pytest.mark.process

NEW = {"group.protocol": "consumer", "enable.auto.commit": False, "auto.offset.reset": "earliest",
       "fetch.wait.max.ms": 100, "topic.metadata.refresh.interval.ms": 1000}


def new_consumer(bootstrap: str, group: str, **extra) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": group, **NEW, **extra})


def call(port: int, body):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        s.sendall(codec.encode_request(body, 7))
        return codec.decode_response(recv_frame(s), body.__api_key__, body.__version__)[1]


def heartbeat(port: int, group: str, member_id: str, epoch: int, topics: tuple[str, ...] | None = None, owned=()):
    return call(port, ConsumerGroupHeartbeatRequest(
        group_id=group, member_id=member_id, member_epoch=epoch, rebalance_timeout=datetime.timedelta(seconds=10),
        subscribed_topic_names=topics, topic_partitions=owned))


def consume_committing(consumers: list[Consumer], done, got: list, timeout: float = 40) -> None:
    """Poll every consumer; each record is committed (synchronously) before the next poll, so a
    record seen twice would be committed work consumed twice. A commit refused with
    STALE_MEMBER_EPOCH (the member's epoch moved on in a rebalance, KIP-848) did not happen: that
    record is not counted, and its partition's next owner reads it again from the committed offset."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, (
            f"timed out with {len(got)} records ({len({(p, o) for _, p, o in got})} distinct); assignments "
            f"{[sorted(assignment(c)) for c in consumers]}; last offsets "
            f"{ {p: max(o for _, q, o in got if q == p) for p in {p for _, p, _ in got}} }; missing "
            f"{sorted({(p, o) for p in range(4) for o in range(50)} - {(p, o) for _, p, o in got})}; "
            f"sequence {[(consumers.index(c), p, o) for c, p, o in got]}")
        for c in consumers:
            m = c.poll(0.05)
            if m is None or m.error() is not None:
                continue
            try:
                c.commit(message=m, asynchronous=False)
            except KafkaException as exc:  # the member's epoch moved on (a rebalance): not committed,
                if exc.args[0].code() != KafkaError.STALE_MEMBER_EPOCH:  # so the record is read again
                    raise
                with contextlib.suppress(KafkaException):  # by this member if it kept the partition
                    c.seek(TopicPartition(m.topic(), m.partition(), m.offset()))
                continue
            got.append((c, m.partition(), m.offset()))


def test_members_share_partitions_and_a_joiner_gets_some_without_double_consumption(shim, topic):
    create_topic(shim.bootstrap, topic, 4)
    produce(shim.bootstrap, topic, 200, 4)
    group = f"g-{topic}"
    cs = [new_consumer(shim.bootstrap, group, **{"client.id": f"m{i}"}) for i in range(2)]
    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    try:
        for c in cs:
            c.subscribe([topic])
        got: list = []
        consume_committing(cs, lambda: [len(assignment(c)) for c in cs] == [2, 2], got)
        assert assignment(cs[0]) | assignment(cs[1]) == set(range(4))
        consume_committing(cs, lambda: len(got) >= 60, got)
        cs.append(new_consumer(shim.bootstrap, group, **{"client.id": "m2"}))
        cs[2].subscribe([topic])
        consume_committing(cs, lambda: len(got) >= 200 and all(assignment(c) for c in cs), got)
        seen = [(p, o) for _, p, o in got]
        assert len(seen) == len(set(seen)) == 200  # every record once: nothing committed was read again
        assert sorted(len(assignment(c)) for c in cs) == [1, 1, 2]
        # the describe of the group: its members, their assignments (equal to their targets)
        d = admin.describe_consumer_groups([group])[group].result(timeout=20)
        assert d.type == ConsumerGroupType.CONSUMER and d.state.name == "STABLE"
        assert d.partition_assignor == "uniform" and not d.is_simple_consumer_group
        described = {m.client_id: {tp.partition for tp in m.assignment.topic_partitions} for m in d.members}
        assert described == {f"m{i}": assignment(c) for i, c in enumerate(cs)}
        for m in d.members:
            assert {tp.partition for tp in m.target_assignment.topic_partitions} == described[m.client_id]
        listed = admin.list_consumer_groups(types={ConsumerGroupType.CONSUMER}).result(timeout=20).valid
        assert group in {g.group_id for g in listed}
        classic = admin.list_consumer_groups(types={ConsumerGroupType.CLASSIC}).result(timeout=20).valid
        assert group not in {g.group_id for g in classic}
    finally:
        for c in cs:
            c.close()
    d = admin.describe_consumer_groups([group])[group].result(timeout=20)
    assert d.state.name == "EMPTY" and not d.members


_DOOMED = textwrap.dedent("""
    import sys
    from confluent_kafka import Consumer
    bootstrap, group, topic = sys.argv[1:4]
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "group.protocol": "consumer",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    while True:
        c.poll(0.05)
        if c.assignment():
            print("assigned", ",".join(str(tp.partition) for tp in c.assignment()), flush=True)
            break
    while True:
        c.poll(0.2)
""")


def test_partitions_move_when_a_member_leaves_and_when_one_crashes(shim, topic):
    create_topic(shim.bootstrap, topic, 4)
    group = f"g-{topic}"
    a, b = new_consumer(shim.bootstrap, group), new_consumer(shim.bootstrap, group)
    doomed = None
    try:
        a.subscribe([topic])
        b.subscribe([topic])
        poll_until([a, b], lambda: len(assignment(a)) == 2 and len(assignment(b)) == 2)
        b.close()  # leaves (member epoch -1): its partitions move at once
        poll_until([a], lambda: len(assignment(a)) == 4, timeout=10)
        doomed = subprocess.Popen([sys.executable, "-c", _DOOMED, shim.bootstrap, group, topic],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        poll_until([a], lambda: len(assignment(a)) == 2, timeout=20)
        ready, _, _ = select.select([doomed.stdout], [], [], 30)  # a blocking readline could hang the run
        assert ready, f"the second member was not assigned within 30 s (alive: {doomed.poll() is None})"
        line = doomed.stdout.readline()
        assert line.startswith("assigned "), f"the second member said {line!r} (exit code {doomed.poll()})"
        theirs = {int(p) for p in line.split()[1].split(",")}
        assert theirs == set(range(4)) - assignment(a)
        doomed.send_signal(signal.SIGKILL)  # no leave: the session timeout (3 s here) removes it
        doomed.wait(10)
        killed_at = time.monotonic()
        poll_until([a], lambda: len(assignment(a)) == 4, timeout=20)
        assert time.monotonic() - killed_at >= 1.5
    finally:
        if doomed is not None and doomed.poll() is None:
            doomed.kill()
            doomed.wait()
        a.close()


def test_range_assignor_co_partitions_and_regex_subscriptions_pick_up_new_topics(shim, topic):
    t1, t2 = f"{topic}-a", f"{topic}-b"
    create_topic(shim.bootstrap, t1, 4)
    create_topic(shim.bootstrap, t2, 4)
    group = f"g-{topic}"
    cs = [new_consumer(shim.bootstrap, group, **{"group.remote.assignor": "range"}) for _ in range(2)]
    try:
        for c in cs:
            c.subscribe([t1, t2])
        poll_until(cs, lambda: all(len(c.assignment()) == 4 for c in cs))
        for c in cs:  # the same partition numbers of both topics, a contiguous range
            parts = {(tp.topic, tp.partition) for tp in c.assignment()}
            nums = {p for _, p in parts}
            assert parts == {(t, p) for t in (t1, t2) for p in nums}
            assert nums in ({0, 1}, {2, 3})
        admin = AdminClient({"bootstrap.servers": shim.bootstrap})
        assert admin.describe_consumer_groups([group])[group].result(20).partition_assignor == "range"
    finally:
        for c in cs:
            c.close()
    rx_group = f"rx-{topic}"
    c = new_consumer(shim.bootstrap, rx_group)
    try:
        c.subscribe([f"^{topic}-.*"])
        poll_until([c], lambda: {tp.topic for tp in c.assignment()} == {t1, t2})
        t3 = f"{topic}-c"
        create_topic(shim.bootstrap, t3, 2)  # a new matching topic joins the subscription
        poll_until([c], lambda: {tp.topic for tp in c.assignment()} == {t1, t2, t3}, timeout=20)
    finally:
        c.close()


def test_member_epochs_guard_commits_and_fetches_and_group_kinds_do_not_mix(shim, topic):
    create_topic(shim.bootstrap, topic, 2)
    group = f"g-{topic}"
    port = shim.port
    me = str(uuid.uuid4())
    join = heartbeat(port, group, me, 0, (topic,))
    assert join.error_code == ErrorCode.none and join.member_epoch >= 1
    assert sum(len(t.partitions) for t in join.assignment.topic_partitions) == 2
    epoch = join.member_epoch

    def commit(epoch: int, member: str = me):
        part = OffsetCommitRequestPartition(partition_index=0, committed_offset=3, committed_metadata=None)
        r = call(port, OffsetCommitRequest(group_id=group, generation_id_or_member_epoch=epoch, member_id=member,
                                           topics=(OffsetCommitRequestTopic(name=topic, partitions=(part,)),)))
        return r.topics[0].partitions[0].error_code

    assert commit(epoch) == ErrorCode.none
    assert commit(epoch - 1) == ErrorCode.stale_member_epoch
    assert commit(epoch, "someone-else") == ErrorCode.unknown_member_id
    v8 = call(port, OffsetCommitRequestV8(group_id=group, generation_id_or_member_epoch=epoch, member_id=me, topics=(
        TopicV8(name=topic, partitions=(PartV8(partition_index=0, committed_offset=3, committed_metadata=None),)),)))
    assert v8.topics[0].partitions[0].error_code == ErrorCode.unsupported_version

    def fetch(member: str | None, epoch: int):
        return call(port, OffsetFetchRequest(groups=(OffsetFetchRequestGroup(
            group_id=group, member_id=member, member_epoch=epoch, topics=None),), require_stable=False)).groups[0]

    assert fetch(me, epoch).error_code == ErrorCode.none
    assert fetch(me, epoch + 1).error_code == ErrorCode.stale_member_epoch
    admin_view = fetch(None, -1)  # an admin reads without a member id
    assert admin_view.error_code == ErrorCode.none and admin_view.topics[0].partitions[0].committed_offset == 3

    # DescribeGroups (the classic describe, v0-5) does not see a consumer group: Dead, no error, as Kafka
    dg = call(port, DescribeGroupsRequest(groups=(group,), include_authorized_operations=False)).groups[0]
    assert (dg.error_code, dg.group_state, dg.protocol_type, dg.members) == (ErrorCode.none, "Dead", "", ())
    # a classic member cannot join this consumer group
    ten_s = datetime.timedelta(seconds=10)
    j = call(port, JoinGroupRequest(group_id=group, session_timeout=ten_s, rebalance_timeout=ten_s, member_id="",
                                    protocol_type="consumer", protocols=(JoinGroupRequestProtocol(name="range", metadata=b""),)))
    assert j.error_code == ErrorCode.inconsistent_group_protocol
    # a wrong epoch is fenced; leaving (-1) ends the membership and a classic group may take the id
    assert heartbeat(port, group, me, epoch + 5).error_code == ErrorCode.fenced_member_epoch
    assert heartbeat(port, group, "nobody", 1).error_code == ErrorCode.unknown_member_id
    assert heartbeat(port, group, me, -1).error_code == ErrorCode.none
    assert commit(epoch) in (ErrorCode.unknown_member_id, ErrorCode.illegal_generation)  # no such member now

    # a classic group with a live member: a consumer-protocol heartbeat gets GROUP_ID_NOT_FOUND
    classic = f"c-{topic}"
    old = consumer(shim.bootstrap, classic)
    try:
        old.subscribe([topic])
        poll_until([old], lambda: len(assignment(old)) == 2)
        r = heartbeat(port, classic, str(uuid.uuid4()), 0, (topic,))
        assert r.error_code == ErrorCode.group_id_not_found and "not a consumer group" in r.error_message
    finally:
        old.close()


def test_members_rejoin_and_keep_consuming_when_their_coordinator_moves(kafka_cluster, shim, tmp_path, topic):
    """Membership is in the coordinator's memory: when the listener coordinating the group stops,
    the other takes the group over; members get NOT_COORDINATOR / UNKNOWN_MEMBER_ID, rejoin with
    epoch 0 and consumption goes on from the committed offsets (records whose commit failed in the
    move may be read again; none is lost)."""
    from .shimproc import ShimProcess
    from .test_groups import coordinator

    proc = ShimProcess(kafka_cluster.metadata_url, tmp_path).start_and_wait()
    cs: list[Consumer] = []
    try:
        create_topic(shim.bootstrap, topic, 2)
        produce(shim.bootstrap, topic, 20, 2)
        admin = AdminClient({"bootstrap.servers": proc.bootstrap})
        node = proc.node_id()
        deadline = time.monotonic() + 15
        while not any(b.port == proc.port for b in admin.list_topics(timeout=10).brokers.values()):
            assert time.monotonic() < deadline, "the new listener is not listed"
        group = next(g for g in (f"mv{i}-{topic}" for i in range(64)) if coordinator(admin, g) == node)
        boot = f"{proc.bootstrap},{shim.bootstrap}"
        cs = [new_consumer(boot, group), new_consumer(boot, group)]
        for c in cs:
            c.subscribe([topic])
        seen: list[tuple[int, int]] = []
        uncommitted: set[tuple[int, int]] = set()

        def consume(done, timeout=40):
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline, f"timed out with {len(set(seen))} records"
                for c in cs:
                    m = c.poll(0.05)
                    if m is None or m.error() is not None:
                        continue
                    seen.append((m.partition(), m.offset()))
                    try:
                        c.commit(message=m, asynchronous=False)
                    except KafkaException:
                        uncommitted.add((m.partition(), m.offset()))

        consume(lambda: len(set(seen)) >= 20 and all(assignment(c) for c in cs))
        proc.stop()  # SIGTERM: it deregisters; the session listener coordinates the group from now on
        produce(shim.bootstrap, topic, 20, 2, prefix="n")
        consume(lambda: len(set(seen)) >= 40 and all(assignment(c) for c in cs))
        assert coordinator(AdminClient({"bootstrap.servers": shim.bootstrap}), group) != node
        assert set(seen) == {(p, o) for p in (0, 1) for o in range(20)}
        twice = {r for r in seen if seen.count(r) > 1}
        assert twice <= uncommitted, (twice, uncommitted)  # only records whose commit failed come again
    finally:
        for c in cs:
            c.close()
        proc.stop()


def test_a_static_member_that_restarts_gets_its_partitions_back_and_the_others_keep_theirs(shim, topic):
    create_topic(shim.bootstrap, topic, 4)
    group = f"g-{topic}"

    def member(instance: str) -> Consumer:
        c = new_consumer(shim.bootstrap, group, **{"group.instance.id": instance})
        c.subscribe([topic])
        return c

    a, b = member("a"), member("b")
    b2 = None
    try:
        poll_until([a, b], lambda: len(assignment(a)) == 2 and len(assignment(b)) == 2)
        mine, theirs = assignment(a), assignment(b)
        b.close()  # a static member's close leaves with epoch -2: its partitions wait for it
        admin = AdminClient({"bootstrap.servers": shim.bootstrap})  # (kept: its futures die with it)
        assert len(admin.describe_consumer_groups([group])[group].result(timeout=20).members) == 2
        b2 = member("b")
        poll_until([a, b2], lambda: assignment(b2) == theirs)
        assert assignment(a) == mine
        # a second live member with the same instance id is refused
        r = heartbeat(shim.port, group, str(uuid.uuid4()), 0, (topic,))
        assert r.error_code == ErrorCode.none  # (no instance id: an ordinary member)
        dup = call(shim.port, ConsumerGroupHeartbeatRequest(
            group_id=group, member_id=str(uuid.uuid4()), member_epoch=0, instance_id="b",
            rebalance_timeout=datetime.timedelta(seconds=10), subscribed_topic_names=(topic,), topic_partitions=()))
        assert dup.error_code == ErrorCode.unreleased_instance_id
        assert heartbeat(shim.port, group, r.member_id, -1).error_code == ErrorCode.none
    finally:
        a.close()
        if b2 is not None:
            b2.close()
