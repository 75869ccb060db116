"""The data plane's wire format: length-prefixed binary frames for adds, reads and LACs.

How this works. gRPC costs ~60 µs per message on each side in Python; at 1,000 appends/s every
append is one message to each of three bookies, so the data path (add, read, LAC read, LAC write)
runs on this lean protocol over a plain asyncio stream, like BookKeeper's "v2" protocol beside its
protobuf one. gRPC stays for the control plane (fence, recovery read, trim, info).

Every frame is ``[u32 length][u8 op][u32 request id][body]``; ``length`` counts op, id and body.
A client numbers its requests; the answer carries the same id with ``op | ANSWER``, so answers may
come in any order (an add waits for its fsync while a read is answered at once). Integers are
little-endian; byte strings are length-prefixed. Entry payloads are never copied to frame them:
encoders return lists of buffers for ``transport.writelines`` and decoders return memoryview
slices of the received frame.

Requests:
- ADD: ``u32 n`` then n times ``ADD_HEAD`` (ledger, entry, term, lac, lafr, flags, digest type,
  digest length, data length) followed by the digest and the data.
- READ: ledger, first, last, max entries, max bytes, wait ms. ``wait ms`` 0 is a plain range
  read. Otherwise it is a *tail read*, capped at the bookie's LAC: with ``wait ms`` > 0 a
  long-poll "read LAC and entries" (when the LAC is below ``first`` the bookie waits, at most that
  long, until it reaches ``first``), with -1 no wait. A tail read answers OK with the entries it
  holds up to the LAC (maybe none) and the LAC, never NO_SUCH_ENTRY.
- READ_LAC: ledger, after LAC, timeout ms (long poll: answered once the LAC passes ``after``).
- WRITE_LAC: ledger, term, LAC, LAFR.
- FENCE: ledger, term (a take-over's fence: the bookie adopts the term, journals it, and answers
  with its LAC and LAFR once that is durable; INVALID_TERM with its term if it holds a later one).
- RECOVERY_READ: ledger, entry, term (a take-over's read: the term is adopted as by a fence, then
  the entry is answered with its term, digest and data, or NO_SUCH_ENTRY, with the bookie's LAC).
  Fence and recovery read were gRPC calls (~300 µs of client CPU each); a take-over of many
  streams sends them as frames on the connection its adds use.
- AUTH: a token (text). On a bookie that requires authentication it is the first frame a client
  sends (unless a verified client certificate already authenticated the connection); any other
  frame first, a frame over ``MAX_PREAUTH_FRAME_BYTES``, or a wrong token gets an ERROR answer
  with UNAUTHENTICATED and the connection is closed. The answer (AUTH | ANSWER) carries OK.
Answers carry a status (``bookie.errors.Status``) and an error text. A frame that cannot be parsed
gets an ERROR answer and the connection is closed: the stream of frames can no longer be trusted.
"""

from __future__ import annotations

import struct

FRAME = struct.Struct("<IBI")  # length (of op + id + body), op, request id
MAX_FRAME_BYTES_DEFAULT = 64 << 20

ADD, READ, READ_LAC, WRITE_LAC, AUTH, FENCE, RECOVERY_READ = 1, 2, 3, 4, 5, 6, 7
ANSWER = 0x80
ERROR = 0xFF
OPS = (ADD, READ, READ_LAC, WRITE_LAC, AUTH, FENCE, RECOVERY_READ)
DATA_OPS = (ADD, READ, READ_LAC, WRITE_LAC, FENCE, RECOVERY_READ)  # what authentication guards
MAX_PREAUTH_FRAME_BYTES = 4096  # frames a connection may send before it is authenticated

FLAG_TRUNCATE, FLAG_RECOVERY = 1, 2

COUNT = struct.Struct("<I")
ADD_HEAD = struct.Struct("<qqqqqBBHI")  # ledger, entry, term, lac, lafr, flags, digest type, digest len, data len
ADD_ANSWER = struct.Struct("<BI")  # all ok, n
ADD_STATUS = struct.Struct("<iq")  # status, bookie term (per add, only when not all ok)
READ_REQ = struct.Struct("<qqqIIq")  # ledger, first, last, max entries, max bytes, wait ms
READ_ANSWER = struct.Struct("<iqqiqBI")  # status, lac, lafr, stop, bookie term, timed out, n
READ_ENTRY = struct.Struct("<qqBHI")  # entry id, entry term, digest type, digest len, data len
READ_LAC_REQ = struct.Struct("<qqq")  # ledger, after lac, timeout ms
READ_LAC_ANSWER = struct.Struct("<iqqqB")  # status, lac, lafr, bookie term, timed out
WRITE_LAC_REQ = struct.Struct("<qqqq")  # ledger, term, lac, lafr
WRITE_LAC_ANSWER = struct.Struct("<iq")  # status, bookie term
FENCE_REQ = struct.Struct("<qq")  # ledger, term
FENCE_ANSWER = struct.Struct("<iqqq")  # status, bookie term, lac, lafr
RECOVERY_READ_REQ = struct.Struct("<qqq")  # ledger, entry, term
RECOVERY_READ_ANSWER = struct.Struct("<iqqqBHI")  # status, bookie term, lac, entry term, digest type, digest len, data len
TEXT = struct.Struct("<H")
ERROR_ANSWER = struct.Struct("<i")


