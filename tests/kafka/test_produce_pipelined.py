"""Pipelined Produce requests of one connection, read together, are handled as one group
(server.py ``_Group``, ``Broker.produce_group``, ``PartitionLog.append_group``): each request still
gets its own answer, in order, with its own base offsets and errors, exactly as if sent alone.

To make the frames really arrive together, the listener's loop is paused (blocked on an event)
while the client writes them all, then let go: it finds them all in one read."""

from __future__ import annotations

import datetime
import struct
import threading
import time

import pytest
from kio.schema.errors import ErrorCode
from kio.schema.init_producer_id.v4 import InitProducerIdRequest
from kio.schema.produce.v9 import ProduceRequest
from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData

from compat_kafka.wire import codec

pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from .shimproc import RawConnection, record_batch  # noqa: E402


def _create(shim, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": shim.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=30)


def _request(topic: str, partition: int, batch: bytes, acks: int = -1) -> ProduceRequest:
    return ProduceRequest(transactional_id=None, acks=acks, timeout=datetime.timedelta(seconds=10), topic_data=(
        TopicProduceData(name=topic, partition_data=(PartitionProduceData(index=partition, records=batch),)),))


class _Paused:
    """The shim's event loop blocked on an event (from inside it) until the block ends."""

    def __init__(self, shim):
        self.shim = shim
        self.go = threading.Event()
        self.holding = threading.Event()

    def _hold(self) -> None:
        self.holding.set()
        self.go.wait(20)

    def __enter__(self):
        self.shim.loop.call_soon_threadsafe(self._hold)
        assert self.holding.wait(20), "the shim's loop did not pause"
        return self

    def __exit__(self, *exc) -> None:
        self.go.set()


def _pipelined(shim, conn: RawConnection, reqs: list, first_corr: int = 100) -> list:
    """Write every request in one send while the listener is paused; the answers, in order, of the
    requests that get one (acks != 0), with their correlation ids checked."""
    frames = b"".join(codec.encode_request(r, first_corr + i) for i, r in enumerate(reqs))
    with _Paused(shim):
        conn.sock.sendall(frames)
    out = []
    for i, r in enumerate(reqs):
        if r.acks == 0:
            continue
        (n,) = struct.unpack(">i", conn._recv(4))
        corr, resp = codec.decode_response(conn._recv(n), r.__api_key__, r.__version__)
        assert corr == first_corr + i  # in request order
        out.append(resp.responses[0].partition_responses[0])
    return out


def _read(bootstrap: str, topic: str, partition: int, n: int) -> list:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, partition, 0)])
    got: list = []
    try:
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            got += [m for m in c.consume(n, timeout=0.5) if m.error() is None]
        got += [m for m in c.consume(10, timeout=0.3) if m.error() is None]  # nothing more (no duplicate)
    finally:
        c.close()
    return [(m.offset(), m.value()) for m in got]


def _stats(shim) -> tuple[int, int]:
    s = shim.server.stats
    return s["coalesced_produce_groups"], s["coalesced_produce_requests"]


def test_pipelined_produces_are_one_group_with_an_answer_each_in_order(shim, topic):
    _create(shim, topic, 2)
    with RawConnection(shim.port) as conn:
        warm = conn.call(_request(topic, 0, record_batch([b"w"])))  # alone: opens partition 0
        assert warm.responses[0].partition_responses[0].base_offset == 0
        groups, requests = _stats(shim)
        reqs = [_request(topic, i % 2, record_batch([f"{i}a".encode(), f"{i}b".encode()])) for i in range(8)]
        answers = _pipelined(shim, conn, reqs)
    assert _stats(shim) == (groups + 1, requests + 8)
    assert [a.error_code for a in answers] == [ErrorCode.none] * 8
    # partition 0 had one record; each request's base offset is its own batch's first
    assert [a.base_offset for a in answers] == [1, 0, 3, 2, 5, 4, 7, 6]
    assert _read(shim.bootstrap, topic, 0, 9) == [(0, b"w")] + [
        (1 + 2 * k + j, f"{i}{c}".encode()) for k, i in enumerate((0, 2, 4, 6)) for j, c in enumerate("ab")]
    assert _read(shim.bootstrap, topic, 1, 8) == [
        (2 * k + j, f"{i}{c}".encode()) for k, i in enumerate((1, 3, 5, 7)) for j, c in enumerate("ab")]


def test_a_bad_request_in_a_group_gets_its_own_error_and_the_others_are_stored(shim, topic):
    _create(shim, topic, 1)
    damaged = bytearray(record_batch([b"bad"]))
    damaged[-1] ^= 0xFF  # its CRC no longer matches
    with RawConnection(shim.port) as conn:
        init = conn.call(InitProducerIdRequest(transactional_id=None, transaction_timeout=datetime.timedelta(
            seconds=60), producer_id=-1, producer_epoch=-1))
        pid = init.producer_id
        conn.call(_request(topic, 0, record_batch([b"w"])))  # alone: opens the partition (offset 0)
        groups, requests = _stats(shim)
        reqs = [
            _request(topic, 0, record_batch([b"a", b"b", b"c"], pid, 0, 0)),
            _request(topic, 0, record_batch([b"a", b"b", b"c"], pid, 0, 0)),  # a retry: its original offset
            _request(topic, 0, record_batch([b"gap"], pid, 0, 10)),  # out of sequence
            _request(topic, 7, record_batch([b"nowhere"])),  # no such partition
            _request(topic, 0, bytes(damaged)),
            _request(topic, 0, record_batch([b"d", b"e"], pid, 0, 3)),  # in sequence after the first
            _request(topic, 0, record_batch([b"f"])),
        ]
        answers = _pipelined(shim, conn, reqs)
    assert _stats(shim) == (groups + 1, requests + len(reqs))
    assert [(a.error_code, a.base_offset) for a in answers] == [
        (ErrorCode.none, 1), (ErrorCode.none, 1), (ErrorCode.out_of_order_sequence_number, -1),
        (ErrorCode.unknown_topic_or_partition, -1), (ErrorCode.corrupt_message, -1), (ErrorCode.none, 4),
        (ErrorCode.none, 6)]
    assert _read(shim.bootstrap, topic, 0, 7) == list(enumerate([b"w", b"a", b"b", b"c", b"d", b"e", b"f"]))


def test_acks0_produces_in_a_group_are_stored_and_not_answered(shim, topic):
    _create(shim, topic, 1)
    with RawConnection(shim.port) as conn:
        conn.call(_request(topic, 0, record_batch([b"w"])))  # alone: opens the partition (offset 0)
        groups, requests = _stats(shim)
        reqs = [_request(topic, 0, record_batch([f"{i}".encode()]), acks=0) for i in range(5)]
        reqs.append(_request(topic, 0, record_batch([b"last"])))  # acks=-1: not in their group
        (answer,) = _pipelined(shim, conn, reqs)
    assert _stats(shim) == (groups + 1, requests + 5)
    assert (answer.error_code, answer.base_offset) == (ErrorCode.none, 6)
    assert [v for _o, v in _read(shim.bootstrap, topic, 0, 7)] == [b"w", b"0", b"1", b"2", b"3", b"4", b"last"]
