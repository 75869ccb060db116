"""Consumer groups with real clients over real TCP against the shim over a real cluster: kcat's
balanced consumer, confluent-kafka group members (assignment, rebalance on leave and on a member's
death, commit and resume, commit metadata), and offsets surviving a shim restart."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402
from kio.schema.errors import ErrorCode  # noqa: E402
from kio.schema.find_coordinator.v4 import FindCoordinatorRequest  # noqa: E402
from kio.schema.heartbeat.v4 import HeartbeatRequest  # noqa: E402
from kio.schema.join_group.v9 import JoinGroupRequest  # noqa: E402
from kio.schema.join_group.v9.request import JoinGroupRequestProtocol  # noqa: E402
from kio.schema.offset_commit.v9 import OffsetCommitRequest  # noqa: E402
from kio.schema.offset_commit.v9.request import OffsetCommitRequestPartition, OffsetCommitRequestTopic  # noqa: E402

from compat_kafka.wire import codec  # noqa: E402
from streams.tools.localcluster import free_port  # noqa: E402

from .conftest import ShimThread  # noqa: E402
from .test_bad_input import recv_frame  # noqa: E402

pytestmark = pytest.mark.process

# Fast group timings for tests (librdkafka defaults: session 45 s, heartbeat every 3 s).
FAST = {"session.timeout.ms": 3000, "heartbeat.interval.ms": 200, "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "fetch.wait.max.ms": 100, "topic.metadata.refresh.interval.ms": 1000}


def kcat(bootstrap, *args, input: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["kcat", "-b", bootstrap, *args], input=input, capture_output=True, text=True,
                          timeout=timeout, check=True)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=20)


def produce(bootstrap: str, topic: str, n: int, partitions: int, prefix: str = "m", partition: int | None = None) -> None:
    """``n`` records round-robin over ``partitions`` (or all to ``partition``)."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    for i in range(n):
        p.produce(topic, value=f"{prefix}{i}".encode(), partition=i % partitions if partition is None else partition)
    assert p.flush(30) == 0


def consumer(bootstrap: str, group: str, **extra) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": group, **FAST, **extra})


