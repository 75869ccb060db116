"""The hand-written Produce v3-v12 codec (compat_kafka/wire/produce.py) against kio's generic one:
for random valid requests and answers of every version it decodes to equal entities and writes the
same bytes; it skips unknown tagged fields (as the protocol says; kio refuses them); and a damaged
request is left to the generic path, so it gets the same error as before."""

from __future__ import annotations

import dataclasses
import datetime
import struct
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.index import load_request_schema, load_response_schema
from kio.schema.errors import ErrorCode

from compat_kafka.wire import codec, produce
from compat_kafka.wire.errors import CorruptRequest

VERSIONS = st.integers(produce.FIRST, produce.LAST)
I16 = st.integers(-(2**15), 2**15 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
TEXT = st.text(max_size=12)  # any unicode (multi-byte included)
NULLABLE_TEXT = st.none() | TEXT
RECORDS = st.none() | st.binary(max_size=64)
# unknown tagged fields: (tag, value) pairs, in increasing tag order as the spec requires
TAGS = st.lists(st.tuples(st.integers(0, 300), st.binary(max_size=140)), max_size=3, unique_by=lambda t: t[0]).map(sorted)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _classes(version: int):
    req = load_request_schema(0, version)
    m = sys.modules[req.__module__]
    return req, m.TopicProduceData, m.PartitionProduceData


@st.composite
def requests(draw, version=VERSIONS, max_topics=4, max_parts=4):
    v = draw(version)
    req_cls, topic_cls, part_cls = _classes(v)
    topics = tuple(
        topic_cls(name=draw(TEXT), partition_data=tuple(
            part_cls(index=draw(I32), records=draw(RECORDS)) for _ in range(draw(st.integers(0, max_parts)))))
        for _ in range(draw(st.integers(0, max_topics))))
    body = req_cls(transactional_id=draw(NULLABLE_TEXT), acks=draw(I16),
                   timeout=datetime.timedelta(milliseconds=draw(I32)), topic_data=topics)
    return body, draw(st.integers(-(2**31), 2**31 - 1)), draw(NULLABLE_TEXT)


def _assert_same_decoding(data: bytes) -> codec.Request:
    _, version, correlation_id = codec.read_prefix(data)
    fast = codec.decode_request(data)
    assert produce.decode_request(data, version) is not None  # the hand-written path took it
    assert fast == codec.decode_request_generic(data, 0, version, correlation_id)
    return fast


@SETTINGS
@given(requests())
def test_fast_decoding_equals_kio_for_random_requests_of_every_version(case):
    body, correlation_id, client_id = case
    data = codec.encode_request(body, correlation_id, client_id)[4:]
    req = _assert_same_decoding(data)
    assert (req.body, req.client_id, req.correlation_id) == (body, client_id, correlation_id)


@pytest.mark.parametrize("version", range(produce.FIRST, produce.LAST + 1))
def test_many_topics_and_partitions_and_empty_arrays(version):
    req_cls, topic_cls, part_cls = _classes(version)
    topics = tuple(topic_cls(name=f"topic-{t}", partition_data=tuple(
        part_cls(index=p, records=None if p % 7 == 0 else bytes([p]) * p) for p in range(t % 40)))
        for t in range(60))  # topic 0: no partitions
    for body in (req_cls(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=30), topic_data=topics),
                 req_cls(transactional_id="txn-ü", acks=0, timeout=datetime.timedelta(0), topic_data=())):
        req = _assert_same_decoding(codec.encode_request(body, 5, None)[4:])
        assert req.body == body


# ---------------------------------------------------------------- v9+ tagged fields
def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tags(tags) -> bytes:
    return _uvarint(len(tags)) + b"".join(_uvarint(t) + _uvarint(len(v)) + v for t, v in tags)


def _cstr(s: str | None) -> bytes:
    if s is None:
        return b"\x00"
    b = s.encode()
    return _uvarint(len(b) + 1) + b


def _v9_frame(body, correlation_id, client_id, tags) -> bytes:
    """A Produce v9+ request written by hand, with the given tagged-field sections (kio writes none)."""
    cid = b"\xff\xff" if client_id is None else struct.pack(">h", len(client_id.encode())) + client_id.encode()
    out = [struct.pack(">hhi", 0, body.__version__, correlation_id), cid, _tags(tags["header"]), _cstr(body.transactional_id),
           struct.pack(">hi", body.acks, round(body.timeout.total_seconds() * 1000)), _uvarint(len(body.topic_data) + 1)]
    for i, t in enumerate(body.topic_data):
        out += [_cstr(t.name), _uvarint(len(t.partition_data) + 1)]
        for j, p in enumerate(t.partition_data):
            rec = b"\x00" if p.records is None else _uvarint(len(p.records) + 1) + p.records
            out += [struct.pack(">i", p.index), rec, _tags(tags["partition"] if (i + j) % 2 == 0 else [])]
        out.append(_tags(tags["topic"]))
    out.append(_tags(tags["body"]))
    return b"".join(out)


@SETTINGS
@given(requests(version=st.integers(9, produce.LAST)), st.fixed_dictionaries({k: TAGS for k in ("header", "body", "topic", "partition")}))
def test_v9_unknown_tagged_fields_are_skipped(case, tags):
    body, correlation_id, client_id = case
    plain = _v9_frame(body, correlation_id, client_id, {k: [] for k in tags})
    assert plain == codec.encode_request(body, correlation_id, client_id)[4:]  # the hand writer is kio's
    req = codec.decode_request(_v9_frame(body, correlation_id, client_id, tags))
    assert (req.body, req.client_id, req.correlation_id) == (body, client_id, correlation_id)


