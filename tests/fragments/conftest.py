"""Fixtures for the metadata-store tests: a real etcd server, and one store per backend.

* ``etcd_server`` (session): the ``etcd`` binary from PATH on free 127.0.0.1 client/peer ports
  with a temporary ``--data-dir``; always killed at the end. Tests skip (with the reason) only
  when etcd is not installed.
* ``etcd_servers`` (per test): a factory of private etcd servers for tests that kill them.
* ``run`` (per test): runs a coroutine on the test's own event loop (an ``asyncio.Runner``), with
  an overall bound. Stores are opened on that loop, because gRPC channels belong to one loop.
* ``store`` (per test, parametrized): a fresh ``MemoryStore`` and a fresh ``EtcdStore`` in its own
  key namespace on the shared server. The contract tests take it, so one suite checks both.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fragments.etcdstore import EtcdStore
from fragments.memstore import MemoryStore
from fragments.store import MetadataStore

ETCD = shutil.which("etcd")
NO_ETCD = "etcd is not installed (no `etcd` on PATH; Debian/Ubuntu: apt-get install etcd-server)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One single-member etcd on 127.0.0.1, tuned for tests (fast election, 1 s minimum lease TTL)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.proc: subprocess.Popen | None = None
        self.client_port = 0
        self.peer_port = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> EtcdServer:
        assert ETCD is not None
        last_error = ""
        for attempt in range(3):  # a free port can be taken between probing and binding: retry
            self.client_port, self.peer_port = free_port(), free_port()
            client = f"http://127.0.0.1:{self.client_port}"
            peer = f"http://127.0.0.1:{self.peer_port}"
            data_dir = self.base_dir / f"data-{attempt}"
            self._log = open(self.base_dir / f"etcd-{attempt}.log", "wb")
            self.proc = subprocess.Popen(
                [
                    ETCD, "--name", "scroll-test", "--data-dir", str(data_dir),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"scroll-test={peer}", "--initial-cluster-state", "new",
                    # 10 ms heartbeats / 100 ms election: quick start, and a 1 s minimum lease TTL
                    "--heartbeat-interval", "10", "--election-timeout", "100",
                    "--log-level", "warn",
                ],
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self._healthy():
                    return self
                time.sleep(0.05)
            last_error = self.log_tail()
            self.kill()
        raise RuntimeError(f"etcd did not become ready:\n{last_error}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def log_tail(self) -> str:
        logs = sorted(self.base_dir.glob("etcd-*.log"))
        return logs[-1].read_text(errors="replace")[-2000:] if logs else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    if ETCD is None:
        pytest.skip(NO_ETCD)
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    try:
        server.start()
        yield server
    finally:
        server.kill()


@pytest.fixture
def etcd_servers(tmp_path: Path) -> Iterator[Callable[[], EtcdServer]]:
    """Start private etcd servers (for tests that kill them); all are killed at the end."""
    if ETCD is None:
        pytest.skip(NO_ETCD)
    started: list[EtcdServer] = []

    def start() -> EtcdServer:
        d = tmp_path / f"etcd{len(started)}"
        d.mkdir()
        server = EtcdServer(d)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def run() -> Iterator[Callable]:
    with asyncio.Runner() as runner:

        def run_(coro, timeout: float = 30.0):
            return runner.run(asyncio.wait_for(coro, timeout))

        yield run_


def namespace() -> str:
    return f"/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["memory", "etcd"])
def store(request: pytest.FixtureRequest, run) -> Iterator[MetadataStore]:
    if request.param == "memory":
        s: MetadataStore = MemoryStore()
    else:
        server = request.getfixturevalue("etcd_server")
        s = run(EtcdStore.connect(server.url, namespace=namespace(), timeout=5.0))
    yield s
    run(s.close())
