"""Many partitions on one listener (issue 14): a first produce to a new topic opens its partitions
concurrently but bounded (``BrokerConfig.max_concurrent_opens``), an idle listener's timers and
tasks do not grow with its open partitions, and a SIGKILLed listener's many partitions are all
served by a survivor with no acknowledged record lost. No absolute time is asserted: the figures
are ``bench/kafka.py --phases open,failover,idle``."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
import urllib.request

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from compat_kafka.partitions.partition import PartitionLog
from streams.tools.localcluster import LocalCluster, free_port
from tests.kafka.conftest import ShimThread
from tests.kafka.shimproc import ShimProcess

BOUND = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of its own: with no other listener registered, every partition is this module's
    listener's (the session's shim would otherwise own some)."""
    c = LocalCluster(tmp_path_factory.mktemp("many-partitions"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def bounded_shim(cluster):
    # asyncio's own loop: the idle test counts the timers in its heap (uvloop does not show them)
    s = ShimThread(cluster.metadata_url, free_port(), max_concurrent_opens=BOUND, event_loop="asyncio")
    s.start()
    yield s
    s.stop()


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                        request_timeout=60)[topic].result(timeout=90)


def produce_each(bootstrap: str, topic: str, partitions: int, per_partition: int, tag: bytes = b"") -> list:
    """``per_partition`` records to every partition (acks=all); the delivery reports."""
    delivered, errors = [], []

    def report(err, msg):
        (errors if err else delivered).append((err, msg.partition(), msg.offset(), msg.value()))

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5, "retry.backoff.ms": 100,
                  "topic.metadata.refresh.interval.ms": 1000})
    for i in range(per_partition):
        for part in range(partitions):
            p.produce(topic, value=b"%s%d-%d" % (tag, part, i), partition=part, on_delivery=report)
        p.poll(0)
    assert p.flush(120) == 0
    assert not errors, errors[:3]
    return delivered


def consume_all(bootstrap: str, topic: str, partitions: int, expect: int, timeout_s: float = 60) -> dict:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{topic}", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 50})
    got: dict[int, list] = {p: [] for p in range(partitions)}
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        deadline = time.monotonic() + timeout_s
        while sum(map(len, got.values())) < expect and time.monotonic() < deadline:
            for m in c.consume(1000, timeout=0.5):
                if m.error() is None:
                    got[m.partition()].append((m.offset(), m.value()))
    finally:
        c.close()
    return got


class OpenGate:
    """Holds every partition open of the listener (``PartitionLog.open``) until ``BOUND`` are in
    flight at once, counting the most ever in flight: opens one after another never reach the
    bound (the gate then opens on its timeout and the count tells); unbounded ones exceed it."""

    def __init__(self, monkeypatch):
        self.in_flight = self.most = self.opened = 0
        self.lock = threading.Lock()
        self.reached: asyncio.Event | None = None
        orig = PartitionLog.open
        gate = self

        async def held_open(plog):
            if gate.reached is None:
                gate.reached = asyncio.Event()
            with gate.lock:
                gate.in_flight += 1
                gate.most = max(gate.most, gate.in_flight)
                if gate.in_flight >= BOUND:
                    gate.reached.set()
            try:
                try:
                    await asyncio.wait_for(gate.reached.wait(), 20)
                except TimeoutError:
                    gate.reached.set()
                await orig(plog)
                gate.opened += 1
            finally:
                with gate.lock:
                    gate.in_flight -= 1

        monkeypatch.setattr(PartitionLog, "open", held_open)


def test_first_produce_opens_partitions_concurrently_bounded(bounded_shim, topic, monkeypatch):
    parts, per = 200, 3
    create_topic(bounded_shim.bootstrap, topic, parts)
    gate = OpenGate(monkeypatch)
    delivered = produce_each(bounded_shim.bootstrap, topic, parts, per)
    assert gate.opened == parts  # each partition opened once, by the first produce
    assert gate.most == BOUND  # concurrently, up to the bound and never beyond
    assert len(delivered) == parts * per
    got = consume_all(bounded_shim.bootstrap, topic, parts, parts * per)
    for part in range(parts):  # dense offsets from 0, every record once, in order
        assert [o for o, _ in got[part]] == list(range(per)), (part, got[part])
        assert [v for _, v in got[part]] == [b"%d-%d" % (part, i) for i in range(per)]
    stored = {(part, o): v for part in range(parts) for o, v in got[part]}
    assert all(stored[(part, off)] == v for _, part, off, v in delivered)  # acks name the stored offsets


