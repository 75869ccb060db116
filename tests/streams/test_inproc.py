"""The client over real gRPC bookie servers running in this process and the in-process metadata
store: fast checks of the driver and the consumer (the multi-process tests are in test_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest

from bookie.config import BookieConfig
from bookie.server import BookieServer
from fragments.memstore import MemoryStore
from fragments.registry import BookieRegistration, register_bookie
from streams.batches import RecordFormatError, stored_batch
from streams.client import ScrollClient
from streams.cluster import Cluster
from streams.driver import ProducerOptions
from streams.errors import StaleTermError


async def start_cluster(tmp_path, n=4):
    store = MemoryStore()
    servers, regs = [], []
    for i in range(n):
        cfg = BookieConfig(data_dir=tmp_path / f"b{i}", bookie_id=f"b{i}").with_overrides({"min_free_bytes": "0"})
        s = BookieServer(cfg, port=0)
        await s.start()
        servers.append(s)
        regs.append(await register_bookie(store, BookieRegistration(f"b{i}", s.address), ttl_s=30))
    client = ScrollClient(Cluster(store, add_timeout_s=5.0, call_timeout_s=5.0))
    return client, servers, regs


async def stop_cluster(client, servers, regs):
    for r in regs:
        await r.close()
    await client.close()
    for s in servers:
        await s.stop()


def test_produce_consume_take_over_in_process(tmp_path):
    """Offsets are dense across batches, fragments and a take-over; every new fragment records its
    first offset; seeks by offset and timestamp land on the right record."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            await client.create_stream("s", ensemble=3, write_quorum=2, ack_quorum=2, fragment_entries_max=5)
            p1 = await client.producer("s", ProducerOptions(batch_bytes=1024))  # ~9 records per batch
            futs = [await p1.append_future(b"a%03d" % i + b"." * 90, timestamp_ms=1000 + i) for i in range(200)]
            offsets = await asyncio.gather(*futs)
            assert offsets == list(range(200))
            assert p1.next_offset == 200
            p2 = await client.producer("s")  # take-over: learns the next offset from the log
            assert p2.term == p1.term + 1 and p2.next_offset == 200
            with pytest.raises(StaleTermError):
                late = await p1.append_future(b"late")  # raises here, or its future fails
                await late
            with pytest.raises(StaleTermError):
                await p1.append(b"later")
            assert await p2.append(b"b", timestamp_ms=5000) == 200
            assert await p2.append_many([b"c", (b"d", b"key", {"h": b"v"}, 6000)]) == [201, 202]
            c = await client.consumer("s", start="earliest")
            got = []
            while batch := await c.read(1000):
                got.extend(batch)
            assert [r.offset for r in got] == list(range(203))
            assert [r.value[:4] for r in got[:200]] == [b"a%03d" % i for i in range(200)]
            assert (got[-1].key, got[-1].headers, got[-1].timestamp_ms) == (b"key", (("h", b"v"),), 6000)
            assert c.position == 203 and await c.end_position() == 203
            info = await client.describe_stream("s")
            assert len(info.fragments) >= 4
            known = [f.first_offset for f in info.fragments if f.first_offset is not None]
            assert known == sorted(known) and len(known) >= 3 and known[0] == 0
            for want in (0, 1, 57, 133, 199, 200, 202):
                await c.seek(want)
                assert (await c.read(1))[0].offset == want
            assert await c.seek_timestamp(1100) == 100
            assert (await c.read(1))[0].timestamp_ms == 1100
            await c.seek(203)
            assert await c.read(10) == []
            await p2.close()
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())


def test_seeking_costs_logarithmic_reads_and_repeats_are_cached(tmp_path):
    """A seek narrows to a fragment by its first offset (metadata), then binary-searches its
    entries with single-entry reads: at most ~log2(entries) + a few reads, and a seek near a point
    already learnt reads nothing."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            await client.create_stream("s", ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=1500)
            p = await client.producer("s", ProducerOptions(batch_bytes=1024))
            # 3000 entries of 3 records each: batches hold [3i, 3i + 3)
            await p.append_many([b"v" * 300] * 9000)
            await p.close()
            info = await client.describe_stream("s")
            assert len(info.fragments) >= 2 and info.fragments[0].first_offset == 0
            for f in info.fragments[1:]:  # entry 0 is the take-over's no-op; entry k holds [3k - 3, 3k)
                assert f.first_offset == 3 * (f.first_entry_id - 1), f
            c = await client.consumer("s", start="earliest")
            reads = []
            real = c.read_raw

            async def counting(first, last):
                reads.append((first, last))
                return await real(first, last)

            c.read_raw = counting
            for offset in (4000, 12, 8999, 6001):
                reads.clear()
                await c.seek(offset)
                assert len(reads) <= 14, (offset, reads)  # log2(1500) ~ 11, plus a no-op step or two
                assert (await c.read(1))[0].offset == offset
            reads.clear()
            await c.seek(4001)  # inside the batch found for 4000 (or next to it): no reads
            assert len(reads) <= 1
            assert (await c.read(1))[0].offset == 4001
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())


def test_a_stream_whose_entries_are_not_record_batches_is_refused_clearly(tmp_path):
    """Format 1 is gone: an entry that is not a Kafka RecordBatch is an error that says so, for a
    consumer and for a producer taking the stream over, and the batches before it stay readable."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            await client.create_stream("s", ensemble=3, write_quorum=3, ack_quorum=2)
            p = await client.producer("s")
            assert await p.append(b"good") == 0
            await p._driver.append_nowait(b"\x01old format record")  # what the old streams API wrote
            await p.close()
            c = await client.consumer("s")
            assert [r.value for r in await c.read(1)] == [b"good"]
            with pytest.raises(RecordFormatError, match="not a Kafka record batch"):
                await c.read(10)
            with pytest.raises(RecordFormatError, match="not a Kafka record batch"):
                await client.producer("s")
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())


