"""The gRPC service and the client, in one process: every operation, long-poll wake-ups,
digests, batching, read-only answers and broken streams."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from bookie.client import UNAVAILABLE, BookieClient
from bookie.entrylog import log_files
from bookie.errors import CorruptEntryError, NoSuchEntryError, NoSuchLedgerError
from bookie.server import BookieServer
from terms.messages import (
    AddOk,
    AddRequest,
    FenceOk,
    InvalidTerm,
    NotTruncated,
    ReadFailed,
    ReadMissing,
    ReadOk,
    WriteFailed,
)

from .helpers import run, small_config


@contextlib.asynccontextmanager
async def serving(path: Path, **overrides):
    server = BookieServer(small_config(path, **overrides))
    await server.start()
    client = BookieClient(server.address)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(0)


def entries(ledger: int, ids, term: int, lac: int = -1, tag: bytes = b"v") -> list[AddRequest]:
    return [AddRequest(ledger, i, term, lac, lac, tag + b"-%d-%d" % (term, i)) for i in ids]


def test_protocol_round_trip(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (server, c):
            b = c.bookie
            assert await c.fence(7, 1) == FenceOk(b, 7, 1, -1, -1)  # never seen: accepted
            assert await c.add(AddRequest(7, 0, 1, -1, -1, b"noop", truncate=True)) == AddOk(b, 7, 0, 1)
            oks = await c.add_many(entries(7, range(1, 6), 1, lac=0))
            assert oks == [AddOk(b, 7, i, 1) for i in range(1, 6)]
            # stale term, and a term this bookie has not truncated in
            assert await c.add(AddRequest(7, 6, 0, 0, 0, b"old")) == InvalidTerm(b, 7, 0, 1)
            assert await c.add(AddRequest(8, 0, 1, -1, -1, b"x")) == NotTruncated(b, 8, 0, 1)
            # recovery reads carry the new term and return the entry's own term
            assert await c.recovery_read(7, 3, 2) == ReadOk(b, 7, 3, 2, 1, b"v-1-3")
            assert await c.recovery_read(7, 9, 2) == ReadMissing(b, 7, 9, 2)
            assert await c.add(AddRequest(7, 7, 1, 0, 0, b"late")) == InvalidTerm(b, 7, 1, 2)
            assert await c.fence(7, 1) == InvalidTerm(b, 7, 1, 2)
            assert await c.write_lac(7, 2, 5, 5) == NotTruncated(b, 7, 5, 2)  # not truncated in term 2
            # take-over: write back with recovery, truncate at 6 in term 2
            assert await c.add(AddRequest(7, 5, 2, 4, 4, b"v-1-5", recovery=True)) == AddOk(b, 7, 5, 2)
            assert await c.add(AddRequest(7, 6, 2, 4, 4, b"noop2", truncate=True)) == AddOk(b, 7, 6, 2)
            assert (await c.write_lac(7, 2, 6, 6)).term == 2
            res = await c.read(7, 0, 100)
            assert res.lac == 6 and res.lafr == 6
            assert [(e.entry_id, e.entry_term, e.data) for e in res.entries][-3:] == [
                (4, 1, b"v-1-4"), (5, 2, b"v-1-5"), (6, 2, b"noop2")]
            await c.trim(7, 0, 2)
            with pytest.raises(NoSuchEntryError):
                await c.read(7, 0)
            assert (await c.read(7, 3)).entries[0].data == b"v-1-3"
            with pytest.raises(NoSuchLedgerError):
                await c.read(99, 0)
            info = await c.info()
            assert info.bookie_id == server.address and not info.read_only and info.ledgers == 1
            await c.delete_ledger(7)
            with pytest.raises(NoSuchLedgerError):
                await c.read(7, 3)

    run(scenario())


@pytest.mark.timeout(20)
def test_long_poll_wakes_on_a_lac_change_not_on_a_timer(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (_server, c):
            await c.add(AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True))
            # the polls would last 60 s if nothing woke them; the test's own limit is 20 s
            by_add = asyncio.ensure_future(c.read_lac(1, after_lac=-1, timeout_s=60))
            by_write = asyncio.ensure_future(c.read_lac(1, after_lac=0, timeout_s=60))
            other = asyncio.ensure_future(c.read_lac(1, after_lac=5, timeout_s=60))
            await c.add(AddRequest(1, 1, 1, 0, 0, b"a"))  # piggybacked LAC 0
            got = await by_add
            assert got.lac == 0 and not got.timed_out
            assert not by_write.done()
            assert (await c.write_lac(1, 1, 1, 1)).ledger_id == 1
            got = await by_write
            assert got.lac == 1 and not got.timed_out
            assert not other.done()
            other.cancel()
            quick = await c.read_lac(1, after_lac=5, timeout_s=0.05)
            assert quick.timed_out and quick.lac == 1

    run(scenario())


def test_passworded_ledgers_use_a_mac_checked_by_the_reader(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (server, c):
            c.set_password(3, b"s3cret")
            assert isinstance(await c.add(AddRequest(3, 0, 1, -1, -1, b"secret data", truncate=True)), AddOk)
            assert (await c.read(3, 0)).entries[0].data == b"secret data"
            async with BookieClient(server.address) as wrong:
                wrong.set_password(3, b"guess")
                with pytest.raises(CorruptEntryError):
                    await wrong.read(3, 0)
                assert isinstance(await wrong.recovery_read(3, 0, 1), ReadFailed)

    run(scenario())


def test_a_corrupt_entry_is_answered_corrupt(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (server, c):
            await c.add(AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True))
            await c.add_many(entries(1, range(1, 4), 1, tag=b"precious"))
            await server.engine.flush_async()
            path = log_files(server.engine.config.data_dir / "entrylogs")[-1][1]
            raw = bytearray(path.read_bytes())
            raw[raw.find(b"precious-1-2")] ^= 0x01
            path.write_bytes(bytes(raw))
            server.engine.read_cache = type(server.engine.read_cache)(1 << 20)  # forget cached copies
            with pytest.raises(CorruptEntryError):
                await c.read(1, 2)
            assert isinstance(await c.recovery_read(1, 2, 1), ReadFailed)
            res = await c.read(1, 0, 3)
            assert [e.entry_id for e in res.entries] == [0, 1] and res.stop.name == "CORRUPT"
            assert (await c.read(1, 3)).entries[0].data == b"precious-1-3"  # the rest still serves

    run(scenario())


def test_read_only_bookie_refuses_writes_with_a_clear_status(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path, min_free_bytes=1 << 62) as (server, c):
            info = await c.info()
            assert info.read_only and "floor" in info.read_only_reason
            res = await c.submit([AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)])
            assert res.statuses == [6]  # READ_ONLY
            assert isinstance(await c.add(AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)), WriteFailed)
            server.engine.set_min_free_bytes(0)
            assert not (await c.info()).read_only
            assert isinstance(await c.add(AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)), AddOk)

    run(scenario())


def test_client_sends_a_lone_add_at_once_and_gathers_while_busy(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (_server, c):
            c.max_inflight_batches = 1
            conn = await c._ready_connection()
            first = c.submit([AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)])
            assert conn.next_rid == 2 and len(conn.adds) == 1  # sent alone, immediately
            later = [c.submit(entries(1, [i], 1)) for i in range(1, 201)]  # gathered while in flight
            assert len(conn.adds) == 1 and len(conn.open) == 1
            assert all(r.all_ok for r in await asyncio.gather(first, *later))
            assert conn.next_rid - 1 <= 4  # 201 adds in a handful of frames

    run(scenario())


def test_adds_in_flight_fail_when_the_bookie_goes_away(tmp_path: Path) -> None:
    async def scenario() -> None:
        server = BookieServer(small_config(tmp_path))
        await server.start()
        c = BookieClient(server.address, add_timeout_s=10)
        try:
            assert isinstance(await c.add(AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)), AddOk)
            await server.stop(0)
            res = await c.submit(entries(1, range(1, 5), 1))
            assert res.statuses == [UNAVAILABLE] * 4
            events = res.events(entries(1, range(1, 5), 1), c.bookie)
            assert all(isinstance(ev, WriteFailed) for ev in events)
        finally:
            await c.close()

    run(scenario())


def test_a_tail_read_waits_for_the_lac_and_answers_the_entries_up_to_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serving(tmp_path) as (_server, c):
            assert (await c.submit([AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)])).all_ok
            assert (await c.submit(entries(1, range(1, 4), 1, lac=0))).all_ok  # stored 0..3, LAC 0
            # entries above the LAC are never answered, though stored
            now = await c.read_tail(1, 1, 100)
            assert now.entries == [] and now.lac == 0 and now.timed_out
            # a long poll: parked until an add carries a LAC that reaches the first id asked
            waiting = asyncio.ensure_future(c.read_tail(1, 1, 100, wait_s=30))
            await asyncio.sleep(0)
            assert not waiting.done()
            assert (await c.submit(entries(1, [4], 1, lac=2))).all_ok
            got = await waiting
            assert [e.entry_id for e in got.entries] == [1, 2] and got.lac == 2 and not got.timed_out
            # nothing new in time: no entries, timed out, the LAC known
            quiet = await c.read_tail(1, 3, 100, wait_s=0.05)
            assert quiet.entries == [] and quiet.timed_out and quiet.lac == 2
            # a LAC write wakes a tail read too
            waiting = asyncio.ensure_future(c.read_tail(1, 3, 100, wait_s=30))
            assert type(await c.write_lac(1, 1, 4, 4)).__name__ == "LacWritten"
            assert [e.data for e in (await waiting).entries] == [b"v-1-3", b"v-1-4"]
            # entries this bookie does not hold, below its LAC (a striped fragment): the LAC, no error
            assert type(await c.write_lac(1, 1, 6, 6)).__name__ == "LacWritten"
            miss = await c.read_tail(1, 5, 100)
            assert miss.entries == [] and miss.lac == 6 and not miss.timed_out
            with pytest.raises(NoSuchLedgerError):
                await c.read_tail(77, 0, 10)

    run(scenario())


def test_a_full_write_cache_holds_a_data_connection_until_a_flush_frees_it(tmp_path: Path) -> None:
    """Back-pressure on the data plane: while the write cache is full the bookie stops taking adds
    from the connection (they wait, in order, unanswered); once a flush frees space they are
    applied and answered."""
    async def scenario() -> None:
        async with serving(tmp_path, write_cache_bytes=512 * 1024) as (server, c):
            e = server.engine
            assert (await c.submit([AddRequest(1, 0, 1, -1, -1, b"noop", truncate=True)])).all_ok
            async with e._flush_lock:  # no flush can run: the cache fills and stays full
                eid = 1
                while not e.adds_must_wait():
                    assert (await c.submit(entries(1, range(eid, eid + 8), 1, tag=b"x" * 8000))).all_ok
                    eid += 8
                held = c.submit(entries(1, [eid, eid + 1], 1))
                conn = next(iter(server.data.connections))
                for _ in range(100_000):  # until the frame arrived and was held back (or answered: wrong)
                    if conn.backlog or held.done():
                        break
                    await asyncio.sleep(0)
                assert conn.backlog and not held.done() and not e.read_range(1, eid, eid).entries  # not applied either
            res = await held  # the flush loop (woken by the wait for space) frees the cache
            assert res.all_ok
            assert [x.entry_id for x in (await c.read(1, eid, eid + 1)).entries] == [eid, eid + 1]

    run(scenario())


def test_adds_of_many_ledgers_made_in_one_loop_turn_leave_in_one_send(tmp_path: Path) -> None:
    """A listener's partitions each hand their entry to the same bookie connection in one loop
    turn: the frames go out together at the end of the turn (one write, not one per ledger), in
    the order made, and every add is stored."""
    async def scenario() -> None:
        async with serving(tmp_path) as (_server, c):
            conn = await c._ready_connection()
            real = conn.transport
            writes: list[int] = []

            class CountingTransport:  # the real transport, its writes counted
                def writelines(self, bufs) -> None:
                    bufs = list(bufs)
                    writes.append(len(bufs))
                    real.writelines(bufs)

                def __getattr__(self, name):
                    return getattr(real, name)

            conn.transport = CountingTransport()
            try:
                futs = [c.submit([AddRequest(ledger, 0, 1, -1, -1, b"noop", truncate=True)]) for ledger in range(1, 9)]
                assert len(conn.adds) == 8 and writes == []  # in flight, sent at the end of this turn
                assert all(r.all_ok for r in await asyncio.gather(*futs))
                assert len(writes) == 1
                futs = [c.submit(entries(ledger, [1], 1)) for ledger in range(1, 9)]
                assert all(r.all_ok for r in await asyncio.gather(*futs))
                assert len(writes) == 2
            finally:
                conn.transport = real
            for ledger in range(1, 9):
                got = await c.read(ledger, 1, 1)
                assert [e.data for e in got.entries] == [b"v-1-1"]

    run(scenario())
