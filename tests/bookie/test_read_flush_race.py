"""A read whose disk part overlaps a flush must not answer a copy that a newer term truncated.

The interleaving (issue 11, and the ``test_kill`` failure of 2026-11-22): a range read sends its
disk part to a read thread, and the index still names term 11's copy of entry X; meanwhile the
flush of the write-cache generation holding term 12's truncating no-op at X (and the tombstone
over the ids after it) commits and drops that generation from memory; back on the event loop the
disk result is checked against the write cache, which no longer knows anything newer. Each test
pauses the disk part right after it read the entry logs (an event, not a sleep), completes the
flush, releases the read, and asserts that term 12's copy is answered and nothing after it.

Every read of entries goes through ``Engine.range_steps`` (the Read RPC, long-poll readers' reads
after a LAC wake-up, and RecoveryRead through ``aread_entry``). A single-entry read checks its id
against the write cache before any disk part, so it can only meet this race for a truncation that
arrived after it began (either answer is then correct); the RPC test below covers the range read.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path

from bookie import digest
from bookie.client import BookieClient
from bookie.server import BookieServer
from bookie.storage import Engine

from .helpers import run, small_config

L = 11
QUIET = dict(flush_interval_s=3600.0)  # no background flush: the test decides when one runs


def _add(e: Engine, ids, term: int, *, truncate: bool = False, lac: int = -1, tag: bytes = b"t") -> None:
    ids = list(ids)
    datas = [tag + b"%d-%d" % (term, i) for i in ids]
    n = len(ids)
    out = e.add_batch([L] * n, ids, [term] * n, [lac] * n, [lac] * n, [truncate] * n, [False] * n, [0] * n,
                      [digest.crc32c_digest(L, i, d) for i, d in zip(ids, datas)], datas)
    assert out.statuses is None, out


def _term_11_flushed_then_term_12_truncates(e: Engine) -> None:
    """Entries 0..9 of term 11 on disk; term 12's truncating no-op at 5 only in the write cache."""
    e.fence(L, 11)
    _add(e, [0], 11, truncate=True)
    _add(e, range(1, 10), 11, lac=0)
    e.flush()
    e.fence(L, 12)
    _add(e, [5], 12, truncate=True, lac=4)


class PausedDiskReads:
    """Wraps ``engine.read_disk``: the first call does its real work, then signals and waits."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.real = engine.read_disk
        self.done_reading = asyncio.Event()
        self.release = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.calls = 0
        engine.read_disk = self  # the engine's read paths look it up on the instance

    def __call__(self, *args):
        result = self.real(*args)
        self.calls += 1
        if self.calls == 1:
            self.loop.call_soon_threadsafe(self.done_reading.set)
            assert self.release.wait(30), "the test never released the paused read"
        return result


@contextlib.asynccontextmanager
async def started(cfg):
    """An engine opened and started on ``cfg`` (its background loops run), closed at the end."""
    e = Engine(cfg)
    e.open()
    await e.start()
    try:
        yield e
    finally:
        await e.aclose()


def _answered(res) -> list[tuple[int, int, bytes]]:
    return [(eid, entry[0], entry[3]) for eid, entry in res.entries]


WANT = [(i, 11, b"t11-%d" % i) for i in range(5)] + [(5, 12, b"t12-5")]


async def _race(engine: Engine, read) -> object:
    """Start ``read``, let its disk part finish reading, flush, release, return its answer."""
    paused = PausedDiskReads(engine)
    task = asyncio.ensure_future(read())
    await paused.done_reading.wait()
    generation_before = engine.write_cache.flushes
    await engine.flush_async()
    assert engine.write_cache.flushes == generation_before + 1  # the flush did complete meanwhile
    retired = engine.metrics.registry.get_sample_value("scroll_bookie_write_cache_retired_bytes")
    assert retired > 0, "the flushed generation is kept (and shown) while the read needs it"
    paused.release.set()
    answer = await task
    assert engine.metrics.registry.get_sample_value("scroll_bookie_write_cache_retired_bytes") == 0
    return answer


def test_a_range_read_overlapping_the_flush_of_a_truncation_answers_the_newer_term(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with started(small_config(tmp_path, **QUIET)) as e:
            _term_11_flushed_then_term_12_truncates(e)
            res = await _race(e, lambda: e.aread_range(L, 0, 9))
            assert _answered(res) == WANT
            # and once nothing is in flight, the same read still agrees (from disk this time)
            assert _answered(await e.aread_range(L, 0, 9)) == WANT
            assert e.write_cache.retired_count == 0  # nothing is kept once no read needs it

    run(scenario())


def test_after_a_restart_the_first_flush_racing_the_first_read_answers_the_replayed_truncation(tmp_path: Path) -> None:
    """Replay puts the acknowledged truncating no-op in the write cache while the index still
    names term 11's copy; the first flush after start races the first range read."""
    cfg = small_config(tmp_path, **QUIET)
    a = Engine(cfg)
    a.open()
    _term_11_flushed_then_term_12_truncates(a)
    a.journal.sync()  # term 12's no-op is acknowledged ...
    a.crash()  # ... and never flushed

    async def scenario() -> None:
        async with started(cfg) as b:
            res = await _race(b, lambda: b.aread_range(L, 0, 9))
            assert _answered(res) == WANT

    run(scenario())


def test_a_flush_and_a_later_overwrite_during_the_read_still_answer_the_newest_copy(tmp_path: Path) -> None:
    """Two flushes complete while one read is out: the generations are consulted newest first."""

    async def scenario() -> None:
        async with started(small_config(tmp_path, **QUIET)) as e:
            _term_11_flushed_then_term_12_truncates(e)
            paused = PausedDiskReads(e)
            task = asyncio.ensure_future(e.aread_range(L, 0, 9))
            await paused.done_reading.wait()
            await e.flush_async()  # term 12's no-op at 5 and the tombstone over 6..
            e.fence(L, 13)
            _add(e, [3], 13, truncate=True, lac=2)  # term 13 truncates from 3
            await e.flush_async()
            paused.release.set()
            res = await task
            assert _answered(res) == [(0, 11, b"t11-0"), (1, 11, b"t11-1"), (2, 11, b"t11-2"), (3, 13, b"t13-3")]

    run(scenario())


def test_a_read_over_the_rpc_overlapping_a_flush_answers_the_newer_term(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = BookieServer(small_config(tmp_path, **QUIET))
        await server.start()
        client = BookieClient(server.address)
        try:
            e = server.engine
            _term_11_flushed_then_term_12_truncates(e)
            res = await _race(e, lambda: client.read(L, 0, 9))
            assert [(x.entry_id, x.entry_term, x.data) for x in res.entries] == WANT
        finally:
            await client.close()
            await server.stop(0)

    run(scenario())
