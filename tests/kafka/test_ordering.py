"""Requests pipelined on one connection take effect in the order sent, as in Kafka.

Each test writes many requests in one ``sendall`` before reading any answer, so the listener has
them all queued at once; a listener that starts their handlers concurrently applies them in
whatever order the metadata store or the writer happens to finish them (seen: the 50th of 50
commits overwritten by an earlier one)."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kio.schema.create_topics.v7 import CreateTopicsRequest
from kio.schema.create_topics.v7.request import CreatableTopic
from kio.schema.delete_groups.v2 import DeleteGroupsRequest
from kio.schema.errors import ErrorCode
from kio.schema.fetch.v12 import FetchRequest
from kio.schema.fetch.v12.request import FetchPartition, FetchTopic
from kio.schema.offset_commit.v8 import OffsetCommitRequest
from kio.schema.offset_commit.v8.request import OffsetCommitRequestPartition, OffsetCommitRequestTopic
from kio.schema.offset_fetch.v7 import OffsetFetchRequest
from kio.schema.offset_fetch.v7.request import OffsetFetchRequestTopic

from compat_kafka.wire import codec

from .test_bad_input import _produce, call, connect, recv_frame

pytestmark = pytest.mark.process


def _create(s, topic: str) -> None:
    r = call(s, CreateTopicsRequest(topics=(CreatableTopic(name=topic, num_partitions=1, replication_factor=-1,
                                                           assignments=(), configs=()),),
                                    timeout=datetime.timedelta(seconds=10), validate_only=False), 1)
    assert r.topics[0].error_code == ErrorCode.none


def _commit(group: str, topic: str, offset: int) -> OffsetCommitRequest:
    part = OffsetCommitRequestPartition(partition_index=0, committed_offset=offset, committed_leader_epoch=-1,
                                        committed_metadata=None)
    return OffsetCommitRequest(group_id=group, generation_id_or_member_epoch=-1, member_id="", group_instance_id=None,
                               topics=(OffsetCommitRequestTopic(name=topic, partitions=(part,)),))


def _committed(s, group: str, topic: str, corr: int) -> int:
    r = call(s, OffsetFetchRequest(group_id=group, topics=(OffsetFetchRequestTopic(name=topic,
                                                                                    partition_indexes=(0,)),),
                                   require_stable=False), corr)
    assert r.error_code == ErrorCode.none
    return r.topics[0].partitions[0].committed_offset


def _pipeline(s, requests: list, first_corr: int) -> list:
    """Send every request before reading any answer; the decoded answers, in order."""
    s.sendall(b"".join(codec.encode_request(body, first_corr + i) for i, body in enumerate(requests)))
    out = []
    for i, body in enumerate(requests):
        corr, resp = codec.decode_response(recv_frame(s), body.__api_key__, body.__version__)
        assert corr == first_corr + i
        out.append(resp)
    return out


def _batch(value: bytes) -> bytes:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                  producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    b.append(0, timestamp=None, key=None, value=value, headers=[])
    return bytes(b.build())


def test_pipelined_offset_commits_leave_the_last_one_sent(shim, topic):
    group = f"g-{topic}"
    with connect(shim) as s:
        _create(s, topic)
        answers = _pipeline(s, [_commit(group, topic, n) for n in range(1, 51)], 10)
        assert all(a.topics[0].partitions[0].error_code == ErrorCode.none for a in answers)
        assert _committed(s, group, topic, 100) == 50


def test_pipelined_group_calls_apply_in_order(shim, topic):
    """Commit, delete the group, commit again...: what stays is what the last two requests left."""
    group = f"g-{topic}"
    with connect(shim) as s:
        _create(s, topic)
        calls = []
        for n in range(1, 11):
            calls += [_commit(group, topic, n * 10), DeleteGroupsRequest(groups_names=(group,))]
        calls.append(_commit(group, topic, 999))
        answers = _pipeline(s, calls, 10)
        deletes = [a.results[0].error_code for a in answers[1::2]]
        assert deletes == [ErrorCode.none] * 10  # each delete found the commit sent just before it
        assert _committed(s, group, topic, 100) == 999


def test_pipelined_produces_are_stored_in_the_order_sent(shim, topic):
    with connect(shim) as s:
        _create(s, topic)
        answers = _pipeline(s, [_produce(topic, 0, _batch(b"v%d" % i)) for i in range(40)], 10)
        parts = [a.responses[0].partition_responses[0] for a in answers]
        assert [p.error_code for p in parts] == [ErrorCode.none] * 40
        assert [p.base_offset for p in parts] == list(range(40))
        fetch = FetchRequest(replica_id=-1, max_wait=datetime.timedelta(milliseconds=100), min_bytes=1,
                             max_bytes=1 << 20, isolation_level=0, session_id=0, session_epoch=-1,
                             topics=(FetchTopic(topic=topic, partitions=(FetchPartition(
                                 partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
                                 log_start_offset=-1, partition_max_bytes=1 << 20),)),),
                             forgotten_topics_data=(), rack_id="")
        values = []
        while len(values) < 40:
            r = call(s, fetch, 200 + len(values))
            data = r.responses[0].partitions[0].records
            assert data, "the acknowledged records are served"
            pos = 0
            while pos < len(data):
                size = int.from_bytes(data[pos + 8:pos + 12], "big")
                batch = DefaultRecordBatch(data[pos:pos + 12 + size])
                values += [rec.value for rec in batch]
                pos += 12 + size
            fetch = dataclasses.replace(fetch, topics=(FetchTopic(topic=topic, partitions=(FetchPartition(
                partition=0, current_leader_epoch=-1, fetch_offset=len(values), last_fetched_epoch=-1,
                log_start_offset=-1, partition_max_bytes=1 << 20),)),))
        assert values == [b"v%d" % i for i in range(40)]


def test_pipelined_requests_beyond_the_in_flight_bounds_are_all_applied_and_answered_in_order(shim, topic):
    """With ``max_inflight_requests`` 2 the listener holds at most 2 requests read and not started,
    and 2 started and not answered: 30 pipelined produces wait in the socket, none is lost or
    reordered, and the connection keeps serving afterwards."""
    config = shim.server.config
    # read once per connection, as it is accepted (this test's connection is the only one meanwhile)
    shim.server.config = dataclasses.replace(config, max_inflight_requests=2)
    try:
        with connect(shim) as s:
            _create(s, topic)
            answers = _pipeline(s, [_produce(topic, 0, _batch(b"v%d" % i)) for i in range(30)], 10)
            parts = [a.responses[0].partition_responses[0] for a in answers]
            assert [p.error_code for p in parts] == [ErrorCode.none] * 30
            assert [p.base_offset for p in parts] == list(range(30))
            group = f"g-{topic}"
            answers = _pipeline(s, [_commit(group, topic, n) for n in range(1, 21)], 100)
            assert all(a.topics[0].partitions[0].error_code == ErrorCode.none for a in answers)
            assert _committed(s, group, topic, 200) == 20
    finally:
        shim.server.config = config
