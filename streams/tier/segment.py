"""The object of an offloaded fragment: its RecordBatches back to back, a sparse index, a footer.
Pure: building and parsing only, no IO.

Layout (all integers little-endian but the batches, which are Kafka's own bytes)::

    body    the fragment's RecordBatches (magic 2) back to back, exactly as stored: bytes
            [0, body_len) are a Kafka log segment body, readable without Scroll
    index   n points of 32 bytes: entry id u64, base offset i64, max timestamp i64, position u64.
            A point starts every chunk of <= INDEX_EVERY bytes of body (the first batch always
            starts one); its max timestamp is the largest of its chunk's batches
    skips   m entry ids u64 (ascending): the fragment's entries that hold no batch (take-over
            no-ops, compaction's holes). Entry ids of the body's batches follow from them
    footer  FOOTER_BYTES: see ``Footer``; ends with its own CRC-32C and the magic

A reader gets the footer (one small range GET of the tail), then the index and skips (one more, or
the same if it fetched enough), and from then on any entry, offset or timestamp narrows to one
chunk without reading data.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from crc32c import crc32c

from terms.entry import KIND_DATA

from ..batches import HEADER_BYTES, OFF_LENGTH, OFF_MAX_TIMESTAMP, RecordFormatError, stored_batch

MAGIC = b"SCRLSEG1"
VERSION = 1
INDEX_EVERY = 64 * 1024
_POINT = struct.Struct("<QqqQ")
_SKIP = struct.Struct("<Q")
# version, first entry, last entry, created term, body length, index points, skips, first offset,
# end offset (one past the last record; = first when empty), max timestamp (-1: none),
# body CRC-32C, index+skips CRC-32C, footer CRC-32C (over everything before it), magic
_FOOTER = struct.Struct("<HqqqQIIqqqIII8s")
FOOTER_BYTES = _FOOTER.size
_KIND = bytes([KIND_DATA])
_BATCH_LEN = struct.Struct(">i")
_I64BE = struct.Struct(">q")
_I32BE = struct.Struct(">i")


class SegmentFormatError(ValueError):
    """An object that is not a well-formed segment (truncated, corrupt, or of another format)."""


@dataclass(frozen=True, slots=True)
class Footer:
    first_entry: int
    last_entry: int
    created_term: int
    body_len: int
    points: int
    skips: int
    first_offset: int
    end_offset: int
    max_timestamp: int
    body_crc: int
    meta_crc: int

    @property
    def meta_len(self) -> int:
        return self.points * _POINT.size + self.skips * _SKIP.size

    @property
    def size(self) -> int:
        """The whole object's size."""
        return self.body_len + self.meta_len + FOOTER_BYTES

    def encode(self) -> bytes:
        head = _FOOTER.pack(VERSION, self.first_entry, self.last_entry, self.created_term, self.body_len,
                            self.points, self.skips, self.first_offset, self.end_offset, self.max_timestamp,
                            self.body_crc, self.meta_crc, 0, MAGIC)
        crc = crc32c(head[:-12])
        return head[:-12] + struct.pack("<I", crc) + head[-8:]

    @classmethod
    def decode(cls, tail: bytes | memoryview, where: str = "object") -> Footer:
        if len(tail) < FOOTER_BYTES:
            raise SegmentFormatError(f"{where}: {len(tail)} bytes, shorter than a footer")
        raw = bytes(tail[-FOOTER_BYTES:])
        (version, first, last, term, body_len, points, skips, first_off, end_off, max_ts, body_crc, meta_crc,
         crc, magic) = _FOOTER.unpack(raw)
        if magic != MAGIC:
            raise SegmentFormatError(f"{where}: not a Scroll segment (bad magic)")
        if crc32c(raw[:-12]) != crc:
            raise SegmentFormatError(f"{where}: footer CRC mismatch")
        if version != VERSION:
            raise SegmentFormatError(f"{where}: segment version {version}, this build reads {VERSION}")
        return cls(first, last, term, body_len, points, skips, first_off, end_off, max_ts, body_crc, meta_crc)


