"""Golden-byte tests of the sans-IO codec: kio-built requests decode through our layer, responses
round-trip, and hand-checked bytes for ApiVersions v0 and v3."""

from __future__ import annotations

import datetime

import pytest
from kio.schema.api_versions.v0 import ApiVersionsRequest as AV0Req
from kio.schema.api_versions.v3 import ApiVersionsRequest as AV3Req
from kio.schema.api_versions.v3 import ApiVersionsResponse as AV3Resp
from kio.schema.api_versions.v3.response import ApiVersion
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12 import MetadataRequest as MD12Req
from kio.schema.metadata.v12.request import MetadataRequestTopic
from kio.schema.produce.v9 import ProduceRequest as P9Req
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

from compat_kafka.wire import codec
from compat_kafka.wire.errors import CorruptRequest, FrameTooLarge, UnsupportedRequest


def test_api_versions_v0_request_hand_checked():
    frame = codec.encode_request(AV0Req(), correlation_id=7, client_id="ab")
    # size 12 | api key 18 | version 0 | correlation 7 | client id "ab" (int16 length); no body
    assert frame == bytes.fromhex("0000000c" "0012" "0000" "00000007" "0002" "6162")
    req = codec.decode_request(frame[4:])
    assert (req.api_key, req.api_version, req.correlation_id, req.client_id) == (18, 0, 7, "ab")


def test_api_versions_v3_request_hand_checked():
    frame = codec.encode_request(AV3Req(client_software_name="k", client_software_version="1"), 1, "c")
    # size 17 | header v2: key, version, correlation, client id (int16 string), empty tagged fields;
    # body: compact strings "k" and "1" (length + 1), empty tagged fields
    assert frame == bytes.fromhex("00000011" "0012" "0003" "00000001" "0001" "63" "00" "026b" "0231" "00")
    req = codec.decode_request(frame[4:])
    assert req.body == AV3Req(client_software_name="k", client_software_version="1")


def test_api_versions_v3_response_hand_checked():
    body = AV3Resp(error_code=ErrorCode.none, api_keys=(ApiVersion(api_key=18, min_version=0, max_version=3),),
                   throttle_time=datetime.timedelta(0))
    frame = codec.encode_response(5, body)
    # ApiVersions always answers with response header v0 (no tagged fields), whatever the version
    assert frame == bytes.fromhex(
        "00000013" "00000005" "0000" "02" "0012" "0000" "0003" "00" "00000000" "00")
    corr, decoded = codec.decode_response(frame[4:], 18, 3)
    assert (corr, decoded) == (5, body)


def test_unsupported_api_versions_answer_is_v0_with_the_api_versions_range():
    frame = codec.unsupported_api_versions_response(9)
    assert frame[4:8] == bytes.fromhex("00000009") and frame[8:10] == bytes.fromhex("0023")  # 35
    corr, body = codec.decode_response(frame[4:], 18, 0)
    assert corr == 9 and body.error_code == ErrorCode.unsupported_version
    assert [(k.api_key, k.min_version, k.max_version) for k in body.api_keys] == [(18, *codec.SUPPORTED[18])]


def test_metadata_and_produce_requests_round_trip():
    md = MD12Req(topics=(MetadataRequestTopic(topic_id=None, name="orders"),), allow_auto_topic_creation=False,
                 include_topic_authorized_operations=False)
    assert codec.decode_request(codec.encode_request(md, 3)[4:]).body == md
    pr = P9Req(acks=-1, timeout=datetime.timedelta(seconds=5), topic_data=(
        TopicProduceData(name="orders", partition_data=(PartitionProduceData(index=0, records=b"xyz"),)),))
    req = codec.decode_request(codec.encode_request(pr, 4)[4:])
    assert req.body == pr and req.api_version == 9


def test_every_supported_response_version_encodes_and_decodes():
    for key, (lo, hi) in codec.SUPPORTED.items():
        for v in (lo, hi):
            cls = codec.response_schema(key, v)
            assert cls.__api_key__ == key and cls.__version__ == v


def test_unsupported_and_corrupt_requests():
    with pytest.raises(UnsupportedRequest) as ei:
        codec.decode_request(bytes.fromhex("0012" "0009" "0000002a" "ffff"))  # ApiVersions v9
    assert ei.value.correlation_id == 42 and ei.value.api_key == 18
    with pytest.raises(UnsupportedRequest):
        codec.decode_request(bytes.fromhex("7fff" "0000" "00000001" "ffff"))  # unknown key
    with pytest.raises(CorruptRequest):
        codec.decode_request(bytes.fromhex("0003" "000c" "00000001" "0005" "61"))  # truncated client id
    with pytest.raises(CorruptRequest):
        codec.decode_request(b"\x00")


def test_frame_decoder_splits_and_limits():
    d = codec.FrameDecoder(max_frame_bytes=1024)
    f1, f2 = codec.encode_request(AV0Req(), 1), codec.encode_request(AV0Req(), 2)
    data = f1 + f2
    assert d.feed(data[:5]) == [] and d.pending_bytes == 5
    assert d.feed(data[5:]) == [f1[4:], f2[4:]] and d.pending_bytes == 0
    with pytest.raises(FrameTooLarge):
        codec.FrameDecoder(max_frame_bytes=1024).feed(b"\x00\x10\x00\x00")
    with pytest.raises(FrameTooLarge):
        codec.FrameDecoder().feed(b"\xff\xff\xff\xff")
