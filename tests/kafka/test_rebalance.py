"""Partitions rebalance onto a `scroll kafka` listener that joins later (real processes on one cluster:
etcd + 3 bookies). The listeners already running hand over exactly the partitions rendezvous hashing
now prefers the new one for, a bounded number at a time; idempotent producers see no loss and no
duplicate across the move (a batch acknowledged by the old owner and retried at the new one is a
duplicate); `--no-rebalance` keeps ownership sticky."""

from __future__ import annotations

import re
import threading
import time

import pytest
from confluent_kafka import Producer  # noqa: E402
from kio.schema.errors import ErrorCode

from compat_kafka.cluster.ownership import partition_key, preferred
from streams.tools.localcluster import LocalCluster
from tests.kafka.shimproc import RawConnection, ShimProcess, record_batch
from tests.kafka.test_failover import consume, create_topic, metadata
from tests.kafka.test_idempotence import _init_pid, _produce

pytestmark = pytest.mark.process

DELAY = "0.5"  # --rebalance-delay: the live listeners must be stable this long before partitions move


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("kafka-rebalance"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture()
def listeners(cluster, tmp_path):
    """start(node_id, *args) -> a listening shim process; every one is stopped after the test."""
    procs: list[ShimProcess] = []

    def start(node_id: int, *args: str) -> ShimProcess:
        p = ShimProcess(cluster.metadata_url, tmp_path, "--rebalance-delay", DELAY, *args, node_id=node_id)
        procs.append(p)
        return p.start_and_wait()

    yield start
    for p in procs:
        p.stop()


def predicted(topic: str, partitions: int, live: list[int]) -> dict[int, int]:
    """partition -> its preferred node among ``live`` (rendezvous hashing, as the listeners place them)."""
    return {p: preferred(partition_key(topic, p), live) for p in range(partitions)}


def wait_for(cond, timeout_s: float, what: str, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)


def handed_over(shim: ShimProcess, topic: str) -> set[int]:
    return {int(p) for p in re.findall(rf"handed kafka/owners/{re.escape(topic)}/(\d+) over", shim.log_text())}


def claimed(shim: ShimProcess, topic: str) -> set[int]:
    return {int(p) for p in re.findall(rf"claimed kafka/owners/{re.escape(topic)}/(\d+)\b", shim.log_text())}


def produce_one_each(bootstrap: str, topic: str, partitions: int, tag: bytes) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 1})
    for part in range(partitions):
        p.produce(topic, value=tag + b"%d" % part, partition=part)
    assert p.flush(30) == 0