def test_a_tailing_consumer_follows_a_rollover_onto_other_bookies(tmp_path):
    """The consumer long-polls the LAC on the bookies of the last fragment it knows. When the
    writer rolls over onto bookies outside that fragment, the old members' LAC stops moving: the
    consumer must notice (a poll without progress re-reads the fragments) instead of waiting on
    them for ever."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path, n=6)
        try:
            await client.create_stream("s", ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=3)
            first = (await client.describe_stream("s")).fragments[0].ensemble
            for r in regs:  # only the other three stay live, so every new fragment goes there
                if r.registration.bookie_id in first:
                    await r.close()
            p = await client.producer("s", ProducerOptions(batch_bytes=1024))
            c = await client.consumer("s", start="latest")  # this term, fragment 0 cached, at the tail
            await p.append_many([b"x" * 600] * 12)  # one record per entry: rollovers
            info = await client.describe_stream("s")
            assert set(info.fragments[-1].ensemble).isdisjoint(first)
            got = []
            while len(got) < 12:
                batch = await c.read(100, timeout_s=15.0)  # without the re-read: stalls for ever
                assert batch, f"the consumer stalled after {len(got)} records"
                got.extend(batch)
            assert [r.offset for r in got] == list(range(12))
            await p.close()
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())


def test_compressed_batches_read_back_identically(tmp_path):
    """Every compression codec Kafka has: the producer compresses whole batches (aiokafka's
    codecs), the consumer reads the same records at the same offsets."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            for i, codec in enumerate(("gzip", "snappy", "lz4", "zstd")):
                await client.create_stream(f"c{i}", ensemble=3, write_quorum=3, ack_quorum=2)
                p = await client.producer(f"c{i}", ProducerOptions(compression=codec))
                recs = [(b"value %d " % n * 20, b"k%d" % (n % 7), {"n": b"%d" % n}, 1_700_000_000_000 + n)
                        for n in range(500)]
                assert await p.append_many(recs) == list(range(500))
                await p.close()
                c = await client.consumer(f"c{i}")
                got = await c.read(1000)
                assert [(r.value, r.key, r.headers, r.timestamp_ms, r.offset) for r in got] == \
                    [(v, k, (("n", h["n"]),), ts, n) for n, (v, k, h, ts) in enumerate(recs)], codec
                raw = await c.read_raw(1, 1)  # entry 0 is the take-over's no-op
                assert raw[0].data[1 + 22] & 0x07 == ("none", "gzip", "snappy", "lz4", "zstd").index(codec)
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())


def test_records_appended_while_a_batch_is_in_flight_go_out_together(tmp_path):
    """Nagle's rule for batches: with nothing in flight a lone record leaves at once (its own
    entry); records appended over several loop turns while that entry is in flight wait for its
    acknowledgement and then leave as one entry, not one entry per turn."""
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            await client.create_stream("s")
            p = await client.producer("s")
            transports = [c.transport for s in servers for c in s.data.connections]
            for t in transports:  # the bookies take no adds: the first entry stays in flight
                t.pause_reading()
            first = await p.append_future(b"lone")
            rest = []
            for turn in range(5):
                await asyncio.sleep(0)  # a loop turn: the producer's idle hand-off runs
                rest += [await p.append_future(b"r%d-%d" % (turn, i)) for i in range(10)]
            for t in transports:
                t.resume_reading()
            assert await asyncio.gather(first, *rest) == list(range(51))
            c = await client.consumer("s")
            entries = [e for e in await c.read_raw(0, 10) if stored_batch(e.entry_id, e.data) is not None]
            assert [stored_batch(e.entry_id, e.data).offset_count for e in entries] == [1, 50]
            await p.close()
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())
