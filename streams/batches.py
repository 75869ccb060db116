"""The one log format: every data entry of every stream is one Kafka RecordBatch (magic 2).

An entry's payload (after the one-byte envelope of ``terms.entry``) is a RecordBatch v2 exactly as
Kafka defines it, and its ``baseOffset`` field holds the stream's **record offset** of its first
record. Record offsets are dense from 0 per stream: the one writer assigns them in append order,
each batch takes ``lastOffsetDelta + 1`` of them, and no-op entries (take-overs) take none. Entry
ids stay inside the protocol; offsets are what users see. A Kafka fetch serves stored entries as
they are, and a stream written by any client is readable by every other.

Building and parsing batches (varints, compression, CRC-32C) is aiokafka's ``aiokafka.record``
(C-accelerated); this module only adds the header fields we need without decoding records, and
the ``Record`` type the client API hands out.
"""

from __future__ import annotations

import gc
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from crc32c import crc32c

from terms.entry import KIND_DATA

HEADER_BYTES = 61  # RecordBatch v2 header, up to and including the record count
_I64 = struct.Struct(">q")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I16 = struct.Struct(">h")
OFF_LENGTH = 8
OFF_MAGIC = 16
OFF_CRC = 17
OFF_ATTRIBUTES = 21
OFF_LAST_DELTA = 23
OFF_FIRST_TIMESTAMP = 27
OFF_MAX_TIMESTAMP = 35
OFF_PRODUCER_ID = 43
OFF_PRODUCER_EPOCH = 51
OFF_BASE_SEQUENCE = 53
OFF_COUNT = 57
ATTR_COMPRESSION = 0x07
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20

COMPRESSION = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


class RecordFormatError(ValueError):
    """An entry's bytes are not a Kafka RecordBatch v2 (or the batch is damaged)."""


class Record(NamedTuple):
    """One record as a consumer returns it (a named tuple: cheap to make by the hundred thousand)."""

    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes | None], ...] = ()
    timestamp_ms: int = 0
    offset: int = -1  # the record offset in its stream, once stored
    stream: str = ""


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One stored entry's batch, by its header only (records are not decoded)."""

    entry_id: int
    data: bytes | memoryview  # the whole entry (envelope + batch)

    @property
    def batch(self) -> memoryview:
        return memoryview(self.data)[1:]

    @property
    def base_offset(self) -> int:
        return _I64.unpack_from(self.data, 1)[0]

    @property
    def offset_count(self) -> int:
        """Offsets the batch takes: lastOffsetDelta + 1."""
        return _I32.unpack_from(self.data, 1 + OFF_LAST_DELTA)[0] + 1

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.offset_count

    @property
    def max_timestamp(self) -> int:
        return _I64.unpack_from(self.data, 1 + OFF_MAX_TIMESTAMP)[0]

    @property
    def attributes(self) -> int:
        return _I16.unpack_from(self.data, 1 + OFF_ATTRIBUTES)[0]

    def producer(self) -> tuple[int, int, int]:
        """(producer id, producer epoch, base sequence) from the header."""
        return producer_fields(self.data, 1)


def producer_fields(buf, at: int = 0) -> tuple[int, int, int]:
    return (_I64.unpack_from(buf, at + OFF_PRODUCER_ID)[0], _I16.unpack_from(buf, at + OFF_PRODUCER_EPOCH)[0],
            _I32.unpack_from(buf, at + OFF_BASE_SEQUENCE)[0])


def check_batch(batch, where: str = "") -> None:
    """Raise RecordFormatError unless ``batch`` is exactly one well-formed RecordBatch v2."""
    n = len(batch)
    if n < HEADER_BYTES:
        raise RecordFormatError(f"{where}: {n} bytes is too short for a record batch")
    (length,) = _I32.unpack_from(batch, OFF_LENGTH)
    if 12 + length != n:
        raise RecordFormatError(f"{where}: record batch length {length} does not match {n} bytes")
    if batch[OFF_MAGIC] != 2:
        raise RecordFormatError(f"{where}: record batch magic {batch[OFF_MAGIC]} (only magic 2 is stored)")
    (last_delta,) = _I32.unpack_from(batch, OFF_LAST_DELTA)
    (count,) = _I32.unpack_from(batch, OFF_COUNT)
    if last_delta < 0 or count < 0 or count > last_delta + 1:
        raise RecordFormatError(f"{where}: {count} records with lastOffsetDelta {last_delta}")


