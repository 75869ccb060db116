"""The admin commands (streams/tools/admin.py via the scroll CLI) against a real 4-bookie LocalCluster."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from bookie.client import BookieClient
from streams.client import connect
from streams.tools import admin
from streams.tools.localcluster import LocalCluster
from terms.messages import AddRequest
from terms.quorum import write_set

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.tools.cli"]


@pytest.fixture(scope="module")
def acluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("admin"), bookies=4)
    c.start()
    yield c
    c.stop()


def cli(cluster, *args, check=True):
    env = dict(os.environ, SCROLL_METADATA=cluster.metadata_url)
    p = subprocess.run([*SCROLL, *args], capture_output=True, env=env, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"scroll {' '.join(args)} failed ({p.returncode}): {p.stderr.decode()}")
    return p


def run(coro):
    return asyncio.run(coro)


async def make(url, stream, n, e=3, wq=3, aq=2, per_fragment=10, seal=False):
    """n records, one per entry (each append waits for the last): record i is entry i + 1 (entry 0
    is the take-over's no-op)."""
    client = await connect(url)
    await client.create_stream(stream, ensemble=e, write_quorum=wq, ack_quorum=aq, fragment_entries_max=per_fragment)
    p = await client.producer(stream)
    for i in range(n):
        assert await p.append(b"value-%d" % i) == i
    await p.close(seal=seal)
    info = await client.describe_stream(stream)
    await client.close()
    return info


async def registered(client, bookie_id, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while bookie_id not in [r.bookie_id for r in await client.live_bookies()]:
        assert time.monotonic() < deadline, f"{bookie_id} did not register again"
        await asyncio.sleep(0.1)


def port_of(cluster, bookie_id):
    return cluster.bookie_ports[int(bookie_id.rsplit("-", 1)[1])]


def test_ledger_show_and_read_every_replica(acluster):
    s = "show-read"
    info = run(make(acluster.metadata_url, s, 25, e=3, wq=2, aq=2))
    shown = json.loads(cli(acluster, "ledger", "show", s, "--json").stdout)
    assert shown["term"] == 1 and shown["status"] == "OPEN" and shown["config"]["write_quorum"] == 2
    assert [f["index"] for f in shown["fragments"]] == [f.index for f in info.fragments]
    assert shown["fragments"][0] == {"index": 0, "first_entry_id": 0, "last_entry_id": 9, "sealed": True,
                                     "ensemble": list(info.fragments[0].ensemble), "entries": 10,
                                     "size_bytes": info.fragments[0].size_bytes, "created_term": 0,
                                     "first_offset": 0, "first_offset_recorded": True, "records": 9}
    assert [(f["first_offset"], f["records"]) for f in shown["fragments"]] == [(0, 9), (9, 10), (19, 6)]
    assert shown["lac"] == 25 and shown["earliest_entry"] == 0
    assert shown["earliest_offset"] == 0 and shown["end_offset"] == 25
    human = cli(acluster, "ledger", "show", s).stdout.decode()
    assert "(open)" in human and "E/WQ/AQ 3/2/2" in human and "offsets 0..24 (next 25)" in human

    # plant a divergent copy of entry 5 on one replica of its write set
    f0 = info.fragments[0]
    victim = write_set(5, f0.ensemble, 2)[0]

    async def plant():
        async with BookieClient(f"127.0.0.1:{port_of(acluster, victim)}") as bc:
            ev = await bc.add(AddRequest(info.meta.ledger_id, 5, 1, -1, -1, b"\x00tampered", False, True))
            assert type(ev).__name__ == "AddOk"

    run(plant())
    d = json.loads(cli(acluster, "read", s, "--from", "0", "--to", "12", "--json").stdout)
    es = {e["entry_id"]: e for e in d["entries"]}
    assert sorted(es) == list(range(13))
    assert es[0]["noop"] and es[0]["first_offset"] is None and es[0]["records"] == 0
    assert es[1]["preview"] == "value-0" and (es[1]["first_offset"], es[1]["records"]) == (0, 1)
    assert (es[12]["first_offset"], es[12]["preview"]) == (11, "value-11")
    assert all(len(e["have"]) == 2 and not e["missing"] for e in es.values())
    assert [i for i, e in es.items() if e["mismatch"]] == [5]
    assert set(es[12]["replicas"]) == set(write_set(12, info.fragments[1].ensemble, 2))
    human = cli(acluster, "read", s, "--from", "4", "--to", "6").stdout.decode()
    assert "MISMATCH" in human
    rec = json.loads(cli(acluster, "read", s, "--force-recovery", "--json").stdout)["recovery"]
    assert rec["previous_term"] == 1 and rec["term"] == 2 and rec["lac"] >= 25
    assert rec["end_offset"] == 25  # the take-over's no-op takes no offset
    assert json.loads(cli(acluster, "ledger", "show", s, "--json").stdout)["end_offset"] == 25
    bad = cli(acluster, "read", s, check=False)
    assert bad.returncode == 2 and b"--from" in bad.stderr
    cli(acluster, "stream", "delete", s)  # its tampered copy is not for the tests below


def test_simpletest(acluster):
    d = json.loads(cli(acluster, "simpletest", "--records", "3000", "--ensemble", "3", "--wq", "2", "--aq", "2",
                       "--json").stdout)
    assert d["verified"] and d["read_back"] == 3000 and d["first_offset"] == 0 and d["write_records_per_s"] > 0
    assert 1 <= d["entries"] <= 3000  # pipelined appends are batched: usually far fewer entries than records
    assert d["latency_ms"]["p50"] <= d["latency_ms"]["p99"] <= d["latency_ms"]["max"]
    listed = json.loads(cli(acluster, "stream", "list", "--json").stdout)
    assert not [x for x in listed if x["name"].startswith("simpletest-")]  # the temporary stream is gone
    human = cli(acluster, "simpletest", "-n", "50").stdout.decode()
    assert "verified" in human and "records/s" in human


def test_check_finds_a_wiped_bookie_and_fix_re_replicates(acluster):
    s = "check-wiped"
    info = run(make(acluster.metadata_url, s, 35, seal=True))  # CLOSED: every fragment sealed
    victim = info.fragments[0].ensemble[1]
    i = int(victim.rsplit("-", 1)[1])
    assert json.loads(cli(acluster, "check", "--stream", s, "--json").stdout) == {"fragments": [], "ok": True}
    acluster.bookies[i].stop()
    shutil.rmtree(acluster.dir / f"bookie-{i}" / "entrylogs")
    shutil.rmtree(acluster.dir / f"bookie-{i}" / "index")
    shutil.rmtree(acluster.dir / f"bookie-{i}" / "journal")
    acluster.start_bookie(i)

    async def wait():
        c = await connect(acluster.metadata_url)
        await registered(c, victim)
        await c.close()

    run(wait())
    found = cli(acluster, "check", "--stream", s, "--json", check=False)
    assert found.returncode == 1
    frags = json.loads(found.stdout)["fragments"]
    expect = [f.index for f in info.fragments if victim in f.ensemble]
    assert [f["fragment"] for f in frags] == expect
    for f in frags:
        n = (f["last_entry_id"] - f["first_entry_id"] + 1)
        assert f["missing"] == {victim: n} and f["under_replicated"] == n and f["action"] == "would re-replicate"
    fixed = json.loads(cli(acluster, "check", "--stream", s, "--fix", "--json").stdout)
    assert fixed["ok"] and all(f["action"] == "re-replicated" and not f["error"] for f in fixed["fragments"])
    assert json.loads(cli(acluster, "check", "--stream", s, "--json").stdout) == {"fragments": [], "ok": True}

    async def replicas():
        c = await connect(acluster.metadata_url)
        d = await admin.read_replicas(c, s, 0, 35)
        await c.close()
        return d

    d = run(replicas())
    assert len(d["entries"]) == 36 and all(not e["missing"] and not e["mismatch"] for e in d["entries"])


def test_decommission_moves_every_fragment_off_a_stopped_bookie(acluster):
    s_open, s_closed = "decom-open", "decom-closed"
    info = run(make(acluster.metadata_url, s_open, 45))
    run(make(acluster.metadata_url, s_closed, 25, seal=True))
    victim = info.fragments[-1].ensemble[0]  # in the open fragment: the take-over path is needed
    acluster.bookies[int(victim.rsplit("-", 1)[1])].stop()
    out = cli(acluster, "bookie", "decommission", victim, "--json", check=False)
    assert out.stdout, out.stderr.decode()[-3000:]
    d = json.loads(out.stdout)
    assert out.returncode == 0 and d["done"] and not d["was_live"], json.dumps({k: d[k] for k in ("left", "errors")})
    assert [t["stream"] for t in d["takeovers"]] == [s_open]
    assert d["moved"] and all(m["to"] not in (None, victim) for m in d["moved"])

    async def verify():
        c = await connect(acluster.metadata_url)
        for s, n in ((s_open, 45), (s_closed, 25)):
            described = await c.describe_stream(s)
            assert all(victim not in f.ensemble for f in described.fragments), described.fragments
            cons = await c.consumer(s, start="earliest")
            got = await cons.read(1000)
            assert [r.value for r in got] == [b"value-%d" % i for i in range(n)]
            assert await cons.end_position() == n  # offsets survive the take-over and the moves
            reps = await admin.read_replicas(c, s, 0, cons.lac)
            assert all(not e["missing"] and not e["mismatch"] for e in reps["entries"])
        await c.close()

    run(verify())
    # the bookie's own CLI still runs a server: `scroll bookie` without a subcommand
    usage = cli(acluster, "bookie", check=False)
    assert usage.returncode == 2 and b"--data-dir" in usage.stderr