def test_idempotent_producer_sees_no_loss_or_duplicate_when_partitions_move(listeners):
    topic, parts, a_id, b_id = "moving", 12, 11, 12
    expect = predicted(topic, parts, [a_id, b_id])
    moving = {p for p, n in expect.items() if n == b_id}
    assert 0 < len(moving) < parts  # the topic name gives B a share (about half), not none or all
    a = listeners(a_id)
    create_topic(a.bootstrap, topic, parts)

    delivered: list[tuple[int, int, bytes]] = []
    errors: list = []
    stop = threading.Event()
    sent = [0]

    def on_delivery(err, msg):
        if err:
            errors.append(err)
        else:
            delivered.append((msg.partition(), msg.offset(), msg.value()))

    def run():  # a steady stream of small batches: requests are in flight when partitions move
        p = Producer({"bootstrap.servers": a.bootstrap, "enable.idempotence": True, "acks": "all",
                      "linger.ms": 5, "retry.backoff.ms": 50, "topic.metadata.refresh.interval.ms": 1000})
        i = 0
        while not stop.is_set():
            p.produce(topic, value=b"%d" % i, partition=i % parts, on_delivery=on_delivery)
            i += 1
            if i % 24 == 0:
                p.poll(0.01)
        sent[0] = i
        assert p.flush(60) == 0

    producer = threading.Thread(target=run, name="idempotent-producer")
    producer.start()
    try:
        wait_for(lambda: len(delivered) >= 600 and len({d[0] for d in delivered}) == parts, 30,
                 "A to acknowledge 600 records, on every partition")
        assert claimed(a, topic) == set(range(parts))  # A alone: it holds every partition
        b = listeners(b_id)
        # A hands B's share over; B claims each partition on the producer's next request for it
        wait_for(lambda: claimed(b, topic) == moving, 40, "B to claim its rendezvous share")
        assert metadata(a.bootstrap, topic)[1] == expect == metadata(b.bootstrap, topic)[1]
        moved_at = len(delivered)
        wait_for(lambda: len(delivered) >= moved_at + 600, 30, "records acknowledged after the move")
    finally:
        stop.set()
        producer.join(90)
    assert not producer.is_alive() and not errors, errors[:3]
    n = sent[0]
    assert len(delivered) == n

    # exactly the predicted partitions moved, each once, and nothing else
    assert handed_over(a, topic) == moving
    assert claimed(b, topic) == moving
    assert a.log_text().count(f"handing kafka/owners/{topic}/") == len(moving)

    got = consume(f"{a.bootstrap},{b.bootstrap}", topic, parts, n)
    for part in range(parts):
        values = [v for _, v in got[part]]
        assert [o for o, _ in got[part]] == list(range(len(values))), part  # dense offsets
        assert values == [b"%d" % i for i in range(part, n, parts)], part  # every record once, in order
    stored = {(part, o): v for part in range(parts) for o, v in got[part]}
    assert all(stored[(part, off)] == v for part, off, v in delivered)  # acks name the stored offsets


def test_batch_acknowledged_before_the_move_is_a_duplicate_after_it(listeners):
    topic, parts, a_id, b_id = "dup-move", 4, 21, 22
    expect = predicted(topic, parts, [a_id, b_id])
    p = next(part for part, n in expect.items() if n == b_id)
    a = listeners(a_id)
    create_topic(a.bootstrap, topic, parts)
    with RawConnection(a.port) as conn:
        err, pid, epoch = _init_pid(conn)
        assert err == ErrorCode.none
        first = record_batch([b"r0"], pid, epoch, 0)
        last = record_batch([b"r1", b"r2"], pid, epoch, 1)
        assert _produce(conn, topic, first, p) == (ErrorCode.none, 0)
        assert _produce(conn, topic, last, p) == (ErrorCode.none, 1)  # acknowledged just before the move
        b = listeners(b_id)
        wait_for(lambda: p in handed_over(a, topic), 30, "A to hand the partition over")
        assert metadata(a.bootstrap, topic)[1][p] == b_id
        err, _ = _produce(conn, topic, record_batch([b"late"], pid, epoch, 3), p)
        assert err == ErrorCode.not_leader_or_follower  # the old owner admits nothing more
    with RawConnection(b.port) as conn:
        # the client retries its last batch at the new owner: the original offset, not stored again
        assert _produce(conn, topic, last, p) == (ErrorCode.none, 1)
        assert _produce(conn, topic, first, p) == (ErrorCode.none, 0)
        assert _produce(conn, topic, record_batch([b"r3"], pid, epoch, 3), p) == (ErrorCode.none, 3)
        err, _ = _produce(conn, topic, record_batch([b"gap"], pid, epoch, 9), p)
        assert err == ErrorCode.out_of_order_sequence_number  # the sequence state moved with the partition
    got = consume(b.bootstrap, topic, parts, 4)
    assert [v for _, v in got[p]] == [b"r0", b"r1", b"r2", b"r3"]
    assert "open: LAC" in b.log_text() and handed_over(a, topic) == {p}  # A had claimed only that one