def stored_batch(entry_id: int, data) -> StoredBatch | None:
    """An entry (envelope included) as a batch; None for a no-op or a hole. Raises RecordFormatError for a
    data entry that is not a RecordBatch v2 (a stream from before the one log format)."""
    if not data or data[0] != KIND_DATA or len(data) == 1:
        return None  # a no-op, or a hole (an entry compaction emptied: streams/cleaner.py)
    if len(data) < 1 + HEADER_BYTES or data[1 + OFF_MAGIC] != 2:
        raise RecordFormatError(f"entry {entry_id} is not a Kafka record batch (magic 2): streams must hold "
                                "record batches (see streams/batches.py)")
    return StoredBatch(entry_id, data)


def set_base_offset(buf: bytearray, base_offset: int) -> None:
    """Write the assigned base offset into a built batch (the CRC does not cover it)."""
    _I64.pack_into(buf, 0, base_offset)


def records_of(b: StoredBatch, stream: str = "", from_offset: int = 0) -> list[Record]:
    """The records of a stored batch with offset >= ``from_offset`` (control batches hold none)."""
    data = b.data
    if crc32c(memoryview(data)[1 + OFF_ATTRIBUTES:]) != _U32.unpack_from(data, 1 + OFF_CRC)[0]:
        raise RecordFormatError(f"stream {stream!r} entry {b.entry_id}: record batch CRC mismatch")
    # Records are acyclic tuples of bytes, str and int: the cyclic GC has nothing to find in them,
    # but making hundreds of thousands triggers its collections over everything else alive (2x the
    # cost, measured). It is paused while one batch is decoded.
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        # aiokafka's parser iterates a bytes copy faster than a memoryview (measured)
        batch = DefaultRecordBatch(data[1:] if isinstance(data, bytes) else bytes(memoryview(data)[1:]))
        if batch.is_control_batch:
            return []
        new = tuple.__new__
        if from_offset <= b.base_offset:
            return [new(Record, (r.value, r.key, tuple(h) if (h := r.headers) else (), r.timestamp, r.offset, stream))
                    for r in batch]
        return [new(Record, (r.value, r.key, tuple(h) if (h := r.headers) else (), r.timestamp, r.offset, stream))
                for r in batch if r.offset >= from_offset]
    except RecordFormatError:
        raise
    except Exception as exc:  # the C parser raises CorruptRecordException / ValueError / struct.error
        raise RecordFormatError(f"stream {stream!r} entry {b.entry_id}: malformed record batch: {exc!r}") from exc
    finally:
        if paused:
            gc.enable()


def normalise_headers(headers) -> list[tuple[str, bytes | None]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, dict) else headers
    out = []
    for name, value in items:
        if isinstance(name, bytes):
            name = name.decode()
        if isinstance(value, str):
            value = value.encode()
        elif value is not None and not isinstance(value, bytes):
            value = bytes(value)
        out.append((name, value))
    return out


def record_size(value, key, headers) -> int:
    """An upper bound of one record's bytes in a batch."""
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)


class BatchBuilder:
    """Records accumulating into one batch (aiokafka's builder); ``build`` gives the batch bytes
    with its base offset set."""

    __slots__ = ("_b", "count", "raw_append")

    def __init__(self, compression: int, batch_bytes: int):
        self._b = DefaultRecordBatchBuilder(2, compression, 0, -1, -1, -1, batch_bytes)
        self.count = 0
        # aiokafka's append(offset delta, timestamp, key, value, headers) -> None when full; a
        # caller using it directly keeps ``count`` right itself
        self.raw_append = self._b.append

    def append(self, value, key, headers, timestamp_ms: int | None) -> bool:
        """Add a record; False when the batch is full (the first record always fits)."""
        if timestamp_ms is None:
            timestamp_ms = int(time.time() * 1000)
        if self._b.append(self.count, timestamp_ms, key, value, headers) is None:
            return False
        self.count += 1
        return True

    def size(self) -> int:
        return self._b.size()

    def build(self, base_offset: int) -> bytearray:
        buf = self._b.build()
        set_base_offset(buf, base_offset)
        return buf
