"""Reading offloaded fragments (streams/tier/reader.py, the consumer's tier path): against real
bookies and a real SeaweedFS, through the native consumer, the Kafka listener and the admin check,
plus the reader's own range and read-ahead logic against an in-memory store.

Offloaded fragments are made here without the offload job: a sealed fragment's entries are read
(``Consumer.read_raw``), built into an object (``SegmentBuilder``), PUT, and the fragment record is
CASed to ``offloaded`` (local), then to released (``local: false``), then its bookie copies are
trimmed -- the order the job follows.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from bookie.client import BookieClient
from fragments.model import Fragment
from fragments.tier import TIER_CONFIG_KEY, object_name, remote_only
from streams.batches import BatchBuilder
from streams.client import connect
from streams.errors import ObjectDataLost, ReadFailedError, TierReadError
from streams.tier.objstore import ObjectMissing, ObjectStore
from streams.tier.reader import TierReader
from streams.tier.segment import SegmentBuilder
from streams.tools import admin
from streams.tools.localcluster import LocalCluster, free_port
from terms.entry import KIND_DATA

KIND = bytes([KIND_DATA])
INDEX_EVERY = 1024  # small chunks, so a test object has many index points


# ----------------------------------------------------------------------------------- the reader alone
class MemStore:
    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.gets: list[tuple[str, int, int]] = []

    async def get_range(self, key, start, end):
        self.gets.append((key, start, end))
        await asyncio.sleep(0)
        if key not in self.objects:
            raise ObjectMissing(f"get {key!r}: 404")
        return self.objects[key][start:end]


def _object(n_entries=400, first_entry=50, first_offset=1000, recs=3, skip_every=17):
    entries, off, ts = [], first_offset, 10_000
    for i in range(n_entries):
        eid = first_entry + i
        if i % skip_every == 5:
            entries.append((eid, b"\x01" + bytes(8)))  # a no-op
            continue
        b = BatchBuilder(0, 1 << 20)
        for k in range(recs):
            assert b.append(b"value-%d-%d-" % (eid, k) + bytes(200), b"k", [], ts)
            ts += 5
        entries.append((eid, KIND + bytes(b.build(off))))
        off += recs
    sb = SegmentBuilder(first_entry, created_term=7, index_every=INDEX_EVERY)
    for eid, d in entries:
        sb.add(eid, d)
    obj, footer = sb.finish()
    f = Fragment(index=3, first_entry_id=first_entry, ensemble=("a", "b", "c"), created_term=7,
                 last_entry_id=first_entry + n_entries - 1, first_offset=first_offset,
                 tier={"state": "offloaded", "key": "p/9/3.x.seg", "size": len(obj), "crc": footer.body_crc,
                       "local": False})
    want = {eid: (b"" if d[:1] != KIND else d) for eid, d in entries}
    return f, obj, want


def test_reader_entries_from_anywhere_and_read_ahead():
    async def main():
        f, obj, want = _object()
        store = MemStore()
        store.objects[f.tier["key"]] = obj
        r = TierReader(store, range_bytes=64 * 1024, in_flight=3)
        # from any entry, contiguous, the object's bytes, the fragment's term
        for first in (50, 51, 55, 56, 200, 449):
            got = await r.read_entries(f, first, first + 30, 1 << 20, stream="s")
            assert [e.entry_id for e in got] == list(range(first, min(449, first + 30) + 1))
            assert all(e.data == want[e.entry_id] and e.entry_term == 7 for e in got)
        assert sum(1 for g in store.gets if g[2] == len(obj)) == 1  # one tail GET: the index is cached
        # a one-entry probe reads one chunk, not the body
        store.gets.clear()
        got = await r.read_entries(f, 300, 300, 1 << 20)
        assert [e.entry_id for e in got] == [300]
        assert len(store.gets) == 1 and store.gets[0][2] - store.gets[0][1] <= INDEX_EVERY + 1024
        # a sequential reader of a backlog: small calls, pieces fetched ahead, every byte GET once
        store.gets.clear()
        out, at = [], 50
        while at <= 449:
            got = await r.read_entries(f, at, 449, 8 * 1024)
            out.extend(got)
            at = got[-1].entry_id + 1
        assert [e.entry_id for e in out] == list(range(50, 450))
        assert all(e.data == want[e.entry_id] for e in out)
        spans = sorted((s, e) for _k, s, e in store.gets)
        assert spans[0][0] == 0 and spans[-1][1] <= len(obj)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "pieces are contiguous, none fetched twice"
        assert len(store.gets) < 20, "fetched in range_bytes pieces, not per call"
        assert len(r._runs) <= r.max_runs

    asyncio.run(main())


def test_reader_missing_and_corrupt_objects_raise_naming_what_was_lost():
    async def main():
        f, obj, _want = _object()
        store = MemStore()
        r = TierReader(store)
        with pytest.raises(ObjectDataLost) as ei:
            await r.read_entries(f, 60, 70, 1 << 20, stream="orders")
        msg = str(ei.value)
        assert "orders" in msg and "60..70" in msg and f.tier["key"] in msg and "missing" in msg
        assert not ei.value.retriable
        bad = bytearray(obj)
        bad[3000] ^= 0xFF  # inside a batch's records: its CRC
        store.objects[f.tier["key"]] = bytes(bad)
        r = TierReader(store)
        with pytest.raises(ObjectDataLost, match="CRC mismatch") as ei:
            for at in range(50, 450, 40):
                await r.read_entries(f, at, at + 39, 1 << 20, stream="orders")
        assert f.tier["key"] in str(ei.value) and "offsets" in str(ei.value)
        # a corrupt footer
        bad = bytearray(obj)
        bad[-20] ^= 0xFF
        store.objects[f.tier["key"]] = bytes(bad)
        with pytest.raises(ObjectDataLost, match="footer"):
            await TierReader(store).read_entries(f, 50, 60, 1 << 20, stream="orders")

    asyncio.run(main())


# ----------------------------------------------------------------------------------- real cluster + store
@pytest.fixture(scope="module")
def tenv(tmp_path_factory):
    from streams.tier.seaweed import SeaweedS3

    cluster = LocalCluster(tmp_path_factory.mktemp("tier-cluster"), bookies=3)
    cluster.start()
    s3 = SeaweedS3(tmp_path_factory.mktemp("tier-s3"), s3_port=free_port(), master_port=free_port(),
                   volume_port=free_port(), filer_port=free_port())
    try:
        s3.start()
        config = s3.tier_config(prefix="tiertest", connect_timeout_s=1.0, request_timeout_s=2.0, retries=1,
                                retry_timeout_s=1.0)

        async def put():
            c = await connect(cluster.metadata_url)
            await c.cluster.store.put(TIER_CONFIG_KEY, json.dumps(config.to_dict()).encode())
            await c.close()

        asyncio.run(put())
        yield cluster, s3, config
    finally:
        if s3.proc is not None and s3.proc.alive:
            os.kill(s3.pid, signal.SIGCONT)
        s3.stop()
        cluster.stop()


_n = [0]


def _name(tag):
    _n[0] += 1
    return f"tier-{tag}-{_n[0]}"


def _records(n, start=0):
    return [{"value": b"value-%d-" % i + bytes(i % 50), "key": None if i % 7 == 0 else b"k%d" % (i % 5),
             "headers": [("h", b"x%d" % i)] if i % 3 else [], "timestamp_ms": 1_700_000_000_000 + i * 10}
            for i in range(start, start + n)]


async def _make(client, name, n=600, per_call=5, per_fragment=12):
    """n records, per_call to a batch (one entry), fragments of per_fragment entries."""
    await client.create_stream(name, fragment_entries_max=per_fragment)
    p = await client.producer(name)
    recs = _records(n)
    for i in range(0, n, per_call):
        await p.append_many(recs[i:i + per_call])
    await p.close()


def _rec(r):
    return (r.offset, r.key, r.value, [tuple(h) for h in r.headers], r.timestamp_ms)


async def _read_all(client, name, start="earliest", **opts):
    c = await client.consumer(name, start=start, **opts)
    end = await c.end_position()
    out = []
    while c.position < end:
        out.extend(await c.read(500, 5.0))
    await c.close()
    return [_rec(r) for r in out]


async def _offload(client, config, name, count, release=True, trim=True):
    """Offload the first ``count`` fragments (sealed); release and trim them if asked."""
    ledgers = client.cluster.ledgers
    meta, _ = await ledgers.get_ledger(name)
    frags = await ledgers.fragments(meta.ledger_id)
    store = ObjectStore(config)
    c = await client.consumer(name, start="earliest")
    done = []
    for f in frags[:count]:
        assert f.sealed
        sb = SegmentBuilder(f.first_entry_id, f.created_term, index_every=INDEX_EVERY)
        at = f.first_entry_id
        while at <= f.last_entry_id:
            for e in await c.read_raw(at, f.last_entry_id):
                sb.add(e.entry_id, e.data)
                at = e.entry_id + 1
        obj, footer = sb.finish(first_offset_hint=f.first_offset)
        key = config.key(object_name(meta.ledger_id, f.index, uuid.uuid4().hex[:8]))
        await store.put_if_absent(key, obj)
        tier = {"state": "offloaded", "key": key, "size": len(obj), "crc": footer.body_crc, "local": True}
        await _set_tier(client, meta.ledger_id, f.index, tier)
        done.append((f, key, obj))
    await c.close()
    if release:
        for f, _key, _obj in done:
            await _release(client, meta.ledger_id, f, trim)
    return done


async def _set_tier(client, ledger_id, index, tier):
    ledgers = client.cluster.ledgers
    for _ in range(20):
        meta, version = await ledgers.get_ledger(ledger_id)
        cur = await ledgers.get_fragment(ledger_id, index)
        if await ledgers.cas_ledger(meta, (cur.with_(tier=tier),), version) is not None:
            return
    raise AssertionError("CAS kept failing")


async def _release(client, ledger_id, f, trim=True):
    cur = await client.cluster.ledgers.get_fragment(ledger_id, f.index)
    await _set_tier(client, ledger_id, f.index, {**cur.tier, "local": False})
    if trim:
        await client.cluster.refresh_bookies()
        for b in f.ensemble:
            await client.cluster.client(b).trim(ledger_id, f.first_entry_id, f.last_entry_id)


class ReadCounter:
    """Counts bookie reads of a ledger's entries (every BookieClient of this process)."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig = BookieClient._read

        async def _read(bc, ledger_id, first, last, *a, **kw):
            self.calls.append((ledger_id, first, last))
            return await orig(bc, ledger_id, first, last, *a, **kw)

        monkeypatch.setattr(BookieClient, "_read", _read)

    def touching(self, ledger_id, first, last):
        return [c for c in self.calls if c[0] == ledger_id and c[1] <= last and c[2] >= first]