# ---------------------------------------------------------------- damaged requests
@SETTINGS
@given(requests(max_topics=2, max_parts=2), st.data())
def test_a_damaged_request_gets_the_generic_paths_answer(case, data):
    """Truncated or with bytes changed: the fast path either decodes what kio decodes, or leaves it
    to the generic path (so the error and the closed connection are the same as before). The only
    requests it takes that kio refuses are ones with tagged fields kio does not know."""
    body, correlation_id, client_id = case
    frame = bytearray(codec.encode_request(body, correlation_id, client_id)[4:])
    cut = data.draw(st.integers(10, len(frame)))
    del frame[cut:]
    for _ in range(data.draw(st.integers(0, 3))):
        if len(frame) > 8:
            frame[data.draw(st.integers(8, len(frame) - 1))] = data.draw(st.integers(0, 255))
    frame = bytes(frame)
    _, version, cid = codec.read_prefix(frame)
    fast = produce.decode_request(frame, version)
    try:
        generic = codec.decode_request_generic(frame, 0, version, cid)
    except CorruptRequest as exc:
        assert fast is None or "Unknown tagged field" in str(exc)
        if fast is None:
            with pytest.raises(CorruptRequest):
                codec.decode_request(frame)
        return
    if fast is not None:
        assert (fast[0], fast[1]) == (generic.client_id, generic.body)


def test_bad_lengths_are_left_to_the_generic_path():
    req_cls, topic_cls, part_cls = _classes(3)
    body = req_cls(transactional_id=None, acks=1, timeout=datetime.timedelta(seconds=1),
                   topic_data=(topic_cls(name="t", partition_data=(part_cls(index=0, records=b"abc"),)),))
    good = codec.encode_request(body, 1, "c")[4:]
    # the topic array claims 2**31-1 elements: the size guard's error, before any allocation
    huge = good.replace(b"\x00\x00\x00\x01\x00\x01t", b"\x7f\xff\xff\xff\x00\x01t")
    with pytest.raises(CorruptRequest, match="array of 2147483647 elements"):
        codec.decode_request(huge)
    # a null topic name (not nullable)
    with pytest.raises(CorruptRequest, match="non-nullable"):
        codec.decode_request(good.replace(b"\x00\x01t", b"\xff\xff"))
    # a topic name that is not UTF-8
    with pytest.raises(CorruptRequest, match="UTF-8|Unicode"):
        codec.decode_request(good.replace(b"\x00\x01t", b"\x00\x01\xff"))


# ---------------------------------------------------------------- answers
def _response(draw, v: int):
    resp_cls = load_response_schema(0, v)
    m = sys.modules[resp_cls.__module__]
    err_cls = getattr(m, "BatchIndexAndErrorMessage", None)
    when = st.none() | st.integers(0, 2**41).map(
        lambda ms: datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC))

    def part():
        errors = tuple(err_cls(batch_index=draw(I32), batch_index_error_message=draw(NULLABLE_TEXT))
                       for _ in range(draw(st.integers(0, 2)))) if err_cls else ()
        return codec.build(m.PartitionProduceResponse, index=draw(I32), error_code=draw(st.sampled_from(ErrorCode)),
                           base_offset=draw(I64), log_append_time=draw(when), log_start_offset=draw(I64),
                           record_errors=errors, error_message=draw(NULLABLE_TEXT))

    topics = tuple(m.TopicProduceResponse(name=draw(TEXT), partition_responses=tuple(
        part() for _ in range(draw(st.integers(0, 3))))) for _ in range(draw(st.integers(0, 3))))
    return resp_cls(responses=topics, throttle_time=datetime.timedelta(milliseconds=draw(st.integers(0, 2**31 - 1))))


@SETTINGS
@given(VERSIONS, st.integers(-(2**31), 2**31 - 1), st.data())
def test_fast_encoding_equals_kio_for_random_answers_of_every_version(version, correlation_id, data):
    body = _response(data.draw, version)
    fast = produce.encode_response(correlation_id, body)
    assert fast is not None
    assert fast == codec.encode_response_generic(correlation_id, body)
    assert codec.encode_response(correlation_id, body) == fast
    assert codec.decode_response(fast[4:], 0, version) == (correlation_id, body)


def test_other_answers_and_old_versions_go_through_kio():
    v2 = codec.response_schema(0, 2)  # derived (kio lacks it): not the hand-written path
    body = codec.build(v2, responses=(), throttle_time=datetime.timedelta(0))
    assert produce.encode_response(1, body) is None
    assert codec.encode_response(1, body) == codec.encode_response_generic(1, body)


def test_v10_answers_with_tagged_fields_set_go_through_kio():
    """KIP-951's current_leader / node_endpoints (Scroll leaves them at their defaults): kio writes them."""
    resp_cls = load_response_schema(0, 12)
    m = sys.modules[resp_cls.__module__]
    part = codec.build(m.PartitionProduceResponse, index=0, error_code=ErrorCode.not_leader_or_follower,
                       base_offset=-1, log_start_offset=-1, record_errors=())
    plain = resp_cls(responses=(m.TopicProduceResponse(name="t", partition_responses=(part,)),))
    assert produce.encode_response(3, plain) == codec.encode_response_generic(3, plain)
    led = dataclasses.replace(part, current_leader=m.LeaderIdAndEpoch(leader_id=2, leader_epoch=5))
    for body in (resp_cls(responses=(m.TopicProduceResponse(name="t", partition_responses=(led,)),)),
                 dataclasses.replace(plain, node_endpoints=(m.NodeEndpoint(node_id=2, host="h", port=9),))):
        assert produce.encode_response(3, body) is None
        assert codec.encode_response(3, body) == codec.encode_response_generic(3, body)
        assert codec.decode_response(codec.encode_response(3, body)[4:], 0, 12) == (3, body)
