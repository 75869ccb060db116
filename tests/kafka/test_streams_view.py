"""A topic written by Kafka clients is readable with the streams API (and so by ``scroll consume``
and the Spark source): every compression codec a Kafka client may use, keys, headers, offsets."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import Producer  # noqa: E402

from streams.client import connect  # noqa: E402
from streams.kafka_records import decode_kafka_entry  # noqa: E402
from streams.records import RecordFormatError  # noqa: E402

pytestmark = pytest.mark.process


async def _read_all(url: str, stream: str, want: int) -> list:
    client = await connect(url)
    try:
        c = await client.consumer(stream)
        out = []
        for _ in range(50):
            out += await c.read(1000, timeout_s=0.2)
            if len(out) >= want:
                break
        return out
    finally:
        await client.close()


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_kafka_batches_read_back_as_records_through_the_streams_api(kafka_cluster, shim, topic, codec):
    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "compression.type": codec,
                  "linger.ms": 20})
    sent = []
    for i in range(40):
        key = b"k%d" % (i % 3)
        value = (b"value-%d-" % i) * (i % 7 + 1)
        p.produce(topic, value=value, key=key, headers=[("n", str(i).encode()), ("empty", None)])
        sent.append((key, value, str(i).encode()))
    assert p.flush(30) == 0
    got = asyncio.run(_read_all(kafka_cluster.metadata_url, f"{topic}-0", len(sent)))
    assert [(r.key, r.value, dict(r.headers)["n"]) for r in got] == sent
    assert [r.extra["kafka_offset"] for r in got] == list(range(len(sent)))
    assert all(dict(r.headers)["empty"] is None for r in got)
    assert all(r.timestamp_ms > 0 for r in got)
    positions = [r.position for r in got]
    assert positions == sorted(positions) and len(set(positions)) < len(positions)  # batches share an entry


def test_a_corrupt_kafka_entry_is_a_clear_error():
    with pytest.raises(RecordFormatError, match="truncated|bad"):
        decode_kafka_entry(b"\x02" + b"\x00" * 12 + b"\x00" * 20, 5)


def test_retention_ages_kafka_batches_by_their_record_timestamps(kafka_cluster, shim, topic):
    """Retention's max_age reads the newest record timestamp of a fragment's last entry; for a
    Kafka topic that entry is a batch, so the age comes from the batch's records."""
    import dataclasses

    from streams.retention import fragment_last_timestamp

    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "linger.ms": 20})
    base = 1_600_000_000_000
    for i in range(5):
        p.produce(topic, value=b"v%d" % i, timestamp=base + i * 1000)
    assert p.flush(30) == 0

    async def go():
        client = await connect(kafka_cluster.metadata_url)
        try:
            info = await client.describe_stream(f"{topic}-0")
            c = await client.consumer(f"{topic}-0")
            lac = await c.end_position() - 1
            frag = dataclasses.replace(info.fragments[-1], last_entry_id=lac)  # as if sealed at the LAC
            return await fragment_last_timestamp(client.cluster, info.meta, frag)
        finally:
            await client.close()

    assert asyncio.run(go()) == base + 4000
