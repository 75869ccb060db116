"""The write cache (unflushed entries and pending deletions) and the read cache (an LRU).

How this works. The write cache is two *generations*: ``active`` receives every accepted add, and
``flushing`` is the previous one, frozen while the flush thread writes it to an entry log and the
index. A generation also records *tombstones*: truncates (``trunc_from``: ids >= this are gone),
trims (id ranges) and whole-ledger deletions (truncate from 0). A truncate or trim removes the ids
from ``active`` at once and leaves a tombstone there, because the frozen ``flushing`` generation,
the read cache and the index may still hold older copies: a lookup walks active -> flushing and the
first generation that holds the id, or a tombstone covering it, decides. A flush applies its
generation's tombstones to the index before its entries, which gives the same result as the order
the operations happened in (every entry added after a generation's first truncate of a ledger is
in that generation). Entries are plain tuples (entry_term, digest_type, digest, data).

A disk read runs in a thread while the event loop goes on, so the write cache it is checked against
afterwards may have changed meanwhile; the dangerous change is a completed flush, which removes the
generation that held a newer copy or a tombstone while the index the read scanned still named the
older copy. So a read *pins* the flush count before its disk part starts (``pin``), and a flushed
generation is kept as *retired* while any read that began before its flush is still in flight;
``lookup_since`` consults active -> flushing -> retired (newest first) and so gives the same answer
the write cache would have given at any instant of the read.

The read cache holds entries read from entry logs, bounded by bytes, least recently used first out;
truncates, trims and overwriting adds drop the affected ids synchronously (ids are reused after a
truncate, and an idempotent re-add may carry a new term).
"""

from __future__ import annotations

import collections

from .entrylog import ENTRY_OVERHEAD, entry_size

DELETED = object()  # a lookup answer: a tombstone covers this id


class WriteGen:
    __slots__ = ("entries", "bytes", "trunc_from", "trims")

    def __init__(self) -> None:
        self.entries: dict[int, dict[int, tuple]] = {}
        self.bytes = 0
        self.trunc_from: dict[int, int] = {}
        self.trims: dict[int, list[tuple[int, int]]] = {}

    def put(self, ledger_id: int, entry_id: int, entry: tuple) -> None:
        led = self.entries.get(ledger_id)
        if led is None:
            led = self.entries[ledger_id] = {}
        old = led.get(entry_id)
        if old is not None:
            self.bytes -= len(old[3]) + len(old[2]) + ENTRY_OVERHEAD
        led[entry_id] = entry
        self.bytes += len(entry[3]) + len(entry[2]) + ENTRY_OVERHEAD

    def lookup(self, ledger_id: int, entry_id: int) -> object:
        """The entry, DELETED, or None when this generation knows nothing about the id."""
        led = self.entries.get(ledger_id)
        if led is not None:
            entry = led.get(entry_id)
            if entry is not None:
                return entry
        if self.trunc_from or self.trims:
            return DELETED if self.covers(ledger_id, entry_id) else None
        return None

    def covers(self, ledger_id: int, entry_id: int) -> bool:
        start = self.trunc_from.get(ledger_id)
        if start is not None and entry_id >= start:
            return True
        return any(first <= entry_id <= last for first, last in self.trims.get(ledger_id, ()))

    def truncate(self, ledger_id: int, start: int) -> None:
        self._drop(ledger_id, lambda e: e >= start)
        self.trunc_from[ledger_id] = min(start, self.trunc_from.get(ledger_id, start))

    def trim(self, ledger_id: int, first: int, last: int) -> None:
        self._drop(ledger_id, lambda e: first <= e <= last)
        self.trims.setdefault(ledger_id, []).append((first, last))

    def _drop(self, ledger_id: int, doomed) -> None:
        led = self.entries.get(ledger_id)
        if not led:
            return
        for entry_id in [e for e in led if doomed(e)]:
            self.bytes -= entry_size(led.pop(entry_id))
        if not led:
            del self.entries[ledger_id]

    def count(self) -> int:
        return sum(len(v) for v in self.entries.values())


