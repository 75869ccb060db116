"""A local cluster of real processes: one etcd server and N bookies, all on 127.0.0.1.

Used by ``scroll standalone`` and by the end-to-end tests. Every process it starts is stopped by
``stop()`` (SIGTERM, then SIGKILL after a grace period). Data lives under one directory:
``<dir>/etcd`` and ``<dir>/bookie-<i>``; starting again on the same directory keeps the data.
Bookies keep their id and port across restarts, so the fragments that name them still find them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


class ClusterError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    for cand in (os.environ.get("SCROLL_ETCD"), shutil.which("etcd"), "/usr/bin/etcd"):
        if cand and os.path.exists(cand):
            return cand
    raise ClusterError("no etcd server binary found: install etcd-server (make setup does) or set SCROLL_ETCD")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise ClusterError(f"{what} not listening on 127.0.0.1:{port} after {timeout_s}s; see {log}:\n{_tail(log)}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log: Path
    popen: subprocess.Popen | None = None
    extra: dict = field(default_factory=dict)
    log_offset: int = 0  # where this incarnation's output starts in the (appended) log
    parent_death_signal: bool = False  # not one of our Python servers (they watch SCROLL_PARENT_PID)

    def start(self, env: dict | None = None) -> None:
        """Start it in a session of its own (a terminal's Ctrl-C reaches only our process, which
        stops the children in order), but tied to us: it stops if we die, even by SIGKILL. Our
        Python servers watch ``SCROLL_PARENT_PID``; other programs (etcd) get a parent-death signal
        through ``setpriv`` when we fork from the main thread (the signal follows the forking
        thread, and a worker thread may end before we do)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env)
        env["SCROLL_PARENT_PID"] = str(os.getpid())
        args = list(self.args)
        setpriv = shutil.which("setpriv")
        if self.parent_death_signal and setpriv and threading.current_thread() is threading.main_thread():
            args = [setpriv, "--pdeathsig", "TERM", "--", *args]
        out = open(self.log, "ab")
        self.log_offset = out.tell()
        self.popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.popen.pid, sig)

    def output(self) -> str:
        """What this incarnation has written to its log so far (a restart appends to the same file,
        so an earlier run's "ready" line must not count)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.alive:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait(5)


class LocalCluster:
    def __init__(self, data_dir: str | Path, bookies: int = 3, *, etcd_port: int | None = None,
                 bookie_ports: list[int] | None = None, python: str | None = None, bookie_args: list[str] | None = None,
                 etcd_peer_port: int | None = None, bookie_metrics_ports: list[int] | None = None):
        self.dir = Path(data_dir).resolve()
        self.n = bookies
        self.python = python or sys.executable
        self.etcd_port = etcd_port or free_port()
        self.etcd_peer_port = etcd_peer_port or free_port()
        self.bookie_ports = bookie_ports or [free_port() for _ in range(bookies)]
        self.bookie_metrics_ports = bookie_metrics_ports
        self.bookie_args = bookie_args or []
        self.etcd: Proc | None = None
        self.bookies: list[Proc] = []

    @property
    def metadata_url(self) -> str:
        return f"etcd://127.0.0.1:{self.etcd_port}"

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        try:
            self.start_etcd(timeout_s)
            for i in range(self.n):
                self.bookies.append(self._bookie_proc(i))
                self.start_bookie(i, wait=False)
            for i in range(self.n):
                self.wait_bookie(i, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_etcd(self, timeout_s: float = 30.0) -> None:
        d = self.dir / "etcd"
        d.mkdir(parents=True, exist_ok=True)
        url = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        args = [find_etcd(), "--name", "scroll", "--data-dir", str(d / "data"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"scroll={peer}", "--log-level", "warn"]
        self.etcd = Proc("etcd", args, self.etcd_port, d / "etcd.log", parent_death_signal=True)
        self.etcd.start()
        _wait_port(self.etcd_port, self.etcd.popen, "etcd", timeout_s, self.etcd.log)

    def _bookie_proc(self, i: int) -> Proc:
        port = self.bookie_ports[i]
        d = self.dir / f"bookie-{i}"
        args = [self.python, "-m", "streams.tools.cli", "bookie", "--data-dir", str(d), "--port", str(port),
                "--bookie-id", f"bookie-{i}", "--metadata", self.metadata_url, "--log-level", "WARNING",
                *self.bookie_args]
        if self.bookie_metrics_ports:
            args += ["--metrics-port", str(self.bookie_metrics_ports[i])]
        return Proc(f"bookie-{i}", args, port, d / "bookie.log")

    def start_bookie(self, i: int, wait: bool = True, timeout_s: float = 30.0) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.bookies[i].start(env)
        if wait:
            self.wait_bookie(i, timeout_s)

    def wait_bookie(self, i: int, timeout_s: float = 30.0) -> None:
        b = self.bookies[i]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not b.alive:
                raise ClusterError(f"{b.name} exited with {b.popen.returncode}; see {b.log}:\n{_tail(b.log)}")
            out = b.output()
            if "bookie ready" in out and "registered" in out:
                return
            time.sleep(0.05)
        raise ClusterError(f"{b.name} not ready after {timeout_s}s; see {b.log}:\n{_tail(b.log)}")

    def kill_bookie(self, i: int) -> None:
        self.bookies[i].kill()

    def stop(self) -> None:
        for b in self.bookies:
            b.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
