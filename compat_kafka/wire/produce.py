"""A hand-written codec for Produce v3-v12, the versions Kafka clients send on the hot path.

Why. At one Produce request per record (librdkafka at linger.ms=0) kio's generic entity walk was a
fifth of the listener's CPU (answer encoding ~15%, request decoding and the size guard ~6%:
docs/benchmarks.md, "Listener per-request cost, third pass"). These versions have a fixed shape,
so the request is read and the answer written here with a few ``struct`` calls, producing and
consuming the very same kio entity objects the handler uses (``decode_request`` and
``encode_response`` in codec.py try this first).

Contract. ``decode_request`` returns kio's decoding of the frame (equal entities), or None for
anything it does not take on: then codec.py decodes it the generic way (the size guard, then kio),
so a malformed request gets exactly the error and close it always did. The one difference is on
purpose: tagged fields this version does not know (Produce v3-v12 defines none; the header none)
are skipped, as the Kafka protocol says a reader must (KIP-482); kio refuses them. ``encode`` writes
the same bytes as kio's writer, or returns None (an entity it does not know) for kio to write.

Wire shapes (clients/src/main/resources/common/message/Produce{Request,Response}.json): request
header v1 (v3-v8) or v2 (v9+: + tagged fields); body transactional_id (nullable string), acks
(int16), timeout_ms (int32), topic_data [name, partition_data [index (int32), records (nullable
bytes)]]. v9+ are flexible: compact strings, arrays and bytes (unsigned varint length + 1, 0 for
null) and tagged fields after every structure. Answer: response header v0 (v1 for v9+: + tagged
fields); responses [name, partition_responses [index, error_code, base_offset, log_append_time_ms,
log_start_offset (v5+), record_errors [batch_index, batch_index_error_message] (v8+),
error_message (v8+)]], throttle_time_ms. v10-v12 requests are v9's; their answers add two tagged
fields (KIP-951: a partition's current_leader, tag 0, and the answer's node_endpoints, tag 0), which
Scroll leaves at their defaults (not written): an answer that sets them is left to kio. librdkafka
2.16 sends a version above v9 (with v3-v9 only, its requests all took the generic path).
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
import sys

from kio.index import load_request_schema, load_response_schema

FIRST, LAST = 3, 12  # the versions this codec speaks
FLEXIBLE = 9  # and later

_H = struct.Struct(">h").unpack_from
_I = struct.Struct(">i").unpack_from
_II = struct.Struct(">ii").unpack_from  # partition index, records size
_HII = struct.Struct(">hii").unpack_from  # acks, timeout_ms, topic count
_HI = struct.Struct(">hi").unpack_from  # acks, timeout_ms
_PREFIX = 8  # api key, api version, correlation id

_i16 = struct.Struct(">h").pack
_i32 = struct.Struct(">i").pack
_PART3 = struct.Struct(">ihqq").pack  # index, error_code, base_offset, log_append_time
_PART5 = struct.Struct(">ihqqq").pack  # + log_start_offset
_timedelta = datetime.timedelta


class _Fallback(Exception):
    """Not decodable here: the generic path decides (and raises the error a bad request gets)."""


def _uvarint(data: bytes, off: int) -> tuple[int, int]:
    b = data[off]
    if b < 0x80:
        return b, off + 1
    result, shift = b & 0x7F, 7
    while True:
        off += 1
        b = data[off]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, off + 1
        shift += 7
        if shift > 28:  # more than 5 bytes: not a 32-bit length
            raise _Fallback


def _skip_tags(data: bytes, off: int) -> int:
    """Skips a tagged-field section: none of the structures read here defines a tag, so every one
    is unknown and skipped by its size (KIP-482)."""
    n, off = _uvarint(data, off)
    for _ in range(n):
        _tag, off = _uvarint(data, off)
        size, off = _uvarint(data, off)
        off += size
        if off > len(data):
            raise _Fallback
    return off


class _Classes:
    """The kio entity classes of one version, and their slots' setters: an entity is made as
    ``object.__new__`` and one C-level slot store per field (its frozen dataclass ``__init__`` goes
    through ``object.__setattr__`` per field: ~3x the time). The result is the same object (kio's
    classes have no ``__post_init__``; the tests compare them with kio's decoding)."""

    def __init__(self, version: int):
        self.request = load_request_schema(0, version)
        module = sys.modules[self.request.__module__]
        self.topic = module.TopicProduceData
        self.partition = module.PartitionProduceData
        assert not any(hasattr(c, "__post_init__") for c in (self.request, self.topic, self.partition))
        slot = lambda c, name: c.__dict__[name].__set__  # noqa: E731
        self.set_txn_id, self.set_acks, self.set_timeout, self.set_topic_data = (
            slot(self.request, n) for n in ("transactional_id", "acks", "timeout", "topic_data"))
        self.set_name, self.set_partition_data = slot(self.topic, "name"), slot(self.topic, "partition_data")
        self.set_index, self.set_records = slot(self.partition, "index"), slot(self.partition, "records")

    def make(self, txn_id, acks, timeout_ms, topics):
        r = _new(self.request)
        self.set_txn_id(r, txn_id)
        self.set_acks(r, acks)
        timeout = _TIMEOUTS.get(timeout_ms)
        if timeout is None:
            timeout = _timedelta(milliseconds=timeout_ms)
            if len(_TIMEOUTS) < 64:  # clients send one or two values: shared (timedelta is immutable)
                _TIMEOUTS[timeout_ms] = timeout
        self.set_timeout(r, timeout)
        self.set_topic_data(r, tuple(topics))
        return r


_new = object.__new__
_TIMEOUTS: dict[int, datetime.timedelta] = {}
_REQUEST = {v: _Classes(v) for v in range(FIRST, LAST + 1)}


def decode_request(data: bytes, version: int) -> tuple[str | None, object] | None:
    """(client id, kio ProduceRequest) of a whole request frame without its size, whose prefix has
    been read (api key 0, ``version`` in FIRST..LAST); None: let the generic path decode it."""
    try:
        if version >= FLEXIBLE:
            return _decode_flexible(data, _REQUEST[version])
        return _decode_legacy(data, _REQUEST[version])
    except (_Fallback, IndexError, struct.error, UnicodeDecodeError):
        return None


def _decode_legacy(data: bytes, cls: _Classes):
    end = len(data)
    (n,) = _H(data, _PREFIX)  # client id: nullable string
    off = _PREFIX + 2
    client_id = None
    if n >= 0:
        client_id = data[off : off + n].decode()
        off += n
    elif n != -1:
        raise _Fallback
    (n,) = _H(data, off)  # transactional id: nullable string
    off += 2
    txn_id = None
    if n >= 0:
        txn_id = data[off : off + n].decode()
        off += n
    elif n != -1:
        raise _Fallback
    acks, timeout_ms, n_topics = _HII(data, off)
    off += 10
    if n_topics < 0 or n_topics * 6 > end - off:  # null (not nullable) or longer than the bytes left
        raise _Fallback
    topics = []
    topic_cls, part_cls = cls.topic, cls.partition
    set_name, set_partition_data, set_index, set_records = (cls.set_name, cls.set_partition_data, cls.set_index,
                                                            cls.set_records)
    for _ in range(n_topics):
        (n,) = _H(data, off)
        if n < 0:
            raise _Fallback
        off += 2
        name = data[off : off + n].decode()
        off += n
        (n_parts,) = _I(data, off)
        off += 4
        if n_parts < 0 or n_parts * 8 > end - off:
            raise _Fallback
        parts = []
        for _ in range(n_parts):
            index, size = _II(data, off)
            off += 8
            if size >= 0:
                if off + size > end:
                    raise _Fallback
                records = data[off : off + size]
                off += size
            elif size == -1:
                records = None
            else:
                raise _Fallback
            p = _new(part_cls)
            set_index(p, index)
            set_records(p, records)
            parts.append(p)
        t = _new(topic_cls)
        set_name(t, name)
        set_partition_data(t, tuple(parts))
        topics.append(t)
    if off > end:
        raise _Fallback
    return client_id, cls.make(txn_id, acks, timeout_ms, topics)


def _decode_flexible(data: bytes, cls: _Classes):
    # unsigned varints are read inline when they take one byte (the common case), else by _uvarint;
    # an empty tagged-field section is one 0 byte
    end = len(data)
    (n,) = _H(data, _PREFIX)  # client id: a legacy nullable string even in header v2
    off = _PREFIX + 2
    client_id = None
    if n >= 0:
        client_id = data[off : off + n].decode()
        off += n
    elif n != -1:
        raise _Fallback
    off = _skip_tags(data, off) if data[off] else off + 1
    n = data[off]  # transactional id: compact nullable string
    n, off = (n, off + 1) if n < 0x80 else _uvarint(data, off)
    txn_id = None
    if n:
        txn_id = data[off : off + n - 1].decode()
        off += n - 1
    acks, timeout_ms = _HI(data, off)
    off += 6
    n_topics = data[off]
    n_topics, off = (n_topics, off + 1) if n_topics < 0x80 else _uvarint(data, off)
    n_topics -= 1
    if n_topics < 0 or n_topics * 3 > end - off:  # null (not nullable) or longer than the bytes left
        raise _Fallback
    topics = []
    topic_cls, part_cls = cls.topic, cls.partition
    set_name, set_partition_data, set_index, set_records = (cls.set_name, cls.set_partition_data, cls.set_index,
                                                            cls.set_records)
    for _ in range(n_topics):
        n = data[off]
        n, off = (n, off + 1) if n < 0x80 else _uvarint(data, off)
        if not n:
            raise _Fallback
        name = data[off : off + n - 1].decode()
        off += n - 1
        n_parts = data[off]
        n_parts, off = (n_parts, off + 1) if n_parts < 0x80 else _uvarint(data, off)
        n_parts -= 1
        if n_parts < 0 or n_parts * 6 > end - off:
            raise _Fallback
        parts = []
        for _ in range(n_parts):
            (index,) = _I(data, off)
            size, off = _uvarint(data, off + 4)
            if size:
                size -= 1
                if off + size > end:
                    raise _Fallback
                records = data[off : off + size]
                off += size
            else:
                records = None
            off = _skip_tags(data, off) if data[off] else off + 1
            p = _new(part_cls)
            set_index(p, index)
            set_records(p, records)
            parts.append(p)
        off = _skip_tags(data, off) if data[off] else off + 1
        t = _new(topic_cls)
        set_name(t, name)
        set_partition_data(t, tuple(parts))
        topics.append(t)
    off = _skip_tags(data, off) if data[off] else off + 1
    if off > end:
        raise _Fallback
    return client_id, cls.make(txn_id, acks, timeout_ms, topics)


# ---------------------------------------------------------------- answers
_RESPONSE = {load_response_schema(0, v): v for v in range(FIRST, LAST + 1)}
# current_leader's default: the very object an answer built without it holds (an ``is`` test suffices)
_NO_LEADER = {v: next(f.default for f in dataclasses.fields(sys.modules[load_response_schema(0, v).__module__]
                                                             .PartitionProduceResponse) if f.name == "current_leader")
              for v in range(10, LAST + 1)}


def _uvarint_bytes(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ms(value) -> int:
    return -1 if value is None else round(value.timestamp() * 1000)


def _str(value: str | None, flexible: bool) -> bytes:
    if value is None:
        return b"\x00" if flexible else b"\xff\xff"
    b = value.encode()
    return (_uvarint_bytes(len(b) + 1) if flexible else _i16(len(b))) + b


def _count(n: int, flexible: bool) -> bytes:
    return _uvarint_bytes(n + 1) if flexible else _i32(n)


def encode_response(correlation_id: int, body) -> bytes | None:
    """The whole answer frame (size, header, body) of a kio ProduceResponse v3-v12, byte for byte
    what kio writes; None for any other entity, or a value out of its field's range (kio's writer
    then raises its own error)."""
    version = _RESPONSE.get(type(body))
    if version is None or (version >= 10 and not _untagged(body, _NO_LEADER[version])):
        return None
    try:
        return _encode(correlation_id, body, version)
    except (struct.error, AttributeError, TypeError):
        return None


def _untagged(body, no_leader) -> bool:
    """Whether a v10+ answer leaves its tagged fields at their defaults (then none is written)."""
    if body.node_endpoints:
        return False
    for t in body.responses:
        for p in t.partition_responses:
            leader = p.current_leader
            if leader is not no_leader and leader != no_leader:
                return False
    return True


def _encode(correlation_id: int, body, version: int) -> bytes:
    flexible = version >= FLEXIBLE
    out = [b"", _i32(correlation_id)]  # out[0]: the frame size, once known
    if flexible:
        out.append(b"\x00")  # response header v1: no tagged fields
    out.append(_count(len(body.responses), flexible))
    for t in body.responses:
        out.append(_str(t.name, flexible))
        out.append(_count(len(t.partition_responses), flexible))
        for p in t.partition_responses:
            if version < 5:
                out.append(_PART3(p.index, p.error_code.value, p.base_offset, _ms(p.log_append_time)))
                continue
            out.append(_PART5(p.index, p.error_code.value, p.base_offset, _ms(p.log_append_time), p.log_start_offset))
            if version >= 8:
                out.append(_count(len(p.record_errors), flexible))
                for e in p.record_errors:
                    out.append(_i32(e.batch_index))
                    out.append(_str(e.batch_index_error_message, flexible))
                    if flexible:
                        out.append(b"\x00")
                out.append(_str(p.error_message, flexible))
                if flexible:
                    out.append(b"\x00")
        if flexible:
            out.append(b"\x00")
    out.append(_i32(round(body.throttle_time.total_seconds() * 1000)))
    if flexible:
        out.append(b"\x00")
    out[0] = _i32(sum(map(len, out)))
    return b"".join(out)


__all__ = ["FIRST", "LAST", "decode_request", "encode_response"]
