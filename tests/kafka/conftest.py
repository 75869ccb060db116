"""A real cluster (etcd + 3 bookies) and the Kafka shim running in-process, in a thread with its own
asyncio loop, on a free port of 127.0.0.1. Shared by every Kafka test in the session."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time

import pytest

from compat_kafka.broker import BrokerConfig
from compat_kafka.cli.main import serve
from compat_kafka.groups.consumer_groups import ConsumerGroupConfig
from compat_kafka.groups.coordinator import GroupConfig
from compat_kafka.server import ServerConfig
from fragments import aioloop
from streams.tools.localcluster import LocalCluster, free_port

# Consumer groups in tests: a short initial rebalance delay (Kafka's default is 3 s, ours 300 ms);
# KIP-848 groups: heartbeats every 200 ms, members removed after 3 s without one (Kafka: 5 s, 45 s).
FAST_GROUPS = GroupConfig(initial_rebalance_delay_ms=100,
                          consumer=ConsumerGroupConfig(session_timeout_ms=3000, heartbeat_interval_ms=200))


class ShimThread:
    def __init__(self, metadata_url: str, port: int, max_frame_bytes: int = 8 << 20, server_options=None,
                 event_loop: str = "uvloop", **broker_options):
        self.port = port
        self._event_loop = event_loop  # "asyncio": the standard loop (a test that looks at its timer heap)
        self._server_options = server_options or {}
        self._broker_options = {"default_partitions": 1, "groups": FAST_GROUPS, **broker_options}
        self.bootstrap = f"127.0.0.1:{port}"
        self._url = metadata_url
        self._max_frame = max_frame_bytes
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kafka-shim", daemon=True)
        self.server = None  # the KafkaServer, once listening (look, don't touch: it runs on its own loop)

    def _on_start(self, server) -> None:
        self.server = server

    def _run(self) -> None:
        async def main():
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            started = asyncio.Event()
            task = asyncio.create_task(serve(
                self._url, ServerConfig(port=self.port, max_frame_bytes=self._max_frame, **self._server_options),
                BrokerConfig(port=self.port, **self._broker_options), started=started, stop=self._stop,
                on_start=self._on_start))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            self._started.set()
            await task

        try:
            if self._event_loop == "asyncio":
                asyncio.run(main())
            else:
                aioloop.run(main())  # the loop the listener process runs on (uvloop when installed)
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._started.set()

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(30) or self._error is not None:
            raise RuntimeError(f"Kafka shim did not start: {self._error!r}")

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("kafka-cluster"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def shim(kafka_cluster):
    s = ShimThread(kafka_cluster.metadata_url, free_port())
    s.start()
    yield s
    s.stop()


def only_live_brokers(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Wait until every broker the listener at ``bootstrap`` lists accepts a connection.

    Tests that stop an extra listener on the shared cluster deregister it, but a listener's
    Metadata answer may name the stopped node for up to half a second more (its cached live-broker
    list). librdkafka retries another broker; kafka-python's admin sends a FindCoordinator to a
    random known broker and fails on ECONNREFUSED, so build one only on a cluster without a dead
    node in its metadata."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout_s
    while True:
        brokers = admin.list_topics(timeout=10).brokers.values()
        dead = []
        for b in brokers:
            with socket.socket() as s:
                s.settimeout(1.0)
                if s.connect_ex((b.host, b.port)) != 0:
                    dead.append(f"{b.id}@{b.host}:{b.port}")
        if not dead:
            return
        assert time.monotonic() < deadline, f"the listener still lists stopped brokers {dead}"
        time.sleep(0.1)


def kafka_python_admin(bootstrap: str, **options):
    """kafka-python's KafkaAdminClient, built once no stopped broker is listed (``only_live_brokers``)."""
    from kafka import KafkaAdminClient

    only_live_brokers(bootstrap)
    return KafkaAdminClient(bootstrap_servers=bootstrap, **options)


_n = itertools.count(1)


@pytest.fixture()
def topic(request):
    return f"t{next(_n)}-{request.node.name[:30].replace('[', '-').replace(']', '')}"
