"""Kafka record batches (magic 2) as stored in stream entries.

A produce request carries a ``records`` blob of one or more RecordBatches. Each batch is checked
(length, magic, CRC-32C over attributes..end) and stored byte-for-byte as one stream entry, with
this payload in front (the writer adds the entry envelope ``b"\\x00"`` before it)::

    b"\\x02" | base_offset int64 BE | offset_count int32 BE | RecordBatch bytes as received

``offset_count`` is lastOffsetDelta + 1: the number of Kafka offsets the batch takes. Compressed
batches stay compressed. The batch's own baseOffset field is whatever the producer sent (usually
0); ``patch_base_offset`` writes the assigned one into the bytes returned on fetch — the CRC does
not cover the first 17 bytes (baseOffset, batchLength, partitionLeaderEpoch), so this is legal.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

from .errors import CorruptMessage, InvalidRequest, UnsupportedForMessageFormat

KAFKA_ENTRY = 0x02
_ENTRY_HEAD = struct.Struct(">bqi")  # marker, base offset, offset count
ENTRY_HEAD_BYTES = _ENTRY_HEAD.size
_ENVELOPE_DATA = 0x00  # terms.entry.KIND_DATA

BATCH_HEADER_BYTES = 61
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_OFF_LENGTH = 8
_OFF_MAGIC = 16
_OFF_CRC = 17
_OFF_ATTRIBUTES = 21
_OFF_LAST_DELTA = 23
_OFF_MAX_TIMESTAMP = 35
_OFF_PRODUCER_ID = 43
_OFF_PRODUCER_EPOCH = 51
_OFF_BASE_SEQUENCE = 53
_OFF_COUNT = 57
_I16 = struct.Struct(">h")
_ATTR_TRANSACTIONAL = 0x10
_ATTR_CONTROL = 0x20


@dataclass(frozen=True, slots=True)
class Batch:
    raw: bytes
    offset_count: int  # lastOffsetDelta + 1
    max_timestamp: int
    producer_id: int  # -1: not an idempotent batch
    producer_epoch: int = -1
    base_sequence: int = -1

    @property
    def last_sequence(self) -> int:
        return increment_sequence(self.base_sequence, self.offset_count - 1)


def increment_sequence(seq: int, n: int) -> int:
    """Kafka's sequence arithmetic: int32 sequences wrap from 2**31-1 to 0."""
    return (seq + n) % (1 << 31)


def producer_fields(raw: bytes) -> tuple[int, int, int]:
    """(producer id, producer epoch, base sequence) of a RecordBatch's header."""
    return (_I64.unpack_from(raw, _OFF_PRODUCER_ID)[0], _I16.unpack_from(raw, _OFF_PRODUCER_EPOCH)[0],
            _I32.unpack_from(raw, _OFF_BASE_SEQUENCE)[0])


def split_batches(records: bytes, max_batches: int = 10_000) -> list[Batch]:
    """Split and check a produce ``records`` blob. Raises CorruptMessage / UnsupportedForMessageFormat."""
    out: list[Batch] = []
    pos, n = 0, len(records)
    while pos < n:
        if n - pos < BATCH_HEADER_BYTES:
            raise CorruptMessage(f"truncated record batch at byte {pos} ({n - pos} bytes left)")
        (length,) = _I32.unpack_from(records, pos + _OFF_LENGTH)
        end = pos + 12 + length
        if length < BATCH_HEADER_BYTES - 12 or end > n:
            raise CorruptMessage(f"record batch at byte {pos} has bad length {length}")
        magic = records[pos + _OFF_MAGIC]
        if magic != 2:
            raise UnsupportedForMessageFormat(f"record batch magic {magic}: only magic 2 is supported")
        raw = bytes(records[pos:end])
        (crc,) = _U32.unpack_from(raw, _OFF_CRC)
        if crc32c.crc32c(raw[_OFF_ATTRIBUTES:]) != crc:
            raise CorruptMessage(f"record batch at byte {pos}: CRC mismatch")
        (last_delta,) = _I32.unpack_from(raw, _OFF_LAST_DELTA)
        (count,) = _I32.unpack_from(raw, _OFF_COUNT)
        if last_delta < 0 or count < 0 or count > last_delta + 1:
            raise CorruptMessage(f"record batch at byte {pos}: {count} records, lastOffsetDelta {last_delta}")
        (max_ts,) = _I64.unpack_from(raw, _OFF_MAX_TIMESTAMP)
        pid, epoch, seq = producer_fields(raw)
        if raw[_OFF_ATTRIBUTES + 1] & (_ATTR_TRANSACTIONAL | _ATTR_CONTROL):
            raise InvalidRequest(f"record batch at byte {pos} is transactional or a control batch: "
                                 "transactions are not supported")
        if pid >= 0 and (epoch < 0 or seq < 0):
            raise InvalidRequest(f"record batch at byte {pos}: producer id {pid} with epoch {epoch}, "
                                 f"base sequence {seq}")
        out.append(Batch(raw, last_delta + 1, max_ts, pid, epoch, seq))
        if len(out) > max_batches:
            raise CorruptMessage(f"more than {max_batches} record batches in one partition's records")
        pos = end
    return out


def encode_entry(base_offset: int, batch: Batch) -> bytes:
    """The stream entry payload for one batch (the writer adds the envelope byte)."""
    return _ENTRY_HEAD.pack(KAFKA_ENTRY, base_offset, batch.offset_count) + batch.raw


@dataclass(frozen=True, slots=True)
class StoredBatch:
    entry_id: int
    base_offset: int
    offset_count: int
    raw: bytes  # as received (baseOffset not patched)

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.offset_count

    @property
    def max_timestamp(self) -> int:
        return _I64.unpack_from(self.raw, _OFF_MAX_TIMESTAMP)[0]

    def producer(self) -> tuple[int, int, int, int]:
        """(producer id, epoch, first sequence, last sequence) as the producer wrote them."""
        pid, epoch, seq = producer_fields(self.raw)
        return pid, epoch, seq, increment_sequence(seq, self.offset_count - 1)


def decode_entry(entry_id: int, data: bytes) -> StoredBatch | None:
    """A stored entry (envelope included) -> its batch, or None for a no-op or a non-Kafka entry."""
    if len(data) < 1 + ENTRY_HEAD_BYTES or data[0] != _ENVELOPE_DATA or data[1] != KAFKA_ENTRY:
        return None
    _, base, count = _ENTRY_HEAD.unpack_from(data, 1)
    return StoredBatch(entry_id, base, count, bytes(data[1 + ENTRY_HEAD_BYTES :]))


def entry_parts(data: bytes) -> tuple[int, int, memoryview] | None:
    """A stored entry -> (base offset, offset count, the batch after its baseOffset field) without
    copying the batch (for fetch responses: the patched baseOffset goes in front); None for a no-op."""
    if len(data) < 1 + ENTRY_HEAD_BYTES or data[0] != _ENVELOPE_DATA or data[1] != KAFKA_ENTRY:
        return None
    _, base, count = _ENTRY_HEAD.unpack_from(data, 1)
    return base, count, memoryview(data)[1 + ENTRY_HEAD_BYTES + 8 :]


def patch_base_offset(raw: bytes, base_offset: int) -> bytes:
    return _I64.pack(base_offset) + raw[8:]
