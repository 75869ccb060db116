"""The offload job (streams/tools/tier.py) SIGKILLed across a real process boundary at each
dangerous point: after its intent, mid-PUT, after the PUT before the metadata step, and mid-release.
A rerun in another process converges: every sealed fragment remote-only and verified, no bookie
copy left, the objects listed equal to the objects referenced, the stream reading back the same.

The offloader runs in a child process whose fault hook, at the chosen step and fragment, prints
``AT <step> <index>`` and blocks: the parent kills it at exactly that point, with no sleep. Mid-PUT:
at "putting" (just before the PUT) the parent SIGSTOPs SeaweedFS, lets the child go on, and waits
until the child's PUT bytes sit unread in the stopped server's receive queue (``/proc/net/tcp``),
then kills the child and resumes the server."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fragments import tier as tp
from streams.client import connect
from streams.tier.objstore import ObjectStore
from streams.tier.segment import verify
from streams.tools import tier
from streams.tools.localcluster import LocalCluster
from tests.tier.test_offload import _read, bookie_entries, fragments, name, objects_of, referenced, run, setup

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0

CHILD = r"""
import asyncio, json, os, sys
from streams.client import connect
from streams.tier.objstore import ObjectStore, TierConfig
from streams.tools import tier

STEP, INDEX = os.environ["KILL_STEP"], int(os.environ["KILL_INDEX"])

async def hook(step, f):
    if step == STEP and f.index == INDEX:
        print(f"AT {step} {f.index}", flush=True)
        if step == "putting":  # the parent stops the store first, then lets the PUT go
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        else:
            await asyncio.Event().wait()  # SIGKILLed here

async def main():
    client = await connect(os.environ["METADATA_URL"], add_timeout_s=5.0, call_timeout_s=5.0)
    objects = ObjectStore(TierConfig.from_dict(json.loads(os.environ["TIER_CONFIG"])))
    rep = await tier.tier_stream(client, objects, os.environ["STREAM"], _fault=hook)
    print("DONE " + json.dumps(rep.to_dict()), flush=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def tcluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("tierkill"), bookies=3)
    c.start()
    yield c
    c.stop()


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """One line of the child's stdout, within the deadline (no sleep: select on the pipe)."""
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"no line from the offloader in time (so far {buf!r})")
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise AssertionError(f"the offloader exited ({proc.wait()}) before its kill point: {buf!r}")
            buf += chunk
    return buf.decode().strip()


def _tcp_rows():
    """(local port, remote port, state, tx_queue, rx_queue, inode) of every TCP socket here."""
    rows = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            tx, rx = (int(x, 16) for x in f[4].split(":"))
            rows.append((int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), int(f[3], 16), tx, rx,
                         int(f[9])))
    return rows


ESTABLISHED, CLOSE_WAIT = 0x01, 0x08


