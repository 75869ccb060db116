"""Incremental fetch sessions (KIP-227): the session rules on their own, then over a real socket
(an idle session answers nothing, a produce is answered for its partition only, forgotten partitions
leave, stale epochs and unknown sessions get Kafka's errors) and with kafka-python, whose consumer
uses sessions."""

from __future__ import annotations

import datetime
import time

import pytest
from kio.schema.fetch.v12 import FetchRequest
from kio.schema.fetch.v12.request import FetchPartition, FetchTopic, ForgottenTopic

from compat_kafka.partitions.fetch_sessions import (
    FETCH_SESSION_ID_NOT_FOUND,
    INVALID_FETCH_SESSION_EPOCH,
    FetchSessionCache,
    SessionError,
)

from .conftest import kafka_python_admin
from .test_bad_input import _produce, call, connect
from .test_ordering import _batch


# ---------------------------------------------------------------------------------------- rules
def test_a_full_fetch_at_epoch_0_opens_a_session_that_takes_changes():
    cache = FetchSessionCache(max_sessions=10)
    s, full = cache.begin(0, 0, [(("t", 0), 5, 100), (("t", 1), 7, 100)], [], now=0.0)
    assert full and s.id > 0 and s.epoch == 1 and set(s.partitions) == {("t", 0), ("t", 1)}
    same, full = cache.begin(s.id, 1, [(("t", 1), 9, 50), (("u", 0), 0, 100)], [("t", 0)], now=1.0)
    assert same is s and not full and s.epoch == 2
    assert {tp: (c.fetch_offset, c.max_bytes) for tp, c in s.partitions.items()} == {("t", 1): (9, 50),
                                                                                      ("u", 0): (0, 100)}
    with pytest.raises(SessionError) as ei:  # a repeated (or skipped) epoch
        cache.begin(s.id, 1, [], [], now=2.0)
    assert ei.value.code == INVALID_FETCH_SESSION_EPOCH
    with pytest.raises(SessionError) as ei:
        cache.begin(s.id + 1, 1, [], [], now=2.0)
    assert ei.value.code == FETCH_SESSION_ID_NOT_FOUND
    none, full = cache.begin(s.id, -1, [(("t", 0), 0, 1)], [], now=3.0)  # final: closed, sessionless
    assert none is None and full and len(cache) == 0


def test_an_incremental_answer_names_only_what_changed():
    cache = FetchSessionCache()
    s, _ = cache.begin(0, 0, [(("t", 0), 0, 100)], [], now=0.0)
    assert s.must_answer(("t", 0), False, False, 10, 10, 0)  # first answer
    assert not s.must_answer(("t", 0), False, False, 10, 10, 0)  # nothing new
    assert s.must_answer(("t", 0), True, False, 10, 10, 0)  # records
    assert s.must_answer(("t", 0), False, False, 11, 11, 0)  # the high watermark moved
    assert s.must_answer(("t", 0), False, False, 11, 11, 3)  # the log start moved
    assert s.must_answer(("t", 0), False, True, 11, 11, 3)  # an error, every time
    assert s.must_answer(("t", 0), False, True, 11, 11, 3)


def test_a_full_cache_evicts_only_idle_sessions():
    cache = FetchSessionCache(max_sessions=2, idle_s=10.0)
    a, _ = cache.begin(0, 0, [], [], now=0.0)
    b, _ = cache.begin(0, 0, [], [], now=1.0)
    none, full = cache.begin(0, 0, [], [], now=5.0)  # both in use: served without a session
    assert none is None and full and len(cache) == 2
    cache.begin(a.id, 1, [], [], now=6.0)  # a used again: b is now the least recently used
    c, _ = cache.begin(0, 0, [], [], now=12.0)
    assert c is not None and cache.get(b.id) is None and cache.get(a.id) is a


def test_epochs_wrap_to_1():
    cache = FetchSessionCache()
    s, _ = cache.begin(0, 0, [], [], now=0.0)
    s.epoch = 2**31 - 1
    cache.begin(s.id, 2**31 - 1, [], [], now=1.0)
    assert s.epoch == 1