@pytest.mark.process
def test_native_reads_of_remote_fragments_equal_the_bookie_reads(tenv, monkeypatch):
    cluster, _s3, config = tenv
    name = _name("native")

    async def main():
        client = await connect(cluster.metadata_url)
        await _make(client, name)
        before = await _read_all(client, name)
        assert [r[0] for r in before] == list(range(600))
        done = await _offload(client, config, name, 5)
        await client.close()
        ledger = (await _ledger(cluster, name))
        remote_last = done[-1][0].last_entry_id
        counter = ReadCounter(monkeypatch)

        client = await connect(cluster.metadata_url)
        try:
            assert await _read_all(client, name) == before
            assert not counter.touching(ledger, 0, remote_last), "no bookie read for a released fragment"
            tier = await client.cluster.tier_reader()
            assert tier.gets > 0
            # a seek into the middle of a remote fragment: the index and one chunk, not the object
            f2 = done[2][0]
            mid = f2.first_offset + 7
            gets, got = tier.gets, tier.bytes_got
            c = await client.consumer(name, start=mid)
            assert c.position == mid
            assert tier.bytes_got - got < done[2][2].__len__(), "the seek read less than the object"
            rest = []
            end = await c.end_position()
            while c.position < end:
                rest.extend(_rec(r) for r in await c.read(500, 5.0))
            assert rest == before[mid:]
            assert tier.gets > gets
            # by timestamp, inside a remote fragment and at its first record
            for off in (mid + 3, done[1][0].first_offset, 1):
                ts = before[off][4]
                assert await c.seek_timestamp(ts) == off
                assert _rec((await c.read(1))[0]) == before[off]
                assert await c.seek_timestamp(ts - 1) == off  # between two records: the next one
            # offset lookups over the remote prefix
            for off in (0, 1, f2.first_offset, f2.first_offset - 1, mid):
                await c.seek(off)
                assert _rec((await c.read(1))[0]) == before[off]
            assert c.fragments[0].tier and remote_only(c.fragments[0])
            assert await c.earliest_offset() == 0
            await c.close()
            assert not counter.touching(ledger, 0, remote_last)
        finally:
            await client.close()

    asyncio.run(main())


