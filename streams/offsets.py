"""Finding record offsets among entries.

Entries are record batches whose headers carry their base offset and offset count (see
``streams/batches.py``), so the entry holding an offset is found by binary search over entry ids:
every probe reads one entry (a no-op, which takes no offsets, makes it read on), so a search costs
O(log n) single-entry reads. Fragment records carry their first offset, which narrows the search
to one fragment before any read. ``OffsetIndex`` caches (entry id, base, end) points learnt from
searches and reads, so repeated seeks near known points cost no reads at all.
"""

from __future__ import annotations

import bisect
from collections.abc import Awaitable, Callable

from .batches import StoredBatch, stored_batch

NextBatch = Callable[[int, int], Awaitable[StoredBatch | None]]
NOT_NARROWED = object()  # a ``narrow`` hook's answer: it cannot answer for this window, search on


async def next_batch(read_raw, first: int, last: int, chunk: int = 8) -> StoredBatch | None:
    """The first batch in entries first..last (no-ops skipped), or None. Reads one entry first
    (a probe almost always hits a batch), then ``chunk`` at a time."""
    n = 1
    while first <= last:
        got = await read_raw(first, min(last, first + n - 1))
        if not got:
            return None
        for e in got:
            first = e.entry_id + 1
            b = stored_batch(e.entry_id, e.data)
            if b is not None:
                return b
        n = chunk
    return None


async def search_offset(next_batch_in: NextBatch, lo: int, hi: int, offset: int) -> tuple[StoredBatch | None, int]:
    """Binary search for the batch holding ``offset`` among the entries strictly between ``lo``
    and ``hi``, where every batch at or below ``lo`` ends at or below ``offset``: (the batch, or
    None; the entry id of the last batch seen that ends at or below it, else ``lo``).
    ``next_batch_in(first, last)`` is the first batch in first..last. O(log n) reads."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        b = await next_batch_in(mid, hi - 1)
        if b is None or b.base_offset > offset:
            hi = mid
        elif offset < b.end_offset:
            return b, lo
        else:
            lo = b.entry_id
    return None, lo


async def search_timestamp(next_batch_in: NextBatch, lo: int, hi: int, ts: int, narrow=None) -> StoredBatch | None:
    """The first batch strictly between ``lo`` and ``hi`` whose max timestamp is >= ``ts`` (batches'
    max timestamps taken as non-decreasing, as Kafka's time index does), or None.

    ``narrow(lo, hi, ts)``, when given, is asked first at every step: it answers the search inside
    that window itself (the batch, or None: none in the window) when it can do so cheaply (an
    offloaded fragment's index), or returns NOT_NARROWED."""
    found = None
    while hi - lo > 1:
        if narrow is not None:
            got = await narrow(lo, hi, ts)
            if got is not NOT_NARROWED:
                return got if got is not None else found
        mid = (lo + hi) // 2
        b = await next_batch_in(mid, hi - 1)
        if b is None:
            hi = mid
        elif b.max_timestamp >= ts:
            found, hi = b, mid
        else:
            lo = b.entry_id
    return found


class OffsetIndex:
    """Sorted (entry id, base offset, end offset) points, at most ``max_points`` of them."""

    def __init__(self, max_points: int = 100_000):
        self.max_points = max_points
        self.eids: list[int] = []
        self.bases: list[int] = []
        self.ends: list[int] = []

    def add(self, b: StoredBatch | tuple[int, int, int]) -> None:
        eid, base, end = (b.entry_id, b.base_offset, b.end_offset) if isinstance(b, StoredBatch) else b
        if self.eids and eid > self.eids[-1]:
            i = len(self.eids)  # the common case: appending in order
        else:
            i = bisect.bisect_left(self.eids, eid)
            if i < len(self.eids) and self.eids[i] == eid:
                return
        self.eids.insert(i, eid)
        self.bases.insert(i, base)
        self.ends.insert(i, end)
        if len(self.eids) > self.max_points:  # thin: keep every other point, and the last
            last = (self.eids[-1], self.bases[-1], self.ends[-1])
            self.eids, self.bases, self.ends = self.eids[::2], self.bases[::2], self.ends[::2]
            if self.eids[-1] != last[0]:
                self.eids.append(last[0])
                self.bases.append(last[1])
                self.ends.append(last[2])

    def drop_below(self, eid: int) -> None:
        """Forget points below entry ``eid`` (removed by retention)."""
        i = bisect.bisect_left(self.eids, eid)
        if i:
            del self.eids[:i], self.bases[:i], self.ends[:i]

    def bracket(self, offset: int) -> tuple[int | None, int | None, bool]:
        """(entry id of the last point with base <= offset, entry id of the first point with
        base > offset, whether the lower point holds ``offset``)."""
        i = bisect.bisect_right(self.bases, offset)
        lo = self.eids[i - 1] if i > 0 else None
        hi = self.eids[i] if i < len(self.eids) else None
        holds = i > 0 and offset < self.ends[i - 1]
        return lo, hi, holds