def test_hand_overs_are_bounded_by_the_batch(listeners):
    topic, parts, a_id, b_id = "bounded-move", 16, 31, 32
    expect = predicted(topic, parts, [a_id, b_id])
    moving = {p for p, n in expect.items() if n == b_id}
    assert len(moving) > 2
    a = listeners(a_id, "--rebalance-batch", "2")
    create_topic(a.bootstrap, topic, parts)
    produce_one_each(a.bootstrap, topic, parts, b"a")  # A claims and opens every partition writable
    b = listeners(b_id)
    wait_for(lambda: handed_over(a, topic) == moving, 40, "A to hand B's share over")
    assert metadata(b.bootstrap, topic)[1] == expect

    # replay A's log: never more than 2 partitions between "handing ... over" and "handed ... over"
    in_hand, most = set(), 0
    for line in a.log_text().splitlines():
        if m := re.search(r"handing (kafka/owners/\S+) over to node \d+ \((\d+) in hand-over\)", line):
            in_hand.add(m[1])
            most = max(most, len(in_hand))
            assert int(m[2]) <= 2, line
        elif m := re.search(r"handed (kafka/owners/\S+) over", line):
            in_hand.discard(m[1])
    assert most == 2 and not in_hand

    produce_one_each(f"{a.bootstrap},{b.bootstrap}", topic, parts, b"b")  # B serves its share now
    wait_for(lambda: claimed(b, topic) == moving, 20, "B to claim its share")
    got = consume(b.bootstrap, topic, parts, 2 * parts)
    assert all([v for _, v in got[p]] == [b"a%d" % p, b"b%d" % p] for p in range(parts)), got


def test_no_rebalance_keeps_ownership_sticky(listeners):
    topic, parts, a_id, b_id = "sticky", 8, 41, 42
    assert b_id in predicted(topic, parts, [a_id, b_id]).values()
    a = listeners(a_id, "--no-rebalance")
    create_topic(a.bootstrap, topic, parts)
    produce_one_each(a.bootstrap, topic, parts, b"a")
    b = listeners(b_id)
    # A's pass ran once the listeners settled, and kept what it holds
    wait_for(lambda: "rebalancing is off, they stay" in a.log_text(), 30, "A's rebalancing pass")
    assert metadata(a.bootstrap, topic)[1] == dict.fromkeys(range(parts), a_id)
    assert metadata(b.bootstrap, topic)[1] == dict.fromkeys(range(parts), a_id)
    produce_one_each(f"{a.bootstrap},{b.bootstrap}", topic, parts, b"b")
    assert handed_over(a, topic) == set() and claimed(b, topic) == set()
    assert metadata(b.bootstrap, topic)[1] == dict.fromkeys(range(parts), a_id)



def test_partition_with_an_open_transaction_moves_after_it_ends(listeners):
    from tests.kafka.test_transactions import read_all, txn_producer

    topic, parts, a_id, b_id = "txn-move", 4, 51, 52
    expect = predicted(topic, parts, [a_id, b_id])
    p = next(part for part, n in expect.items() if n == b_id)
    a = listeners(a_id)
    create_topic(a.bootstrap, topic, parts)
    producer = txn_producer(a.bootstrap, "txn-move-id")
    producer.begin_transaction()
    producer.produce(topic, b"in-txn", partition=p)
    assert producer.flush(30) == 0  # stored and acknowledged: the transaction is open on the partition
    b = listeners(b_id)
    wait_for(lambda: f"kafka/owners/{topic}/{p} has a transaction open" in a.log_text(), 30,
             "A to defer the partition's hand-over")
    assert metadata(b.bootstrap, topic)[1][p] == a_id and p not in handed_over(a, topic)
    producer.commit_transaction(30)  # the marker goes to A, which still owns the partition
    wait_for(lambda: p in handed_over(a, topic), 30, "the hand-over once the transaction ended")
    assert metadata(a.bootstrap, topic)[1][p] == b_id
    producer.begin_transaction()  # the next transaction writes to the new owner
    producer.produce(topic, b"after-move", partition=p)
    producer.commit_transaction(30)
    got = read_all(f"{a.bootstrap},{b.bootstrap}", topic, "read_committed", parts)
    assert [v for part, _, v in got if part == p] == [b"in-txn", b"after-move"]
    assert p in claimed(b, topic)