def poll_until(consumers: list[Consumer], done, timeout: float = 30, sink: list | None = None) -> None:
    """Poll every consumer in turn (each poll serves its rebalance callbacks) until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for c in consumers:
            m = c.poll(0.05)
            if m is not None and m.error() is None and sink is not None:
                sink.append((c, m))


def coordinator(admin: AdminClient, group: str) -> int:
    return admin.describe_consumer_groups([group])[group].result(timeout=10).coordinator.id


def assignment(c: Consumer) -> set[int]:
    return {tp.partition for tp in c.assignment()}


def test_kcat_balanced_group_consumer_reads_everything(shim, topic):
    create_topic(shim.bootstrap, topic, 3)
    lines = [f"line{i}" for i in range(60)]
    keyed = "".join(f"k{i}:{v}\n" for i, v in enumerate(lines))  # keys spread records over the partitions
    kcat(shim.bootstrap, "-P", "-t", topic, "-K:", input=keyed)
    assert f'topic "{topic}" with 3 partitions' in kcat(shim.bootstrap, "-L", "-t", topic).stdout
    out = kcat(shim.bootstrap, "-G", f"g-{topic}", "-X", "auto.offset.reset=earliest", "-e", "-f", "%p %s\n", topic, timeout=40).stdout
    got = [line.split(" ", 1) for line in out.splitlines() if line.strip()]
    assert sorted(v for _, v in got) == sorted(lines)
    assert len({p for p, _ in got}) > 1  # read from several partitions


def test_three_members_share_six_partitions_and_rebalance_when_one_leaves(shim, topic):
    create_topic(shim.bootstrap, topic, 6)
    group = f"g-{topic}"
    cs = [consumer(shim.bootstrap, group, **{"client.id": f"member{i}"}) for i in range(3)]
    try:
        for c in cs:
            c.subscribe([topic])
        poll_until(cs, lambda: sum(len(assignment(c)) for c in cs) == 6 and all(assignment(c) for c in cs))
        sets = [assignment(c) for c in cs]
        assert set().union(*sets) == set(range(6))
        assert sum(len(s) for s in sets) == 6  # each partition to exactly one member
        assert sorted(len(s) for s in sets) == [2, 2, 2]

        gone = sets[0]
        cs[0].close()  # LeaveGroup: the others rebalance and take its partitions over
        rest = cs[1:]
        poll_until(rest, lambda: set().union(*(assignment(c) for c in rest)) == set(range(6)))
        a, b = (assignment(c) for c in rest)
        assert not a & b and gone <= a | b
        produce(shim.bootstrap, topic, 60, 6)
        got: list = []
        poll_until(rest, lambda: len(got) >= 60, sink=got)
        assert sorted(m.value() for _, m in got) == sorted(f"m{i}".encode() for i in range(60))
        for c, m in got:  # each record came to the member owning its partition
            assert m.partition() in assignment(c)
    finally:
        for c in cs[1:]:
            c.close()


def test_commit_and_resume_sees_every_record_once_and_metadata_round_trips(shim, topic):
    create_topic(shim.bootstrap, topic, 3)
    produce(shim.bootstrap, topic, 300, 3)
    group = f"g-{topic}"
    first = consumer(shim.bootstrap, group)
    seen: list[tuple[int, int, bytes]] = []
    try:
        first.subscribe([topic])
        got: list = []

        def forty_each() -> bool:
            return all(sum(1 for _, m in got if m.partition() == p) >= 40 for p in range(3))

        poll_until([first], forty_each, sink=got)
        # "process" exactly the first 40 records of each partition, commit those positions
        by_part: dict[int, list] = {}
        for _, m in got:
            by_part.setdefault(m.partition(), []).append(m)
        offsets = []
        for p, ms in sorted(by_part.items()):
            kept = ms[:40]
            seen += [(p, m.offset(), m.value()) for m in kept]
            offsets.append(TopicPartition(topic, p, kept[-1].offset() + 1, metadata=f"upto-{p}"))
        first.commit(offsets=offsets, asynchronous=False)
        committed = first.committed([TopicPartition(topic, p) for p in range(3)], timeout=10)
        assert [(tp.partition, tp.offset, tp.metadata) for tp in committed] == \
            [(p, 40, f"upto-{p}") for p in range(3)]
    finally:
        first.close()

    second = consumer(shim.bootstrap, group)
    try:
        second.subscribe([topic])
        got = []
        poll_until([second], lambda: len(got) >= 180, sink=got)
        time.sleep(0.3)
        got += [(second, m) for m in second.consume(100, timeout=0.3) if m.error() is None]
        seen += [(m.partition(), m.offset(), m.value()) for _, m in got]
    finally:
        second.close()
    assert len(seen) == 300 and len(set(seen)) == 300  # nothing twice
    assert sorted(v for _, _, v in seen) == sorted(f"m{i}".encode() for i in range(300))  # nothing skipped
    assert {(p, o) for p, o, _ in seen} == {(p, o) for p in range(3) for o in range(100)}


_DOOMED = textwrap.dedent("""
    import sys, time
    from confluent_kafka import Consumer
    c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": sys.argv[2], "session.timeout.ms": 2000,
                  "heartbeat.interval.ms": 200, "auto.offset.reset": "earliest"})
    c.subscribe([sys.argv[3]])
    while True:
        c.poll(0.1)
        if c.assignment():
            print("assigned", ",".join(str(tp.partition) for tp in c.assignment()), flush=True)
            break
    while True:
        c.poll(0.1)
