"""Reading Kafka record batches (entry format 2) as Scroll records.

The Kafka shim stores one produce RecordBatch (magic 2) per stream entry, byte-for-byte, behind a
small head (see ``compat_kafka/batches.py``)::

    0x02 | base offset int64 BE | offset count int32 BE | RecordBatch bytes as received

so a topic partition's stream can also be read with the streams API (``scroll consume``, the
Python consumer, the Spark source). This module turns such an entry into its records: it checks
the batch (length, magic, CRC-32C), decompresses the records section (gzip, snappy with or
without the xerial framing, lz4 frame, zstd), and decodes each record's varint fields. Each
record keeps the stream position of its entry (several records share one position) and carries
its Kafka offset in ``Record.extra["kafka_offset"]``. Control batches (transaction markers) hold
no user records and yield none. This is a reader only: the streams layer never writes format 2.
"""

from __future__ import annotations

import gzip
import struct

import crc32c

from .records import Record, RecordFormatError

KAFKA_ENTRY = 0x02
_HEAD = struct.Struct(">bqi")
_BATCH_HEADER = 61
_ATTR_COMPRESSION = 0x07
_ATTR_CONTROL = 0x20
_XERIAL_MAGIC = b"\x82SNAPPY\x00"


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zig-zag varint (Kafka's varint/varlong) at ``pos``: (value, next position)."""
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise RecordFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise RecordFormatError("varint too long")


def _decompress(codec: int, data: bytes) -> bytes:
    if codec == 0:
        return data
    if codec == 1:
        return gzip.decompress(data)
    if codec == 2:
        import cramjam

        if data.startswith(_XERIAL_MAGIC):
            out, pos = [], 16
            while pos < len(data):
                (n,) = struct.unpack_from(">i", data, pos)
                pos += 4
                out.append(bytes(cramjam.snappy.decompress_raw(data[pos:pos + n])))
                pos += n
            return b"".join(out)
        return bytes(cramjam.snappy.decompress_raw(data))
    if codec == 3:
        import lz4.frame

        return lz4.frame.decompress(data)
    if codec == 4:
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    raise RecordFormatError(f"unknown Kafka compression codec {codec}")


def decode_kafka_entry(payload: bytes, position: int = -1, stream: str = "") -> list[Record]:
    """The records of one stored Kafka batch entry (``payload`` without the entry envelope)."""
    try:
        marker, base_offset, _count = _HEAD.unpack_from(payload, 0)
        if marker != KAFKA_ENTRY:
            raise RecordFormatError(f"not a Kafka batch entry (format {marker})")
        batch = memoryview(payload)[_HEAD.size:]
        if len(batch) < _BATCH_HEADER:
            raise RecordFormatError(f"truncated Kafka batch at position {position}")
        (length,) = struct.unpack_from(">i", batch, 8)
        if 12 + length != len(batch) or batch[16] != 2:
            raise RecordFormatError(f"bad Kafka batch at position {position} (length {length}, magic {batch[16]})")
        (crc,) = struct.unpack_from(">I", batch, 17)
        if crc32c.crc32c(batch[21:]) != crc:
            raise RecordFormatError(f"Kafka batch at position {position}: CRC mismatch")
        (attributes,) = struct.unpack_from(">h", batch, 21)
        if attributes & _ATTR_CONTROL:
            return []
        (base_ts,) = struct.unpack_from(">q", batch, 27)
        (n,) = struct.unpack_from(">i", batch, 57)
        body = _decompress(attributes & _ATTR_COMPRESSION, bytes(batch[_BATCH_HEADER:]))
        out: list[Record] = []
        pos = 0
        for _ in range(n):
            size, pos = _varint(body, pos)
            end = pos + size
            pos += 1  # record attributes (unused)
            ts_delta, pos = _varint(body, pos)
            off_delta, pos = _varint(body, pos)
            klen, pos = _varint(body, pos)
            key = None
            if klen >= 0:
                key, pos = bytes(body[pos:pos + klen]), pos + klen
            vlen, pos = _varint(body, pos)
            value = b""
            if vlen >= 0:
                value, pos = bytes(body[pos:pos + vlen]), pos + vlen
            nh, pos = _varint(body, pos)
            headers = []
            for _h in range(nh):
                hk, pos = _varint(body, pos)
                name, pos = bytes(body[pos:pos + hk]).decode(), pos + hk
                hv, pos = _varint(body, pos)
                hval = None
                if hv >= 0:
                    hval, pos = bytes(body[pos:pos + hv]), pos + hv
                headers.append((name, hval))
            if pos != end:
                raise RecordFormatError(f"Kafka record at position {position} has a bad length")
            out.append(Record(value, key, tuple(headers), base_ts + ts_delta, position, stream,
                              {"kafka_offset": base_offset + off_delta}))
        return out
    except (struct.error, UnicodeDecodeError, OSError, ValueError) as exc:
        if isinstance(exc, RecordFormatError):
            raise
        raise RecordFormatError(f"malformed Kafka batch at position {position}: {exc}") from exc
