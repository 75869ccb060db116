"""Checking the RecordBatches of a produce request before they are stored.

A produce request carries a ``records`` blob of one or more RecordBatches (magic 2). Each batch is
checked here (length, magic, CRC-32C over attributes..end, record count, no control batch — only
the transaction coordinator writes those —, consistent idempotent-producer fields, a producer id on
every transactional batch) and then stored as one stream entry through
``streams.producer.Producer.append_batch``, which writes the assigned base offset into the batch's
baseOffset field (not covered by the CRC) — the one log format of every stream (``streams/batches.py``):
an entry's payload *is* the RecordBatch. Compressed batches stay compressed; a Fetch serves the
stored bytes as they are. (Small plain batches have their records merged into shared entries
instead: ``PartitionConfig.merge_batch_bytes`` in ``compat_kafka/partitions/partition.py``.)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c
from aiokafka.record.default_records import DefaultRecordBatch

from streams.batches import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    HEADER_BYTES,
    OFF_ATTRIBUTES,
    OFF_COUNT,
    OFF_CRC,
    OFF_LAST_DELTA,
    OFF_LENGTH,
    OFF_MAGIC,
    OFF_MAX_TIMESTAMP,
)

from .errors import CorruptMessage, InvalidRecord, InvalidRequest, UnsupportedForMessageFormat

_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
# a batch's header from its CRC on, in one unpack: crc, attributes, lastOffsetDelta, (baseTimestamp
# skipped), maxTimestamp, producerId, producerEpoch, baseSequence, records count
_HEADER = struct.Struct(">Ihi8xqqhii")
assert (OFF_CRC + 4, OFF_ATTRIBUTES + 2, OFF_LAST_DELTA + 4, OFF_MAX_TIMESTAMP, OFF_COUNT + 4 - OFF_CRC) == (
    OFF_ATTRIBUTES, OFF_LAST_DELTA, OFF_MAX_TIMESTAMP - 8, OFF_MAX_TIMESTAMP, _HEADER.size)


@dataclass(frozen=True, slots=True)
class Batch:
    raw: bytes | memoryview  # the batch as received (its baseOffset is set when it is stored)
    offset_count: int  # lastOffsetDelta + 1
    max_timestamp: int
    producer_id: int  # -1: not an idempotent batch
    producer_epoch: int = -1
    base_sequence: int = -1
    transactional: bool = False

    @property
    def last_sequence(self) -> int:
        return increment_sequence(self.base_sequence, self.offset_count - 1)


def increment_sequence(seq: int, n: int) -> int:
    """Kafka's sequence arithmetic: int32 sequences wrap from 2**31-1 to 0."""
    return (seq + n) % (1 << 31)


def split_batches(records: bytes, max_batches: int = 10_000) -> list[Batch]:
    """Split and check a produce ``records`` blob. Raises CorruptMessage / UnsupportedForMessageFormat
    / InvalidRequest. The batches are views of ``records`` (no copy)."""
    out: list[Batch] = []
    view = memoryview(records)
    pos, n = 0, len(view)
    while pos < n:
        if n - pos < HEADER_BYTES:
            raise CorruptMessage(f"truncated record batch at byte {pos} ({n - pos} bytes left)")
        (length,) = _I32.unpack_from(view, pos + OFF_LENGTH)
        end = pos + 12 + length
        if length < HEADER_BYTES - 12 or end > n:
            raise CorruptMessage(f"record batch at byte {pos} has bad length {length}")
        magic = view[pos + OFF_MAGIC]
        if magic != 2:
            raise UnsupportedForMessageFormat(f"record batch magic {magic}: only magic 2 is supported")
        raw = view if end - pos == n else view[pos:end]  # the common case: one batch, the whole blob
        (crc, attrs, last_delta, max_ts, pid, epoch, seq, count) = _HEADER.unpack_from(raw, OFF_CRC)
        if crc32c.crc32c(raw[OFF_ATTRIBUTES:]) != crc:
            raise CorruptMessage(f"record batch at byte {pos}: CRC mismatch")
        if last_delta < 0 or count < 0 or count > last_delta + 1:
            raise CorruptMessage(f"record batch at byte {pos}: {count} records, lastOffsetDelta {last_delta}")
        if attrs & ATTR_CONTROL:
            raise InvalidRecord(f"record batch at byte {pos} is a control batch: only the transaction "
                                "coordinator writes those")
        transactional = bool(attrs & ATTR_TRANSACTIONAL)
        if (pid >= 0 or transactional) and (pid < 0 or epoch < 0 or seq < 0):
            raise InvalidRequest(f"record batch at byte {pos}: producer id {pid} with epoch {epoch}, "
                                 f"base sequence {seq}{' (transactional)' if transactional else ''}")
        out.append(Batch(raw, last_delta + 1, max_ts, pid, epoch, seq, transactional))
        if len(out) > max_batches:
            raise CorruptMessage(f"more than {max_batches} record batches in one partition's records")
        pos = end
    return out


