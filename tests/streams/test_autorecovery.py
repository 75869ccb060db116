"""Autorecovery (streams/tools/autorecovery.py) against a real 4-bookie LocalCluster: bookies are
SIGSTOPped (their registration lapses with its short lease) and the fragments that named them are
re-replicated with no command typed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from streams.client import connect
from streams.producer import writer_key
from streams.tools import admin
from streams.tools.autorecovery import AUDITOR, AutoRecovery, AutoRecoveryConfig, status
from streams.tools.localcluster import LocalCluster

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.tools.cli"]
N = 40


@pytest.fixture(scope="module")
def rcluster(tmp_path_factory):
    # registration leases of 2 s (etcd's minimum TTL): a stopped bookie drops out quickly
    c = LocalCluster(tmp_path_factory.mktemp("autorec"), bookies=4, bookie_args=["--registration-ttl", "2"])
    c.start()
    yield c
    for b in c.bookies:  # a stopped bookie would not hear the SIGTERM
        b.signal(signal.SIGCONT)
    c.stop()


def run_then_resume(main, rcluster, stopped: list[int]) -> None:
    """``asyncio.run(main())``, then SIGCONT every bookie it left stopped, even when it failed."""
    try:
        asyncio.run(main())
    finally:
        for i in stopped:
            rcluster.bookies[i].signal(signal.SIGCONT)


async def until(cond, what: str, timeout_s: float = 60.0, every_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)


def idx(bookie_id: str) -> int:
    return int(bookie_id.rsplit("-", 1)[1])


async def live(c) -> set[str]:
    return {r.bookie_id for r in await c.live_bookies()}


async def verify(c, s: str, n: int = N) -> list:
    """Every record readable, every fragment's ensemble 3 distinct live bookies holding every copy."""
    cons = await c.consumer(s, start="earliest")
    got = await cons.read(1000)
    assert [r.value for r in got] == [b"value-%d" % i for i in range(n)]
    frags = await fragments(c, s)
    alive = await live(c)
    for f in frags:
        assert len(set(f.ensemble)) == 3 and set(f.ensemble) <= alive, (f.index, f.ensemble, alive)
    reps = await admin.read_replicas(c, s, 0, cons.lac)
    assert all(not e["missing"] and not e["mismatch"] for e in reps["entries"]), reps["entries"]
    return frags


async def fragments(c, s: str):
    """The stream's fragments, a CLOSED ledger's last one shown sealed (as admin and the workers see it)."""
    meta, _ = await c.cluster.ledgers.get_ledger(s)
    return await admin._visible(c, meta)


async def make(c, s: str):
    await c.create_stream(s, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=8)
    p = await c.producer(s)
    for i in range(N):
        await p.append(b"value-%d" % i)
    await p.close(seal=True)  # CLOSED: every fragment sealed
    return await fragments(c, s)