class FrameError(ValueError):
    """A frame that does not parse: the connection that sent it is closed."""


def frame_head(op: int, rid: int, body_len: int) -> bytes:
    return FRAME.pack(5 + body_len, op, rid)


def text(s: str) -> bytes:
    raw = s.encode("utf-8", "replace")[:65535]
    return TEXT.pack(len(raw)) + raw


def read_text(buf: memoryview, off: int) -> tuple[str, int]:
    if off + TEXT.size > len(buf):
        raise FrameError("text runs past the frame")
    (n,) = TEXT.unpack_from(buf, off)
    off += TEXT.size
    if off + n > len(buf):
        raise FrameError("text runs past the frame")
    return bytes(buf[off:off + n]).decode("utf-8", "replace"), off + n


# ------------------------------------------------------------------------------ adds


def add_entry(ledger_id: int, entry_id: int, term: int, lac: int, lafr: int, truncate: bool, recovery: bool,
              digest_type: int, digest, data) -> tuple[list, int]:
    """One add of an ADD frame: its parts (``ADD_HEAD``, digest, data) and their size."""
    flags = (FLAG_TRUNCATE if truncate else 0) | (FLAG_RECOVERY if recovery else 0)
    head = ADD_HEAD.pack(ledger_id, entry_id, term, lac, lafr, flags, digest_type, len(digest), len(data))
    return [head, digest, data], ADD_HEAD.size + len(digest) + len(data)


def add_frame(rid: int, n: int, size: int, parts: list) -> list:
    """An ADD frame around the ``parts`` of ``n`` adds (``add_entry``; ``size`` bytes in all), as
    buffers for ``writelines``."""
    return [frame_head(ADD, rid, COUNT.size + size) + COUNT.pack(n), *parts]


def decode_add(body: memoryview) -> tuple:
    """Columns of an ADD body (data and digests as memoryviews of ``body``)."""
    if len(body) < COUNT.size:
        raise FrameError("add frame too short")
    (n,) = COUNT.unpack_from(body, 0)
    off = COUNT.size
    end = len(body)
    if n * ADD_HEAD.size > end:
        raise FrameError(f"add frame claims {n} adds in {end} bytes")
    lids, eids, terms, lacs, lafrs, truncs, recs, dtypes, digs, datas = ([] for _ in range(10))
    unpack = ADD_HEAD.unpack_from
    hs = ADD_HEAD.size
    for _ in range(n):
        if off + hs > end:
            raise FrameError("add header runs past the frame")
        lid, eid, term, lac, lafr, flags, dtype, dlen, blen = unpack(body, off)
        off += hs
        if off + dlen + blen > end:
            raise FrameError("add payload runs past the frame")
        lids.append(lid)
        eids.append(eid)
        terms.append(term)
        lacs.append(lac)
        lafrs.append(lafr)
        truncs.append(bool(flags & FLAG_TRUNCATE))
        recs.append(bool(flags & FLAG_RECOVERY))
        dtypes.append(dtype)
        digs.append(body[off:off + dlen])
        off += dlen
        datas.append(body[off:off + blen])
        off += blen
    if off != end:
        raise FrameError(f"{end - off} stray bytes after the adds")
    return lids, eids, terms, lacs, lafrs, truncs, recs, dtypes, digs, datas


def encode_add_answer(rid: int, n: int, statuses, bookie_terms, error: str = "") -> bytes:
    if statuses is None and not error:
        return frame_head(ADD | ANSWER, rid, ADD_ANSWER.size) + ADD_ANSWER.pack(1, n)
    body = bytearray(ADD_ANSWER.pack(1 if statuses is None else 0, n))
    if statuses is not None:
        for s, t in zip(statuses, bookie_terms):
            body += ADD_STATUS.pack(int(s), t)
    body += text(error)
    return frame_head(ADD | ANSWER, rid, len(body)) + bytes(body)


def decode_add_answer(body: memoryview) -> tuple[int, list[int] | None, list[int] | None, str]:
    """(n, statuses or None when all OK, bookie terms, error)."""
    all_ok, n = ADD_ANSWER.unpack_from(body, 0)
    off = ADD_ANSWER.size
    statuses = terms = None
    if not all_ok:
        statuses, terms = [], []
        for _ in range(n):
            s, t = ADD_STATUS.unpack_from(body, off)
            off += ADD_STATUS.size
            statuses.append(s)
            terms.append(t)
    error = read_text(body, off)[0] if off < len(body) else ""
    return n, statuses, terms, error