# ---------------------------------------------------------------------------------------- real socket
def _fetch(topic_parts: dict[str, list[tuple[int, int]]], session_id: int, epoch: int,
           forgotten: dict[str, list[int]] | None = None, wait_ms: int = 50) -> FetchRequest:
    return FetchRequest(
        replica_id=-1, max_wait=datetime.timedelta(milliseconds=wait_ms), min_bytes=1, max_bytes=1 << 20,
        isolation_level=0, session_id=session_id, session_epoch=epoch, rack_id="",
        topics=tuple(FetchTopic(topic=t, partitions=tuple(FetchPartition(
            partition=p, current_leader_epoch=-1, fetch_offset=o, last_fetched_epoch=-1, log_start_offset=-1,
            partition_max_bytes=1 << 20) for p, o in parts)) for t, parts in topic_parts.items()),
        forgotten_topics_data=tuple(ForgottenTopic(topic=t, partitions=tuple(ps))
                                    for t, ps in (forgotten or {}).items()))


def _answered(resp) -> dict[int, tuple[int, int]]:
    return {p.partition_index: (p.high_watermark, len(p.records or b"")) for t in resp.responses
            for p in t.partitions}


@pytest.mark.process
def test_session_over_a_socket(shim, topic):
    from kio.schema.create_topics.v7 import CreateTopicsRequest
    from kio.schema.create_topics.v7.request import CreatableTopic

    with connect(shim) as s:
        r = call(s, CreateTopicsRequest(topics=(CreatableTopic(name=topic, num_partitions=4, replication_factor=-1,
                                                               assignments=(), configs=()),),
                                        timeout=datetime.timedelta(seconds=10), validate_only=False), 1)
        assert r.topics[0].error_code == 0
        for p in range(4):  # every partition open and writable: one record each
            call(s, _produce(topic, p, _batch(b"x")), 2 + p)
        full = call(s, _fetch({topic: [(p, 1) for p in range(4)]}, 0, 0), 10)
        assert full.error_code == 0 and full.session_id > 0
        assert _answered(full) == {p: (1, 0) for p in range(4)}  # a full answer names every partition
        sid = full.session_id
        idle = call(s, _fetch({}, sid, 1), 11)  # nothing changed: nothing sent, nothing answered
        assert (idle.error_code, idle.session_id, _answered(idle)) == (0, sid, {})
        call(s, _produce(topic, 2, _batch(b"y")), 12)
        inc = call(s, _fetch({}, sid, 2), 13)
        assert set(_answered(inc)) == {2} and _answered(inc)[2][0] == 2 and _answered(inc)[2][1] > 0
        # the client moves partition 2 on and forgets partition 3; a produce to 3 is not answered
        call(s, _produce(topic, 3, _batch(b"z")), 14)
        inc = call(s, _fetch({topic: [(2, 2)]}, sid, 3, forgotten={topic: [3]}), 15)
        assert _answered(inc) == {}
        stale = call(s, _fetch({}, sid, 3), 16)
        assert (stale.error_code, _answered(stale)) == (INVALID_FETCH_SESSION_EPOCH, {})
        gone = call(s, _fetch({}, sid + 1, 1), 17)
        assert gone.error_code == FETCH_SESSION_ID_NOT_FOUND
        final = call(s, _fetch({topic: [(0, 0)]}, sid, -1), 18)  # closes the session
        assert (final.session_id, set(_answered(final))) == (0, {0})
        assert call(s, _fetch({}, sid, 4), 19).error_code == FETCH_SESSION_ID_NOT_FOUND


@pytest.mark.process
def test_kafka_python_consumer_uses_a_session_and_reads_everything(shim, topic):
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.admin import NewTopic

    admin = kafka_python_admin(shim.bootstrap)
    admin.create_topics([NewTopic(topic, 12, 1)])
    admin.close()
    p = KafkaProducer(bootstrap_servers=shim.bootstrap, acks="all")
    for i in range(120):
        p.send(topic, value=b"a%d" % i, partition=i % 12)
    p.flush(30)
    c = KafkaConsumer(topic, bootstrap_servers=shim.bootstrap, auto_offset_reset="earliest",
                      enable_auto_commit=False, fetch_max_wait_ms=100, consumer_timeout_ms=100)
    try:
        got = set()
        deadline = time.monotonic() + 60
        while len(got) < 120 and time.monotonic() < deadline:
            got.update(m.value for m in c)
            if len(got) == 60:
                break
        before = len(shim_sessions(shim))
        assert before >= 1, "kafka-python opened a fetch session"
        for i in range(120, 180):  # more records while the consumer is on incremental fetches
            p.send(topic, value=b"a%d" % i, partition=i % 12)
        p.flush(30)
        while len(got) < 180 and time.monotonic() < deadline:
            got.update(m.value for m in c)
        assert got == {b"a%d" % i for i in range(180)}
    finally:
        c.close()
        p.close()


def shim_sessions(shim) -> list:
    return list(shim.server.broker.fetch_sessions._sessions.values())