def _loop_load(shim: ShimThread) -> tuple[int, int]:
    """(tasks, timers) of the listener's event loop now."""
    async def count():
        loop = asyncio.get_running_loop()
        return len(asyncio.all_tasks(loop)), sum(1 for h in loop._scheduled if not h.cancelled())

    return asyncio.run_coroutine_threadsafe(count(), shim.loop).result(10)


def _settled_load(shim: ShimThread) -> tuple[int, int]:
    """The listener's tasks and timers once idle (the least seen over a few samples: a request's
    own tasks and timers, and the client connections just closed, may linger for a moment)."""
    samples = []
    for _ in range(6):
        time.sleep(0.5)
        samples.append(_loop_load(shim))
    return min(s[0] for s in samples), min(s[1] for s in samples)


def test_idle_timers_and_tasks_do_not_grow_with_open_partitions(bounded_shim, topic):
    """Per-partition timers (a snapshot loop, a writer tick) are the regression: an idle listener
    has about as many tasks and timers after 80 more partitions were opened for writing."""
    create_topic(bounded_shim.bootstrap, topic + "-one", 1)
    produce_each(bounded_shim.bootstrap, topic + "-one", 1, 2)  # the snapshot task exists from here
    tasks_before, timers_before = _settled_load(bounded_shim)
    create_topic(bounded_shim.bootstrap, topic, 80)
    produce_each(bounded_shim.bootstrap, topic, 80, 2)
    tasks_after, timers_after = _settled_load(bounded_shim)
    assert tasks_after - tasks_before <= 4, (tasks_before, tasks_after)
    assert timers_after - timers_before <= 4, (timers_before, timers_after)


