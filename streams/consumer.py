"""The consumer: reads a stream's records by record offset, never above the LAC.

How this works. Entries are record batches (``streams/batches.py``); the consumer keeps its
**position** (the offset of the next record it returns), the entry it reads next, and the highest
LAC it has learnt (every read answer carries the bookie's LAC). When it has caught up it sends a
*tail read* to a bookie of the last fragment: a long poll that answers, as soon as the LAC passes
the position, with the LAC and the entries up to it in one round trip (BookKeeper's "read LAC and
entry") — a tailing consumer is woken by the write, not by a timer. Entries are read in ranges from
one member of the write set (``terms.reader.read_order``), failing over to the next member on an
error, a missing entry or a corrupt copy, and sending a speculative second read when the first is
slow. Copies older than the fragment (leftovers of an earlier term) are never served; no-op entries
take no offsets and are skipped. Fragments are cached and refreshed when the position moves past
the cached ones or a read comes back empty below the LAC.

Seeking to an offset narrows to one fragment by the fragments' first offsets (metadata), then
binary-searches its entries, one single-entry read per step (``streams/offsets.py``); points learnt
on the way are cached in an ``OffsetIndex``. Seeking to a timestamp binary-searches batches' max
timestamps the same way.

Offloaded fragments (tiered storage, ``fragments/tier.py``). A fragment whose bookie copies were
released (``remote_only``) is read from its object through the cluster's ``TierReader``
(``streams/tier/reader.py``); no bookie is asked. One offloaded but still local is read from its
bookies, and from the object when no replica served a range. A fragment released under a reader
(its record flips to remote-only, then bookies trim) shows as an empty bookie answer: the fragments
are re-read and the second attempt goes to the object, from the same entry. Seeks inside a
remote-only fragment use the object's index: one index GET (cached) and one chunk read, never the
whole object. Objects teach nothing of the LAC or the term (their fragments are sealed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from bookie.client import ReadResult
from bookie.errors import BookieAuthError, BookieError
from fragments.model import Fragment, LedgerMeta, LedgerStatus, fragment_for
from fragments.tier import TIER_CONFIG_KEY, offloaded, remote_only
from terms.quorum import write_set
from terms.reader import copy_is_current, read_order

from .batches import Record, RecordFormatError, StoredBatch, records_of, stored_batch
from .errors import AuthenticationFailed, DataRemovedError, ReadFailedError, TierReadError
from .offsets import NOT_NARROWED, OffsetIndex, next_batch, search_offset, search_timestamp

log = logging.getLogger(__name__)

EARLIEST = "earliest"
LATEST = "latest"
STRIPED_RUNS = 32  # concurrent replica reads per range of a striped fragment
SCAN_BACK_ENTRIES = 64
LAC_POLL_MAX_S = 1.0  # longest single long-poll
IDLE_REFRESH_S = 2.0  # an idle consumer re-reads the fragments this often (a rollover onto other bookies)  # entries read at a time when looking back for the last batch


class Consumer:
    def __init__(self, cluster, meta: LedgerMeta, *, long_poll_s: float = 30.0, speculative_s: float = 0.05,
                 max_read_entries: int = 1000, max_read_bytes: int = 4 << 20, index_points: int = 10_000,
                 read_ahead: bool = True):
        self.cluster = cluster
        self.meta = meta
        self.name = meta.name
        self.long_poll_s = long_poll_s
        self.speculative_s = speculative_s
        self.max_read_entries = max_read_entries
        self.max_read_bytes = max_read_bytes
        self.fragments: list[Fragment] = []
        self.position = 0  # record offset of the next record read() returns
        self.entry = 0  # entry id read next
        self.lac = -1
        self.seen_term = -1  # the highest term a bookie answered with (see _read_one)
        self.index = OffsetIndex(index_points)
        self._rotate = 0
        self._buf: list[Record] = []
        self._buf_at = 0
        self._read_end = 0  # end offset of the last batch read into the buffer
        self._first_offsets: dict[tuple[int, int], int] = {}  # (fragment index, first entry) -> offset
        self._end_cache: tuple[int, int] = (-2, 0)  # (entry id, offset after it)
        self.read_ahead = read_ahead
        self._refreshed_at = 0.0
        self._prefetch: tuple[int, asyncio.Future] | None = None  # (first entry, its read)

    # ---------------------------------------------------------------- position
    async def start_at(self, start) -> None:
        await self._refresh()
        if start == EARLIEST:
            await self.seek(await self.earliest_offset())
        elif start == LATEST:
            await self._learn_lac(0.0)
            self._set(await self.offset_after(self.lac), self.lac + 1)
        else:
            await self.seek(int(start))

    def _set(self, offset: int, entry: int) -> None:
        if self._prefetch is not None and self._prefetch[0] != entry:
            self._prefetch[1].cancel()
            self._prefetch = None
        self.position, self.entry = offset, entry
        self._buf, self._buf_at, self._read_end = [], 0, offset

    async def seek(self, offset: int) -> None:
        """Read from record ``offset`` next. Past the end, reading waits for it to be written;
        below the earliest retained offset, raises DataRemovedError(earliest)."""
        if offset < 0:
            raise ValueError("offset must be >= 0")
        if not self.fragments:
            await self._refresh()
        earliest = await self.earliest_offset()
        if offset < earliest:
            raise DataRemovedError(
                f"stream {self.name!r}: offset {offset} was removed by retention; earliest is {earliest}", earliest)
        self._set(offset, await self.locate(offset))

    async def seek_timestamp(self, timestamp_ms: int) -> int:
        """Move to the first record whose timestamp is >= ``timestamp_ms`` (the end if none);
        returns the new position."""
        await self._refresh()
        await self._learn_lac(0.0)
        lo, hi = self.earliest_entry() - 1, self.lac + 1
        b = await search_timestamp(self._next_batch, lo, hi, timestamp_ms, narrow=self._narrow_timestamp)
        if b is None:
            self._set(await self.offset_after(self.lac), self.lac + 1)
            return self.position
        offset = b.end_offset
        for r in records_of(b, self.name):
            if r.timestamp_ms >= timestamp_ms:
                offset = r.offset
                break
        self._set(offset, b.entry_id)
        return offset

    def earliest_entry(self) -> int:
        return self.fragments[0].first_entry_id if self.fragments else 0

    async def earliest_offset(self) -> int:
        """The first record offset retention has kept."""
        if not self.fragments:
            await self._refresh()
        return await self.first_offset_of(self.fragments[0]) if self.fragments else 0

    async def end_position(self) -> int:
        """One past the last readable record now (the offset the next append gets)."""
        await self._learn_lac(0.0)
        return await self.offset_after(self.lac)

    async def locate(self, offset: int) -> int:
        """The entry id of the batch holding ``offset``; past the end, the entry after the LAC."""
        await self._learn_lac(0.0)
        lo, hi, holds = self.index.bracket(offset)
        if holds:
            return lo
        # Narrow to the fragment whose first offset is the last at or below ``offset``.
        f = None
        for cand in reversed(self.fragments):
            if await self.first_offset_of(cand) <= offset:
                f = cand
                break
        if f is None:
            f = self.fragments[0]
        f_lo = f.first_entry_id - 1
        f_hi = (f.last_entry_id if f.last_entry_id is not None else self.lac) + 1
        lo = f_lo if lo is None else max(lo, f_lo)
        hi = f_hi if hi is None else min(hi, f_hi)
        if lo >= hi:
            lo, hi = f_lo, f_hi
        if remote_only(f):  # the object's index narrows to one chunk: one GET, no search
            e = await (await self._tier(f)).find_offset(f, offset, stream=self.name)
            if e is not None:
                self.index.add(stored_batch(e.entry_id, e.data))
                return e.entry_id
            return f.last_entry_id + 1
        found, below = await search_offset(self._next_batch, lo, hi, offset)
        if found is not None:
            return found.entry_id
        if f.last_entry_id is not None and f is not self.fragments[-1]:
            return f.last_entry_id + 1  # the offset starts the next fragment
        # Past the end: wait for it after the entries searched. Not ``self.lac + 1``: read answers
        # raise the LAC during the search, and entries above the bound searched were not looked at.
        return f_hi

    async def first_offset_of(self, f: Fragment) -> int:
        """A fragment's first record offset: from its record, else learnt from the entries."""
        if f.first_offset is not None:
            return f.first_offset
        key = (f.index, f.first_entry_id)
        got = self._first_offsets.get(key)
        if got is None:
            got = await self._offset_before_fragment(f)
            self._first_offsets[key] = got
        return got

    async def _offset_before_fragment(self, f: Fragment) -> int:
        i = next((k for k, g in enumerate(self.fragments) if g.index == f.index), 0)
        if i > 0:
            return await self.offset_after(f.first_entry_id - 1)
        # The earliest fragment and its first offset is unknown: its first batch tells.
        last = f.last_entry_id if f.last_entry_id is not None else self.lac
        b = await self._next_batch(f.first_entry_id, last)
        return b.base_offset if b is not None else 0

    async def offset_after(self, eid: int) -> int:
        """The record offset of the first record after entry ``eid``: the end of the last batch at
        or below it (scanning back over no-ops), or the first offset of its fragment."""
        if eid == self._end_cache[0]:
            return self._end_cache[1]
        if not self.fragments:
            await self._refresh()
        result = None
        hi = eid
        while result is None:
            f = fragment_for(self.fragments, hi) if self.fragments else None
            if f is None:
                if self.fragments and hi >= self.fragments[-1].first_entry_id:
                    f = self.fragments[-1]
                else:
                    result = await self.earliest_offset() if self.fragments else 0
                    break
            if remote_only(f) and hi >= f.last_entry_id:  # the object's footer knows its end
                ft = (await (await self._tier(f)).index(f.tier["key"], int(f.tier["size"]))).footer
                if ft.end_offset > ft.first_offset:
                    result = ft.end_offset
                    break
            step = 2  # the last entry is usually a no-op (a take-over) right after a batch
            while hi >= f.first_entry_id:
                lo = max(f.first_entry_id, hi - step + 1)
                step = min(step * 4, SCAN_BACK_ENTRIES)
                got = await self._read_all(lo, hi)
                for e in reversed(got):
                    b = stored_batch(e.entry_id, e.data)
                    if b is not None:
                        self.index.add(b)
                        result = b.end_offset
                        break
                if result is not None:
                    break
                hi = lo - 1
            if result is None:
                result = await self.first_offset_of(f)
        self._end_cache = (eid, result)
        return result

    async def _read_all(self, first: int, last: int) -> list:
        out = []
        while first <= last:
            got = await self._read_range(first, last)
            out.extend(got)
            first = got[-1].entry_id + 1
        return out

    async def _next_batch(self, first: int, last: int) -> StoredBatch | None:
        b = await next_batch(self.read_raw, first, last)
        if b is not None:
            self.index.add(b)
        return b

    # ---------------------------------------------------------------- reading
    async def read(self, max_records: int = 100, timeout_s: float = 0.0) -> list[Record]:
        """Up to ``max_records`` records from the position; waits up to ``timeout_s`` for new ones."""
        out: list[Record] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(out) < max_records:
            if self._buf_at < len(self._buf):
                take = self._buf[self._buf_at:self._buf_at + max_records - len(out)]
                self._buf_at += len(take)
                out.extend(take)
                self.position = take[-1].offset + 1
                if self._buf_at >= len(self._buf):
                    self._buf, self._buf_at = [], 0
                    self.position = max(self.position, self._read_end)
                continue
            if self.entry > self.lac:
                if out:
                    break  # caught up: hand these over now (one more poll would cost a round trip first)
                # caught up: one tail read asks for the LAC and the entries up to it at once, and
                # (when nothing is new) waits on the bookie until the next one is acknowledged
                result = await self._read_tail(0.0)
                if not result and self.entry > self.lac:
                    if out or loop.time() >= deadline or self._closed_at_end():
                        break
                    result = await self._read_tail(max(0.0, deadline - loop.time()))
                if not result:
                    continue
            else:
                last = min(self.lac, self.entry + self.max_read_entries - 1)
                result = await self._take_range(self.entry, last)
            nxt = result[-1].entry_id + 1
            if nxt <= self.lac and self.read_ahead:  # read the next range while this one is decoded
                t = asyncio.ensure_future(self._read_range(nxt, min(self.lac, nxt + self.max_read_entries - 1)))
                t.add_done_callback(_retrieved)  # a read-ahead nobody takes must not log its error
                self._prefetch = (nxt, t)
            buf = []
            for e in result:
                try:
                    b = stored_batch(e.entry_id, e.data)
                    if b is None:
                        self.entry = e.entry_id + 1
                        continue
                    end = b.end_offset
                    if end > self.position:
                        buf.extend(records_of(b, self.name, self.position))
                        self._read_end = max(self._read_end, end)
                except RecordFormatError:
                    if buf or out:
                        break  # hand out what came before the bad entry; the next read raises
                    raise
                self.entry = e.entry_id + 1
            if buf:
                self._buf, self._buf_at = buf, 0
            elif self.entry <= result[-1].entry_id:
                break  # stopped before a bad entry with records in hand
            else:
                self.position = max(self.position, self._read_end)
        return out

    async def _take_range(self, first: int, last: int):
        """Entries from ``first``: the read-ahead started by the previous ``read`` if it starts
        there, else a read now."""
        pre, self._prefetch = self._prefetch, None
        if pre is not None:
            if pre[0] == first:
                return await pre[1]
            await _cancel(pre[1])
        return await self._read_range(first, last)

    async def close(self) -> None:
        """Stop a read-ahead in flight (a consumer holds no other resources)."""
        pre, self._prefetch = self._prefetch, None
        if pre is not None:
            await _cancel(pre[1])

    async def read_raw(self, first: int, last: int):
        """Raw entries ``first..last`` (clipped to what one replica read returns), no-ops included.

        Each item has ``entry_id``, ``data`` (the envelope: see ``terms.entry``) and ``entry_term``.
        The caller keeps ``last`` at or below the LAC; this neither moves the consumer's position
        nor decodes records. Used by the Kafka listener, the Spark source and the admin tools.
        """
        if first > last:
            return []
        return await self._read_range(first, last)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Record:
        while True:
            got = await self.read(1, self.long_poll_s)  # decoded batches wait in the buffer
            if got:
                return got[0]
            if self._closed_at_end():
                raise StopAsyncIteration

    def _closed_at_end(self) -> bool:
        m = self.meta
        return m.status is LedgerStatus.CLOSED and m.last_entry_id is not None and self.entry > m.last_entry_id

    # ---------------------------------------------------------------- internals
    def seed_fragments(self, fragments: list[Fragment]) -> None:
        """Start from fragment records the caller holds as they are in the metadata store (a
        writer's, just after its take-over committed them) instead of reading them again."""
        self._refreshed_at = asyncio.get_running_loop().time()
        self.fragments = list(fragments)
        self._sealed_lac()

    async def _refresh(self, tail: bool = False) -> None:
        """Re-read the meta and the fragments. ``tail`` (a caught-up reader's idle re-read): only
        the fragments from the last one known on (one or two records however long the stream),
        dropping those retention removed; the sealed ones before are kept as known (as after any
        refresh, a read that no replica of a stale record serves re-reads them all)."""
        self._refreshed_at = asyncio.get_running_loop().time()
        meta, _ = await self.cluster.ledgers.get_ledger(self.meta.ledger_id)
        self.meta = meta
        known = self.fragments[-1].index if tail and self.fragments else None
        if known is not None and meta.first_fragment_index <= known <= meta.last_fragment_index:
            newer = await self.cluster.ledgers.fragments(meta.ledger_id, known, meta.last_fragment_index)
            self.fragments = [f for f in self.fragments if meta.first_fragment_index <= f.index < known] + newer
        else:
            self.fragments = await self.cluster.ledgers.fragments(
                meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        self._sealed_lac()
        await self.cluster.refresh_bookies(max_age_s=1.0)

    def _sealed_lac(self) -> None:
        """Every entry of a sealed fragment was acknowledged before the fragment was sealed, so the
        LAC is at least the last sealed entry: a reader of sealed (or offloaded) fragments needs no
        bookie to learn it."""
        for f in reversed(self.fragments):
            if f.sealed:
                self.lac = max(self.lac, f.last_entry_id)
                break

    async def _fragment(self, entry_id: int) -> Fragment:
        f = fragment_for(self.fragments, entry_id) if self.fragments else None
        if f is None or (f is self.fragments[-1] and f.sealed):
            await self._refresh()
            f = fragment_for(self.fragments, entry_id)
        if f is None:
            if entry_id < self.earliest_entry():
                earliest = await self.earliest_offset()
                raise DataRemovedError(
                    f"stream {self.name!r}: entry {entry_id} was removed by retention; earliest offset is "
                    f"{earliest}", earliest)
            raise ReadFailedError(f"stream {self.name!r}: no fragment holds position {entry_id}")
        return f

    async def wait_lac(self, after: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the LAC to pass entry ``after`` (a long-poll LAC read on a
        bookie of the last fragment, answered as soon as the LAC passes it); returns the LAC known
        then. ``seen_term`` is updated too. For readers that serve entries themselves (``read_raw``)
        rather than through ``read``, such as the Kafka listener."""
        await self._learn_lac(timeout_s, after)
        return self.lac

    async def _learn_lac(self, wait_s: float, after: int | None = None) -> None:
        await self._poll_last_fragment(wait_s, after, tail=False)

    async def _read_tail(self, wait_s: float) -> list:
        """Entries from the position up to the LAC, read from a bookie of the last fragment which
        first waits up to ``wait_s`` for the LAC to reach them (BookKeeper's long-poll "read LAC
        and entry"); [] when nothing new came in time or that bookie does not hold them (the LAC
        learnt then lets the next read fetch them from a replica that does)."""
        return await self._poll_last_fragment(wait_s, None, tail=True)

    async def _poll_last_fragment(self, wait_s: float, after: int | None, tail: bool) -> list:
        if not self.fragments:
            await self._refresh()
        last = self.fragments[-1]
        bookies = list(last.ensemble)
        self._rotate += 1
        after = self.entry - 1 if after is None else after
        first = after + 1
        wait = min(wait_s, LAC_POLL_MAX_S)
        rotated = [bookies[(self._rotate + i) % len(bookies)] for i in range(len(bookies))]
        for b in self.cluster.rank(rotated):  # (unregistered or unresponsive members last)
            client = self.cluster.client(b)
            if client is None:
                continue
            try:
                if tail:
                    r = await client.read_tail(self.meta.ledger_id, first, first + self.max_read_entries - 1, wait_s=wait,
                                               max_entries=self.max_read_entries, max_bytes=self.max_read_bytes)
                else:
                    r = await client.read_lac(self.meta.ledger_id, after, wait)
            except BookieError as exc:
                if isinstance(exc, BookieAuthError) and exc.definite:
                    raise AuthenticationFailed(str(exc)) from exc
                log.debug("stream=%s LAC read from %s failed: %s", self.name, b, exc)
                self.cluster.failed_call(b)
                continue
            # A fragment starting at F exists only once every entry below F was acknowledged
            # (rollover drains first; an ensemble change starts at LAFR + 1), so LAC >= F - 1 even
            # when this member, new to the fragment, has not been told (LAC writes reach a member
            # only after its first add of the term).
            self.lac = max(self.lac, r.lac, self.fragments[-1].first_entry_id - 1)
            self.seen_term = max(self.seen_term, r.term)
            got = self._usable(last, b, first, r.entries) if tail and r.entries else []
            now = asyncio.get_running_loop().time()
            if wait_s > 0 and self.lac <= after and now - self._refreshed_at >= IDLE_REFRESH_S:
                # A poll without progress: the writer may have rolled over onto other bookies,
                # whose LAC these members never hear. Re-read the fragments (at most one metadata
                # read per IDLE_REFRESH_S while idle) so later polls ask the real last fragment.
                await self._refresh(tail=True)
                self.lac = max(self.lac, self.fragments[-1].first_entry_id - 1)
            return got
        await self._refresh()  # the ensemble may have changed
        await asyncio.sleep(min(wait_s, 0.1))  # no bookie answered: do not spin until the deadline
        return []

    def _usable(self, f: Fragment, bookie: str, first: int, entries) -> list:
        """The contiguous run of ``entries`` from ``first`` that this bookie may serve: inside
        the fragment, written in its term or later, by a member of each entry's write set, and at
        most the LAC; cut at the first entry that is not."""
        if self.seen_term > self.meta.term:
            return []  # a newer term than our metadata: let the range read re-check (see _read_one)
        wq = self.meta.config.write_quorum
        out = []
        expect = first
        for e in entries:
            if e.entry_id != expect or e.entry_id > self.lac or not f.contains(e.entry_id) \
                    or not copy_is_current(f, e.entry_term) or bookie not in write_set(e.entry_id, f.ensemble, wq):
                break
            out.append(e)
            expect += 1
        return out

    async def _tier(self, f: Fragment):
        tier = await self.cluster.tier_reader()
        if tier is None:
            raise TierReadError(
                f"stream {self.name!r}: fragment {f.index} (entries {f.first_entry_id}..{f.last_entry_id}) is "
                f"offloaded to object {f.tier.get('key')!r}, but this cluster has no object store configured "
                f"({TIER_CONFIG_KEY})", stream=self.name, key=f.tier.get("key", ""), retriable=False)
        return tier

    async def _read_tier(self, f: Fragment, first: int, last: int):
        last = min(last, first + self.max_read_entries - 1)
        return await (await self._tier(f)).read_entries(f, first, last, self.max_read_bytes, stream=self.name)

    async def _narrow_timestamp(self, lo: int, hi: int, ts: int):
        """A timestamp search's window lo..hi (exclusive) inside one remote-only fragment is
        answered by its object's index (see ``search_timestamp``)."""
        f = fragment_for(self.fragments, lo + 1) if self.fragments else None
        if f is None or not remote_only(f) or f.last_entry_id < hi - 1:
            return NOT_NARROWED
        e = await (await self._tier(f)).find_timestamp(f, ts, after_entry=lo, stream=self.name)
        if e is None or e.entry_id >= hi:
            return None
        b = stored_batch(e.entry_id, e.data)
        self.index.add(b)
        return b

    async def _read_range(self, first: int, last: int):
        tier_error = None
        for _attempt in range(2):
            f = await self._fragment(first)
            if f.last_entry_id is not None:
                last = min(last, f.last_entry_id)
            if remote_only(f):  # bookie copies released: the object is the only copy
                return await self._read_tier(f, first, last)
            wq = self.meta.config.write_quorum
            order = read_order(f, first, wq, self._rotate)
            if len(f.ensemble) > wq and last > first:
                got = await self._read_striped(f, first, last, wq)
            else:
                self._rotate += 1
                got = await self._read_from_replicas(f, order, first, last)
            if got:
                return got
            if offloaded(f):  # still local by its record, but no replica served it: the object has it
                try:
                    return await self._read_tier(f, first, last)
                except TierReadError as exc:
                    tier_error = exc
            await self._refresh()
        if tier_error is not None:
            raise ReadFailedError(f"stream {self.name!r}: no replica served entry {first} (LAC {self.lac}; bookies "
                                  f"{list(order)}), and its object failed too: {tier_error}") from tier_error
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
        if f.data_ledger is not None:
            return await self._read_rewritten(f, client, bookie, first, last)
        try:
            r: ReadResult = await client.read(self.meta.ledger_id, first, last, max_entries=self.max_read_entries,
                                              max_bytes=self.max_read_bytes)
        except BookieError as exc:
            if isinstance(exc, BookieAuthError) and exc.definite:  # the bookie said so: retrying cannot help
                raise AuthenticationFailed(str(exc)) from exc
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

    async def _read_rewritten(self, f: Fragment, client, bookie: str, first: int, last: int):
        """Entries of a compacted fragment: they live in its data ledger (sealed, written once by the
        compaction job), entry ``first_entry_id + k`` of the stream being entry ``data_first_entry
        + k`` there. Answers say nothing of this stream's LAC or term, so neither is learnt here."""
        shift = f.data_first_entry - f.first_entry_id
        try:
            r: ReadResult = await client.read(f.data_ledger, first + shift, last + shift,
                                              max_entries=self.max_read_entries, max_bytes=self.max_read_bytes)
        except BookieError as exc:
            if isinstance(exc, BookieAuthError) and exc.definite:
                raise AuthenticationFailed(str(exc)) from exc
            log.debug("stream=%s read %s..%s (data ledger %s) from %s failed: %s", self.name, first, last,
                      f.data_ledger, bookie, exc)
            return []
        out = []
        expect = first
        for e in r.entries:
            eid = e.entry_id - shift
            if eid != expect or eid > last or not f.contains(eid) or not copy_is_current(f, e.entry_term):
                break
            out.append(dataclasses.replace(e, entry_id=eid))
            expect += 1
        return out


async def _cancel(t: asyncio.Future) -> None:
    t.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await t


def _retrieved(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()
