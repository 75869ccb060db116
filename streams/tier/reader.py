"""Reading offloaded fragments from their objects (see ``streams/tier/segment.py`` for the format).

``TierReader`` serves ``Consumer`` reads of fragments whose entries live in the object store: it
gets an object's index with one range GET of its tail (LRU-cached per key, ``index_cache`` of them:
an index costs ~200 KB of memory per 64 MiB of body, so later reads of the object cost no index GET), narrows any entry, offset or timestamp to one index chunk, and GETs only
the body bytes a read needs — never the whole object for a seek.

Read-ahead. A reader whose next call starts where its last one ended (or that starts reading an
object at its first entry) is streaming a backlog: the body is fetched in ``range_bytes`` pieces
ahead of it, up to ``in_flight`` of them outstanding, so the next calls find their bytes already
here. Pieces behind the reader are dropped at once and at most ``max_runs`` readers keep a window
(the least recently used one is cancelled), so memory stays below ``max_runs * (in_flight + 1) *
range_bytes`` plus one call's bytes.

Every batch handed out has its own CRC checked here (its bytes came over the network from a
store), as well as its place (lengths inside the body, base offsets ascending inside the object's
range). A missing or corrupt object raises ``ObjectDataLost`` naming the stream, the entries and
offsets asked for and the key; an unreachable or slow store raises a retriable ``TierReadError``.
Nothing is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field

from crc32c import crc32c

from bookie.client import Entry
from fragments.model import Fragment
from terms.entry import KIND_DATA

from ..batches import HEADER_BYTES, OFF_ATTRIBUTES, OFF_CRC, OFF_LAST_DELTA, OFF_LENGTH, OFF_MAX_TIMESTAMP
from ..errors import ObjectDataLost, TierReadError
from .objstore import NoSuchBucket, ObjectMissing, ObjectStoreAuthError, ObjectStoreError
from .segment import SegmentFormatError, SegmentIndex, parse_tail

log = logging.getLogger(__name__)

TAIL_BYTES = 64 * 1024  # first GET of an object's tail: the footer and, usually, the whole index
_SEQUENTIAL_ENTRIES = 16  # a read of this many entries or more is a reader's, not a seek's probe
_KIND = bytes([KIND_DATA])
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")


class _Lost(Exception):
    """Internal: the object is missing or corrupt (becomes ObjectDataLost)."""


class _Unavailable(Exception):
    """Internal: the store did not answer (becomes a TierReadError, retriable unless the store
    refused our credentials or has no such bucket)."""

    def __init__(self, message: str, retriable: bool = True):
        super().__init__(message)
        self.retriable = retriable


@dataclass
class _Run:
    """One sequential reader's window on an object: contiguous body pieces [start, end), fetched
    or being fetched, and where its next call is expected (entry id, body position)."""
    key: str
    pieces: list = field(default_factory=list)  # [start, end, future]
    next_eid: int = -1
    next_pos: int = -1
    # body positions of the entries the last call returned: a reader that goes on from one of them
    # (a Kafka fetch drops the batch that would overflow its answer and starts the next fetch at it)
    # keeps its window and read-ahead
    recent: dict = field(default_factory=dict)

    def drop(self) -> None:
        for _s, _e, fut in self.pieces:
            if not fut.done():
                fut.cancel()
        self.pieces.clear()


class TierReader:
    def __init__(self, store, *, range_bytes: int = 4 << 20, in_flight: int = 4, index_cache: int = 128,
                 max_runs: int = 16, timeout_s: float = 30.0):
        self.store = store
        self.range_bytes = max(64 * 1024, int(range_bytes))
        self.in_flight = max(1, int(in_flight))
        self.index_cache = max(1, int(index_cache))
        self.max_runs = max(1, int(max_runs))
        self.timeout_s = timeout_s
        self._indexes: OrderedDict[str, SegmentIndex] = OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        self._runs: OrderedDict[int, _Run] = OrderedDict()
        self._run_ids = 0
        self.gets = 0  # range GETs sent (for tests and stats)
        self.bytes_got = 0

    # ------------------------------------------------------------------------------ store access
    async def _get(self, key: str, start: int, end: int) -> bytes:
        """Body bytes [start, end) of ``key`` (end exclusive)."""
        self.gets += 1
        try:
            data = await asyncio.wait_for(self.store.get_range(key, start, end), self.timeout_s)
        except ObjectMissing as exc:
            raise _Lost(f"the object is missing ({exc})") from exc
        except TimeoutError as exc:
            raise _Unavailable(f"the object store did not answer within {self.timeout_s:g} s") from exc
        except (ObjectStoreAuthError, NoSuchBucket) as exc:  # a setup problem: retrying does not help
            raise _Unavailable(f"the object store refused the read: {exc}", retriable=False) from exc
        except ObjectStoreError as exc:  # ObjectStoreUnavailable and any other failure of the store
            raise _Unavailable(f"the object store failed: {exc}") from exc
        if len(data) != end - start:
            raise _Lost(f"a range GET of bytes {start}..{end - 1} returned {len(data)} bytes (object truncated?)")
        self.bytes_got += len(data)
        return data

    async def index(self, key: str, size: int) -> SegmentIndex:
        """The object's footer, index and skips: one GET of its last TAIL_BYTES (a second one when
        the index is larger), cached by key. Raises ObjectDataLost / TierReadError."""
        try:
            return await self._index(key, size)
        except _Lost as exc:
            raise ObjectDataLost(f"object {key!r}: {exc}", key=key) from None
        except _Unavailable as exc:
            raise TierReadError(f"object {key!r}: {exc}", key=key, retriable=exc.retriable) from None

    async def _index(self, key: str, size: int) -> SegmentIndex:
        idx = self._indexes.get(key)
        if idx is not None:
            self._indexes.move_to_end(key)
            return idx
        fut = self._loading.get(key)
        if fut is None:
            fut = self._loading[key] = asyncio.ensure_future(self._load_index(key, size))
            fut.add_done_callback(lambda _f, k=key: self._loading.pop(k, None))
        return await asyncio.shield(fut)

    async def _load_index(self, key: str, size: int) -> SegmentIndex:
        n = min(size, TAIL_BYTES)
        tail = await self._get(key, size - n, size)
        try:
            got = parse_tail(tail, size, key)
            if isinstance(got, int):
                if got > size:
                    raise SegmentFormatError(f"{key}: the footer wants {got} index bytes of a {size}-byte object")
                tail = await self._get(key, size - got, size)
                got = parse_tail(tail, size, key)
                if isinstance(got, int):
                    raise SegmentFormatError(f"{key}: index still incomplete")
        except SegmentFormatError as exc:
            raise _Lost(f"corrupt: {exc}") from exc
        self._indexes[key] = got
        while len(self._indexes) > self.index_cache:
            self._indexes.popitem(last=False)
        return got

    def forget(self, key: str) -> None:
        """Drop what is cached of ``key`` (its index and read-ahead)."""
        self._indexes.pop(key, None)
        for rid, run in list(self._runs.items()):
            if run.key == key:
                run.drop()
                del self._runs[rid]

    async def close(self) -> None:
        for run in self._runs.values():
            run.drop()
        self._runs.clear()

    # ------------------------------------------------------------------------------ reading
    async def read_entries(self, f: Fragment, first: int, last: int, max_bytes: int = 4 << 20, *,
                           stream: str = "") -> list[Entry]:
        """Entries ``first..last`` of offloaded fragment ``f`` from its object, contiguous from
        ``first`` (no-op and hole entries with data ``b""``), cut after ``max_bytes`` of data
        (at least one entry). ``entry_term`` is the fragment's created term."""
        key, size = f.tier["key"], int(f.tier["size"])
        idx = None
        try:
            idx = await self._index(key, size)
            return await self._read(f, idx, key, first, last, max_bytes)
        except (_Lost, _Unavailable) as exc:
            raise self._error(exc, stream, f, key, idx, first, last) from None

    def _error(self, exc: Exception, stream: str, f: Fragment, key: str, idx: SegmentIndex | None, first: int,
               last: int) -> TierReadError:
        if isinstance(exc, _Lost):
            return ObjectDataLost(self._what(stream, f, key, idx, first, last, f"cannot be read: {exc}"),
                                  stream=stream, key=key, first=first, last=last)
        return TierReadError(self._what(stream, f, key, idx, first, last, f"could not be read now: {exc}"),
                             stream=stream, key=key, first=first, last=last, retriable=exc.retriable)

    @staticmethod
    def _what(stream: str, f: Fragment, key: str, idx: SegmentIndex | None, first: int, last: int, why: str) -> str:
        if idx is not None:
            p = idx.point_for_entry(first)
            lo = idx.offsets[p] if p >= 0 else idx.footer.first_offset
            offs = f"offsets {lo}..{idx.footer.end_offset - 1}"
        elif f.first_offset is not None:
            offs = f"offsets from {f.first_offset}"
        else:
            offs = "offsets unknown"
        return (f"stream {stream!r} fragment {f.index}: entries {first}..{last} ({offs}) are offloaded to object "
                f"{key!r}, which {why}")

    def _find_run(self, key: str, first: int) -> _Run | None:
        for rid, run in self._runs.items():
            if run.key == key and run.next_eid == first:
                self._runs.move_to_end(rid)
                return run
        if self._runs:  # the reader last served goes on from inside its last answer
            rid, run = next(reversed(self._runs.items()))
            if run.key == key and first in run.recent:
                run.next_eid, run.next_pos = first, run.recent[first]
                return run
        return None

    def _new_run(self, key: str) -> _Run:
        self._run_ids += 1
        run = _Run(key)
        self._runs[self._run_ids] = run
        while len(self._runs) > self.max_runs:
            _rid, old = self._runs.popitem(last=False)
            old.drop()
        return run

    async def _read(self, f: Fragment, idx: SegmentIndex, key: str, first: int, last: int,
                    max_bytes: int) -> list[Entry]:
        ft = idx.footer
        if first < ft.first_entry or first > ft.last_entry or (f.sealed and ft.last_entry != f.last_entry_id) \
                or ft.first_entry != f.first_entry_id:
            raise _Lost(f"corrupt: it holds entries {ft.first_entry}..{ft.last_entry}, the fragment record says "
                        f"{f.first_entry_id}..{f.last_entry_id}")
        last = min(last, ft.last_entry)
        run = self._find_run(key, first)
        if run is not None and run.next_pos >= 0:
            eid, pos = first, run.next_pos
            sequential = True
        else:
            p = idx.point_for_entry(first)
            eid, pos = (ft.first_entry, 0) if p < 0 else (idx.entries[p], idx.positions[p])
            sequential = first == ft.first_entry and last - first >= _SEQUENTIAL_ENTRIES
            # a probe (a seek's one-entry reads) gets a window of its own, not kept: it must not push
            # a streaming reader's out
            run = self._new_run(key) if last - first >= _SEQUENTIAL_ENTRIES else _Run(key)
        # body bytes needed: up to the end of the chunk holding ``last``, at most max_bytes, but
        # at least the chunk holding ``first`` (a chunk holds whole batches)
        pl = idx.point_for_entry(last)
        need = pos if pl < 0 else idx.chunk_end(pl)
        pf = idx.point_for_entry(first)
        floor = pos if pf < 0 else idx.chunk_end(pf)
        end = max(min(need, pos + max(1, max_bytes)), floor)
        end = max(pos, min(end, ft.body_len))
        try:
            body = await self._body(run, key, pos, end, ft.body_len, sequential)
        except BaseException:
            run.drop()
            run.next_eid = -1
            raise
        out, eid, used = self._walk(idx, f, key, eid, pos, body, first, last, max_bytes)
        run.next_eid, run.next_pos = eid, pos + used
        recent, at = {}, pos + used
        for e in reversed(out):  # where each returned entry starts in the body
            if e.data:
                at -= len(e.data) - 1
            recent[e.entry_id] = at
        run.recent = recent
        if eid > ft.last_entry:  # read to the end: the reader goes on in the next fragment's object
            self._end_run(run)
        if not out:
            raise _Lost(f"corrupt: body bytes {pos}..{end - 1} hold no entry from {first}")
        return out

    def _end_run(self, run: _Run) -> None:
        run.drop()
        for rid, r in list(self._runs.items()):
            if r is run:
                del self._runs[rid]

    async def _body(self, run: _Run, key: str, pos: int, end: int, body_len: int, ahead: bool) -> memoryview:
        """Body bytes [pos, end) through the run's window; with ``ahead`` the next pieces after
        ``end`` are requested too (up to ``in_flight`` beyond it)."""
        ps = run.pieces
        while ps and ps[0][1] <= pos:  # behind the reader: done with
            ps.pop(0)
        if ps and ps[0][0] > pos:
            run.drop()
        nxt = ps[-1][1] if ps else pos
        while nxt < end:  # what this call needs: no more
            e = min(end, nxt + self.range_bytes)
            ps.append([nxt, e, asyncio.ensure_future(self._get(key, nxt, e))])
            nxt = e
        if ahead:
            while nxt < body_len and sum(1 for p in ps if p[0] >= end) < self.in_flight:
                e = min(body_len, nxt + self.range_bytes)
                t = asyncio.ensure_future(self._get(key, nxt, e))
                t.add_done_callback(_retrieved)
                ps.append([nxt, e, t])
                nxt = e
        if end <= pos:
            return memoryview(b"")
        wanted = [p for p in ps if p[0] < end and p[1] > pos]
        datas = await asyncio.gather(*(asyncio.shield(p[2]) for p in wanted))
        if len(wanted) == 1:
            s, e, _ = wanted[0]
            return memoryview(datas[0])[pos - s:end - s]
        parts = []
        for (s, e, _), d in zip(wanted, datas):
            parts.append(memoryview(d)[max(0, pos - s):min(e, end) - s])
        return memoryview(b"".join(parts))

    @staticmethod
    def _walk(idx: SegmentIndex, f: Fragment, key: str, eid: int, pos: int, body: memoryview, first: int,
              last: int, max_bytes: int) -> tuple[list[Entry], int, int]:
        """Entries from ``eid`` at body position ``pos`` (``body`` = the bytes from there), those
        from ``first`` on kept, each batch checked. (entries, next entry id, bytes used)."""
        ft = idx.footer
        term = f.created_term
        out: list[Entry] = []
        at = 0
        n_bytes = 0
        prev_end = ft.first_offset
        while eid <= last:
            if idx.is_skip(eid):
                if eid >= first:
                    out.append(Entry(eid, term, b""))
                eid += 1
                continue
            if out and n_bytes >= max_bytes:
                break
            if at + 12 > len(body):
                if pos + at >= ft.body_len:
                    raise _Lost(f"corrupt: the body ends before entry {eid} (last entry {ft.last_entry})")
                break
            (blen,) = _I32.unpack_from(body, at + OFF_LENGTH)
            n = 12 + blen
            if blen < HEADER_BYTES - 12 or pos + at + n > ft.body_len:
                raise _Lost(f"corrupt: entry {eid} at body position {pos + at}: bad batch length {blen}")
            if at + n > len(body):
                break
            if eid >= first:
                batch = body[at:at + n]
                if crc32c(batch[OFF_ATTRIBUTES:]) != _U32.unpack_from(batch, OFF_CRC)[0]:
                    raise _Lost(f"corrupt: entry {eid} at body position {pos + at}: record batch CRC mismatch")
                (base,) = _I64.unpack_from(batch, 0)
                (delta,) = _I32.unpack_from(batch, OFF_LAST_DELTA)
                if base < prev_end or base + delta + 1 > ft.end_offset:
                    raise _Lost(f"corrupt: entry {eid} at body position {pos + at}: base offset {base} outside "
                                f"{prev_end}..{ft.end_offset - 1}")
                prev_end = base + delta + 1
                out.append(Entry(eid, term, _KIND + batch))
                n_bytes += n
            at += n
            eid += 1
        return out, eid, at

    # ------------------------------------------------------------------------------ seeking
    async def _chunk_batches(self, f: Fragment, idx: SegmentIndex, key: str, point: int) -> list[Entry]:
        """The batches (no skips) of index chunk ``point``: one GET of that chunk's bytes."""
        pos, end = idx.positions[point], idx.chunk_end(point)
        body = memoryview(await self._get(key, pos, end))
        last = idx.entries[point + 1] - 1 if point + 1 < len(idx.entries) else idx.footer.last_entry
        got, _eid, _used = self._walk(idx, f, key, idx.entries[point], pos, body, idx.entries[point], last, 1 << 62)
        return [e for e in got if e.data]

    async def find_offset(self, f: Fragment, offset: int, *, stream: str = "") -> Entry | None:
        """The batch of ``f`` holding record ``offset`` (or the first one after it, when it is in a
        gap), from the index and one chunk GET; None when the fragment's batches all end at or
        below it."""
        key, size = f.tier["key"], int(f.tier["size"])
        idx = None
        try:
            idx = await self._index(key, size)
            if not idx.positions or offset >= idx.footer.end_offset:
                return None
            p = idx.point_for_offset(offset)
            while p < len(idx.positions):
                for e in await self._chunk_batches(f, idx, key, p):
                    (base,) = _I64.unpack_from(e.data, 1)
                    (delta,) = _I32.unpack_from(e.data, 1 + OFF_LAST_DELTA)
                    if offset < base + delta + 1:
                        return e
                p += 1
            return None
        except (_Lost, _Unavailable) as exc:
            raise self._error(exc, stream, f, key, idx, f.first_entry_id, f.last_entry_id) from None

    async def find_timestamp(self, f: Fragment, ts: int, after_entry: int = -1, *, stream: str = "") -> Entry | None:
        """The first batch of ``f`` after entry ``after_entry`` whose max timestamp is >= ``ts``,
        from the index and (usually) one chunk GET; None when there is none."""
        key, size = f.tier["key"], int(f.tier["size"])
        idx = None
        try:
            idx = await self._index(key, size)
            p = idx.point_for_timestamp(ts)
            if p is None:
                return None
            while p < len(idx.positions):
                chunk_last = idx.entries[p + 1] - 1 if p + 1 < len(idx.entries) else idx.footer.last_entry
                if idx.timestamps[p] >= ts and chunk_last > after_entry:
                    for e in await self._chunk_batches(f, idx, key, p):
                        if e.entry_id > after_entry and _I64.unpack_from(e.data, 1 + OFF_MAX_TIMESTAMP)[0] >= ts:
                            return e
                p += 1
            return None
        except (_Lost, _Unavailable) as exc:
            raise self._error(exc, stream, f, key, idx, f.first_entry_id, f.last_entry_id) from None


def _retrieved(t: asyncio.Future) -> None:
    if not t.cancelled():
        with contextlib.suppress(BaseException):
            t.exception()
