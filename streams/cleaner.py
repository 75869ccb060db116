"""The log cleaner's decisions, batch by batch: Kafka's compaction rules. Sans-IO: entries in,
entries out; the job in ``streams/tools/compaction.py`` reads and writes them.

How this works. A pass has two scans over a stream's cleanable prefix (sealed fragments, oldest
first), as Kafka's ``LogCleaner`` does:

1. ``DirtyScan`` reads the *dirty* fragments (those after the previous pass's end) and builds the
   offset map: for every key, the offset of its latest record. Records of a transaction enter the
   map only when its COMMIT marker is seen; an ABORT marker records the transaction's range as
   aborted. A fragment end where no transaction is open is a *safe point*: the pass cleans up to
   the last one (an open transaction is at or above the last stable offset and is never touched),
   and map updates are staged until a safe point so records beyond it never count. The scan also
   notes each producer's last batch.
2. ``Rewriter`` reads every fragment from the log start to that safe point (the previous pass's
   output included: an incremental pass starts from it) and decides each entry:

   * a record is kept iff it is the latest for its key (the map holds no later offset); a record
     without a key is dropped; records of aborted transactions are dropped;
   * a tombstone (null value) that is the latest for its key is kept until its batch's delete
     horizon passes; a batch keeping tombstones gets the horizon when first cleaned (KIP-534:
     attribute bit 6, base timestamp = now + ``delete.retention.ms``; record timestamps are kept,
     their deltas taken from the horizon);
   * a commit/abort marker is kept while any record of its transaction survives; once none does it
     gets a horizon, and goes when the horizon has passed;
   * a batch that keeps every record is the same bytes; one that keeps some is rebuilt with its
     base offset, last offset delta, producer id/epoch and base sequence (so the next batch's
     offset and the producer's sequence are where they were); one that keeps none stays as an
     empty batch when it is its producer's last batch in the scanned log (idempotent
     de-duplication and producer state recovery need it), else becomes a *hole*;
   * no-op entries and holes stay (a no-op written into a data ledger becomes a hole there).

A *hole* is a data entry with no payload (``HOLE``): it keeps an entry id so the compacted
fragment maps its entries one to one onto the original ones, and readers skip it as they skip
no-ops (``streams.batches.stored_batch`` returns None).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.record.default_records import DefaultRecordBatch, _DefaultRecordBatchBuilderPy
from crc32c import crc32c

from .batches import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    HEADER_BYTES,
    OFF_ATTRIBUTES,
    OFF_COUNT,
    OFF_CRC,
    OFF_FIRST_TIMESTAMP,
    OFF_LAST_DELTA,
    OFF_LENGTH,
    OFF_MAX_TIMESTAMP,
    StoredBatch,
    producer_fields,
    stored_batch,
)

HOLE = b"\x00"  # a data entry with no payload: an entry that held only removed records
ATTR_DELETE_HORIZON = 0x40  # KIP-534: the batch's base timestamp is its delete horizon
ATTR_TIMESTAMP_TYPE = 0x08
CONTROL_ABORT, CONTROL_COMMIT = 0, 1
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_U32 = struct.Struct(">I")
_KEY_DIGEST_OVER = 32  # keys longer than this are kept in the map by a 16-byte digest


def map_key(key: bytes) -> bytes:
    return key if len(key) <= _KEY_DIGEST_OVER else hashlib.blake2b(key, digest_size=16).digest()


def control_type(batch: DefaultRecordBatch) -> int | None:
    """ABORT (0) or COMMIT (1) of a control batch's record (None: not a transaction marker)."""
    for r in batch:
        if r.key is not None and len(r.key) >= 4:
            return _I16.unpack_from(r.key, 2)[0]
    return None


def delete_horizon(b: StoredBatch) -> int | None:
    if b.attributes & ATTR_DELETE_HORIZON:
        return _I64.unpack_from(b.data, 1 + OFF_FIRST_TIMESTAMP)[0]
    return None


def _decode(b: StoredBatch) -> DefaultRecordBatch:
    data = b.data
    return DefaultRecordBatch(bytes(memoryview(data)[1:]))