class SegmentIndex:
    """The footer, index points and skips of one object: where an entry, offset or timestamp is."""

    def __init__(self, footer: Footer, meta: bytes | memoryview, where: str = "object"):
        if len(meta) != footer.meta_len:
            raise SegmentFormatError(f"{where}: index is {len(meta)} bytes, the footer says {footer.meta_len}")
        if crc32c(meta) != footer.meta_crc:
            raise SegmentFormatError(f"{where}: index CRC mismatch")
        self.footer = footer
        pts = [_POINT.unpack_from(meta, i * _POINT.size) for i in range(footer.points)]
        self.entries = [p[0] for p in pts]
        self.offsets = [p[1] for p in pts]
        self.timestamps = [p[2] for p in pts]
        self.positions = [p[3] for p in pts]
        base = footer.points * _POINT.size
        self.skips = [_SKIP.unpack_from(meta, base + i * _SKIP.size)[0] for i in range(footer.skips)]
        self._skipset = frozenset(self.skips)
        # the running max of chunk timestamps, for "first chunk with a timestamp >= t"
        self._ts_max = []
        m = -1
        for t in self.timestamps:
            m = max(m, t)
            self._ts_max.append(m)

    def chunk_end(self, i: int) -> int:
        return self.positions[i + 1] if i + 1 < len(self.positions) else self.footer.body_len

    def point_for_entry(self, entry_id: int) -> int:
        """The index point to start reading at to reach ``entry_id`` (-1: no batch at or before it)."""
        return bisect.bisect_right(self.entries, entry_id) - 1

    def point_for_offset(self, offset: int) -> int:
        """The point whose chunk holds ``offset`` (or the first batch after it): the last point
        with base offset <= offset (0 when the offset is below the first)."""
        return max(0, bisect.bisect_right(self.offsets, offset) - 1)

    def point_for_timestamp(self, ts: int) -> int | None:
        """The first point whose chunk holds a batch with max timestamp >= ts (None: none)."""
        i = bisect.bisect_left(self._ts_max, ts)
        return i if i < len(self._ts_max) else None

    def is_skip(self, entry_id: int) -> bool:
        return entry_id in self._skipset

    def skips_between(self, first: int, last: int) -> list[int]:
        lo = bisect.bisect_left(self.skips, first)
        hi = bisect.bisect_right(self.skips, last)
        return self.skips[lo:hi]

    def entries_from(self, point: int, body: bytes | memoryview, last: int | None = None):
        """(entry id, entry data) for every entry from index point ``point`` on, parsed from
        ``body`` (body bytes starting at that point's position; may end mid-batch: the walk stops
        before a batch not wholly in it), skip entries as no-op entries (data ``b""``). Entry data
        carries the stream's one-byte envelope, as bookies serve it."""
        f = self.footer
        eid = f.first_entry if point < 0 else self.entries[point]
        end = f.last_entry if last is None else min(last, f.last_entry)
        out = []
        mv = memoryview(body)
        at = 0
        while eid <= end:
            if eid in self._skipset:
                out.append((eid, b""))
                eid += 1
                continue
            if at + 12 > len(mv):
                break
            (blen,) = _BATCH_LEN.unpack_from(mv, at + OFF_LENGTH)
            if blen < HEADER_BYTES - 12:
                raise SegmentFormatError(f"batch at body position {at}: bad length {blen}")
            n = 12 + blen
            if at + n > len(mv):
                break  # the rest is in the next range
            out.append((eid, _KIND + mv[at:at + n]))
            at += n
            eid += 1
        return out, at