# ---------------------------------------------------------------- message formats v0 and v1
# Produce v0-2 carry message sets of magic 0/1 (Produce v0-1: magic 0; v2: magic 0 or 1) and Fetch
# v0-3 clients read only those (v0-1: magic 0; v2-3: magic 0 or 1). Kafka 3.9 converts both ways
# (a v2 log since KIP-724); so do we: an old produce's messages become one uncompressed magic-2
# batch (timestamps kept, magic 0's are -1), and an old fetch gets each stored batch's records as
# uncompressed messages of the client's magic (headers dropped, control batches skipped, as Kafka's
# down-conversion does). Compressed message sets (gzip, snappy, lz4) are read through aiokafka.
MAX_CONVERTED_RECORDS = 100_000


def upconvert(records: bytes) -> bytes:
    """A magic 0/1 message set -> one uncompressed RecordBatch v2 (b"" for an empty set). Raises
    CorruptMessage (damaged or truncated messages) / UnsupportedForMessageFormat (a magic-2 batch
    in a request that may only carry older messages, as Kafka answers)."""
    from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
    from aiokafka.record.memory_records import MemoryRecords

    records = bytes(records)
    pos = 0
    while pos < len(records):  # whole messages only (aiokafka stops quietly at a truncated one)
        if len(records) - pos < 12 or pos + 12 + _I32.unpack_from(records, pos + 8)[0] > len(records):
            raise CorruptMessage(f"truncated message at byte {pos} of a {len(records)}-byte message set")
        pos += 12 + _I32.unpack_from(records, pos + 8)[0]
    try:
        mr = MemoryRecords(records)
        out = []
        while (batch := mr.next_batch()) is not None:
            if isinstance(batch, DefaultRecordBatch):
                raise UnsupportedForMessageFormat("a magic-2 record batch in a produce request of version 0-2")
            if not batch.validate_crc():
                raise CorruptMessage("message CRC mismatch")
            for r in batch:
                out.append((r.timestamp if r.timestamp is not None else -1, r.key, r.value))
                if len(out) > MAX_CONVERTED_RECORDS:
                    raise CorruptMessage(f"more than {MAX_CONVERTED_RECORDS} messages in one partition's set")
    except (CorruptMessage, UnsupportedForMessageFormat):
        raise
    except Exception as exc:  # aiokafka raises CorruptRecordException, struct.error, ValueError
        raise CorruptMessage(f"malformed message set: {exc!r}") from exc
    if not out:
        return b""
    b = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 62)
    for i, (ts, key, value) in enumerate(out):
        b.append(i, ts, key, value, [])
    return bytes(b.build())


def downconvert(records: bytes, magic: int, from_offset: int) -> bytes:
    """Stored RecordBatches v2 -> uncompressed messages of ``magic`` (0 or 1) at offsets >= ``from_offset``."""
    from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
    from aiokafka.record.memory_records import MemoryRecords

    if not records:
        return b""
    mr = MemoryRecords(bytes(records))
    out = bytearray()
    while (batch := mr.next_batch()) is not None:
        if getattr(batch, "is_control_batch", False):
            continue
        for r in batch:
            if r.offset < from_offset:
                continue
            b = LegacyRecordBatchBuilder(magic, 0, 1 << 62)
            b.append(0, r.timestamp, r.key, r.value)
            msg = b.build()
            _I64.pack_into(msg, 0, r.offset)  # the builder numbers from 0; the message keeps its offset
            out += msg
    return bytes(out)

def keyless_records(batch: Batch) -> list[int]:
    """The indexes (in the batch, from 0) of the records without a key: a compacted topic refuses
    them. This decodes the batch (aiokafka's C parser, decompressing if need be), so it runs only on
    the produce path of compacted topics. Raises CorruptMessage for records that do not parse."""
    try:
        return [i for i, r in enumerate(DefaultRecordBatch(bytes(batch.raw))) if r.key is None]
    except Exception as exc:  # the C parser raises CorruptRecordException / ValueError / struct.error
        raise CorruptMessage(f"malformed records in a record batch: {exc!r}") from None