# ------------------------------------------------------------------------------ reads


def encode_read(rid: int, ledger_id: int, first: int, last: int, max_entries: int, max_bytes: int, wait_ms: int) -> bytes:
    return frame_head(READ, rid, READ_REQ.size) + READ_REQ.pack(ledger_id, first, last, max_entries, max_bytes, wait_ms)


def encode_read_answer(rid: int, status: int, lac: int, lafr: int, stop: int, term: int, timed_out: bool,
                       entries, error: str = "") -> list:
    """``entries``: (entry id, (entry term, digest type, digest, data, ...)) pairs."""
    parts: list = [b"", READ_ANSWER.pack(int(status), lac, lafr, int(stop), term, 1 if timed_out else 0, len(entries))]
    size = READ_ANSWER.size
    pack = READ_ENTRY.pack
    for eid, e in entries:
        eterm, dtype, dig, data = e[0], e[1], e[2], e[3]
        parts.append(pack(eid, eterm, dtype, len(dig), len(data)))
        parts.append(dig)
        parts.append(data)
        size += READ_ENTRY.size + len(dig) + len(data)
    t = text(error)
    parts.append(t)
    size += len(t)
    parts[0] = frame_head(READ | ANSWER, rid, size)
    return parts


def decode_read_answer(body: memoryview):
    """(status, lac, lafr, stop, term, timed_out, [(entry id, entry term, dtype, digest, data)], error)."""
    status, lac, lafr, stop, term, timed_out, n = READ_ANSWER.unpack_from(body, 0)
    off = READ_ANSWER.size
    entries = []
    unpack = READ_ENTRY.unpack_from
    for _ in range(n):
        eid, eterm, dtype, dlen, blen = unpack(body, off)
        off += READ_ENTRY.size
        dig = bytes(body[off:off + dlen])
        off += dlen
        data = bytes(body[off:off + blen])
        off += blen
        entries.append((eid, eterm, dtype, dig, data))
    error = read_text(body, off)[0] if off < len(body) else ""
    return status, lac, lafr, stop, term, bool(timed_out), entries, error


# ------------------------------------------------------------------------------ LACs


def encode_read_lac(rid: int, ledger_id: int, after_lac: int, timeout_ms: int) -> bytes:
    return frame_head(READ_LAC, rid, READ_LAC_REQ.size) + READ_LAC_REQ.pack(ledger_id, after_lac, timeout_ms)


def encode_read_lac_answer(rid: int, status: int, lac: int, lafr: int, term: int, timed_out: bool, error: str = "") -> bytes:
    body = READ_LAC_ANSWER.pack(int(status), lac, lafr, term, 1 if timed_out else 0) + text(error)
    return frame_head(READ_LAC | ANSWER, rid, len(body)) + body


def decode_read_lac_answer(body: memoryview):
    status, lac, lafr, term, timed_out = READ_LAC_ANSWER.unpack_from(body, 0)
    return status, lac, lafr, term, bool(timed_out), read_text(body, READ_LAC_ANSWER.size)[0]


def encode_write_lac(rid: int, ledger_id: int, term: int, lac: int, lafr: int) -> bytes:
    return frame_head(WRITE_LAC, rid, WRITE_LAC_REQ.size) + WRITE_LAC_REQ.pack(ledger_id, term, lac, lafr)


def encode_write_lac_answer(rid: int, status: int, bookie_term: int, error: str = "") -> bytes:
    body = WRITE_LAC_ANSWER.pack(int(status), bookie_term) + text(error)
    return frame_head(WRITE_LAC | ANSWER, rid, len(body)) + body


def decode_write_lac_answer(body: memoryview):
    status, term = WRITE_LAC_ANSWER.unpack_from(body, 0)
    return status, term, read_text(body, WRITE_LAC_ANSWER.size)[0]


# ------------------------------------------------------------------------------ take-over


def encode_fence(rid: int, ledger_id: int, term: int) -> bytes:
    return frame_head(FENCE, rid, FENCE_REQ.size) + FENCE_REQ.pack(ledger_id, term)


def encode_fence_answer(rid: int, status: int, bookie_term: int, lac: int, lafr: int, error: str = "") -> bytes:
    body = FENCE_ANSWER.pack(int(status), bookie_term, lac, lafr) + text(error)
    return frame_head(FENCE | ANSWER, rid, len(body)) + body


