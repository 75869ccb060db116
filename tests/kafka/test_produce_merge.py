"""Small plain produce batches share one entry (``PartitionConfig.merge_batch_bytes``): the records of
small uncompressed batches without a producer id go into the partition producer's open batch, so
a Kafka producer with a short linger does not pay a bookie entry per batch. Every record keeps its
offset, key, value, headers and timestamp; other batches are stored as they came; a batch with a
record that cannot be decoded is refused whole."""

from __future__ import annotations

import datetime
import struct
import time

import crc32c
import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from kio.schema.errors import ErrorCode
from kio.schema.produce.v9 import ProduceRequest
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from .shimproc import RawConnection  # noqa: E402


def _batch(records: list[tuple], compression: int = 0) -> bytes:
    """A magic-2 batch of (key, value, headers, timestamp_ms) records, no producer id."""
    b = DefaultRecordBatchBuilder(2, compression, 0, -1, -1, -1, 1 << 20)
    for i, (key, value, headers, ts) in enumerate(records):
        assert b.append(i, ts, key, value, headers) is not None
    return bytes(b.build())


def _produce(conn: RawConnection, topic: str, records: bytes):
    req = ProduceRequest(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=10), topic_data=(
        TopicProduceData(name=topic, partition_data=(PartitionProduceData(index=0, records=records),)),))
    (t,) = conn.call(req).responses
    (p,) = t.partition_responses
    return p


def _read(bootstrap: str, topic: str, n: int) -> list:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, 0)])
    got: list = []
    try:
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            got += [m for m in c.consume(n, timeout=0.5) if m.error() is None]
    finally:
        c.close()
    return [(m.offset(), m.key(), m.value(), m.headers() or [], m.timestamp()[1]) for m in got]


def _create(shim, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=30)


def _lac(shim, topic: str) -> int:
    return shim.server.broker._logs[(topic, 0)].producer.lac  # look only: the shim runs on its own loop


def test_small_plain_batches_share_an_entry_and_keep_every_record(shim, topic):
    t0 = int(time.time() * 1000) - 60_000
    a = [(b"k1", b"v1", [("h", b"1")], t0), (None, b"v2", [], t0 + 5)]
    b = [(b"k3", None, [("h", b"3"), ("g", None)], t0 + 7)]
    c = [(b"k4", b"v4", [], t0 + 9), (b"k5", b"v5", [], t0 + 2), (None, b"", [], t0 + 11)]
    gz = [(b"z", b"zipped", [], t0 + 20)]
    _create(shim, topic)
    with RawConnection(shim.port) as conn:
        assert _produce(conn, topic, _batch([(None, b"first", [], t0)])).error_code == ErrorCode.none  # opens it
        lac = _lac(shim, topic)
        r = _produce(conn, topic, _batch(a) + _batch(b) + _batch(c))  # three batches, one request
        assert (r.error_code, r.base_offset) == (ErrorCode.none, 1)
        assert _lac(shim, topic) == lac + 1  # one entry, not three
        lac = _lac(shim, topic)
        r = _produce(conn, topic, _batch(a) + _batch(gz, compression=1) + _batch(b))
        assert (r.error_code, r.base_offset) == (ErrorCode.none, 7)
        assert _lac(shim, topic) == lac + 3  # a compressed batch is stored as it came, between the others
    want = [(None, b"first", [], t0)] + a + b + c + a + gz + b
    got = _read(shim.bootstrap, topic, len(want))
    assert got == [(i, k, v, h, ts) for i, (k, v, h, ts) in enumerate(want)]


def test_a_batch_with_a_damaged_record_is_refused_whole(shim, topic):
    _create(shim, topic)
    with RawConnection(shim.port) as conn:
        assert _produce(conn, topic, _batch([(None, b"ok", [], 1000)])).error_code == ErrorCode.none
        bad = bytearray(_batch([(None, b"x" * 10, [], 1000), (None, b"y" * 10, [], 1000)]))
        bad[61] = 0x7E  # the first record's length varint: 63, past the batch's end
        struct.pack_into(">I", bad, 17, crc32c.crc32c(bytes(bad[21:])))  # a valid CRC over damaged records
        good = _batch([(None, b"after", [], 1000)])
        r = _produce(conn, topic, good + bytes(bad))
        assert r.error_code == ErrorCode.corrupt_message  # nothing of the request is stored
        r = _produce(conn, topic, good)
        assert (r.error_code, r.base_offset) == (ErrorCode.none, 1)
    assert [v for _, _, v, _, _ in _read(shim.bootstrap, topic, 2)] == [b"ok", b"after"]