class WriteCache:
    def __init__(self) -> None:
        self.active = WriteGen()
        self.flushing: WriteGen | None = None
        self.flushes = 0  # completed flushes
        self._retired: collections.deque[tuple[int, WriteGen]] = collections.deque()  # (flush no., gen), oldest first
        self._pins: collections.Counter[int] = collections.Counter()  # flush count at a read's start -> reads

    @property
    def bytes(self) -> int:
        return self.active.bytes + (self.flushing.bytes if self.flushing is not None else 0)

    def lookup(self, ledger_id: int, entry_id: int) -> object:
        found = self.active.lookup(ledger_id, entry_id)
        if found is None and self.flushing is not None:
            found = self.flushing.lookup(ledger_id, entry_id)
        return found

    def lookup_since(self, ledger_id: int, entry_id: int, mark: int) -> object:
        """``lookup`` for a read that pinned ``mark``: also asks the generations flushed since,
        newest first (the index the read scanned may predate their flush)."""
        found = self.lookup(ledger_id, entry_id)
        if found is None and self._retired:
            for number, gen in reversed(self._retired):
                if number <= mark:
                    break
                found = gen.lookup(ledger_id, entry_id)
                if found is not None:
                    break
        return found

    def pin(self) -> int:
        """A disk read starts: keep every generation flushed from now on until ``unpin``."""
        mark = self.flushes
        self._pins[mark] += 1
        return mark

    def unpin(self, mark: int) -> None:
        left = self._pins[mark] - 1
        if left:
            self._pins[mark] = left
        else:
            del self._pins[mark]
        self._prune()

    def _prune(self) -> None:
        oldest = min(self._pins) if self._pins else self.flushes
        retired = self._retired
        while retired and retired[0][0] <= oldest:
            retired.popleft()

    @property
    def retired_count(self) -> int:
        return len(self._retired)

    @property
    def retired_bytes(self) -> int:
        """Memory held by flushed generations that in-flight reads still need."""
        return sum(gen.bytes for _n, gen in self._retired)

    def swap(self) -> WriteGen:
        assert self.flushing is None, "one flush at a time"
        self.flushing, self.active = self.active, WriteGen()
        return self.flushing

    def flushed(self) -> None:
        gen, self.flushing = self.flushing, None
        self.flushes += 1
        if self._pins and gen is not None:
            self._retired.append((self.flushes, gen))


class ReadCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._lru: collections.OrderedDict[tuple[int, int], tuple] = collections.OrderedDict()
        self.ids_by_ledger: dict[int, set[int]] = {}  # read by the add path to spot overwrites

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, ledger_id: int, entry_id: int) -> tuple | None:
        key = (ledger_id, entry_id)
        entry = self._lru.get(key)
        if entry is not None:
            self._lru.move_to_end(key)
        return entry

    def put(self, ledger_id: int, entry_id: int, entry: tuple) -> None:
        size = entry_size(entry)
        if size > self.max_bytes:
            return
        self._remove((ledger_id, entry_id))
        self._lru[(ledger_id, entry_id)] = entry
        self.ids_by_ledger.setdefault(ledger_id, set()).add(entry_id)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._lru)))

    def _remove(self, key: tuple[int, int]) -> None:
        entry = self._lru.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry_size(entry)
        ids = self.ids_by_ledger.get(key[0])
        if ids is not None:
            ids.discard(key[1])
            if not ids:
                del self.ids_by_ledger[key[0]]

    def clear(self) -> None:
        self._lru.clear()
        self.ids_by_ledger.clear()
        self.bytes = 0

    def drop(self, ledger_id: int, first: int, last: int | None = None) -> None:
        """Forget the ledger's ids in [first, last] (last None: to the end)."""
        ids = self.ids_by_ledger.get(ledger_id)
        if not ids:
            return
        doomed = [e for e in ids if e >= first and (last is None or e <= last)]
        for entry_id in doomed:
            self._remove((ledger_id, entry_id))