async def _ledger(cluster, name):
    c = await connect(cluster.metadata_url)
    try:
        return (await c.cluster.ledgers.get_ledger(name))[0].ledger_id
    finally:
        await c.close()


@pytest.mark.process
def test_reader_paused_in_a_fragment_released_under_it_resumes_on_the_object(tenv):
    cluster, _s3, config = tenv
    name = _name("paused")

    async def main():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=300)
            before = await _read_all(client, name)
            meta, _ = await client.cluster.ledgers.get_ledger(name)
            frags = await client.cluster.ledgers.fragments(meta.ledger_id)
            f1 = frags[1]
            # a consumer half way through fragment 1, reading a few entries at a time, no read-ahead
            c = await client.consumer(name, start="earliest", max_read_entries=3, read_ahead=False)
            got = []
            while c.entry < f1.first_entry_id + (f1.last_entry_id - f1.first_entry_id) // 2:
                got.extend(_rec(r) for r in await c.read(5))
            # the fragments through 1 are offloaded, released, and their bookie copies trimmed
            await _offload(client, config, name, 2)
            tier = await client.cluster.tier_reader()
            gets = tier.gets if tier is not None else 0
            end = await c.end_position()
            while c.position < end:
                got.extend(_rec(r) for r in await c.read(7, 5.0))
            assert got == before, "nothing skipped or repeated"
            tier = await client.cluster.tier_reader()
            assert tier.gets > gets, "the rest of fragment 1 came from its object"
            await c.close()
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.process
def test_offloaded_but_local_fragment_falls_back_to_the_object(tenv):
    cluster, _s3, config = tenv
    name = _name("fallback")

    async def main():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=200)
            before = await _read_all(client, name)
            meta, _ = await client.cluster.ledgers.get_ledger(name)
            done = await _offload(client, config, name, 2, release=False)
            for f, _k, _o in done:  # bookie copies gone but the record still says local
                for b in f.ensemble:
                    await client.cluster.client(b).trim(meta.ledger_id, f.first_entry_id, f.last_entry_id)
        finally:
            await client.close()
        client = await connect(cluster.metadata_url)
        try:
            assert await _read_all(client, name) == before
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.process
def test_missing_or_corrupt_object_fails_the_read_naming_stream_offsets_and_key(tenv):
    cluster, _s3, config = tenv
    name = _name("lost")

    async def main():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=200)
            done = await _offload(client, config, name, 2)
        finally:
            await client.close()
        store = ObjectStore(config)
        f0, key0, obj0 = done[0]
        f1, key1, obj1 = done[1]
        bad = bytearray(obj1)
        bad[len(bad) // 3] ^= 0x55  # a byte of the body flipped
        await store.delete(key1)
        await store.put_if_absent(key1, bytes(bad))
        await store.delete(key0)
        client = await connect(cluster.metadata_url)
        try:
            await client.consumer(name, start=f0.first_offset + 2)  # seek: the index of a missing object
        except ObjectDataLost as exc:
            msg = str(exc)
            assert name in msg and key0 in msg and "missing" in msg, msg
        else:
            raise AssertionError("seek into a missing object did not fail")
        try:
            latest = await client.consumer(name, start="latest")
            for how in ("seek", "read"):  # a seek onto the bad chunk; a read of the fragment's entries
                with pytest.raises(ObjectDataLost) as ei:
                    if how == "seek":
                        await client.consumer(name, start=f1.first_offset)
                    at = f1.first_entry_id
                    while at <= f1.last_entry_id:
                        at = (await latest.read_raw(at, f1.last_entry_id))[-1].entry_id + 1
                msg = str(ei.value)
                assert name in msg and key1 in msg and "CRC" in msg and "offsets" in msg, msg
                assert isinstance(ei.value, ReadFailedError) and not ei.value.retriable
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.process
def test_stopped_object_store_fails_the_read_within_its_deadline(tenv):
    cluster, s3, config = tenv
    name = _name("sigstop")

    async def main():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=150)
            done = await _offload(client, config, name, 2)
        finally:
            await client.close()
        client = await connect(cluster.metadata_url)
        os.kill(s3.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(ReadFailedError) as ei:  # the seek (the index) or the read
                c = await client.consumer(name, start="earliest")
                await c.read(10, 1.0)
            took = time.monotonic() - t0
            assert isinstance(ei.value, TierReadError) and ei.value.retriable
            assert done[0][1] in str(ei.value)
            assert took < config.deadline_s + 3, took
        finally:
            os.kill(s3.pid, signal.SIGCONT)
            await client.close()

    asyncio.run(main())


@pytest.mark.process
def test_kafka_fetch_of_an_offloaded_range(tenv):
    from tests.kafka.conftest import ShimThread

    cluster, _s3, config = tenv
    name = _name("kafka")

    async def prep():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=300)
            before = await _read_all(client, name)
            await _offload(client, config, name, 4)
            return before
        finally:
            await client.close()

    before = asyncio.run(prep())
    shim = ShimThread(cluster.metadata_url, free_port())
    shim.start()
    try:
        p = subprocess.run(["kcat", "-b", shim.bootstrap, "-C", "-t", name, "-p", "0", "-o", "beginning", "-e",
                            "-f", "%o\t%k\t%s\t%T\n"], capture_output=True, timeout=60)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.split(b"\n")[:-1]
        got = [tuple(line.split(b"\t")) for line in lines]
        assert [int(g[0]) for g in got] == [r[0] for r in before]
        for g, r in zip(got, before):
            assert g[1] == (r[1] or b"") and g[2] == r[2] and int(g[3]) == r[4]
    finally:
        shim.stop()