def test_merged_batches_stay_within_a_consumers_fetch_size(shim, topic):
    """Small batches share entries, but a merged batch is at most MERGED_BATCH_BYTES (256 KiB): a
    consumer takes a fetch's first batch whole however small its max.partition.fetch.bytes, so a
    listener under load merging up to 1 MiB broke that bound (and a fetch quota's window)."""
    from compat_kafka.partitions.partition import MERGED_BATCH_BYTES

    _create(shim, topic)
    value = b"x" * 1000
    small = [_batch([(None, value, [], 1000 + j) for j in range(15)]) for _ in range(48)]  # ~15 KB each
    assert sum(map(len, small)) > 2.5 * MERGED_BATCH_BYTES
    with RawConnection(shim.port) as conn:
        assert _produce(conn, topic, _batch([(None, b"first", [], 1000)])).error_code == ErrorCode.none
        lac = _lac(shim, topic)
        r = _produce(conn, topic, b"".join(small))  # one request: merged as they come
        assert (r.error_code, r.base_offset) == (ErrorCode.none, 1)
        entries = _lac(shim, topic) - lac
    assert 3 <= entries < len(small), entries  # merged (not one entry each), but not all into one
    got = _read(shim.bootstrap, topic, 1 + 48 * 15)
    assert [o for o, *_ in got] == list(range(1 + 48 * 15)) and all(v == value for _o, _k, v, _h, _t in got[1:])


def test_the_high_watermark_is_an_entry_end_when_a_batch_is_split_over_two_entries(shim, topic):
    """A fetch serves stored entries whole, so the high watermark must never lie inside one. When the
    listener's open merged batch fills in the middle of a Kafka batch, that batch's first records go
    out in one entry and the rest in the next. The first entry's acknowledgement must move the high
    watermark to that entry's end: it used to move only to the end of the last batch wholly inside
    it, so a tailing consumer was given records past the high watermark, its next fetch was "out of
    range" and it reset to the end, skipping records (seen in bench/kafka.py's paced phases)."""
    import asyncio

    from compat_kafka.partitions.partition import MERGED_BATCH_BYTES
    from compat_kafka.wire.batches import split_batches

    _create(shim, topic)
    value = b"x" * 1000
    per_batch = 60  # ~60 KB: under merge_batch_bytes, so merged; five of them overflow one merged entry
    blob = b"".join(_batch([(None, value, [], 1000 + j) for j in range(per_batch)]) for _ in range(5))
    assert 4 * len(blob) // 5 < MERGED_BATCH_BYTES < len(blob)  # the fifth batch fills the open merged one
    with RawConnection(shim.port) as conn:
        assert _produce(conn, topic, _batch([(None, b"first", [], 1000)])).error_code == ErrorCode.none  # opens it

    async def append_and_watch():
        plog = shim.server.broker._logs[(topic, 0)]
        _first, futures = await plog.append(split_batches(blob))
        # queued, not acknowledged: a consumer already there is inside the log (Kafka: up to the log
        # end offset), answered nothing until the high watermark passes it, not told "out of range"
        assert plog.high_watermark < plog.next_offset
        plog.check_offset(plog.next_offset)
        seen: list[int] = []
        # futures: one per batch and entry, in offset order; the last two are the split batch's entries
        futures[-2].add_done_callback(lambda _f: seen.append(plog.high_watermark))  # after the listener's own
        await asyncio.gather(*futures)
        return seen, futures[-1].result(), plog.high_watermark  # the second entry's base = the first's end

    seen, first_entry_end, hw = asyncio.run_coroutine_threadsafe(append_and_watch(), shim.loop).result(60)
    assert hw == 1 + 5 * per_batch
    assert 1 + 4 * per_batch < first_entry_end < hw  # the fifth batch really was split
    assert seen == [first_entry_end]  # at the first entry's acknowledgement: its end, not the fourth batch's
    got = _read(shim.bootstrap, topic, 1 + 5 * per_batch)
    assert [o for o, *_ in got] == list(range(1 + 5 * per_batch))
