"""Every crash the fuzzers found, as a test with its exact input (and a readable equivalent).

``tests/fuzz/regressions/TARGET/*`` are raw fuzz inputs: each must pass its target's contract
check now. The tests below spell the same bugs out.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from bookie import digest
from bookie.errors import Status
from compat_kafka.wire import codec
from compat_kafka.wire.errors import CorruptRequest
from tests.bookie.helpers import small_config

from . import targets

REGRESSIONS = Path(__file__).resolve().parent / "regressions"
_CASES = sorted((d.name, f) for d in REGRESSIONS.iterdir() if d.is_dir() for f in sorted(d.iterdir()))
_set_up: set[str] = set()


@pytest.mark.parametrize(("target", "path"), _CASES, ids=[f"{t}/{p.name}" for t, p in _CASES])
def test_fuzz_input_passes_the_contract(target: str, path: Path) -> None:
    setup, one, _instrument = targets.TARGETS[target]
    if target not in _set_up:
        setup()
        _set_up.add(target)
    one(path.read_bytes())


# ---------------------------------------------------------------- Kafka decoder
def _v1_header(api_key: int, version: int) -> bytes:
    return struct.pack(">hhih", api_key, version, 1, -1)  # header v1, null client id


def test_huge_legacy_array_is_a_corrupt_request_not_an_abort() -> None:
    # Metadata v0: topics claims 2**31-1 elements in a 14-byte frame. kio allocated room for them
    # up front (~100 GB) and Rust aborted the listener process.
    frame = _v1_header(codec.API_METADATA, 0) + struct.pack(">i", 0x7FFFFFFF)
    with pytest.raises(CorruptRequest, match="2147483647 elements"):
        codec.decode_request(frame)


def test_huge_compact_array_is_a_corrupt_request_not_an_abort() -> None:
    # Fetch v14 (flexible): the topics array's uvarint claims 2**32-2 elements (the fuzzer's case)
    body = codec.encode_request(codec.build(codec.request_schema(codec.API_FETCH, 14), replica_id=-1,
                                            max_wait=codec.ZERO_MS, min_bytes=0, topics=(), forgotten_topics_data=(),
                                            rack_id=""), 1)[4:]
    assert codec.decode_request(body).body.topics == ()
    at = body.index(b"\x01\x01\x00")  # topics (empty: 1), forgotten (1), rack id ("": 1)
    bad = body[:at] + b"\xff\xff\xff\xff\x0f" + body[at + 1:]
    with pytest.raises(CorruptRequest, match="4294967294 elements"):
        codec.decode_request(bad)


def test_null_in_a_non_nullable_array_is_a_corrupt_request() -> None:
    # ListOffsets v1 with topics = null: kio read it as None and the handler failed on it
    # (TypeError, a traceback and a closed connection); Kafka refuses it while parsing.
    frame = _v1_header(codec.API_LIST_OFFSETS, 1) + struct.pack(">ii", -1, -1)
    with pytest.raises(CorruptRequest, match="non-nullable"):
        codec.decode_request(frame)


def test_null_in_a_nullable_array_is_still_none() -> None:
    # Metadata v1+: topics = null means every topic
    req = codec.decode_request(_v1_header(codec.API_METADATA, 1) + struct.pack(">i", -1))
    assert req.body.topics is None


# ---------------------------------------------------------------- bookie storage
def test_negative_ledger_id_is_bad_request_and_changes_nothing(tmp_path) -> None:
    # An add for ledger -1 (a MAC digest, so no CRC check first) passed validation, installed a
    # state for ledger -1 and cached the batch's earlier adds, then failed packing the entry head
    # (struct.error): those adds were readable but never journaled, and every later flush failed
    # on ledger -1's index key (the bookie could not flush, checkpoint or close).
    from bookie.storage import Engine

    engine = Engine(small_config(tmp_path / "data"))
    engine.open()
    try:
        good = digest.crc32c_digest(5, 0, b"hello")
        out = engine.add_batch([5, -1, -1], [0, 0, 0], [1, 1, 1], [-1] * 3, [-1] * 3, [True] * 3, [], [0, 1, 0],
                               [good, b"m" * 16, b"c" * 4], [b"hello", b"y", b"z"])
        assert out.statuses == [0, Status.BAD_REQUEST, Status.BAD_REQUEST]
        assert set(engine.states) == {5}
        engine.close()
        engine = Engine(small_config(tmp_path / "data"))
        engine.open()
        assert set(engine.states) == {5}
        assert engine.read_entry(5, 0).data == b"hello"
    finally:
        engine.close()


# ---------------------------------------------------------------- Kafka dispatcher
def test_metadata_v10_by_topic_id_is_answered_invalid_request() -> None:
    # Metadata v10-11 may carry a topic id with a null name; the answer put the null name in the
    # response, where it is not nullable before v12: encoding the answer failed (TypeError, the
    # connection closed with a traceback). Kafka refuses topic ids before v12 (INVALID_REQUEST).
    import uuid

    if "kafka_dispatch" not in _set_up:
        targets.kafka_dispatch_setup()
        _set_up.add("kafka_dispatch")
    schema = codec.request_schema(codec.API_METADATA, 10)
    body = codec.build(schema, allow_auto_topic_creation=False, include_cluster_authorized_operations=False,
                       include_topic_authorized_operations=False,
                       topics=(codec.build(codec.nested(schema, "MetadataRequestTopic"), topic_id=uuid.uuid4(), name=None),))
    req = codec.decode_request(codec.encode_request(body, 3)[4:])
    broker, loop = targets._dispatch["broker"], targets._dispatch["loop"]
    answer = loop.run_until_complete(broker.handle(req))
    assert answer.topics[0].error_code == 42  # INVALID_REQUEST
    _corr, decoded = codec.decode_response(codec.encode_response(3, answer)[4:], codec.API_METADATA, 10)
    assert decoded.topics[0].name == ""
