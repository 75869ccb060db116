"""Every Scroll process runs on uvloop (fragments/aioloop.py), and falls back to asyncio's loop when
uvloop is switched off (SCROLL_EVENT_LOOP=asyncio) or cannot be imported: the real bookie and
listener processes say which loop they run, and records go through either."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

pytest.importorskip("confluent_kafka")
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

import streams.sync as scroll  # noqa: E402
from fragments import aioloop  # noqa: E402

from .shimproc import ShimProcess  # noqa: E402

pytestmark = pytest.mark.process


def _round_trip(bootstrap: str, topic: str) -> list[bytes]:
    """acks=all produce of two records through ``bootstrap``, then read them back from offset 0."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
    errors = []
    for v in (b"one", b"two"):
        p.produce(topic, value=v, on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert p.flush(30) == 0 and not errors, errors
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, 0)])
    got: list[bytes] = []
    try:
        for _ in range(60):
            got += [m.value() for m in c.consume(10, timeout=0.5) if m.error() is None]
            if len(got) >= 2:
                break
    finally:
        c.close()
    return got


def _listener(kafka_cluster, tmp_path, loop_env: str | None) -> ShimProcess:
    shim = ShimProcess(kafka_cluster.metadata_url, tmp_path)
    env = dict(os.environ)
    env.pop(aioloop.ENV, None)
    if loop_env is not None:
        env[aioloop.ENV] = loop_env
    shim.start(env)
    try:
        return shim.wait_listening()
    except BaseException:
        shim.stop()
        raise


@pytest.mark.skipif("uvloop" not in sys.modules and not __import__("importlib").util.find_spec("uvloop"),
                    reason="uvloop is not installed")
@pytest.mark.parametrize("loop_env, expected", [(None, "uvloop"), ("asyncio", "asyncio")])
def test_bookies_and_listener_processes_say_their_loop_and_serve_on_it(kafka_cluster, tmp_path, topic, loop_env,
                                                                       expected):
    """The bookies (started with the default) run uvloop; a listener process runs uvloop by default
    and asyncio's loop with SCROLL_EVENT_LOOP=asyncio, and acks=all records round-trip either way
    (grpc.aio to the bookies included)."""
    for b in kafka_cluster.bookies:
        assert "loop=uvloop" in b.output(), b.output()[-2000:]
    shim = _listener(kafka_cluster, tmp_path, loop_env)
    try:
        assert _round_trip(shim.bootstrap, topic) == [b"one", b"two"]
        assert f"event loop {expected}" in shim.log_text(), shim.log_text()[-2000:]
    finally:
        shim.stop()


def test_fallback_when_uvloop_cannot_be_imported(monkeypatch):
    monkeypatch.delenv(aioloop.ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # "import uvloop" raises ImportError

    async def which() -> str:
        await asyncio.sleep(0)
        return aioloop.loop_name()

    assert aioloop.run(which()) == "asyncio"
    loop = aioloop.new_event_loop()
    try:
        assert aioloop.loop_name(loop) == "asyncio"
    finally:
        loop.close()


def test_a_bad_loop_setting_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv(aioloop.ENV, "tokio")
    with pytest.raises(ValueError, match="SCROLL_EVENT_LOOP must be 'uvloop' or 'asyncio'"):
        aioloop.new_event_loop()


@pytest.mark.skipif(not __import__("importlib").util.find_spec("uvloop"), reason="uvloop is not installed")
def test_sync_client_runs_on_uvloop(kafka_cluster, topic, monkeypatch):
    """The blocking client's background loop is uvloop's, and appends and reads work on it."""
    monkeypatch.delenv(aioloop.ENV, raising=False)
    with scroll.connect(kafka_cluster.metadata_url) as client:
        assert aioloop.loop_name(client._loop.loop) == "uvloop"
        client.create_stream(topic, ensemble=3, write_quorum=3, ack_quorum=2)
        with client.producer(topic) as p:
            assert p.append_many([b"a", b"b"]) == [0, 1]
        assert [r.value for r in client.consumer(topic, start="earliest").read(2)] == [b"a", b"b"]
