"""The consumer: reads a stream from a position, never above the LAC, skipping no-op entries.

How this works. The consumer keeps its position and the highest LAC it has learnt (every read
answer carries the bookie's LAC). When it has caught up it sends a long-poll LAC read to a bookie
of the last fragment, which answers as soon as the LAC passes the position — a tailing consumer is
woken by the write, not by a timer. Entries are read in ranges from one member of the write set
(``terms.reader.read_order``), failing over to the next member on an error, a missing entry or a
corrupt copy, and sending a speculative second read when the first is slow. Copies older than the
fragment (leftovers of an earlier term) are never served. Fragments are cached and refreshed when
the position moves past the cached ones or a read comes back empty below the LAC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from bookie.client import ReadResult
from bookie.errors import BookieError
from fragments.model import Fragment, LedgerMeta, LedgerStatus, fragment_for
from terms import entry as entry_codec
from terms.quorum import write_set
from terms.reader import copy_is_current, read_order

from . import records
from .errors import DataRemovedError, ReadFailedError

log = logging.getLogger(__name__)

EARLIEST = "earliest"
LATEST = "latest"
STRIPED_RUNS = 32  # concurrent replica reads per range of a striped fragment


class Consumer:
    def __init__(self, cluster, meta: LedgerMeta, *, long_poll_s: float = 30.0, speculative_s: float = 0.05,
                 max_read_entries: int = 1000, max_read_bytes: int = 4 << 20):
        self.cluster = cluster
        self.meta = meta
        self.name = meta.name
        self.long_poll_s = long_poll_s
        self.speculative_s = speculative_s
        self.max_read_entries = max_read_entries
        self.max_read_bytes = max_read_bytes
        self.fragments: list[Fragment] = []
        self.position = 0
        self.lac = -1
        self.seen_term = -1  # the highest term a bookie answered with (see _read_one)
        self._rotate = 0

    # ---------------------------------------------------------------- position
    async def start_at(self, start) -> None:
        await self._refresh()
        if start == EARLIEST:
            self.position = self.earliest()
        elif start == LATEST:
            await self._learn_lac(0.0)
            self.position = self.lac + 1
        else:
            self.seek(int(start))

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError("position must be >= 0")
        self.position = position

    def earliest(self) -> int:
        return self.fragments[0].first_entry_id if self.fragments else 0

    async def end_position(self) -> int:
        """One past the last readable entry now (the LAC + 1)."""
        await self._learn_lac(0.0)
        return self.lac + 1

    # ---------------------------------------------------------------- reading
    async def read(self, max_records: int = 100, timeout_s: float = 0.0) -> list[records.Record]:
        """Up to ``max_records`` records from the position; waits up to ``timeout_s`` for new ones."""
        out: list[records.Record] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(out) < max_records:
            if self.position > self.lac:
                await self._learn_lac(0.0)
            if self.position > self.lac:
                if out or loop.time() >= deadline or self._closed_at_end():
                    break
                await self._learn_lac(max(0.0, deadline - loop.time()))
                continue
            last = min(self.lac, self.position + min(max_records - len(out), self.max_read_entries) - 1)
            result = await self._read_range(self.position, last)
            for e in result:
                if not entry_codec.is_noop(e.data):
                    out.extend(records.decode_entry(entry_codec.payload_of(e.data), e.entry_id, self.name))
            self.position = result[-1].entry_id + 1
        return out

    async def read_raw(self, first: int, last: int):
        """Raw entries ``first..last`` (clipped to what one replica read returns), no-ops included.

        Each item has ``entry_id``, ``data`` (the envelope: see ``terms.entry``) and ``entry_term``.
        The caller keeps ``last`` at or below the LAC (``end_position() - 1``); this neither moves
        the consumer's position nor decodes records. Used by the Kafka shim and the Spark source.
        """
        if first > last:
            return []
        return await self._read_range(first, last)

    def __aiter__(self):
        return self

    async def __anext__(self) -> records.Record:
        while True:
            if getattr(self, "_buf", None):
                return self._buf.pop(0)
            self._buf = await self.read(self.max_read_entries, self.long_poll_s)
            if not self._buf and self._closed_at_end():
                raise StopAsyncIteration

    def _closed_at_end(self) -> bool:
        m = self.meta
        return m.status is LedgerStatus.CLOSED and m.last_entry_id is not None and self.position > m.last_entry_id

    # ---------------------------------------------------------------- internals
    async def _refresh(self) -> None:
        meta, _ = await self.cluster.ledgers.get_ledger(self.meta.ledger_id)
        self.meta = meta
        self.fragments = await self.cluster.ledgers.fragments(
            meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        await self.cluster.refresh_bookies(max_age_s=1.0)

    async def _fragment(self, entry_id: int) -> Fragment:
        f = fragment_for(self.fragments, entry_id) if self.fragments else None
        if f is None or (f is self.fragments[-1] and f.sealed):
            await self._refresh()
            f = fragment_for(self.fragments, entry_id)
        if f is None:
            earliest = self.earliest()
            if entry_id < earliest:
                raise DataRemovedError(
                    f"stream {self.name!r}: position {entry_id} was removed by retention; earliest is {earliest}",
                    earliest)
            raise ReadFailedError(f"stream {self.name!r}: no fragment holds position {entry_id}")
        return f

    async def _learn_lac(self, wait_s: float) -> None:
        if not self.fragments:
            await self._refresh()
        last = self.fragments[-1]
        bookies = list(last.ensemble)
        self._rotate += 1
        after = self.position - 1
        for i in range(len(bookies)):
            b = bookies[(self._rotate + i) % len(bookies)]
            client = self.cluster.client(b)
            if client is None:
                continue
            try:
                r = await client.read_lac(self.meta.ledger_id, after, wait_s)
            except BookieError as exc:
                log.debug("stream=%s LAC read from %s failed: %s", self.name, b, exc)
                continue
            # A fragment starting at F exists only once every entry below F was acknowledged
            # (rollover drains first; an ensemble change starts at LAFR + 1), so LAC >= F - 1 even
            # when this member, new to the fragment, has not been told (LAC writes reach a member
            # only after its first add of the term).
            self.lac = max(self.lac, r.lac, self.fragments[-1].first_entry_id - 1)
            self.seen_term = max(self.seen_term, r.term)
            return
        await self._refresh()  # the ensemble may have changed
        await asyncio.sleep(min(wait_s, 0.1))  # no bookie answered: do not spin until the deadline

    async def _read_range(self, first: int, last: int):
        for _attempt in range(2):
            f = await self._fragment(first)
            if f.last_entry_id is not None:
                last = min(last, f.last_entry_id)
            wq = self.meta.config.write_quorum
            order = read_order(f, first, wq, self._rotate)
            if len(f.ensemble) > wq and last > first:
                got = await self._read_striped(f, first, last, wq)
            else:
                self._rotate += 1
                got = await self._read_from_replicas(f, order, first, last)
            if got:
                return got
            await self._refresh()
        raise ReadFailedError(
            f"stream {self.name!r}: no replica served entry {first} (LAC {self.lac}); bookies {list(order)}")

    async def _read_striped(self, f: Fragment, first: int, last: int, wq: int):
        """Under striping (E > WQ) a bookie holds runs of at most WQ consecutive entries, so one
        replica read returns one short run. Split the range into runs, each held whole by the
        first bookie of its read order, read up to ``STRIPED_RUNS`` of them at once (each with the
        usual fail-over) and return the contiguous prefix."""
        runs = []
        i = first
        while i <= last and len(runs) < STRIPED_RUNS:
            order = read_order(f, i, wq, self._rotate)
            j = i
            while j < last and order[0] in write_set(j + 1, f.ensemble, wq):
                j += 1
            runs.append((i, j, order))
            i = j + 1
        self._rotate += 1
        results = await asyncio.gather(*(self._read_from_replicas(f, order, a, b) for a, b, order in runs))
        out = []
        for (_a, b, _order), got in zip(runs, results):
            out.extend(got)
            if not got or got[-1].entry_id != b:
                break
        return out

    async def _read_from_replicas(self, f: Fragment, order, first: int, last: int):
        pending: set[asyncio.Task] = set()
        queue = list(order)

        def launch() -> None:
            b = queue.pop(0)
            t = asyncio.ensure_future(self._read_one(f, b, first, last))
            pending.add(t)

        try:
            launch()
            while pending:
                timeout = self.speculative_s if queue else None
                done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done and queue:
                    launch()  # the first replica is slow: ask the next one too
                    continue
                for t in done:
                    pending.discard(t)
                    entries = t.result()
                    if entries:
                        return entries
                    if queue:
                        launch()
            return []
        finally:
            for t in pending:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def _read_one(self, f: Fragment, bookie: str, first: int, last: int):
        client = self.cluster.client(bookie)
        if client is None:
            return []
        try:
            r: ReadResult = await client.read(self.meta.ledger_id, first, last, max_entries=self.max_read_entries,
                                              max_bytes=self.max_read_bytes)
        except BookieError as exc:
            log.debug("stream=%s read %s..%s from %s failed: %s", self.name, first, last, bookie, exc)
            return []
        self.lac = max(self.lac, r.lac)
        self.seen_term = max(self.seen_term, r.term)
        ws = None
        if self.seen_term > self.meta.term:
            # A term newer than our metadata view exists: the fragment's ensemble may have changed
            # and its tail been truncated by the new term since we cached it. A member replaced in
            # the meantime can keep a dirty copy the truncation never reached, so re-read the
            # metadata and keep only copies from a bookie still in each entry's write set.
            await self._refresh()
            fresh = fragment_for(self.fragments, first)
            if fresh is None:
                return []
            f, wq = fresh, self.meta.config.write_quorum
            ws = lambda eid: write_set(eid, f.ensemble, wq)  # noqa: E731
        out = []
        expect = first
        for e in r.entries:
            if e.entry_id != expect or e.entry_id > last or not f.contains(e.entry_id) \
                    or not copy_is_current(f, e.entry_term) or (ws is not None and bookie not in ws(e.entry_id)):
                break
            out.append(e)
            expect += 1
        return out
