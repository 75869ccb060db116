"""Idempotent producers against `scroll kafka` processes over a real cluster (etcd + 3 bookies):
confluent-kafka with enable.idempotence through real retries (the shim drops the connection instead
of answering some produce requests it has stored), the sequence rules over raw requests, and dedup
state that survives a take-over by another shim process."""

from __future__ import annotations

import datetime
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402
from kio.schema.errors import ErrorCode
from kio.schema.init_producer_id.v4 import InitProducerIdRequest
from kio.schema.list_offsets.v7 import ListOffsetsRequest
from kio.schema.list_offsets.v7.request import ListOffsetsPartition, ListOffsetsTopic
from kio.schema.produce.v9 import ProduceRequest
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

from streams.tools.localcluster import LocalCluster
from tests.kafka.shimproc import RawConnection, ShimProcess, record_batch

pytestmark = pytest.mark.process

DROP_EVERY = 7


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("kafka-idem"), bookies=3)
    c.start()
    yield c
    c.stop()


class Shims:
    """The module's one shim process at a time; a test may replace it (stop or kill it, start another)."""

    def __init__(self, cluster, log_dir):
        self.cluster, self.log_dir = cluster, log_dir
        self.current = self._new()

    def _new(self, *args: str) -> ShimProcess:
        return ShimProcess(self.cluster.metadata_url, self.log_dir, *args).start_and_wait()

    def replace(self, *args: str, kill: bool = False) -> ShimProcess:
        if kill:
            self.current.kill()
        else:
            self.current.stop()  # SIGTERM: its lease is revoked, the successor owns everything at once
        self.current = self._new(*args)
        return self.current


@pytest.fixture(scope="module")
def shims(cluster, tmp_path_factory):
    s = Shims(cluster, tmp_path_factory.mktemp("idem-logs"))
    yield s
    s.current.stop()


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=20)


def consume_all(bootstrap: str, topic: str, partitions: int, expect: int, timeout_s: float = 30) -> dict:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "idem-check", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 100})
    got: dict[int, list] = {p: [] for p in range(partitions)}
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        while sum(map(len, got.values())) < expect and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=0.5):
                assert m.error() is None, m.error()
                got[m.partition()].append((m.offset(), m.value()))
        for m in c.consume(1000, timeout=1.0):  # anything beyond the expected count is a duplicate
            if m.error() is None:
                got[m.partition()].append((m.offset(), m.value()))
    finally:
        c.close()
    return got


