"""Several `scroll kafka` processes on one cluster (etcd + 3 bookies): Metadata names every live shim
and spreads partition leadership; SIGKILLing a partition's owner during an idempotent confluent-kafka
run moves the partition to a survivor with no acknowledged record lost or duplicated; a SIGSTOPped
owner that comes back after its partition moved cannot append; a zombie writer is fenced by term."""

from __future__ import annotations

import asyncio
import datetime
import json
import signal
import subprocess
import sys
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402
from kio.schema.errors import ErrorCode
from kio.schema.produce.v9 import ProduceRequest
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

from compat_kafka.broker import Broker
from compat_kafka.partitions.partition import PartitionConfig, PartitionLog
from compat_kafka.wire.batches import split_batches
from compat_kafka.wire.errors import code_for
from streams.client import connect
from streams.producer import writer_key
from streams.tools.localcluster import LocalCluster, free_port
from tests.kafka.shimproc import RawConnection, ShimProcess, record_batch

pytestmark = pytest.mark.process

TTL = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("kafka-failover"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def shims(cluster, tmp_path_factory):
    logs = tmp_path_factory.mktemp("failover-logs")
    # fail-over only: a listener that comes back (SIGCONT) would otherwise get its partitions back
    # after --rebalance-delay (tests/kafka/test_rebalance.py), racing the assertions on who owns what
    procs = [ShimProcess(cluster.metadata_url, logs, "--no-rebalance", node_id=7, lease_ttl_s=TTL),
             ShimProcess(cluster.metadata_url, logs, "--no-rebalance", lease_ttl_s=TTL),
             ShimProcess(cluster.metadata_url, logs, "--no-rebalance", lease_ttl_s=TTL)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_listening()
        yield procs
    finally:
        for p in procs:
            p.signal(signal.SIGCONT)
            p.stop()


def bootstrap(procs) -> str:
    return ",".join(p.bootstrap for p in procs if p.alive)


def metadata(bootstrap_servers: str, topic: str):
    """(node id -> port, partition -> leader node id) as one shim answers Metadata."""
    md = AdminClient({"bootstrap.servers": bootstrap_servers}).list_topics(topic, timeout=10)
    brokers = {b.id: b.port for b in md.brokers.values()}
    leaders = {p.id: p.leader for p in md.topics[topic].partitions.values()}
    return brokers, leaders


def create_topic(bootstrap_servers: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=20)


def consume(bootstrap_servers: str, topic: str, partitions: int, expect: int, timeout_s: float = 40) -> dict:
    c = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "failover-check",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 100})
    got: dict[int, list] = {p: [] for p in range(partitions)}
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        while sum(map(len, got.values())) < expect and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=0.5):
                if m.error() is None:
                    got[m.partition()].append((m.offset(), m.value()))
        for m in c.consume(1000, timeout=1.0):  # anything beyond the expected count is a duplicate
            if m.error() is None:
                got[m.partition()].append((m.offset(), m.value()))
    finally:
        c.close()
    return got


def by_node(procs) -> dict[int, ShimProcess]:
    return {p.node_id(): p for p in procs}


def test_node_ids_and_metadata_spread_leadership(shims):
    nodes = by_node(shims)
    assert 7 in nodes and len(nodes) == 3  # one explicit id, two allocated ones
    topic = "spread"
    create_topic(shims[0].bootstrap, topic, 8)
    answers = [metadata(p.bootstrap, topic) for p in shims]
    brokers, leaders = answers[0]
    assert brokers == {n: p.port for n, p in nodes.items()}  # every live shim, at its port
    assert all(a == answers[0] for a in answers)  # every shim tells the same story
    assert len(set(leaders.values())) >= 2  # leadership is spread

    p = Producer({"bootstrap.servers": bootstrap(shims), "acks": "all", "linger.ms": 1})
    for part in range(8):
        p.produce(topic, value=b"x%d" % part, partition=part)
    assert p.flush(30) == 0
    assert metadata(shims[1].bootstrap, topic)[1] == leaders  # the owners claimed what Metadata promised



def test_node_id_of_a_live_shim_is_refused(cluster, shims):
    # waits up to twice the TTL (a restarted shim's previous incarnation may still be expiring), then fails
    dup = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                          "--port", str(free_port()), "--node-id", "7", "--lease-ttl", "1"],
                         capture_output=True, text=True, timeout=60)
    assert dup.returncode != 0
    assert "node id 7 is registered by another live shim" in dup.stderr + dup.stdout


