"""Kafka offsets are the streams' record offsets: dense across take-overs, the next offset recovered
from the log, the entry holding an offset found without any index of the listener's own, and the
stored batches served byte for byte."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from compat_kafka.broker import Broker, BrokerConfig
from compat_kafka.wire.errors import OffsetOutOfRange
from streams.batches import stored_batch
from streams.client import connect

pytestmark = pytest.mark.process


def test_take_over_recovers_dense_offsets(shim, kafka_cluster, topic):
    def kcat(*args, input=None):
        return subprocess.run(["kcat", "-b", shim.bootstrap, *args], input=input, capture_output=True, text=True,
                              timeout=30, check=True).stdout

    kcat("-P", "-t", topic, input="a\nb\nc\n")
    kcat("-P", "-t", topic, input="d\n")

    async def second_broker():
        # Another broker (a restarted shim) takes the partition over: its producer recovers the next
        # offset from the log, every offset is found by the consumer's search, and no holes appear.
        client = await connect(kafka_cluster.metadata_url, add_timeout_s=5, call_timeout_s=5)
        broker = Broker(client, BrokerConfig())
        try:
            plog = await broker.partition(topic, 0, write=True)
            assert (plog.log_start, plog.next_offset, plog.high_watermark) == (0, 4, 4)
            stored = []  # (base offset, end offset, the stored batch bytes)
            eid, lac = plog.reader.earliest_entry(), plog.producer.lac
            while eid <= lac:
                for e in await plog.reader.read_raw(eid, lac):
                    eid = e.entry_id + 1
                    b = stored_batch(e.entry_id, e.data)
                    if b is not None:
                        stored.append((b.base_offset, b.end_offset, bytes(b.batch)))
            assert [(base, end) for base, end, _ in stored][-1] == (3, 4)  # the last kcat call: one batch
            assert [base for base, _, _ in stored] == sorted({base for base, _, _ in stored})
            for off in range(4):  # every fetch offset: the stored batches from the one holding it, as stored
                assert await plog.read(off, 1 << 20) == b"".join(raw for _, end, raw in stored if end > off)
            data = await plog.read(3, 1 << 20)
            assert int.from_bytes(data[:8], "big") == 3  # the stored batch carries its own base offset
            assert await plog.read(4, 1 << 20) == b""
            with pytest.raises(OffsetOutOfRange):
                await plog.read(5, 1 << 20)
        finally:
            await broker.close()
            await client.close()

    asyncio.run(second_broker())
    # The shim's writer was fenced by that take-over: its next produce fails, the client retries,
    # the shim takes the stream over again and carries on at offset 4.
    kcat("-P", "-t", topic, input="e\n")
    out = kcat("-C", "-t", topic, "-e", "-f", "%s@%o\n")
    assert out.splitlines() == ["a@0", "b@1", "c@2", "d@3", "e@4"]


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_list_offsets_by_timestamp_finds_the_record_not_its_batch(shim, topic, codec):
    """Kafka answers the offset of the first *record* whose timestamp is >= the target, even when it
    sits in the middle of a (compressed) batch, and -1 when no record is that late."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    p = Producer({"bootstrap.servers": shim.bootstrap, "linger.ms": 1000, "compression.type": codec,
                  "batch.num.messages": 1000})
    base = 1_600_000_000_000
    for batch in range(3):  # three flushes: three batches of 10 records, timestamps 10 ms apart
        for i in range(10):
            n = batch * 10 + i
            p.produce(topic, value=b"v%d" % n, timestamp=base + 10 * n)
        p.flush(30)
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": f"g-{topic}"})
    try:
        def lookup(ts):
            got = c.offsets_for_times([TopicPartition(topic, 0, ts)], timeout=30)[0]
            assert got.error is None
            return got.offset

        assert lookup(base - 1) == 0
        assert lookup(base + 10 * 4) == 4  # inside the first batch
        assert lookup(base + 10 * 4 + 1) == 5  # between two records
        assert lookup(base + 10 * 15) == 15  # inside the second batch
        assert lookup(base + 10 * 29) == 29
        assert lookup(base + 10 * 29 + 1) == -1  # no record that late
    finally:
        c.close()