def test_confluent_idempotent_producer_exactly_once_through_retries(shims):
    shim = shims.replace("--test-drop-produce-response-every", str(DROP_EVERY))
    topic = "idem-retries"
    create_topic(shim.bootstrap, topic, 2)
    p = Producer({"bootstrap.servers": shim.bootstrap, "enable.idempotence": True, "acks": "all",
                  "linger.ms": 2, "batch.num.messages": 40, "retry.backoff.ms": 20})
    n = 2000
    delivered = []
    for i in range(n):
        p.produce(topic, value=b"%d" % i, partition=i % 2,
                  on_delivery=lambda err, msg: delivered.append((err, msg.partition(), msg.offset(), msg.value())))
        if i % 50 == 0:
            p.poll(0)
    assert p.flush(60) == 0
    assert len(delivered) == n and all(err is None for err, *_ in delivered), [d for d in delivered if d[0]][:3]

    # the retries were real: the shim stored batches and dropped the connection instead of answering
    drops = shim.log_text().count("dropping the response to a produce request")
    assert drops >= 3

    got = consume_all(shim.bootstrap, topic, 2, n)
    for part in (0, 1):
        values = [v for _, v in got[part]]
        assert [o for o, _ in got[part]] == list(range(n // 2))  # dense, no duplicate took an offset
        assert values == [b"%d" % i for i in range(part, n, 2)]  # every record once, in order
    # the acknowledged offsets are the stored ones (a retried batch is answered with its original offset)
    stored = {(part, o): v for part in (0, 1) for o, v in got[part]}
    assert all(stored[(part, off)] == v for _, part, off, v in delivered)
    shims.replace()  # without fault injection for the next tests


def _produce(conn: RawConnection, topic: str, batch: bytes, partition: int = 0):
    resp = conn.call(ProduceRequest(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=10),
                                    topic_data=(TopicProduceData(name=topic, partition_data=(
                                        PartitionProduceData(index=partition, records=batch),)),)))
    r = resp.responses[0].partition_responses[0]
    return r.error_code, r.base_offset


def _init_pid(conn: RawConnection, producer_id: int = -1, epoch: int = -1, transactional_id: str | None = None):
    resp = conn.call(InitProducerIdRequest(transactional_id=transactional_id,
                                           transaction_timeout=datetime.timedelta(seconds=60),
                                           producer_id=producer_id, producer_epoch=epoch))
    return resp.error_code, resp.producer_id, resp.producer_epoch


def _end_offset(conn: RawConnection, topic: str, partition: int = 0) -> int:
    resp = conn.call(ListOffsetsRequest(replica_id=-1, isolation_level=0, topics=(ListOffsetsTopic(
        name=topic, partitions=(ListOffsetsPartition(partition_index=partition, current_leader_epoch=-1,
                                                     timestamp=-1),)),)))
    return resp.topics[0].partitions[0].offset


def _retry_not_leader(fn, timeout_s: float = 20.0):
    """Call ``fn`` until it stops answering NOT_LEADER_OR_FOLLOWER (a dead owner's lease expiring)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = fn()
        if out[0] != ErrorCode.not_leader_or_follower or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def test_sequence_rules_over_raw_requests(shims):
    shim = shims.current
    topic = "idem-raw"
    create_topic(shim.bootstrap, topic, 1)
    with RawConnection(shim.port) as conn:
        err, pid, epoch = _init_pid(conn)
        assert err == ErrorCode.none and pid >= 0 and epoch == 0
        err2, pid2, _ = _init_pid(conn)
        assert err2 == ErrorCode.none and pid2 != pid  # ids are never handed out twice

        first = record_batch([b"a", b"b", b"c"], pid, 0, 0)
        assert _produce(conn, topic, first) == (ErrorCode.none, 0)
        assert _produce(conn, topic, first) == (ErrorCode.none, 0)  # a retry: the original offset, not stored
        assert _produce(conn, topic, record_batch([b"d", b"e"], pid, 0, 3)) == (ErrorCode.none, 3)
        assert _produce(conn, topic, first) == (ErrorCode.none, 0)  # still among the last 5 batches
        err, _ = _produce(conn, topic, record_batch([b"gap"], pid, 0, 10))
        assert err == ErrorCode.out_of_order_sequence_number

        # an epoch bump (KIP-360): same id, epoch + 1, sequences restart at 0; the old epoch is fenced
        err, bumped_pid, bumped_epoch = _init_pid(conn, pid, 0)
        assert (err, bumped_pid, bumped_epoch) == (ErrorCode.none, pid, 1)
        err, _ = _produce(conn, topic, record_batch([b"x"], pid, 1, 4))
        assert err == ErrorCode.out_of_order_sequence_number  # a new epoch must start at 0
        assert _produce(conn, topic, record_batch([b"f"], pid, 1, 0)) == (ErrorCode.none, 5)
        err, _ = _produce(conn, topic, record_batch([b"stale"], pid, 0, 5))
        assert err == ErrorCode.invalid_producer_epoch

        # a producer this partition has no state for cannot start in the middle
        err, _ = _produce(conn, topic, record_batch([b"lost"], pid2, 0, 7))
        assert err == ErrorCode.unknown_producer_id

        assert _end_offset(conn, topic) == 6  # a b c d e f: nothing refused or duplicated was stored
    got = consume_all(shim.bootstrap, topic, 1, 6)
    assert [v for _, v in got[0]] == [b"a", b"b", b"c", b"d", b"e", b"f"]


def test_dedup_state_survives_a_take_over(shims):
    shim = shims.current
    topic = "idem-takeover"
    create_topic(shim.bootstrap, topic, 1)
    with RawConnection(shim.port) as conn:
        _, pid, _ = _init_pid(conn)
        batches = [record_batch([b"v%d-%d" % (i, j) for j in range(4)], pid, 0, 4 * i) for i in range(6)]
        for i in range(3):
            assert _produce(conn, topic, batches[i]) == (ErrorCode.none, 4 * i)
        time.sleep(1.5)  # a producer-state snapshot is written (every 1 s); the next batches are after it
        for i in range(3, 6):
            assert _produce(conn, topic, batches[i]) == (ErrorCode.none, 4 * i)
    # SIGKILL right away: no clean snapshot; the successor rebuilds from the snapshot plus the log tail
    new = shims.replace(kill=True)
    with RawConnection(new.port) as conn:
        assert _retry_not_leader(lambda: _produce(conn, topic, batches[5])) == (ErrorCode.none, 20)  # after the snapshot
        assert _produce(conn, topic, batches[2]) == (ErrorCode.none, 8)  # before it
        err, _ = _produce(conn, topic, batches[0])
        assert err == ErrorCode.out_of_order_sequence_number  # older than the last 5 batches: not a known retry
        nxt = record_batch([b"next"], pid, 0, 24)
        assert _produce(conn, topic, nxt) == (ErrorCode.none, 24)
        assert _end_offset(conn, topic) == 25
    assert "open: LAC" in new.log_text()
    got = consume_all(new.bootstrap, topic, 1, 25)
    assert len(got[0]) == 25 and [o for o, _ in got[0]] == list(range(25))
