"""One log, every client: streams written with the Python API are read by Kafka clients (kcat,
confluent-kafka, aiokafka) with the same offsets, keys, headers and timestamps, and topics written
by Kafka clients (every compression codec) are read by the Python consumer at the same offsets.
Keys land on the same partition whichever client wrote them (murmur2, Kafka's default
partitioner). A stream whose entries are not record batches is refused with a clear error.

Real processes throughout: etcd and three bookies (``LocalCluster``), the Kafka listener, kcat and
librdkafka; the Python side is the asyncio client of ``streams.client``."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import threading

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from streams.batches import RecordFormatError
from streams.client import connect
from streams.driver import WriterDriver
from streams.topics import TopicProducer

pytestmark = pytest.mark.process

T0 = 1_700_000_000_000


def run(coro_fn, url: str):
    async def go():
        client = await connect(url)
        try:
            return await coro_fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def python_records(n: int, first: int = 0) -> list[tuple]:
    """(value, key, headers, timestamp_ms): keys (one None), headers (one None-valued), explicit times."""
    out = []
    for i in range(first, first + n):
        key = None if i % 5 == 4 else b"key-%d" % (i % 3)
        headers = [("n", str(i).encode()), ("src", b"python")] + ([("none", None)] if i % 4 == 0 else [])
        out.append((b"value-%d" % i + b"." * (i % 7), key, headers, T0 + 1000 * i))
    return out


def expected(records: list[tuple]) -> list[tuple]:
    """(offset, key, value, headers, timestamp) as every client should read them."""
    return [(i, k, v, [(n, hv) for n, hv in h], ts) for i, (v, k, h, ts) in enumerate(records)]


def read_kcat(bootstrap: str, topic: str, partition: int = 0) -> list[tuple]:
    out = subprocess.run(["kcat", "-b", bootstrap, "-C", "-t", topic, "-p", str(partition), "-o", "beginning", "-e",
                          "-J"], capture_output=True, text=True, timeout=60, check=True).stdout
    got = []
    for line in out.splitlines():
        m = json.loads(line)
        h = m.get("headers") or []
        headers = [(h[i], None if h[i + 1] is None else h[i + 1].encode()) for i in range(0, len(h), 2)]
        key = None if m["key"] is None else m["key"].encode()
        got.append((m["offset"], key, m["payload"].encode(), headers, m["ts"]))
    return got


def read_confluent(bootstrap: str, topic: str, n: int, partition: int = 0) -> list[tuple]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"view-{topic}", "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, partition, 0)])
        got = []
        for _ in range(300):
            m = c.poll(0.1)
            if m is not None:
                assert m.error() is None, m.error()
                got.append((m.offset(), m.key(), m.value(), list(m.headers() or []), m.timestamp()[1]))
            if len(got) >= n:
                return got
        raise AssertionError(f"confluent-kafka read {len(got)} of {n} records")
    finally:
        c.close()


def read_aiokafka(bootstrap: str, topic: str, n: int, partition: int = 0) -> list[tuple]:
    from aiokafka import AIOKafkaConsumer
    from aiokafka import TopicPartition as AioTP

    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
        await c.start()
        try:
            tp = AioTP(topic, partition)
            c.assign([tp])
            await c.seek_to_beginning(tp)
            got = []
            for _ in range(100):
                for msgs in (await c.getmany(tp, timeout_ms=200)).values():
                    got += [(m.offset, m.key, m.value, list(m.headers), m.timestamp) for m in msgs]
                if len(got) >= n:
                    return got
            raise AssertionError(f"aiokafka read {len(got)} of {n} records")
        finally:
            await c.stop()

    return asyncio.run(go())


def test_python_producer_records_read_by_kcat_confluent_and_aiokafka(kafka_cluster, shim, topic):
    first, second, third = python_records(7), python_records(5, 7), python_records(30, 12)

    async def write(client):
        await client.create_stream(topic)
        async with await client.producer(topic) as p:
            assert await p.append_many(first) == list(range(7))
            await p.flush()
            assert [await p.append(*r) for r in second[:2]] == [7, 8]  # a batch each
            assert await p.append_many(second[2:]) == [9, 10, 11]
        async with await client.producer(topic) as p:  # a take-over: its no-op entry takes no offset
            assert await p.append_many(third[:10]) == list(range(12, 22))
            await p.flush()
            assert await p.append_many(third[10:]) == list(range(22, 42))
        c = await client.consumer(topic)
        return await c.read(100)

    records = first + second + third
    want = expected(records)
    got = run(write, kafka_cluster.metadata_url)
    assert [(r.offset, r.key, r.value, list(r.headers), r.timestamp_ms) for r in got] == want
    assert read_kcat(shim.bootstrap, topic) == want
    assert read_confluent(shim.bootstrap, topic, len(want)) == want
    assert read_aiokafka(shim.bootstrap, topic, len(want)) == want


def test_kafka_consumer_tails_a_stream_the_python_producer_keeps_writing(kafka_cluster, shim, topic):
    """Reading through the listener takes nothing over: a Kafka consumer tails the stream while the
    Python producer keeps writing it, and sees each record as it is acknowledged."""
    got: queue.Queue = queue.Queue()
    stop = threading.Event()
    ready = threading.Event()

    def tail() -> None:
        c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": f"tail-{topic}", "enable.auto.commit": False,
                      "fetch.wait.max.ms": 5000})  # a long poll: woken by the Python producer's appends
        try:
            c.assign([TopicPartition(topic, 0, 0)])
            while not stop.is_set():
                m = c.poll(0.1)
                ready.set()
                if m is not None:
                    got.put(m.error() or (m.offset(), m.value()))
        finally:
            c.close()

    async def write(client):
        await client.create_stream(topic)
        reader = threading.Thread(target=tail, daemon=True)
        reader.start()
        try:
            async with await client.producer(topic) as p:
                await asyncio.to_thread(ready.wait, 30)
                for i in range(10):  # one record at a time: the consumer sees it before the next is written
                    assert await p.append(b"live-%d" % i) == i  # never fenced by the Kafka reads
                    assert await asyncio.to_thread(got.get, timeout=30) == (i, b"live-%d" % i)
        finally:
            stop.set()
            await asyncio.to_thread(reader.join, 30)

    run(write, kafka_cluster.metadata_url)


def test_records_written_after_taking_a_kafka_topic_over_are_read_by_kafka_clients(kafka_cluster, shim, topic):
    """The listener wrote the partition (a Kafka producer), then a Python producer takes it over:
    the listener notices when a reader catches up (the bookies answer with the newer term) and
    serves the partition read-only, so Kafka consumers see the Python records at once."""
    subprocess.run(["kcat", "-b", shim.bootstrap, "-P", "-t", topic], input="from-kafka\n", text=True, timeout=30,
                   check=True)
    assert [(o, v) for o, _, v, _, _ in read_kcat(shim.bootstrap, topic)] == [(0, b"from-kafka")]

    async def write(client):
        async with await client.producer(topic) as p:
            return await p.append_many([b"from-python-1", b"from-python-2"])

    assert run(write, kafka_cluster.metadata_url) == [1, 2]
    assert [(o, v) for o, _, v, _, _ in read_kcat(shim.bootstrap, topic)] == [
        (0, b"from-kafka"), (1, b"from-python-1"), (2, b"from-python-2")]
    # and a Kafka producer takes it back: offsets go on densely
    subprocess.run(["kcat", "-b", shim.bootstrap, "-P", "-t", topic], input="again\n", text=True, timeout=30,
                   check=True)
    assert [o for o, _, _, _, _ in read_kcat(shim.bootstrap, topic)] == [0, 1, 2, 3]


def test_kcat_lists_a_stream_created_with_the_python_api(kafka_cluster, shim, topic):
    async def create(client):
        await client.create_stream(topic)
        await client.create_topic(f"{topic}.multi", 3)

    run(create, kafka_cluster.metadata_url)
    out = subprocess.run(["kcat", "-b", shim.bootstrap, "-L", "-J"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    topics = {t["topic"]: sorted(p["partition"] for p in t["partitions"]) for t in json.loads(out)["topics"]}
    assert topics[topic] == [0]
    assert topics[f"{topic}.multi"] == [0, 1, 2]
    assert not any(":" in name for name in topics)  # partition streams are not topics of their own


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_kafka_producer_records_read_by_the_python_consumer(kafka_cluster, shim, topic, codec):
    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "compression.type": codec,
                  "linger.ms": 20, "batch.num.messages": 7})  # several batches
    sent = []
    for i in range(40):
        key = b"k%d" % (i % 3)
        value = (b"value-%d-" % i) * (i % 7 + 1)
        headers = [("n", str(i).encode()), ("empty", None)]
        p.produce(topic, value=value, key=key, headers=headers, timestamp=T0 + i)
        sent.append((i, key, value, headers, T0 + i))
    assert p.flush(30) == 0

    async def read(client):
        c = await client.consumer(topic)
        out = []
        while len(out) < len(sent):
            got = await c.read(1000, timeout_s=5)
            assert got, f"read {len(out)} of {len(sent)}"
            out += got
        return out

    got = run(read, kafka_cluster.metadata_url)
    assert [(r.offset, r.key, r.value, list(r.headers), r.timestamp_ms) for r in got] == sent
    assert read_confluent(shim.bootstrap, topic, len(sent)) == sent  # and Kafka clients see the same


def test_keys_land_on_the_same_partition_whichever_client_wrote_them(kafka_cluster, shim, topic):
    keys = [b"customer-%d" % i for i in range(24)]

    async def write_python(client):
        await client.create_topic(topic, 4)
        async with await client.producer(topic) as p:
            assert isinstance(p, TopicProducer)
            placed = await p.append_many([(b"py", k) for k in keys])
        return {k: part for k, (part, _) in zip(keys, placed, strict=True)}

    python_partition = run(write_python, kafka_cluster.metadata_url)
    assert len(set(python_partition.values())) > 1  # spread over partitions

    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "partitioner": "murmur2_random"})
    for k in keys:  # librdkafka's murmur2_random is the Java client's default partitioner
        p.produce(topic, value=b"librdkafka", key=k)
    assert p.flush(30) == 0

    async def write_aiokafka():
        from aiokafka import AIOKafkaProducer

        prod = AIOKafkaProducer(bootstrap_servers=shim.bootstrap, acks="all")  # murmur2 by default
        await prod.start()
        try:
            for k in keys:
                await prod.send_and_wait(topic, value=b"aiokafka", key=k)
        finally:
            await prod.stop()

    asyncio.run(write_aiokafka())

    async def read_all(client):
        where: dict[bytes, set[tuple[int, bytes]]] = {}
        for part in range(4):
            c = await client.consumer(topic, partition=part)
            for r in await c.read(1000, timeout_s=1):
                where.setdefault(r.key, set()).add((part, r.value))
        return where

    where = run(read_all, kafka_cluster.metadata_url)
    for k in keys:
        part = python_partition[k]
        assert where[k] == {(part, b"py"), (part, b"librdkafka"), (part, b"aiokafka")}, k


def test_a_stream_of_non_batch_entries_is_refused_with_a_clear_error(kafka_cluster, shim, topic):
    async def write_junk(client):
        await client.create_stream(topic)
        d = WriterDriver(client.cluster, topic)
        await d.open()
        try:
            await d.append_nowait(b"junk: not a record batch")
        finally:
            await d.close()
        with pytest.raises(RecordFormatError, match="not a Kafka record batch"):
            c = await client.consumer(topic)
            await c.read(10, timeout_s=1)

    run(write_junk, kafka_cluster.metadata_url)
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": f"junk-{topic}", "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        err = None
        for _ in range(100):
            m = c.poll(0.2)
            if m is not None:
                assert m.error() is not None, "a junk entry was served as a record"
                err = m.error()
                break
        assert err is not None and err.code() == KafkaError.INVALID_MSG, err  # CORRUPT_MESSAGE (2)
    finally:
        c.close()
    # the listener is still serving: another topic works
    subprocess.run(["kcat", "-b", shim.bootstrap, "-P", "-t", f"{topic}-ok"], input="fine\n", text=True, timeout=30,
                   check=True)
    assert [v for _, _, v, _, _ in read_kcat(shim.bootstrap, f"{topic}-ok")] == [b"fine"]


def test_retention_ages_kafka_batches_by_their_record_timestamps(kafka_cluster, shim, topic):
    """Retention's max_age reads the max timestamp of a fragment's last batch: for a topic written by
    a Kafka client, the producer's CreateTime."""
    import dataclasses

    from streams.tools.retention import fragment_last_timestamp

    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "linger.ms": 20})
    for i in range(5):
        p.produce(topic, value=b"v%d" % i, timestamp=T0 + i * 1000)
    assert p.flush(30) == 0

    async def go(client):
        info = await client.describe_stream(topic)
        c = await client.consumer(topic)
        await c.end_position()  # learns the LAC
        frag = dataclasses.replace(info.fragments[-1], last_entry_id=c.lac)  # as if sealed at the LAC
        return await fragment_last_timestamp(client.cluster, info.meta, frag)

    assert run(go, kafka_cluster.metadata_url) == T0 + 4000
