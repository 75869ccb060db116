"""Autorecovery inside ``scroll standalone`` (issue 25), as an operator meets it: ``make run
ARGS="--bookies 4 --lost-bookie-delay 1 --registration-ttl 5"``, started directly, streams with E3/WQ3/AQ2 written natively (sealed) and
through the Kafka listener (its writer alive and idle), one bookie process SIGSTOPped (its
registration lapses): ``scroll check`` (the real CLI) turns clean with no command typed, every
record reads back, and a second bookie SIGSTOPped afterwards loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streams.client import connect
from tests.ports import port_block
from tests.standalone_run import Run

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[1]
N = 40
K = 20


def ports() -> dict[str, int]:
    """etcd, its peer, Kafka, 4 bookies, metrics + 4 bookies' + the listener's, the object store (8),
    the console (never the default port: another standalone may hold it)."""
    base = port_block(22)
    return {"etcd": base, "peer": base + 1, "kafka": base + 2, "bookie": base + 3, "metrics": base + 7,
            "objectstore": base + 13, "console": base + 21}


class Standalone(Run):
    """``scroll standalone`` itself (what ``make run`` starts once its venv is set up), in a session
    of its own, logging next to the data directory."""

    def __init__(self, data: Path, ports: dict[str, int], extra: str):
        self.data, self.ports = data, ports
        args = ["--data-dir", str(data), "--etcd-port", str(ports["etcd"]), "--etcd-peer-port", str(ports["peer"]),
                "--kafka-port", str(ports["kafka"]), "--bookie-port", str(ports["bookie"]),
                "--metrics-port", str(ports["metrics"]), "--object-store-port", str(ports["objectstore"]),
                "--console-port", str(ports["console"]),
                *extra.split()]
        self.log = data.parent / f"run-{time.monotonic_ns()}.log"
        self.out = open(self.log, "wb")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.p = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "standalone", *args], cwd=ROOT, env=env,
                                  stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)


def bookie_pid(data: Path, i: int) -> int:
    """The pid of standalone's bookie-i (a child in a session of its own)."""
    marks = (str(data / f"bookie-{i}"), f"--bookie-id bookie-{i} ")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(m in cmd for m in marks):
            return int(d.name)
    raise AssertionError(f"no bookie-{i} process")


def scroll(url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SCROLL_METADATA=url, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "streams.tools.cli", *args], capture_output=True, env=env,
                          timeout=120, cwd=ROOT)


def kcat(port: int, *args: str, input: str | None = None) -> str:
    r = subprocess.run(["kcat", "-b", f"127.0.0.1:{port}", *args], input=input, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"kcat {' '.join(args)} exited {r.returncode}: {r.stderr[-3000:]}"
    return r.stdout


async def until(cond, what: str, timeout_s: float = 180.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)  # polling a condition


def test_standalone_repairs_a_lost_bookie_with_no_command_typed(tmp_path):
    data = tmp_path / "scroll-data"
    p = ports()
    url = f"etcd://127.0.0.1:{p['etcd']}"
    run = Standalone(data, p, "--bookies 4 --lost-bookie-delay 1 --no-object-store --registration-ttl 5")
    stopped: list[int] = []
    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"{time.monotonic() - t0:6.1f}s {what}")

    async def fragments(c, s):
        meta, _ = await c.cluster.ledgers.get_ledger(s)
        return [await c.cluster.ledgers.get_fragment(meta.ledger_id, i)
                for i in range(meta.first_fragment_index, meta.last_fragment_index + 1)]

    async def live(c) -> set[str]:
        return {r.bookie_id for r in await c.live_bookies()}

    def read_back():
        got = kcat(p["kafka"], "-C", "-t", "ar-kafka", "-e", "-f", "%o %s\n")
        assert got.splitlines() == [f"{i} k-{i}" for i in range(K)]

    async def native_back(c):
        cons = await c.consumer("ar-native", start="earliest")
        out = []
        while len(out) < N:
            batch = await cons.read(N, timeout_s=30.0)
            assert batch, f"the consumer stalled after {len(out)} records"
            out += [r.value for r in batch]
        assert out == [b"value-%d" % i for i in range(N)]

    async def main():
        phase("ready")
        c = await connect(url, add_timeout_s=5.0, call_timeout_s=5.0)
        try:
            await c.create_stream("ar-native", ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=8)
            w = await c.producer("ar-native")
            for i in range(N):
                await w.append(b"value-%d" % i)
            await w.close(seal=True)
            await c.create_topic("ar-kafka", ensemble=3, write_quorum=3, ack_quorum=2)
            kcat(p["kafka"], "-P", "-t", "ar-kafka", input="".join(f"k-{i}\n" for i in range(K)))
            read_back()  # the listener's writer is open (and idle from here on)
            open_frag = (await fragments(c, "ar-kafka"))[-1]
            assert not open_frag.sealed
            a = open_frag.ensemble[0]  # in the live writer's open ensemble (and, E3 of 4, in native ones)

            phase("written")
            os.kill(bookie_pid(data, int(a.rsplit("-", 1)[1])), signal.SIGSTOP)
            stopped.append(int(a.rsplit("-", 1)[1]))

            async def clean():
                if a in await live(c):
                    return False
                for s in ("ar-native", "ar-kafka"):
                    if any(a in f.ensemble for f in await fragments(c, s)):
                        return False
                chk = await asyncio.to_thread(scroll, url, "check", "--json")
                return chk.returncode == 0 and json.loads(chk.stdout)["ok"]

            await until(clean, f"`scroll check` clean with {a} stopped")
            phase(f"check clean, {a} stopped")
            await native_back(c)
            phase("native read back")
            await asyncio.to_thread(read_back)
            phase("Kafka read back")

            # a second bookie lost afterwards: every entry still has two live copies
            b = next(x for x in (await fragments(c, "ar-kafka"))[-1].ensemble if x != a)
            os.kill(bookie_pid(data, int(b.rsplit("-", 1)[1])), signal.SIGSTOP)
            stopped.append(int(b.rsplit("-", 1)[1]))

            async def b_gone():
                return b not in await live(c)

            await until(b_gone, f"{b} to drop out of the registry")
            phase(f"{b} gone too")
            await native_back(c)
            await asyncio.to_thread(read_back)
            phase("read back again")
        finally:
            await c.close()

    try:
        run.wait_ready()
        asyncio.run(main())
    except BaseException:
        print("---- scroll standalone's log (tail)\n" + run.text()[-20000:])
        raise
    finally:
        for i in stopped:
            try:
                os.kill(bookie_pid(data, i), signal.SIGCONT)
            except (AssertionError, OSError):
                pass
        try:
            run.ctrl_c()
        finally:
            run.kill()