def _etcd_requests(cluster: LocalCluster) -> dict[str, float]:
    """Requests (messages) etcd received so far, by gRPC method, from its own metrics."""
    url = f"http://127.0.0.1:{cluster.etcd_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            method = re.search(r'grpc_method="(\w+)"', line).group(1)
            out[method] = out.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _until_quiet(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    """Until etcd receives nothing but lease keep-alives for 2 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = _etcd_requests(cluster)
        time.sleep(2)
        if _etcd_delta(before, _etcd_requests(cluster))[1] == 0:
            return
        assert time.monotonic() < deadline, "etcd kept receiving requests other than keep-alives"


def _etcd_delta(before: dict, after: dict) -> tuple[float, float]:
    """(lease keep-alives, every other request) between two readings."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    keepalives = d.pop("LeaseKeepAlive", 0.0)
    return keepalives, sum(d.values())


def test_idle_cluster_sends_etcd_only_lease_keepalives(bounded_shim, cluster, topic):
    """An idle listener holding many open partitions, and idle bookies, send etcd nothing but their
    lease keep-alives (one per process every third of its TTL): no listing, read or write per
    partition or per second (the live listeners and the ACLs are watched; a bookie writes its space
    figures only when they change). Counted by etcd itself."""
    create_topic(bounded_shim.bootstrap, topic, 40)
    produce_each(bounded_shim.bootstrap, topic, 40, 2)
    _until_quiet(cluster)  # the snapshots of what was just produced, the bookies' first reports
    window_s = 6.0
    before = _etcd_requests(cluster)
    time.sleep(window_s)  # the window counted, not a wait for an event
    keepalives, others = _etcd_delta(before, _etcd_requests(cluster))
    # at most the two once-a-minute re-checks (live listeners, orphaned transactions) may fall in it
    assert others <= 2, others
    # 3 bookies (TTL 5 s) and 1 listener (TTL 10 s): a keep-alive every 1.7 s / 3.3 s each, plus slack
    assert keepalives <= 3 * (window_s / (5 / 3) + 2) + (window_s / (10 / 3) + 2), keepalives


@pytest.mark.process
def test_sigkilled_listener_many_partitions_served_by_survivor(tmp_path, topic):
    """Listener A alone takes every partition with a first produce; B starts; A is SIGKILLed. After
    A's lease expires B serves every partition: a record more lands on each, after every record
    acknowledged by A."""
    parts, per = 60, 4
    cluster = LocalCluster(tmp_path / "cluster", bookies=3).start()  # no other listener
    a = ShimProcess(cluster.metadata_url, tmp_path, node_id=41, lease_ttl_s=2.0).start_and_wait()
    b = None
    try:
        create_topic(a.bootstrap, topic, parts)
        before = produce_each(a.bootstrap, topic, parts, per, tag=b"a")
        b = ShimProcess(cluster.metadata_url, tmp_path, node_id=42, lease_ttl_s=2.0).start_and_wait()
        a.signal(signal.SIGKILL)
        after = produce_each(b.bootstrap, topic, parts, 1, tag=b"b")  # NOT_LEADER until A's lease expires
        got = consume_all(b.bootstrap, topic, parts, parts * (per + 1))
        assert "claimed kafka/owners/" in b.log_text()
    finally:
        a.stop()
        if b is not None:
            b.stop()
        cluster.stop()
    for part in range(parts):
        assert [o for o, _ in got[part]] == list(range(per + 1)), (part, got[part])
        assert [v for _, v in got[part]] == [b"a%d-%d" % (part, i) for i in range(per)] + [b"b%d-0" % part]
    stored = {(part, o): v for part in range(parts) for o, v in got[part]}
    assert all(stored[(part, off)] == v for _, part, off, v in before + after)


def test_lease_refresh_is_retried_soon_after_a_failure(monkeypatch):
    """A refresh that fails (the store busy with an open storm) is retried within a quarter second,
    not a third of the TTL later, which could let the lease run out and drop every partition."""
    from compat_kafka.cluster.ownership import Ownership
    from fragments.memstore import MemoryLease, MemoryStore
    from fragments.store import MetadataUnavailable

    calls: list[float] = []
    orig = MemoryLease.refresh

    async def flaky_refresh(lease):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise MetadataUnavailable("busy")
        await orig(lease)

    monkeypatch.setattr(MemoryLease, "refresh", flaky_refresh)

    async def body():
        own = Ownership(MemoryStore(), "127.0.0.1", 9092, node_id=1, ttl_s=3.0)
        await own.start()
        try:
            deadline = time.monotonic() + 5
            while len(calls) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await own.close()

    asyncio.run(body())
    assert len(calls) >= 2
    assert calls[1] - calls[0] < 0.6  # the usual interval is ttl/3 = 1 s


def test_opening_many_partitions_batches_metadata_requests(bounded_shim, cluster, topic):
    """A first produce to many new partitions sends etcd far fewer requests than partitions times
    the take-over's metadata calls (claim, name and ledger record, last fragment, bookie listing,
    two compare-and-sets, producer-state snapshot read and write: ~9 each, one at a time, before
    batching): the claims go as create-all transactions, the reads and compare-and-sets of one loop
    turn as one transaction (``fragments.batching``). Counted by etcd itself, until the snapshots of
    what was produced are written."""
    parts = 64
    create_topic(bounded_shim.bootstrap, topic, parts)
    before = _etcd_requests(cluster)
    produce_each(bounded_shim.bootstrap, topic, parts, 1)
    _until_quiet(cluster)  # until the snapshot writes after the produce are done
    _, others = _etcd_delta(before, _etcd_requests(cluster))
    # measured: ~530 before batching (8.3 per partition), 90-130 after
    assert others <= 3 * parts, others


def test_creating_a_topic_batches_its_metadata_requests(bounded_shim, cluster, topic):
    """CreateTopics of many partitions: one bookie listing, one block of ledger ids for all the
    partitions, and each wave of partitions' reads and transactions as one request (before: about
    five requests per partition, one at a time; 500 partitions took 4-9 s). Counted by etcd itself."""
    parts = 128
    _until_quiet(cluster)  # what earlier tests of the module left running (snapshots) is done
    before = _etcd_requests(cluster)
    create_topic(bounded_shim.bootstrap, topic, parts)
    _, others = _etcd_delta(before, _etcd_requests(cluster))
    # measured: 776 one partition at a time, 17 batched
    assert others <= parts // 4, others