@dataclass
class DirtyScan:
    """Pass 1 over the dirty fragments, in order: ``fragment(batches)`` per fragment, then the
    results. ``max_keys`` bounds the map: the scan stops at the safe point before it overflows."""

    max_keys: int = 5_000_000
    offsets: dict[bytes, int] = field(default_factory=dict)  # key -> latest offset (up to the safe point)
    aborted: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # pid -> [(first, marker)]
    producer_last: dict[int, int] = field(default_factory=dict)  # pid -> base offset of its last batch
    safe_fragments: int = 0  # how many fragments given form the cleanable prefix
    records: int = 0
    full: bool = False
    _stage: list = field(default_factory=list)
    _open: dict[int, int] = field(default_factory=dict)  # pid -> first offset of its open transaction
    _pending: dict[int, list] = field(default_factory=dict)  # pid -> [(key, offset)] of its open transaction
    _given: int = 0

    def fragment(self, batches: Iterable[StoredBatch]) -> bool:
        """Scan one fragment's batches; True when its end is a safe point that was taken."""
        if self.full:
            return False
        stage = self._stage
        for b in batches:
            attrs = b.attributes
            pid = b.producer()[0]
            if attrs & ATTR_CONTROL:
                kind = control_type(_decode(b))
                first = self._open.pop(pid, None)
                pending = self._pending.pop(pid, [])
                if kind == CONTROL_COMMIT:
                    stage.extend(pending)
                elif kind == CONTROL_ABORT and first is not None:
                    self.aborted.setdefault(pid, []).append((first, b.base_offset))
                continue
            if pid >= 0:
                self.producer_last[pid] = b.base_offset
            if attrs & ATTR_TRANSACTIONAL:
                self._open.setdefault(pid, b.base_offset)
                target = self._pending.setdefault(pid, [])
            else:
                target = stage
            for r in _decode(b):
                k = r.key
                if k is not None:
                    target.append((map_key(k), r.offset))
                self.records += 1
        self._given += 1
        if self._open:
            return False
        if len(self.offsets) + len(stage) > self.max_keys and self.safe_fragments:
            self.full = True
            return False
        offsets = self.offsets
        for k, off in stage:
            offsets[k] = off
        stage.clear()
        self.safe_fragments = self._given
        return True

    def is_aborted(self, pid: int, offset: int) -> bool:
        for first, marker in self.aborted.get(pid, ()):
            if first <= offset < marker:
                return True
        return False


@dataclass
class Outcome:
    """What a rewrite did to one fragment (for the report and the switch)."""

    entries: list  # the new entries (envelope included), one per input entry
    changed: bool = False
    bytes_in: int = 0
    bytes_out: int = 0
    records_in: int = 0
    records_out: int = 0
    tombstones_dropped: int = 0
    markers_dropped: int = 0


