"""The entry envelope: one kind byte in front of the payload.

The bookie stores the envelope as opaque bytes. A no-op entry (written at the truncate point at the
end of every take-over) keeps its entry id; readers skip it. A no-op carries the term of the
take-over that created it, and keeps it when a later take-over writes it back: every copy older
than that term found after it is a leftover of an earlier term (see ``terms.writer``).
"""

from __future__ import annotations

import struct

KIND_DATA = 0
KIND_NOOP = 1
_TERM = struct.Struct(">Q")


def encode_data(payload: bytes) -> bytes:
    return b"\x00" + payload


def noop(term: int) -> bytes:
    return bytes([KIND_NOOP]) + _TERM.pack(term)


def is_noop(data: bytes) -> bool:
    return data[:1] == b"\x01"


def noop_term(data: bytes) -> int:
    """The term of the take-over that created this no-op."""
    return _TERM.unpack_from(data, 1)[0]


def payload_of(data: bytes) -> bytes:
    """The user payload of a data entry (raises on a no-op: callers must skip those)."""
    if not data or data[0] != KIND_DATA:
        raise ValueError("not a data entry")
    return data[1:]
