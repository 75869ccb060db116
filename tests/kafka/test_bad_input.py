"""Bad input over raw TCP: the connection gets the right error or is closed cleanly, and the
server keeps serving everyone else. Also ordering of pipelined requests and acks=0."""

from __future__ import annotations

import datetime
import socket
import struct

import pytest
from kio.schema.api_versions.v0 import ApiVersionsRequest
from kio.schema.create_topics.v7 import CreateTopicsRequest
from kio.schema.create_topics.v7.request import CreatableTopic
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12 import MetadataRequest
from kio.schema.produce.v9 import ProduceRequest
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

from compat_kafka.wire import codec

pytestmark = pytest.mark.process


def connect(shim) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", shim.port), timeout=10)
    s.settimeout(10)
    return s


def recv_frame(s: socket.socket) -> bytes | None:
    head = _recv_exactly(s, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">i", head)
    return _recv_exactly(s, n)


def _recv_exactly(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def assert_closed(s: socket.socket) -> None:
    assert recv_frame(s) is None


def assert_serving(shim) -> None:
    with connect(shim) as s:
        s.sendall(codec.encode_request(ApiVersionsRequest(), 77))
        corr, body = codec.decode_response(recv_frame(s), 18, 0)
        assert corr == 77 and body.error_code == ErrorCode.none


def call(s, body, corr):
    s.sendall(codec.encode_request(body, corr))
    got_corr, resp = codec.decode_response(recv_frame(s), body.__api_key__, body.__version__)
    assert got_corr == corr
    return resp


def test_garbage_frame_closes_connection(shim):
    with connect(shim) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # size 0x47455420: over the limit
        assert_closed(s)
    with connect(shim) as s:
        s.sendall(struct.pack(">i", 20) + b"\x13\x37" * 10)  # in-size frame, unknown api key 0x1337
        assert_closed(s)
    assert_serving(shim)


def test_truncated_frame_closes_connection(shim):
    with connect(shim) as s:
        s.sendall(struct.pack(">i", 100) + b"\x00\x03\x00\x0c")
        s.shutdown(socket.SHUT_WR)
        assert_closed(s)
    with connect(shim) as s:  # a body kio cannot parse (Metadata v12 cut short)
        s.sendall(codec.frame(bytes.fromhex("0003000c00000001ffff00") + b"\x05"))
        assert_closed(s)
    assert_serving(shim)


def test_oversize_frame_is_refused_before_reading_it(shim):
    with connect(shim) as s:
        s.sendall(struct.pack(">i", 9 << 20) + b"\x00" * 1024)  # the shim's limit here is 8 MiB
        assert_closed(s)
    assert_serving(shim)


def test_api_versions_above_range_gets_v0_unsupported(shim):
    with connect(shim) as s:
        s.sendall(codec.frame(bytes.fromhex("0012" "0009" "00000005" "ffff" "00")))
        corr, body = codec.decode_response(recv_frame(s), 18, 0)
        assert corr == 5 and body.error_code == ErrorCode.unsupported_version
        # as Kafka (KIP-511): the ApiVersions range only
        assert [(k.api_key, k.min_version, k.max_version) for k in body.api_keys] == [(18, *codec.SUPPORTED[18])]
        s.sendall(codec.encode_request(ApiVersionsRequest(), 6))  # the connection stays usable
        assert codec.decode_response(recv_frame(s), 18, 0)[0] == 6


def test_unsupported_version_of_known_api_closes(shim):
    with connect(shim) as s:
        s.sendall(codec.frame(bytes.fromhex("0000" "000d" "00000001" "ffff")))  # Produce v13
        assert_closed(s)
    assert_serving(shim)


def _produce(topic: str, partition: int, records: bytes, acks: int = -1) -> ProduceRequest:
    return ProduceRequest(acks=acks, timeout=datetime.timedelta(seconds=10), topic_data=(
        TopicProduceData(name=topic, partition_data=(PartitionProduceData(index=partition, records=records),)),))


def _batch() -> bytes:
    """One uncompressed magic-2 batch with one record (value b"x"), built by hand."""
    import crc32c

    record = bytes([0x00]) + b"\x00\x00" + b"\x01" + b"\x02x" + b"\x00"  # attrs, ts/offset deltas, key -1, value
    record = bytes([len(record) << 1]) + record
    after_crc = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, 1) + record
    crc = crc32c.crc32c(after_crc)
    body = struct.pack(">ibI", 0, 2, crc) + after_crc
    return struct.pack(">qi", 0, len(body)) + body


def test_produce_errors_per_partition(shim, topic):
    with connect(shim) as s:
        r = call(s, CreateTopicsRequest(topics=(CreatableTopic(name=topic, num_partitions=1, replication_factor=-1,
                                                               assignments=(), configs=()),),
                                        timeout=datetime.timedelta(seconds=10), validate_only=False), 1)
        assert r.topics[0].error_code == ErrorCode.none
        r = call(s, _produce(topic, 5, _batch()), 2)
        assert r.responses[0].partition_responses[0].error_code == ErrorCode.unknown_topic_or_partition
        r = call(s, _produce("no-such-topic-xyz", 0, _batch()), 3)
        assert r.responses[0].partition_responses[0].error_code == ErrorCode.unknown_topic_or_partition
        bad = bytearray(_batch())
        bad[-1] ^= 0xFF
        r = call(s, _produce(topic, 0, bytes(bad)), 4)
        assert r.responses[0].partition_responses[0].error_code == ErrorCode.corrupt_message
        r = call(s, _produce(topic, 0, _batch()[:30]), 5)
        assert r.responses[0].partition_responses[0].error_code == ErrorCode.corrupt_message
        r = call(s, _produce(topic, 0, _batch(), acks=2), 6)
        assert r.responses[0].partition_responses[0].error_code == ErrorCode.invalid_required_acks
        r = call(s, _produce(topic, 0, _batch() + _batch()), 7)
        p = r.responses[0].partition_responses[0]
        assert (p.error_code, p.base_offset) == (ErrorCode.none, 0)
        r = call(s, _produce(topic, 0, _batch()), 8)
        assert r.responses[0].partition_responses[0].base_offset == 2  # nothing stored by the bad ones


def test_pipelined_requests_answered_in_order_and_acks0_silent(shim, topic):
    md = MetadataRequest(topics=None, allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    with connect(shim) as s:
        s.sendall(codec.encode_request(_produce(topic, 0, _batch(), acks=0), 1)  # auto-create is off for produce
                  + codec.encode_request(md, 2) + codec.encode_request(ApiVersionsRequest(), 3)
                  + codec.encode_request(md, 4))
        order = [struct.unpack(">i", recv_frame(s)[:4])[0] for _ in range(3)]
        assert order == [2, 3, 4]  # the acks=0 produce got no answer
