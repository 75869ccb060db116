"""The record inside a data entry: what a producer appends and a consumer gets back.

Format 1, what the streams API writes (little overhead, no schema registry): ``0x01`` format
version, timestamp in ms (uint64), key length (int32, -1 = none) and key, header count (uint16)
and each header as name length (uint16) + name + value length (int32, -1 = none) + value, then the
value to the end. Format 2 is a Kafka RecordBatch stored by the Kafka shim; ``decode_entry`` reads
both (see ``streams/kafka_records.py``).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

FORMAT = 1
_HEAD = struct.Struct("<BQi")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")


class RecordFormatError(ValueError):
    """An entry's bytes are not a Scroll record."""


@dataclass(frozen=True, slots=True)
class Record:
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[str, bytes | None], ...] = ()
    timestamp_ms: int = 0
    position: int = -1  # the entry id, once stored
    stream: str = ""
    extra: dict = field(default_factory=dict, compare=False)


def encode(value: bytes, key: bytes | None = None, headers=None, timestamp_ms: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"record value must be bytes, not {type(value).__name__}")
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    parts = [_HEAD.pack(FORMAT, ts, -1 if key is None else len(key))]
    if key is not None:
        parts.append(bytes(key))
    hs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
    if len(hs) > 0xFFFF:
        raise ValueError("too many headers")
    parts.append(_U16.pack(len(hs)))
    for name, hv in hs:
        nb = name.encode() if isinstance(name, str) else bytes(name)
        parts.append(_U16.pack(len(nb)) + nb)
        parts.append(_I32.pack(-1 if hv is None else len(hv)))
        if hv is not None:
            parts.append(hv.encode() if isinstance(hv, str) else bytes(hv))
    parts.append(bytes(value))
    return b"".join(parts)


def decode_entry(raw: bytes, position: int = -1, stream: str = "") -> list[Record]:
    """The records of one data entry's payload: one for format 1 (written by the streams API),
    the whole batch for format 2 (a Kafka RecordBatch stored by the Kafka shim)."""
    if raw[:1] == b"\x02":
        from .kafka_records import decode_kafka_entry

        return decode_kafka_entry(raw, position, stream)
    return [decode(raw, position, stream)]


def decode(raw: bytes, position: int = -1, stream: str = "") -> Record:
    try:
        fmt, ts, klen = _HEAD.unpack_from(raw, 0)
        if fmt != FORMAT:
            raise RecordFormatError(f"unknown record format {fmt}")
        off = _HEAD.size
        key = None
        if klen >= 0:
            key = raw[off : off + klen]
            off += klen
        (n,) = _U16.unpack_from(raw, off)
        off += 2
        headers = []
        for _ in range(n):
            (nl,) = _U16.unpack_from(raw, off)
            off += 2
            name = raw[off : off + nl].decode()
            off += nl
            (vl,) = _I32.unpack_from(raw, off)
            off += 4
            hv = None
            if vl >= 0:
                hv = raw[off : off + vl]
                off += vl
            headers.append((name, hv))
        if off > len(raw):
            raise RecordFormatError("truncated record")
        return Record(raw[off:], key, tuple(headers), ts, position, stream)
    except (struct.error, UnicodeDecodeError) as exc:
        raise RecordFormatError(f"malformed record at position {position}: {exc}") from exc