class Rewriter:
    """Pass 2: entries in, entries out, one fragment at a time, oldest first."""

    def __init__(self, scan: DirtyScan, now_ms: int, delete_retention_ms: int):
        self.scan = scan
        self.now_ms = now_ms
        self.delete_retention_ms = delete_retention_ms
        self._txn_alive: dict[int, bool] = {}  # pid -> a record of its current transaction survives

    def fragment(self, entries: Iterable) -> Outcome:
        out = Outcome([])
        for e in entries:
            data = e.data
            out.bytes_in += len(data)
            new = self.entry(e.entry_id, data, out)
            if new is not data:
                out.changed = True
            out.entries.append(new)
            out.bytes_out += len(new)
        return out

    def entry(self, entry_id: int, data, out: Outcome):
        b = stored_batch(entry_id, data)  # raises on a data entry that is not a batch: nothing is lost
        if b is None:
            return data  # a take-over's no-op or a hole: nothing to remove
        if crc32c(memoryview(data)[1 + OFF_ATTRIBUTES:]) != _U32.unpack_from(data, 1 + OFF_CRC)[0]:
            raise ValueError(f"entry {entry_id}: record batch CRC mismatch: not compacting a damaged batch")
        attrs = b.attributes
        pid = b.producer()[0]
        horizon = delete_horizon(b)
        if attrs & ATTR_CONTROL:
            return self._marker(b, pid, horizon, out)
        batch = _decode(b)
        records = list(batch)
        out.records_in += len(records)
        aborted = bool(attrs & ATTR_TRANSACTIONAL) and self.scan.is_aborted(pid, b.base_offset)
        keep = []
        tombstones = False
        if not aborted:
            offsets = self.scan.offsets
            for r in records:
                k = r.key
                if k is None or offsets.get(map_key(k), -1) > r.offset:
                    continue
                if r.value is None:
                    if horizon is not None and horizon <= self.now_ms:
                        out.tombstones_dropped += 1
                        continue
                    tombstones = True
                keep.append(r)
        if attrs & ATTR_TRANSACTIONAL and keep:
            self._txn_alive[pid] = True
        out.records_out += len(keep)
        new_horizon = horizon
        if tombstones and horizon is None:
            new_horizon = self.now_ms + self.delete_retention_ms
        if len(keep) == len(records) and new_horizon == horizon:
            return data
        if keep:
            return b"\x00" + rebuild(b, keep, new_horizon if tombstones else None)
        if pid >= 0 and self.scan.producer_last.get(pid) == b.base_offset:
            return data if _count(b) == 0 else b"\x00" + empty_batch(b)
        return HOLE

    def _marker(self, b: StoredBatch, pid: int, horizon: int | None, out: Outcome):
        alive = self._txn_alive.pop(pid, False)
        if alive:
            return b.data
        if horizon is None:
            decoded = _decode(b)
            return b"\x00" + rebuild(b, list(decoded), self.now_ms + self.delete_retention_ms)
        if horizon <= self.now_ms:
            out.markers_dropped += 1
            return HOLE
        return b.data


def _count(b: StoredBatch) -> int:
    return _I32.unpack_from(b.data, 1 + OFF_COUNT)[0]


def rebuild(b: StoredBatch, keep: list, horizon: int | None) -> bytearray:
    """The batch ``b`` holding only the records ``keep``: same base offset, last offset delta,
    attributes (control, transactional, compression), producer id/epoch and base sequence; with
    ``horizon``, KIP-534's delete horizon (bit 6, base timestamp = horizon)."""
    data = b.data
    attrs = b.attributes
    pid, epoch, base_seq = producer_fields(data, 1)
    base = b.base_offset
    builder = _DefaultRecordBatchBuilderPy(2, attrs & 0x07, attrs & ATTR_TRANSACTIONAL, pid, epoch, base_seq,
                                           1 << 62)
    builder._first_timestamp = horizon if horizon is not None else keep[0].timestamp
    builder._max_timestamp = b.max_timestamp
    for r in keep:
        builder.append(r.offset - base, r.timestamp, r.key, r.value, list(r.headers or ()))
    buf = builder.build()
    new_attrs = _I16.unpack_from(buf, OFF_ATTRIBUTES)[0]
    new_attrs |= attrs & (ATTR_CONTROL | ATTR_TIMESTAMP_TYPE)
    if horizon is not None:
        new_attrs |= ATTR_DELETE_HORIZON
    else:
        new_attrs &= ~ATTR_DELETE_HORIZON
    _I16.pack_into(buf, OFF_ATTRIBUTES, new_attrs)
    _I64.pack_into(buf, 0, base)
    _I32.pack_into(buf, OFF_LAST_DELTA, _I32.unpack_from(data, 1 + OFF_LAST_DELTA)[0])
    _U32.pack_into(buf, OFF_CRC, crc32c(memoryview(buf)[OFF_ATTRIBUTES:]))
    return buf


def empty_batch(b: StoredBatch) -> bytearray:
    """``b``'s header with no records (uncompressed): it keeps the batch's offsets and its producer's
    last sequence."""
    buf = bytearray(memoryview(b.data)[1:1 + HEADER_BYTES])
    _I32.pack_into(buf, OFF_LENGTH, HEADER_BYTES - 12)
    attrs = b.attributes & ~0x07
    _I16.pack_into(buf, OFF_ATTRIBUTES, attrs)
    _I32.pack_into(buf, OFF_COUNT, 0)
    _I64.pack_into(buf, OFF_MAX_TIMESTAMP, b.max_timestamp)
    _U32.pack_into(buf, OFF_CRC, crc32c(memoryview(buf)[OFF_ATTRIBUTES:]))
    return buf