def _child_ports_to(pid: int, port: int, rows) -> set[int]:
    """The local ports of the child's sockets connected to ``port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return {lp for lp, rp, _st, _tx, _rx, ino in rows if ino in inodes and rp == port}


def _wait_put_in_flight(child: int, s3_port: int, deadline: float) -> None:
    """Until the stopped server's side of one of the child's connections holds unread bytes (the
    PUT reached it) and the child has nothing left unacknowledged (all it wrote is there)."""
    while True:
        rows = _tcp_rows()
        ports = _child_ports_to(child, s3_port, rows)
        sent = any(lp == s3_port and rp in ports and st == ESTABLISHED and rx > 0 for lp, rp, st, _tx, rx, _i in rows)
        acked = all(tx == 0 for lp, rp, _st, tx, _rx, _i in rows if lp in ports and rp == s3_port)
        if sent and acked:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the offloader's PUT never reached the stopped store: {rows}")
        os.sched_yield()


def _wait_server_done(s3_port: int, ports: set[int], deadline: float) -> None:
    """Until the server has closed its side of the killed child's connections: it has read and
    finished (or given up) the interrupted PUT, so no late write lands after the rerun looked."""
    while True:
        left = [r for r in _tcp_rows() if r[0] == s3_port and r[1] in ports and r[2] in (ESTABLISHED, CLOSE_WAIT)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the store never finished the killed offloader's PUT: {left}")
        os.sched_yield()


POINTS = ["intent", "putting", "put", "released"]


@pytest.mark.parametrize("step", POINTS)
def test_the_offloader_sigkilled_at_a_dangerous_point_and_a_rerun_converges(tcluster, seaweed, tmp_path, step):
    s = name(f"kill-{step}")

    async def write():
        client, objects, p = await setup(tcluster, seaweed, s, n=30, per_fragment=10)
        try:
            await p.flush()
            before = [(r.offset, r.key, r.value, r.timestamp_ms) for r in await _read(client, s, 30)]
            meta, frags = await fragments(client, s)
            sealed = [f.index for f in frags if f.sealed]
            return before, meta.ledger_id, sealed
        finally:
            await p.close()
            await client.close()

    before, ledger_id, sealed = run(write())
    assert len(sealed) >= 2
    target = sealed[1]  # the second fragment: the first is already through the step, a mixed state
    stderr = (tmp_path / "offloader.err").open("w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "METADATA_URL": tcluster.metadata_url, "STREAM": s,
           "TIER_CONFIG": json.dumps(seaweed.tier_config().to_dict()), "KILL_STEP": step, "KILL_INDEX": str(target)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=stderr)
    stopped = False
    s3_port = int(seaweed.endpoint.rsplit(":", 1)[1])
    ports: set[int] = set()
    try:
        deadline = time.monotonic() + DEADLINE_S
        try:
            line = _read_line(child, deadline)
        except AssertionError:
            stderr.seek(0)
            raise AssertionError(stderr.read()[-3000:]) from None
        assert line == f"AT {step} {target}", line
        if step == "putting":
            os.kill(seaweed.pid, signal.SIGSTOP)
            stopped = True
            child.stdin.write(b"go\n")
            child.stdin.flush()
            _wait_put_in_flight(child.pid, s3_port, deadline)
            ports = _child_ports_to(child.pid, s3_port, _tcp_rows())
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if stopped:
            os.kill(seaweed.pid, signal.SIGCONT)
        stderr.close()
    if ports:
        _wait_server_done(s3_port, ports, time.monotonic() + DEADLINE_S)

    async def rerun():
        client = await connect(tcluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
        objects = ObjectStore(seaweed.tier_config())
        try:
            _, frags = await fragments(client, s)
            killed = next(f for f in frags if f.index == target)
            if step in ("intent", "putting", "put"):
                assert tp.state(killed) == tp.UPLOADING  # the intent outlived the offloader
            else:
                assert tp.remote_only(killed) and killed.tier.get("trimmed") is False
                assert await bookie_entries(client, ledger_id, killed) > 0  # released, not yet trimmed
            # a later run, after the killed run's intent expired, finishes the job; then the sweep
            later = int(time.time() * 1000) + int(tier.INTENT_TTL_S * 1000) + 1
            rep = (await tier.run_tier(client, s, now_ms=later)).streams[0]
            assert not rep.skipped, rep.skipped
            if step == "put":
                assert rep.adopted == [target]  # the whole object the killed run stored is switched in
            elif step == "intent":
                assert target in rep.offloaded and not rep.adopted  # nothing was there: redone
            elif step == "putting":  # the cut PUT either landed whole (adopted) or not at all (redone)
                assert target in rep.adopted + rep.offloaded
            await tier.run_tier(client, None, now_ms=later, grace_s=0)
            meta, frags = await fragments(client, s)
            done = [f for f in frags if f.sealed]
            assert [f.index for f in done] == sealed
            assert all(tp.remote_only(f) and "trimmed" not in f.tier for f in done), [f.tier for f in done]
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)
            for f in done:
                assert await bookie_entries(client, meta.ledger_id, f) == 0
                verify(await objects.get(f.tier["key"]))
            after = [(r.offset, r.key, r.value, r.timestamp_ms) for r in await _read(client, s, 30)]
            assert after == before
            return rep
        finally:
            await client.close()

    run(rerun())