def test_sigkill_owner_during_idempotent_produce(shims):
    topic = "failover"
    parts = 4
    create_topic(shims[0].bootstrap, topic, parts)
    _, leaders = metadata(shims[0].bootstrap, topic)
    victim = by_node(shims)[leaders[0]]
    delivered, errors = [], []

    def on_delivery(err, msg):
        (errors if err else delivered).append((err, msg.partition(), msg.offset(), msg.value()))

    p = Producer({"bootstrap.servers": bootstrap(shims), "enable.idempotence": True, "acks": "all",
                  "linger.ms": 5, "retry.backoff.ms": 100, "topic.metadata.refresh.interval.ms": 1000})
    n = 3000
    killed_at = None
    for i in range(n):
        p.produce(topic, value=b"%d" % i, partition=i % parts, on_delivery=on_delivery)
        if i == 400:
            assert p.flush(30) == 0  # warmed up: producer id known, every partition claimed
        elif i % 20 == 19:
            p.poll(0.005)  # a steady stream of small batches, so requests are in flight at the kill
        if i == 1500:
            killed_at = len(delivered)
            victim.kill()  # SIGKILL with requests in flight: its lease runs out, a survivor takes over
    assert p.flush(90) == 0
    assert not errors, errors[:3]
    assert killed_at < n and len(delivered) == n

    survivors = [s for s in shims if s.alive]
    got = consume(bootstrap(survivors), topic, parts, n)
    for part in range(parts):
        assert [o for o, _ in got[part]] == list(range(n // parts))  # dense offsets, no duplicates
        assert [v for _, v in got[part]] == [b"%d" % i for i in range(part, n, parts)]  # all once, in order
    stored = {(part, o): v for part in range(parts) for o, v in got[part]}
    assert all(stored[(part, off)] == v for _, part, off, v in delivered)  # acks name the stored offsets

    brokers, leaders_after = metadata(survivors[0].bootstrap, topic)
    assert victim.port not in brokers.values()
    assert leaders_after[0] != leaders[0] and leaders_after[0] in brokers


def _produce_request(topic: str, partition: int, value: bytes) -> ProduceRequest:
    return ProduceRequest(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=10),
                          topic_data=(TopicProduceData(name=topic, partition_data=(
                              PartitionProduceData(index=partition, records=record_batch([value])),)),))


async def _writer_key(url: str, stream: str) -> dict | None:
    """The stream's writer key (streams.producer: its writer's liveness), or None."""
    c = await connect(url)
    try:
        meta, _ = await c.cluster.ledgers.get_ledger(stream)
        got = await c.cluster.store.get(writer_key(meta.ledger_id))
        return json.loads(got.value) if got is not None else None
    finally:
        await c.close()


def test_sigstopped_owner_cannot_append_after_its_partition_moved(cluster, shims):
    live = [s for s in shims if s.alive]
    assert len(live) >= 2
    topic = "zombie"
    create_topic(live[0].bootstrap, topic, 1)
    p = Producer({"bootstrap.servers": bootstrap(live), "acks": "all"})
    p.produce(topic, value=b"before", partition=0)
    assert p.flush(30) == 0
    _, leaders = metadata(live[0].bootstrap, topic)
    owner = by_node(live)[leaders[0]]
    other = next(s for s in live if s is not owner)
    assert asyncio.run(_writer_key(cluster.metadata_url, topic))["pid"] == owner.popen.pid

    conn = RawConnection(owner.port, timeout_s=30)
    owner.signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while owner.port in metadata(other.bootstrap, topic)[0].values():  # its lease runs out
            assert time.monotonic() < deadline
            time.sleep(0.3)
        # the writer key lived under the ownership lease (no lease of its own): gone with it
        assert asyncio.run(_writer_key(cluster.metadata_url, topic)) is None
        q = Producer({"bootstrap.servers": other.bootstrap, "acks": "all"})
        q.produce(topic, value=b"after", partition=0)  # the survivor claims it: a take-over, a new term
        assert q.flush(30) == 0
        req = _produce_request(topic, 0, b"zombie")
        conn.send(req)  # waits in the socket buffer: the stopped owner reads it the moment it resumes
    finally:
        owner.signal(signal.SIGCONT)
    resp = conn.receive(req)
    conn.close()
    assert resp.responses[0].partition_responses[0].error_code == ErrorCode.not_leader_or_follower

    got = consume(other.bootstrap, topic, 1, 2)
    assert [v for _, v in got[0]] == [b"before", b"after"]
    deadline = time.monotonic() + 20
    while True:  # the resumed shim registers again and names the new owner as leader
        brokers, leaders_now = metadata(owner.bootstrap, topic)
        if owner.port in brokers.values():
            break
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert leaders_now[0] != leaders[0]
    assert "dropping" in owner.log_text()


def test_zombie_writer_is_fenced_by_term(cluster):
    """The protocol fences a writer that missed its take-over: its append fails, nothing lands."""

    async def run():
        client = await connect(cluster.metadata_url, add_timeout_s=5, call_timeout_s=5)
        try:
            broker = Broker(client)  # not started: used as a library, no ownership
            await broker.create_topic("fenced", 1, {})
            cfg = PartitionConfig()
            old = PartitionLog(client, "fenced", 0, cfg)
            await old.open()
            base, futs = await old.append(split_batches(record_batch([b"one"])))
            await asyncio.gather(*futs)
            new = PartitionLog(client, "fenced", 0, cfg)
            await new.open()  # the take-over: a new term
            assert new.next_offset == 1
            with pytest.raises(Exception) as ei:
                _, futs = await old.append(split_batches(record_batch([b"zombie"])))
                await asyncio.gather(*futs)
            assert code_for(ei.value) == ErrorCode.not_leader_or_follower
            _, futs = await new.append(split_batches(record_batch([b"two"])))
            await asyncio.gather(*futs)
            data = await new.read(0, 1 << 20)
            assert b"zombie" not in data and b"one" in data and b"two" in data
            await old.close()
            await new.close()
        finally:
            await client.close()

    asyncio.run(run())