@pytest.mark.process
def test_check_reports_released_fragments_as_offloaded_not_missing(tenv):
    cluster, _s3, config = tenv
    name = _name("check")

    async def main():
        client = await connect(cluster.metadata_url)
        try:
            await _make(client, name, n=150)
            done = await _offload(client, config, name, 2)
            reps = await admin.check(client, stream=name)
            by = {r["fragment"]: r for r in reps}
            for f, key, _o in done:
                assert by[f.index]["under_replicated"] == 0 and by[f.index]["action"] == "offloaded", by
                assert by[f.index]["object"] == key
            assert all(r["action"] == "offloaded" for r in reps), reps
            fixed = await admin.check(client, fix=True, stream=name)
            assert all(r["action"] == "offloaded" and r["copied"] == 0 for r in fixed)
            # a missing object is reported
            await ObjectStore(config).delete(done[0][1])
            reps = await admin.check(client, stream=name)
            bad = [r for r in reps if r["fragment"] == done[0][0].index][0]
            assert bad["error"] and "missing" in bad["error"], bad
        finally:
            await client.close()

    asyncio.run(main())


def test_a_reader_that_goes_on_from_inside_its_last_answer_keeps_its_read_ahead():
    """A Kafka fetch drops the batch that would overflow its answer and the next fetch starts at it:
    the reader's window and read-ahead carry on, every byte is fetched once."""
    async def main():
        f, obj, want = _object()
        store = MemStore()
        store.objects[f.tier["key"]] = obj
        r = TierReader(store, range_bytes=64 * 1024, in_flight=3)
        await r.index(f.tier["key"], len(obj))
        store.gets.clear()
        out, at = [], 50
        while at <= 449:
            got = await r.read_entries(f, at, 449, 16 * 1024)
            keep = got if got[-1].entry_id == 449 or len(got) == 1 else got[:-1]  # the overflowing batch goes
            out.extend(keep)
            at = keep[-1].entry_id + 1
        assert [e.entry_id for e in out] == list(range(50, 450))
        assert all(e.data == want[e.entry_id] for e in out)
        spans = sorted((s, e) for _k, s, e in store.gets)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "pieces are contiguous, none fetched twice"

    asyncio.run(main())
