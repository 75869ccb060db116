"""Entry digests: CRC32C by default, a keyed MAC when the ledger has a password.

How this works: the client computes a digest over the entry header (ledger id, entry id, both
big-endian u64) and the payload, and sends it with the add. The bookie stores it next to the data.
For CRC32C the bookie recomputes it on ingest and on every read (a mismatch is BAD_DIGEST on add and
CORRUPT on read). For the MAC (HMAC-SHA256 truncated to 16 bytes) the bookie has no key: its own
storage checksum (journal and entry-log frames) guards the bytes, and the client, which holds the
password, verifies the MAC on read.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import crc32c

DIGEST_CRC32C = 0
DIGEST_MAC = 1
DIGEST_KINDS = (DIGEST_CRC32C, DIGEST_MAC)
DIGEST_SIZE = {DIGEST_CRC32C: 4, DIGEST_MAC: 16}

_HEADER = struct.Struct(">QQ")
_CRC = struct.Struct(">I")


def crc32c_digest(ledger_id: int, entry_id: int, data: bytes) -> bytes:
    return _CRC.pack(crc32c.crc32c(data, crc32c.crc32c(_HEADER.pack(ledger_id, entry_id))))


def mac_key(password: bytes) -> bytes:
    """Derive the MAC key from a ledger password (so the password itself never travels)."""
    return hashlib.sha256(b"scroll-ledger-mac:" + password).digest()


def mac_digest(key: bytes, ledger_id: int, entry_id: int, data: bytes) -> bytes:
    mac = hmac.new(key, _HEADER.pack(ledger_id, entry_id), hashlib.sha256)
    mac.update(data)
    return mac.digest()[: DIGEST_SIZE[DIGEST_MAC]]


def compute(kind: int, ledger_id: int, entry_id: int, data: bytes, key: bytes | None = None) -> bytes:
    if kind == DIGEST_CRC32C:
        return crc32c_digest(ledger_id, entry_id, data)
    if kind == DIGEST_MAC:
        if key is None:
            raise ValueError("a MAC digest needs the ledger's key")
        return mac_digest(key, ledger_id, entry_id, data)
    raise ValueError(f"unknown digest kind {kind}")


def verify(kind: int, ledger_id: int, entry_id: int, data: bytes, digest: bytes, key: bytes | None = None) -> bool:
    """True when the digest matches. A MAC without a key can only be checked for its size."""
    if kind == DIGEST_MAC and key is None:
        return len(digest) == DIGEST_SIZE[DIGEST_MAC]
    try:
        expected = compute(kind, ledger_id, entry_id, data, key)
    except ValueError:
        return False
    return hmac.compare_digest(expected, digest)
