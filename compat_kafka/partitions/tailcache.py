"""The entries a writable partition wrote last, kept to answer tailing fetches without a bookie read.

How this works. A consumer that keeps up with a partition asks, fetch after fetch, for the entry its
listener has just written and had acknowledged. That entry's bytes were in this process a moment
ago (the partition producer's sealed batch, base offset already set), so reading it back from a
bookie (one request, its answer decoded, the bookie's read) is work for nothing, and a round trip
more between an acknowledgement and the consumer. ``Producer.on_acked`` hands each acknowledged
batch to ``TailCache.add``; ``PartitionLog.read`` takes a contiguous run of cached entries from the
one it wants and reads from the bookies only what is not here (an older entry, a gap).

Only acknowledged entries are kept (they are at or below the LAC and survive any take-over, so what
is served from here is what a bookie would answer), and only those of the writer's current
fragment are served (``min_entry``): compaction rewrites sealed fragments, and a compacted entry
must be read from where it lives now. Bounded twice: per partition the last ``entries`` entries and
``max_bytes`` bytes, and per process a shared ``TailBudget`` (a listener with thousands of
partitions keeps at most its limit in all; the listener sets it to a sixteenth of its in-flight
produce bound and sheds every cache when a produce has to wait for room, so the cache never costs
a produce its memory); a batch that does not fit is simply not kept. A partition that stops being
the writer drops its cache with its producer.
"""

from __future__ import annotations

import collections
import struct
import weakref

from streams.batches import OFF_LAST_DELTA

_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")


class TailBudget:
    """The bytes all tail caches of a process may hold together."""

    __slots__ = ("limit", "used", "caches")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.caches: weakref.WeakSet[TailCache] = weakref.WeakSet()

    def shed(self) -> None:
        """Empty every cache (memory is wanted for produces)."""
        if self.used:
            for c in list(self.caches):
                c.clear()


PROCESS_BUDGET = TailBudget(64 << 20)


class CachedBatch:
    """One cached entry, with what ``PartitionLog.read`` uses of a ``StoredBatch`` (no envelope)."""

    __slots__ = ("entry_id", "batch", "base_offset", "end_offset", "size")

    def __init__(self, entry_id: int, batch) -> None:
        self.entry_id = entry_id
        self.batch = batch
        self.base_offset = _I64.unpack_from(batch, 0)[0]
        self.end_offset = self.base_offset + _I32.unpack_from(batch, OFF_LAST_DELTA)[0] + 1
        self.size = len(batch)


class TailCache:
    __slots__ = ("entries", "max_bytes", "budget", "bytes", "_q", "hits", "misses", "__weakref__")

    def __init__(self, entries: int = 32, max_bytes: int = 1 << 20, budget: TailBudget = PROCESS_BUDGET) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self.budget = budget
        self.bytes = 0
        self._q: collections.deque[CachedBatch] = collections.deque()
        self.hits = 0  # entries served from here
        self.misses = 0  # reads that had to go to a bookie
        budget.caches.add(self)

    def add(self, entry_id: int, batch) -> None:
        """An acknowledged entry (its batch, base offset set), in entry id order."""
        n = len(batch)
        q = self._q
        if q and q[-1].entry_id + 1 != entry_id:
            self.clear()  # not the next one (a no-op between, or a gap): keep runs contiguous
        while q and (len(q) >= self.entries or self.bytes + n > self.max_bytes
                     or self.budget.used + n > self.budget.limit):
            self._drop_oldest()
        if n > self.max_bytes or self.budget.used + n > self.budget.limit:
            return
        q.append(CachedBatch(entry_id, batch))
        self.bytes += n
        self.budget.used += n

    def run(self, first: int, last: int, min_entry: int = 0) -> list[CachedBatch]:
        """The cached entries ``first..last``, from ``first`` on without a gap; [] if ``first`` is not
        here or below ``min_entry`` (the writer's current fragment starts there)."""
        q = self._q
        if not q or not max(q[0].entry_id, min_entry) <= first <= q[-1].entry_id:
            return []
        i = first - q[0].entry_id
        end = min(last, q[-1].entry_id) - q[0].entry_id
        return [q[j] for j in range(i, end + 1)]

    def locate(self, offset: int, min_entry: int = 0) -> int | None:
        """The cached entry (at or after ``min_entry``) holding ``offset``, or None."""
        q = self._q
        if not q or not q[0].base_offset <= offset < q[-1].end_offset:
            return None
        for b in q:
            if offset < b.end_offset:
                return b.entry_id if b.base_offset <= offset and b.entry_id >= min_entry else None
        return None

    def clear(self) -> None:
        self.budget.used -= self.bytes
        self.bytes = 0
        self._q.clear()

    def _drop_oldest(self) -> None:
        n = self._q.popleft().size
        self.bytes -= n
        self.budget.used -= n