def decode_fence_answer(body: memoryview):
    """(status, bookie term, lac, lafr, error)."""
    status, term, lac, lafr = FENCE_ANSWER.unpack_from(body, 0)
    return status, term, lac, lafr, read_text(body, FENCE_ANSWER.size)[0]


def encode_recovery_read(rid: int, ledger_id: int, entry_id: int, term: int) -> bytes:
    return frame_head(RECOVERY_READ, rid, RECOVERY_READ_REQ.size) + RECOVERY_READ_REQ.pack(ledger_id, entry_id, term)


def encode_recovery_read_answer(rid: int, status: int, bookie_term: int, lac: int, entry_term: int = -1,
                                digest_type: int = 0, digest=b"", data=b"", error: str = "") -> list:
    head = RECOVERY_READ_ANSWER.pack(int(status), bookie_term, lac, entry_term, digest_type, len(digest), len(data))
    t = text(error)
    return [frame_head(RECOVERY_READ | ANSWER, rid, len(head) + len(digest) + len(data) + len(t)), head, digest,
            data, t]


def decode_recovery_read_answer(body: memoryview):
    """(status, bookie term, lac, entry term, digest type, digest, data, error)."""
    status, term, lac, eterm, dtype, dlen, blen = RECOVERY_READ_ANSWER.unpack_from(body, 0)
    off = RECOVERY_READ_ANSWER.size
    if off + dlen + blen > len(body):
        raise FrameError("recovery read answer runs past the frame")
    dig = bytes(body[off:off + dlen])
    data = bytes(body[off + dlen:off + dlen + blen])
    return status, term, lac, eterm, dtype, dig, data, read_text(body, off + dlen + blen)[0]


def encode_auth(rid: int, token: str) -> bytes:
    body = text(token)
    return frame_head(AUTH, rid, len(body)) + body


def decode_auth(body: memoryview) -> bytes:
    """The token's bytes (compared as bytes: no decoding of untrusted input needed)."""
    if len(body) < TEXT.size:
        raise FrameError("auth frame too short")
    (n,) = TEXT.unpack_from(body, 0)
    if TEXT.size + n != len(body):
        raise FrameError("auth token length does not match the frame")
    return bytes(body[TEXT.size:])


def encode_auth_answer(rid: int, status: int, message: str = "") -> bytes:
    body = ERROR_ANSWER.pack(int(status)) + text(message)
    return frame_head(AUTH | ANSWER, rid, len(body)) + body


def encode_error(rid: int, status: int, message: str) -> bytes:
    body = ERROR_ANSWER.pack(int(status)) + text(message)
    return frame_head(ERROR, rid, len(body)) + body


def decode_error(body: memoryview) -> tuple[int, str]:
    (status,) = ERROR_ANSWER.unpack_from(body, 0)
    return status, read_text(body, ERROR_ANSWER.size)[0]


class FrameReader:
    """Splits a byte stream into frames: ``feed`` returns complete (op, id, body) frames; the body
    is a memoryview that stays valid.

    Each chunk is parsed where it lies: a frame that fills most of its chunk (a large add or read
    answer) is a view of the chunk, no copy; a small one is copied out (so a small body kept for
    long does not pin a large chunk: a view pins at most twice its size). The tail of a frame not
    yet complete is kept as the chunks it came in and joined once (one copy) when the frame is
    complete, rather than appended to a growing buffer and copied out again."""

    __slots__ = ("_chunks", "_have", "_need", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT) -> None:
        self._chunks: list[bytes] = []  # an incomplete frame (and what came after it)
        self._have = 0  # bytes in _chunks
        self._need = 0  # bytes _chunks must hold before they are parsed again
        self.max_frame_bytes = max_frame_bytes

    @property
    def buffered(self) -> int:
        """Bytes held of frames not yet complete."""
        return self._have

    def feed(self, data) -> list[tuple[int, int, memoryview]]:
        if type(data) is not bytes:  # a view of a buffer its owner reuses: the frames must not share it
            data = bytes(data)
        if self._chunks:
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            data = b"".join(self._chunks)
            self._chunks = []
            self._have = 0
        out = []
        off = 0
        n = len(data)
        hs = FRAME.size
        view = memoryview(data)
        need = hs
        while n - off >= hs:
            length, op, rid = FRAME.unpack_from(data, off)
            if length < 5 or length > self.max_frame_bytes:
                raise FrameError(f"frame length {length} outside 5..{self.max_frame_bytes}")
            end = off + 4 + length
            if end > n:
                need = 4 + length
                break
            if 2 * (end - off - hs) >= n:  # most of the chunk: a view of it
                out.append((op, rid, view[off + hs:end]))
            else:
                out.append((op, rid, memoryview(data[off + hs:end])))
            off = end
        if off < n:
            self._chunks.append(data[off:] if off else data)
            self._have = n - off
            self._need = need
        return out
