"""``make run`` (``scroll standalone``) as a person runs it, for the tests of the quick start and of
``--secure``: free ports, the foreground run, its readiness, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.ports import port_block

ROOT = Path(__file__).resolve().parents[1]


def ports() -> dict[str, int]:
    """A block of consecutive free ports: etcd, etcd peer, kafka, 3 bookies, metrics + 4, the object
    store + 7, the console."""
    base = port_block(20)
    return {"etcd": base, "peer": base + 1, "kafka": base + 2, "bookie": base + 3, "metrics": base + 6,
            "objectstore": base + 11, "console": base + 19}


class Run:
    """``make run ARGS="..."`` in the foreground, in a session of its own (``extra``: more options,
    e.g. ``--secure``), logging to a file next to the data directory."""

    def __init__(self, data: Path, ports: dict[str, int], extra: str = ""):
        self.data, self.ports = data, ports
        args = (f"--data-dir {data} --etcd-port {ports['etcd']} --etcd-peer-port {ports['peer']} "
                f"--kafka-port {ports['kafka']} --bookie-port {ports['bookie']} --metrics-port {ports['metrics']} "
                f"--object-store-port {ports['objectstore']} --console-port {ports['console']} "
                f"--retention-interval 1 --compaction-interval 1 --tier-interval 1 {extra}").strip()
        self.log = data.parent / f"run-{time.monotonic_ns()}.log"
        self.out = open(self.log, "wb")
        self.p = subprocess.Popen(["make", "--no-print-directory", "run", f"ARGS={args}"], cwd=ROOT,
                                  stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            t = self.text()
            if "scroll standalone ready" in t and "try it:" in t:
                return t
            if self.p.poll() is not None:
                raise AssertionError(f"make run exited with {self.p.returncode}:\n{t}")
            time.sleep(0.2)
        raise AssertionError(f"not ready after {timeout_s}s:\n{self.text()}")

    def ctrl_c(self, timeout_s: float = 60) -> str:
        """SIGINT to the whole foreground process group, as a terminal's Ctrl-C; returns the log
        once scroll standalone says it stopped (make itself then dies of the SIGINT, as usual)."""
        os.killpg(self.p.pid, signal.SIGINT)
        try:
            self.p.wait(timeout_s)
            deadline = time.monotonic() + timeout_s
            while "stopped; data kept in" not in self.text() and time.monotonic() < deadline:
                time.sleep(0.2)
            return self.text()
        finally:
            self.out.close()

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(10)
        self.out.close()