def test_lost_bookies_are_re_replicated_without_a_command(rcluster):
    s = "autorec-sealed"
    stopped: list[int] = []

    async def main():
        c = await connect(rcluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
        frags = await make(c, s)
        assert len(frags) >= 4 and all(f.sealed for f in frags)
        a = frags[0].ensemble[0]
        commits: list[tuple] = []
        resume: dict = {}

        async def before_commit(old, new):
            commits.append((old.index, tuple(old.ensemble), tuple(new.ensemble)))
            hook = resume.pop("hook", None)
            if hook is not None:
                await hook()

        stop = asyncio.Event()
        ar = AutoRecovery(c, AutoRecoveryConfig(lost_bookie_delay_s=0, lease_ttl_s=3, retry_s=0.5, relist_s=5),
                          before_commit=before_commit)
        task = asyncio.create_task(ar.run(stop))
        try:
            await until(lambda: asyncio.sleep(0, ar.is_auditor), "the auditor")
            # 1. lose bookie A: every fragment that named it moves to the fourth bookie
            t0 = time.monotonic()
            rcluster.bookies[idx(a)].signal(signal.SIGSTOP)
            stopped.append(idx(a))
            await until(lambda: _gone(c, a), f"{a} to drop out of the registry")

            async def repaired():
                fs = await fragments(c, s)
                if any(a in f.ensemble for f in fs):
                    return False
                return not (await status(c))["underreplicated"]

            await until(repaired, f"the fragments on {a} to be re-replicated")
            t_repair = time.monotonic() - t0
            assert [r for r in await admin.check(c, stream=s) if r["under_replicated"]] == []
            assert ar.repaired == len([f for f in frags if a in f.ensemble]) and ar.bytes_copied > 0
            st = await status(c)
            assert st["auditor"]["id"] == ar.id and st["progress"]["repaired"] >= ar.repaired
            # every record readable (A still stopped), 3 distinct live bookies each holding its copies
            await verify(c, s)

            # 2. A comes back (not in any ensemble now); lose a second bookie B, and let B come back
            # while its fragments are being repaired: between the copies and the record's CAS
            rcluster.bookies[idx(a)].signal(signal.SIGCONT)
            stopped.remove(idx(a))
            await until(lambda: _back(c, a), f"{a} to register again")
            fs = await fragments(c, s)
            b = next(x for x in fs[0].ensemble if x != a)
            on_b = [f.index for f in fs if b in f.ensemble]

            async def bring_b_back():
                rcluster.bookies[idx(b)].signal(signal.SIGCONT)
                stopped.remove(idx(b))
                await until(lambda: _back(c, b), f"{b} to register again")

            resume["hook"] = bring_b_back
            n_commits = len(commits)
            rcluster.bookies[idx(b)].signal(signal.SIGSTOP)
            stopped.append(idx(b))

            async def b_gone():  # or already back: its repair can reach the hook between two polls
                return "hook" not in resume or await _gone(c, b)

            await until(b_gone, f"{b} to drop out of the registry")
            await until(lambda: asyncio.sleep(0, len(commits) > n_commits and "hook" not in resume),
                        "a repair to reach its commit")
            await until(lambda: _settled(c, s), "the to-do list to empty")
            assert [r for r in await admin.check(c, stream=s) if r["under_replicated"]] == []
            frags2 = await verify(c, s)  # no lost write, no duplicate ensemble member
            # the fragment repaired while B came back: the CAS committed the replacement (B is out)
            first = commits[n_commits]
            assert first[0] in on_b and b in first[1] and b not in first[2]
            f_now = next(f for f in frags2 if f.index == first[0])
            assert tuple(f_now.ensemble) == first[2]
            return t_repair
        finally:
            stop.set()
            await task
            await c.close()

    try:
        t = asyncio.run(main())
        print(f"re-replication after the loss took {t:.1f}s")
    finally:
        for i in stopped:
            rcluster.bookies[i].signal(signal.SIGCONT)


async def _gone(c, b):
    return b not in await live(c)


async def _back(c, b):
    return b in await live(c)


async def _settled(c, s):
    st = await status(c)
    return not st["underreplicated"] and not any(it for it in st["lost_bookies"])


def test_auditor_election_takes_over(rcluster):
    async def main():
        c1 = await connect(rcluster.metadata_url)
        c2 = await connect(rcluster.metadata_url)
        cfg = AutoRecoveryConfig(lease_ttl_s=3, relist_s=5)
        a1, a2 = AutoRecovery(c1, cfg, instance_id="ar-one"), AutoRecovery(c2, cfg, instance_id="ar-two")
        s1, s2 = asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(a1.run(s1))
        t2 = asyncio.create_task(a2.run(s2))
        try:
            await until(lambda: asyncio.sleep(0, a1.is_auditor or a2.is_auditor), "an auditor")
            first, second = (a1, a2) if a1.is_auditor else (a2, a1)
            assert not second.is_auditor
            # the holder's lease is revoked (as when it dies and its lease expires): the other takes over
            await first._lease.revoke()
            await until(lambda: asyncio.sleep(0, second.is_auditor), "the other instance to take over")
            holder = json.loads((await c1.cluster.store.get(AUDITOR)).value)["id"]
            assert holder == second.id
            await until(lambda: asyncio.sleep(0, not first.is_auditor), "the first to step down")
            # the holder stops (its lease revoked at once): the first, with a new lease, is elected again
            s_second = s1 if second is a1 else s2
            s_second.set()
            await until(lambda: asyncio.sleep(0, first.is_auditor), "the first to be elected again")
            st = await status(c1)
            assert st["auditor"]["id"] == first.id
        finally:
            s1.set()
            s2.set()
            await asyncio.gather(t1, t2)
            await c1.close()
            await c2.close()

    asyncio.run(main())
    env = dict(os.environ, SCROLL_METADATA=rcluster.metadata_url)
    p = subprocess.run([*SCROLL, "autorecovery", "status", "--json"], capture_output=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    d = json.loads(p.stdout)
    assert d["auditor"] is None and set(d) >= {"lost_bookies", "underreplicated", "progress"}
    p = subprocess.run([*SCROLL, "autorecovery", "status"], capture_output=True, env=env, timeout=120)
    assert p.returncode == 0 and b"auditor: none" in p.stdout, p.stderr.decode()


def test_delay_drops_a_bookie_that_returns_and_an_open_fragment_is_taken_over(rcluster):
    s = "autorec-open"
    stopped: list[int] = []

    async def main():
        c = await connect(rcluster.metadata_url, add_timeout_s=3.0, call_timeout_s=3.0)
        await c.create_stream(s, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=8)
        p = await c.producer(s)
        for i in range(N):
            await p.append(b"value-%d" % i)
        await p.close()  # not sealed: the last fragment stays open, with no writer
        frags = await fragments(c, s)
        assert not frags[-1].sealed
        victim = frags[-1].ensemble[1]
        stop = asyncio.Event()
        ar = AutoRecovery(c, AutoRecoveryConfig(lost_bookie_delay_s=3600, open_ledger_grace_s=0, lease_ttl_s=3,
                                                retry_s=0.5, relist_s=5))
        task = asyncio.create_task(ar.run(stop))
        try:
            await until(lambda: asyncio.sleep(0, ar.is_auditor), "the auditor")
            # 1. a long delay: the bookie is lost, comes back before the delay ends, nothing is marked
            rcluster.bookies[idx(victim)].signal(signal.SIGSTOP)
            stopped.append(idx(victim))

            async def lost():
                return victim in (await status(c))["lost_bookies"]

            await until(lost, f"{victim} to be seen lost")
            st = await status(c)
            assert not st["lost_bookies"][victim]["marked"] and not st["underreplicated"]
            rcluster.bookies[idx(victim)].signal(signal.SIGCONT)
            stopped.remove(idx(victim))
            await until(lambda: _back(c, victim), f"{victim} to register again")
            await until(lambda: _not_lost(c, victim), f"{victim} to be dropped from the lost bookies")
            assert not (await status(c))["underreplicated"] and ar.repaired == 0

            # 2. delay 0 and no grace: the open fragment is taken over, then repaired with the others
            ar.config.lost_bookie_delay_s = 0
            meta_before, _ = await c.cluster.ledgers.get_ledger(s)
            rcluster.bookies[idx(victim)].signal(signal.SIGSTOP)
            stopped.append(idx(victim))

            async def repaired():
                fs = await fragments(c, s)
                return not any(victim in f.ensemble for f in fs) and not (await status(c))["underreplicated"]

            await until(repaired, "the open fragment taken over and everything repaired", timeout_s=120)
            meta_after, _ = await c.cluster.ledgers.get_ledger(s)
            assert meta_after.term > meta_before.term and ar.takeovers >= 1
            # every record readable with the victim still stopped; the next writer appends after them
            cons = await c.consumer(s, start="earliest")
            assert [r.value for r in await cons.read(1000)] == [b"value-%d" % i for i in range(N)]
            p = await c.producer(s)
            assert await p.append(b"after") == N
            await p.close()
        finally:
            stop.set()
            await task
            await c.close()

    run_then_resume(main, rcluster, stopped)


async def _not_lost(c, b):
    return b not in (await status(c))["lost_bookies"]


def test_standalone_options():
    p = subprocess.run([*SCROLL, "standalone", "--help"], capture_output=True, timeout=120)
    assert b"--no-autorecovery" in p.stdout and b"--lost-bookie-delay" in p.stdout


def test_throttle_paces_copies(monkeypatch):
    from streams.tools import autorecovery

    slept: list[float] = []

    async def fake_sleep(s):
        slept.append(s)

    async def main():
        b = autorecovery._Bucket(1000.0)
        monkeypatch.setattr(autorecovery.asyncio, "sleep", fake_sleep)
        for _ in range(5):
            await b.take(500)  # at 1000 B/s the k-th batch of 500 bytes may go 0.5 * k s after the first
        unthrottled = autorecovery._Bucket(None)
        await unthrottled.take(10**9)
        return b

    asyncio.run(main())
    # the fake sleep does not advance the clock: each wait is counted from (about) the same start
    assert len(slept) == 4 and slept == sorted(slept) and 1.9 < slept[-1] <= 2.0 + 1e-6


WRITER = """
import asyncio, sys
import streams.producer as sp
sp.WRITER_LEASE_TTL_S = 2  # its writer key is gone 2 s after the process is
from streams.client import connect
from streams.producer import writer_key

async def main():
    c = await connect(sys.argv[1])
    p = await c.producer(sys.argv[2])
    for i in range(int(sys.argv[3])):
        await p.append(b"value-%d" % i)
    print("written", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_live_idle_writer_replaces_a_lost_bookie_itself_a_dead_writer_is_taken_over(rcluster):
    """The issue's rule for open fragments: the live writer's is its own (no take-over even with no
    grace at all: its producer keeps working, no StaleTermError), and its written prefix is still
    repaired; a writer whose process is gone (its writer key expired with its lease) is taken over."""
    live_s, dead_s = "autorec-live-writer", "autorec-dead-writer"
    stopped: list[int] = []
    procs: list[subprocess.Popen] = []

    async def main():
        c = await connect(rcluster.metadata_url, add_timeout_s=3.0, call_timeout_s=3.0)
        await c.create_stream(live_s, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=1000)
        p = await c.producer(live_s)
        for i in range(N):
            await p.append(b"value-%d" % i)
        term = p.term
        key = json.loads((await c.cluster.store.get(writer_key(p.stream_id))).value)
        assert key["term"] == term and key["pid"] == os.getpid()
        victim = (await fragments(c, live_s))[-1].ensemble[1]
        stop = asyncio.Event()
        # no delay and no grace: without the writer's key the stream would be taken over at once
        ar = AutoRecovery(c, AutoRecoveryConfig(lost_bookie_delay_s=0, open_ledger_grace_s=0, lease_ttl_s=3,
                                                retry_s=0.5, relist_s=5))
        task = asyncio.create_task(ar.run(stop))
        try:
            await until(lambda: asyncio.sleep(0, ar.is_auditor), "the auditor")
            # 1. the idle writer: its ensemble change seals the written prefix, which is repaired.
            # The writer hears of the loss only once autorecovery has seen its open fragment on the
            # lost bookie (whichever comes first otherwise) and left it to the writer.
            held: list[str] = []
            tell = p._driver.bookie_left
            p._driver.bookie_left = held.append
            rcluster.bookies[idx(victim)].signal(signal.SIGSTOP)
            stopped.append(idx(victim))
            await until(lambda: asyncio.sleep(0, ar.deferred or ar.takeovers), "autorecovery to look at the open fragment")
            assert ar.takeovers == 0 and ar.deferred >= 1
            p._driver.bookie_left = tell
            for b in held:
                tell(b)

            async def repaired(s):
                fs = await fragments(c, s)
                return not any(victim in f.ensemble for f in fs) and not (await status(c))["underreplicated"]

            await until(lambda: repaired(live_s), "the idle writer's ensemble change and the repair")
            meta, _ = await c.cluster.ledgers.get_ledger(live_s)
            # never taken over (ar.takeovers may count other streams of the module's cluster whose
            # writers are gone: an earlier test's, on the same stopped bookie)
            assert meta.term == term
            assert await p.append(b"value-%d" % N) == N  # the producer carries on: no StaleTermError
            fs = await fragments(c, live_s)
            assert len(fs) >= 2 and fs[0].sealed and fs[0].last_entry_id >= N  # the prefix, sealed
            await p.close()
            assert await c.cluster.store.get(writer_key(p.stream_id)) is None  # closed: the key is gone
            cons = await c.consumer(live_s, start="earliest")
            assert [r.value for r in await cons.read(1000)] == [b"value-%d" % i for i in range(N + 1)]
            rcluster.bookies[idx(victim)].signal(signal.SIGCONT)
            stopped.remove(idx(victim))
            await until(lambda: _back(c, victim), f"{victim} to register again")

            # 2. a writer whose process is gone: its key expires with its lease, then the take-over
            await c.create_stream(dead_s, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=1000)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            w = subprocess.Popen([sys.executable, "-c", WRITER, rcluster.metadata_url, dead_s, str(N)],
                                 stdout=subprocess.PIPE, env=env)
            procs.append(w)
            line = await asyncio.to_thread(w.stdout.readline)
            assert line.strip() == b"written", line
            meta_before, _ = await c.cluster.ledgers.get_ledger(dead_s)
            assert json.loads((await c.cluster.store.get(writer_key(meta_before.ledger_id))).value)["pid"] == w.pid
            w.kill()
            w.wait(30)
            victim2 = (await fragments(c, dead_s))[-1].ensemble[0]
            rcluster.bookies[idx(victim2)].signal(signal.SIGSTOP)
            stopped.append(idx(victim2))

            async def taken_over():
                fs = await fragments(c, dead_s)
                return not any(victim2 in f.ensemble for f in fs) and not (await status(c))["underreplicated"]

            await until(taken_over, "the dead writer's stream taken over and repaired", timeout_s=120)
            meta_after, _ = await c.cluster.ledgers.get_ledger(dead_s)
            assert meta_after.term > meta_before.term and ar.takeovers >= 1
            cons = await c.consumer(dead_s, start="earliest")
            assert [r.value for r in await cons.read(1000)] == [b"value-%d" % i for i in range(N)]
        finally:
            stop.set()
            await task
            await c.close()

    try:
        asyncio.run(main())
    finally:
        for w in procs:
            if w.poll() is None:
                w.kill()
                w.wait(30)
        for i in stopped:
            rcluster.bookies[i].signal(signal.SIGCONT)


def test_a_writer_whose_lease_lapsed_holds_its_key_again(rcluster):
    """A client stalled past its writer lease (here: the lease revoked) finds the lease gone on its
    next keep-alive and puts the keys of its open writers again under a new one."""
    from streams.producer import _Liveness

    async def main():
        c = await connect(rcluster.metadata_url)
        try:
            await c.create_stream("autorec-relapse", ensemble=3, write_quorum=3, ack_quorum=2)
            p = await c.producer("autorec-relapse")
            await p.append(b"one")
            store, key = c.cluster.store, writer_key(p.stream_id)
            live = _Liveness.of(c.cluster)
            old = live._lease
            await old.revoke()
            assert await store.get(key) is None
            await until(lambda: store.get(key), "the writer key put again", timeout_s=30)
            assert live._lease is not old and json.loads((await store.get(key)).value)["term"] == p.term
            assert await p.append(b"two") == 1
            # lapsed again, and a producer opens before the keep-alive notices: its open replaces
            # the lease and puts every open writer's key again (it failed with LeaseExpired)
            await c.create_stream("autorec-relapse-2", ensemble=3, write_quorum=3, ack_quorum=2)
            old = live._lease
            await old.revoke()
            q = await c.producer("autorec-relapse-2")
            assert live._lease is not old and await store.get(writer_key(q.stream_id)) is not None
            assert await store.get(key) is not None
            await q.close()
            await p.close()
            assert await store.get(key) is None and live._lease is None  # the last producer closed: lease revoked
        finally:
            await c.close()

    asyncio.run(main())


def test_a_stopped_bookie_is_asked_for_the_lac_last(rcluster):
    """A SIGSTOPped bookie keeps accepting connections and never answers: a consumer whose cached
    last fragment names it, and which asked it first for the LAC, waited a whole call timeout (the
    ~10 s stall of a Kafka read after a bookie loss). Once the client knows the bookie left the
    registry, every rotation of the LAC poll asks a live member first; a member whose call failed
    is asked last for a while even before the registry drops it."""
    s = "lac-rank"
    stopped: list[int] = []

    async def main():
        c = await connect(rcluster.metadata_url, call_timeout_s=120.0)  # a stall would be this long
        try:
            await c.create_stream(s, ensemble=3, write_quorum=3, ack_quorum=2)
            p = await c.producer(s)
            for i in range(5):
                await p.append(b"v%d" % i)
            await p.close()  # (not sealed: the ledger stays open, its last fragment names the victim)
            cons = await c.consumer(s, start="earliest")  # caches the fragments
            victim = cons.fragments[-1].ensemble[0]
            rcluster.bookies[idx(victim)].signal(signal.SIGSTOP)
            stopped.append(idx(victim))
            await until(lambda: _gone(c, victim), f"{victim} to leave the registry")
            for k in range(3):  # whichever member the rotation would ask first
                cons._rotate = k
                assert await asyncio.wait_for(cons.end_position(), 60) == 5
            rcluster.bookies[idx(victim)].signal(signal.SIGCONT)
            stopped.remove(idx(victim))
            await until(lambda: _back(c, victim), f"{victim} to register again")
        finally:
            await c.close()

    run_then_resume(main, rcluster, stopped)


async def _gone(c, b):
    return b not in await live(c)  # (a listing: the client's own view of the registry follows it)