class SegmentBuilder:
    """Builds one fragment's object from its entries, given in entry id order."""

    def __init__(self, first_entry: int, created_term: int, index_every: int = INDEX_EVERY):
        self.first_entry = first_entry
        self.created_term = created_term
        self.index_every = index_every
        self._next = first_entry
        self._parts: list[bytes | memoryview] = []
        self._body_len = 0
        self._crc = 0
        self._points: list[tuple[int, int, int, int]] = []
        self._chunk_start = -1
        self._skips: list[int] = []
        self.first_offset: int | None = None
        self.end_offset: int | None = None
        self.max_timestamp = -1

    def add(self, entry_id: int, data: bytes | memoryview) -> None:
        if entry_id != self._next:
            raise ValueError(f"entry {entry_id} given, expected {self._next}")
        self._next += 1
        b = stored_batch(entry_id, data)
        if b is None:
            self._skips.append(entry_id)
            return
        batch = memoryview(data)[1:]
        (ts,) = _I64BE.unpack_from(batch, OFF_MAX_TIMESTAMP)
        base = b.base_offset
        if self.end_offset is not None and base < self.end_offset:
            raise RecordFormatError(f"entry {entry_id}: base offset {base} below the previous batch's end "
                                    f"{self.end_offset}")
        if self._chunk_start < 0 or self._body_len - self._chunk_start >= self.index_every:
            self._points.append([entry_id, base, ts, self._body_len])
            self._chunk_start = self._body_len
        else:
            p = self._points[-1]
            p[2] = max(p[2], ts)
        if self.first_offset is None:
            self.first_offset = base
        self.end_offset = b.end_offset
        self.max_timestamp = max(self.max_timestamp, ts)
        self._parts.append(batch)
        self._crc = crc32c(batch, self._crc)
        self._body_len += len(batch)

    def finish(self, first_offset_hint: int | None = None) -> tuple[bytes, Footer]:
        """The object's bytes and its footer. ``first_offset_hint``: the fragment's first offset, for
        a fragment with no batch (its offsets are empty at that point)."""
        meta = b"".join(_POINT.pack(*p) for p in self._points) + b"".join(_SKIP.pack(s) for s in self._skips)
        first = self.first_offset if self.first_offset is not None else (first_offset_hint or 0)
        footer = Footer(self.first_entry, self._next - 1, self.created_term, self._body_len, len(self._points),
                        len(self._skips), first, self.end_offset if self.end_offset is not None else first,
                        self.max_timestamp, self._crc, crc32c(meta))
        return b"".join([*self._parts, meta, footer.encode()]), footer

    @property
    def body_len(self) -> int:
        return self._body_len


def parse_tail(tail: bytes | memoryview, object_size: int, where: str = "object") -> SegmentIndex | int:
    """The index from the last ``len(tail)`` bytes of an object of ``object_size`` bytes, or, when the
    tail is too short to hold the index, how many tail bytes are needed."""
    footer = Footer.decode(tail, where)
    if footer.size != object_size:
        raise SegmentFormatError(f"{where}: {object_size} bytes, the footer says {footer.size}")
    need = footer.meta_len + FOOTER_BYTES
    if len(tail) < need:
        return need
    meta = memoryview(tail)[len(tail) - need:len(tail) - FOOTER_BYTES]
    return SegmentIndex(footer, meta, where)


def verify(obj: bytes | memoryview, where: str = "object") -> Footer:
    """Check a whole object: footer, index and body CRCs, and that the body parses as batches."""
    idx = parse_tail(obj, len(obj), where)
    if isinstance(idx, int):
        raise SegmentFormatError(f"{where}: truncated")
    f = idx.footer
    body = memoryview(obj)[:f.body_len]
    if crc32c(body) != f.body_crc:
        raise SegmentFormatError(f"{where}: body CRC mismatch")
    entries, used = idx.entries_from(-1, body)
    if used != f.body_len or (entries and entries[-1][0] != f.last_entry) or \
            (not entries and f.last_entry >= f.first_entry):
        raise SegmentFormatError(f"{where}: body holds entries up to {entries[-1][0] if entries else None}, "
                                 f"footer says {f.last_entry}")
    return f