""")


def test_member_that_stops_heartbeating_is_removed_and_its_partitions_reassigned(shim, topic):
    create_topic(shim.bootstrap, topic, 4)
    group = f"g-{topic}"
    survivor = consumer(shim.bootstrap, group, **{"session.timeout.ms": 2000})
    survivor.subscribe([topic])
    poll_until([survivor], lambda: len(assignment(survivor)) == 4)
    doomed = subprocess.Popen([sys.executable, "-c", _DOOMED, shim.bootstrap, group, topic], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        # the newcomer makes the group rebalance: each member gets two partitions
        poll_until([survivor], lambda: len(assignment(survivor)) == 2)
        line = doomed.stdout.readline()
        theirs = {int(p) for p in line.split()[1].split(",")}
        assert theirs == set(range(4)) - assignment(survivor)
        doomed.send_signal(signal.SIGKILL)  # no LeaveGroup, no more heartbeats
        doomed.wait(10)
        killed_at = time.monotonic()
        poll_until([survivor], lambda: len(assignment(survivor)) == 4, timeout=20)
        assert time.monotonic() - killed_at >= 1.0  # it took the session timeout (2 s, less the last beat)
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait()
        survivor.close()


def test_committed_offsets_survive_a_shim_restart(kafka_cluster, shim, topic):
    """Commit through one shim process, stop it, start a new one on the same cluster: the group's
    new coordinator (a different process) serves the committed offsets and the consumer resumes."""
    a = ShimThread(kafka_cluster.metadata_url, free_port(), node_id=None)
    a.start()
    try:
        create_topic(a.bootstrap, topic, 2)
        produce(a.bootstrap, topic, 40, 2)
        admin = AdminClient({"bootstrap.servers": a.bootstrap})
        deadline = time.monotonic() + 15
        while True:  # as a client would, refresh until shim A is listed (its registration is live)
            brokers = admin.list_topics(timeout=10).brokers
            node_a = next((b.id for b in brokers.values() if b.port == a.port), None)
            if node_a is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert node_a is not None, f"shim A (port {a.port}) is not listed: {brokers}"
        # a group that shim A coordinates (with several shims live, groups are spread over them)
        group = next(g for g in (f"g{i}-{topic}" for i in range(64)) if coordinator(admin, g) == node_a)
        c = consumer(a.bootstrap, group)
        c.assign([TopicPartition(topic, 0, 0), TopicPartition(topic, 1, 0)])
        got: list = []
        poll_until([c], lambda: len(got) >= 40, sink=got)
        c.commit(offsets=[TopicPartition(topic, 0, 15, metadata="zero"), TopicPartition(topic, 1, 5)],
                 asynchronous=False)
        c.close()
    finally:
        a.stop()
    b = ShimThread(kafka_cluster.metadata_url, free_port(), node_id=None)
    b.start()
    try:
        assert coordinator(AdminClient({"bootstrap.servers": b.bootstrap}), group) != node_a
        c = consumer(b.bootstrap, group)
        deadline = time.monotonic() + 30
        while True:  # NOT_COORDINATOR is retriable (Kafka): the listeners' views of who coordinates
            try:     # the group converge after A left and B joined; librdkafka's committed() surfaces it
                committed = c.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=15)
                break
            except KafkaException as exc:
                if exc.args[0].code() not in (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS) \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert [(tp.offset, tp.metadata) for tp in committed] == [(15, "zero"), (5, None)]
        c.subscribe([topic])
        got = []
        poll_until([c], lambda: len(got) >= 5 + 15, sink=got)
        got += [(c, m) for m in c.consume(100, timeout=0.3) if m.error() is None]  # nothing more comes
        c.close()
        assert sorted((m.partition(), m.offset()) for _, m in got) == \
            [(0, o) for o in range(15, 20)] + [(1, o) for o in range(5, 20)]
    finally:
        b.stop()


def test_only_the_coordinator_serves_a_group_and_find_coordinator_batches(kafka_cluster, shim):
    """Raw requests: FindCoordinator v4 (batched keys) names one shim per group; group requests sent
    to another shim get NOT_COORDINATOR; the coordinator answers JoinGroup v9 with MEMBER_ID_REQUIRED."""
    def call(port: int, body, key: int):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.settimeout(10)
            s.sendall(codec.encode_request(body, 5))
            return codec.decode_response(recv_frame(s), key, body.__version__)[1]

    other = ShimThread(kafka_cluster.metadata_url, free_port(), node_id=None)
    other.start()
    try:
        # exactly these two listeners live (a listener an earlier test stopped may still hold its lease),
        # and both see it: each names the same coordinators (a listener deciding from a listing made
        # before the other joined would claim groups the other is now preferred for, which is allowed)
        groups = tuple(f"nc-{i}" for i in range(12))
        deadline = time.monotonic() + 30
        while True:
            views = [AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=10)
                     for port in (shim.port, other.port)]
            answers = [call(port, FindCoordinatorRequest(key_type=0, coordinator_keys=groups), 10).coordinators
                       for port in (shim.port, other.port)]
            if (all({b.port for b in v.brokers.values()} == {shim.port, other.port} for v in views)
                    and [c.port for c in answers[0]] == [c.port for c in answers[1]]):
                break
            assert time.monotonic() < deadline, "the listeners' registrations did not settle"
            time.sleep(0.1)
        found = answers[1]
        assert [c.key for c in found] == list(groups) and {c.error_code for c in found} == {ErrorCode.none}
        assert {c.port for c in found} <= {shim.port, other.port}
        assert len({c.port for c in found}) == 2  # groups are spread over both shims
        for c in found:
            wrong = other.port if c.port == shim.port else shim.port
            hb = call(wrong, HeartbeatRequest(group_id=c.key, generation_id=1, member_id="m"), 12)
            assert hb.error_code == ErrorCode.not_coordinator
            part = OffsetCommitRequestPartition(partition_index=0, committed_offset=1, committed_metadata=None)
            commit = call(wrong, OffsetCommitRequest(group_id=c.key, generation_id_or_member_epoch=-1, member_id="",
                                                     topics=(OffsetCommitRequestTopic(name="x", partitions=(part,)),)), 8)
            assert commit.topics[0].partitions[0].error_code == ErrorCode.not_coordinator
        c = found[0]
        ten_s = datetime.timedelta(seconds=10)
        join = call(c.port, JoinGroupRequest(
            group_id=c.key, session_timeout=ten_s, rebalance_timeout=ten_s, member_id="", protocol_type="consumer",
            protocols=(JoinGroupRequestProtocol(name="range", metadata=b""),)), 11)
        assert join.error_code == ErrorCode.member_id_required and join.member_id.startswith("scroll-")
    finally:
        other.stop()
