"""Storage engine behaviour that the model test does not single out: caches and truncation,
corruption, space reclaimed by GC, the read-only states, back-pressure."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest

from bookie import digest
from bookie.entrylog import log_files
from bookie.errors import BadRequestError, CorruptEntryError, ReadOnlyError, Status
from bookie.storage import Engine

from .helpers import dir_bytes, run


def add(engine: Engine, ledger: int, ids, term: int = 1, *, data=None, truncate: bool = False, recovery: bool = False, lac: int = -1):
    ids = list(ids)
    datas = [data(i) if callable(data) else (data or b"e%d-%d" % (ledger, i)) for i in ids]
    n = len(ids)
    return engine.add_batch(
        [ledger] * n, ids, [term] * n, [lac] * n, [lac] * n, [truncate] * n, [recovery] * n, [0] * n,
        [digest.crc32c_digest(ledger, i, d) for i, d in zip(ids, datas)], datas,
    )


def start(engine: Engine, ledger: int, term: int = 1) -> None:
    """What a take-over does first on a bookie: the truncating no-op at entry 0."""
    assert add(engine, ledger, [0], term, truncate=True).statuses is None


def test_truncate_drops_ids_from_every_cache_and_the_index(make_engine) -> None:
    e = make_engine()
    start(e, 1)
    add(e, 1, range(1, 40), data=lambda i: b"old-%d" % i)
    e.flush()  # 1..39 in the entry log and the index
    assert e.read_entry(1, 20).data == b"old-20"  # fills the read cache
    add(e, 1, range(40, 50), data=lambda i: b"old-%d" % i)  # 40..49 in the write cache
    # a new term truncates from 10 and reuses the ids with new data
    assert add(e, 1, [10], 2, truncate=True, data=b"noop").statuses is None
    add(e, 1, [11, 12], 2, data=lambda i: b"new-%d" % i)
    for entry_id, want in [(9, b"old-9"), (10, b"noop"), (11, b"new-11"), (12, b"new-12")]:
        got = e.read_entry(1, entry_id)
        assert got.data == want
    for gone in (13, 20, 39, 45):
        assert e.read_entry(1, gone) is None
    assert e.read_entry(1, 11).entry_term == 2 and e.read_entry(1, 9).entry_term == 1
    e.checkpoint()
    assert e.read_entry(1, 20) is None and e.read_entry(1, 12).data == b"new-12"
    e.close()
    e2 = make_engine()
    assert e2.read_entry(1, 20) is None and e2.read_entry(1, 11).data == b"new-11"


def test_range_reads_stop_at_the_first_gap_and_respect_limits(make_engine) -> None:
    e = make_engine()
    start(e, 1)
    add(e, 1, range(1, 30), data=b"x" * 100)
    e.flush()
    add(e, 1, range(30, 60), data=b"y" * 100)  # half on disk, half in memory
    res = e.read_range(1, 0, 100)
    assert [i for i, _e in res.entries] == list(range(60)) and res.stop == Status.NO_SUCH_ENTRY
    res = e.read_range(1, 5, 100, max_entries=7)
    assert [i for i, _e in res.entries] == list(range(5, 12))
    res = e.read_range(1, 5, 100, max_bytes=350)
    assert len(res.entries) == 3 and res.stop == Status.OK


def test_a_corrupt_entry_is_reported_never_served(make_engine) -> None:
    e = make_engine()
    start(e, 1)
    add(e, 1, range(1, 5), data=lambda i: b"payload-%d" % i * 10)
    e.checkpoint()
    e.close()
    path = log_files(e.config.data_dir / "entrylogs")[-1][1]
    raw = bytearray(path.read_bytes())
    at = raw.find(b"payload-3")
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    e2 = make_engine()
    assert e2.read_entry(1, 2).data.startswith(b"payload-2")
    with pytest.raises(CorruptEntryError):
        e2.read_entry(1, 3)
    res = e2.read_range(1, 1, 4)
    assert [i for i, _e in res.entries] == [1, 2] and res.stop == Status.CORRUPT


def test_gc_gives_disk_space_back(make_engine) -> None:
    e = make_engine()
    data_dir = e.config.data_dir
    for ledger in (1, 2):
        start(e, ledger)
    payload = b"z" * 8000
    for first in range(1, 400, 50):
        for ledger in (1, 2):
            add(e, ledger, range(first, first + 50), data=payload)
        e.checkpoint()
    full = dir_bytes(data_dir)
    assert full > 2 * 400 * 8000 * 0.9
    e.delete_ledger(1)
    e.trim(2, 0, 299)
    e.checkpoint()
    result = e.gc()
    e.checkpoint()
    after = dir_bytes(data_dir)
    assert result.reclaimed_bytes > 0
    assert after < full * 0.4, (full, after)
    # what is left is intact
    assert [i for i, _e in e.read_range(2, 300, 500).entries] == list(range(300, 401))
    e.close()
    e2 = make_engine()
    assert e2.read_entry(2, 350).data == payload and 1 not in e2.states


def test_floor_turns_read_only_and_back(make_engine) -> None:
    e = make_engine(min_free_bytes=1 << 62)  # more than any disk has
    assert e.read_only_reason is not None and "floor" in e.read_only_reason
    out = add(e, 1, [0], truncate=True)
    assert out.statuses == [Status.READ_ONLY]
    with pytest.raises(ReadOnlyError):
        e.fence(1, 1)
    e.set_min_free_bytes(0)
    assert e.read_only_reason is None
    start(e, 1)
    assert e.read_entry(1, 0) is not None


def test_enospc_in_the_journal_turns_read_only_until_space_returns(make_engine) -> None:
    async def scenario() -> None:
        e = make_engine()
        await e.start()
        start(e, 1)
        await e.wait_durable(e.journal.last_seq)
        real = e.journal.write_group
        broken = {"on": True}

        def full_disk(group):
            if broken["on"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(group)

        e.journal.write_group = full_disk
        out = add(e, 1, [1, 2])
        with pytest.raises(Exception) as info:
            await e.wait_durable(out.seq)
        assert info.value.status == Status.STORAGE_ERROR
        assert e.read_only_reason and "disk write failed" in e.read_only_reason
        assert add(e, 1, [3]).statuses == [Status.READ_ONLY]
        broken["on"] = False
        e.check_disk()  # space is back: the journal retries the records it kept
        await e.wait_durable(out.seq)
        e.check_disk()
        assert e.read_only_reason is None
        assert add(e, 1, [3]).statuses is None
        assert [i for i, _x in e.read_range(1, 0, 10).entries] == [0, 1, 2, 3]
        await e.aclose()

    run(scenario())


def test_a_full_write_cache_holds_adds_until_a_flush_frees_it(make_engine) -> None:
    async def scenario() -> None:
        e = make_engine(write_cache_bytes=1 << 20, max_batch_bytes=256 * 1024)
        await e.start()
        gate = threading.Event()
        real = e.flusher.run

        def slow_flush(job):
            gate.wait(30)
            return real(job)

        e.flusher.run = slow_flush
        start(e, 1)
        first = 1
        while e.write_cache.bytes < e.config.write_cache_bytes:
            add(e, 1, range(first, first + 100), data=b"w" * 2000)
            first += 100
        waiter = asyncio.ensure_future(e.wait_for_space())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiter.done()  # back-pressure: held while the cache is full
        gate.set()
        await asyncio.wait_for(waiter, 30)
        assert e.write_cache.bytes < e.config.write_cache_bytes
        await e.aclose()

    run(scenario())


def test_a_bad_digest_is_refused_at_ingest_or_caught_on_read(make_engine) -> None:
    checked = make_engine(verify_digest_on_add=True)
    start(checked, 1)
    out = checked.add_batch([1], [1], [1], [0], [0], [False], [False], [0], [b"\0\0\0\0"], [b"data"])
    assert out.statuses == [Status.BAD_DIGEST] and checked.read_entry(1, 1) is None
    checked.close()
    lenient = make_engine()  # the default: stored as sent, and every read checks it
    assert lenient.add_batch([1], [1], [1], [0], [0], [False], [False], [0], [b"\0\0\0\0"], [b"data"]).statuses is None
    with pytest.raises(CorruptEntryError):
        lenient.read_entry(1, 1)


def test_an_overwriting_add_replaces_the_read_cache_copy(make_engine) -> None:
    e = make_engine()
    start(e, 1)
    add(e, 1, [1], data=b"first")
    e.flush()
    assert e.read_entry(1, 1).data == b"first"  # now in the read cache
    add(e, 1, [1], 2, recovery=True, data=b"second")  # a take-over write-back rewrites the id
    e.flush()  # the write cache no longer shadows the read cache
    got = e.read_entry(1, 1)
    assert (got.entry_term, got.data) == (2, b"second")


def test_a_read_that_raced_a_compaction_finds_the_moved_entries(make_engine) -> None:
    e = make_engine()
    start(e, 1)
    add(e, 1, range(1, 40), data=lambda i: b"keep-%d" % i * 300)
    add(e, 2, [0], truncate=True)
    for first in range(1, 200, 100):
        add(e, 2, range(first, first + 100), data=b"x" * 3000)
    e.checkpoint()
    stale = e._locate_run(1, 1, 39, 1 << 30)  # what a reader looked up before the compaction
    e.delete_ledger(2)
    e.checkpoint()
    assert e.gc().logs_compacted > 0
    assert not all((e.flusher.log_dir / f"entrylog-{loc[0]:010d}.log").exists() for _i, loc in stale)
    from bookie.entrylog import LogReader
    from bookie.storage import _spans

    with LogReader(e.flusher.log_dir) as reader:
        got = []
        for span in _spans(stale):
            found, corrupt = e._read_span(reader, 1, span)
            assert not corrupt
            got += found
    assert [(i, entry[3]) for i, entry in got] == [(i, b"keep-%d" % i * 300) for i in range(1, 40)]


def test_a_lac_only_write_wakes_tail_readers_without_a_journal_record(make_engine) -> None:
    """A LAC write that moves only the LAC/LAFR (the writer's eager push after each entry at low
    rates) is answered without journaling (no record, so no fsync before the answer) yet wakes the
    long polls at once. A restart that forgets it still knows the LAC the adds carried; a LAC
    write that changes the term is journaled as before."""
    e = make_engine()

    async def scenario() -> None:
        start(e, 1)
        add(e, 1, [1, 2], lac=1)  # the adds carry LAC 1
        seq = e.applied_seq
        waiter = e.lac_waiter(1, 1)
        decision, _ = e.write_lac(1, 1, 2, 2)
        assert decision.state.lac == 2 and e.state(1).lac == 2
        assert e.applied_seq == seq  # no journal record
        assert waiter.done() and waiter.result() == 2  # the parked tail read is answered now
        with pytest.raises(BadRequestError):
            e.write_lac(1, 1, -5, 0)  # bad input: refused, nothing changed
        assert e.state(1).lac == 2

    run(scenario())
    e.close()
    e2 = make_engine()
    assert e2.state(1).lac >= 1  # at least what the journaled adds carried


def test_a_parked_tail_read_is_answered_inside_the_add_that_moves_the_lac(make_engine) -> None:
    """The add carrying a higher LAC wakes a parked long poll synchronously, before the add's own
    journal record is synced (the reader learns an entry acknowledged elsewhere without waiting
    for this bookie's fsync of the next one), and only once the LAC passes what it waits for."""
    e = make_engine()

    async def scenario() -> None:
        start(e, 1)
        add(e, 1, [1], lac=0)
        seen: list[tuple[int, int]] = []
        fut = e.lac_waiter(1, 1, lambda: seen.append((e.state(1).lac, e.journal.synced_seq)))
        add(e, 1, [2], lac=1)  # LAC 1: not past 1, keeps waiting
        assert seen == [] and not fut.done()
        outcome = add(e, 1, [3], lac=2)
        assert [lac for lac, _ in seen] == [2] and fut.result() == 2
        assert seen[0][1] < outcome.seq  # answered before this add's record was durable
        assert e.lac_waiter(1, 1, lambda: seen.append((-1, -1))) is None  # already past: no waiter

    run(scenario())
