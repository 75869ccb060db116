"""Scrubbing across real processes (issue 25): a byte flipped in one bookie's entry log is found
by a scrub pass (or by a read first), reported (Info, metrics, log), never served, the native
consumer reads every record through another replica, ``scroll check`` reports the copy missing,
``check --fix`` copies it back, and a later pass finds nothing corrupt."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bookie.client import BookieClient
from bookie.entrylog import log_files
from bookie.errors import CorruptEntryError, NoSuchEntryError
from streams.client import connect
from streams.tools.localcluster import LocalCluster
from terms.quorum import write_set

from .test_admin import cli, port_of, run

pytestmark = pytest.mark.process
N = 40


def value(i: int, stream: str) -> bytes:
    return b"%s-record-%04d|" % (stream.encode(), i) * 8


@pytest.fixture(scope="module")
def scluster(tmp_path_factory):
    # no periodic passes (the test asks for one with the Scrub RPC); flushes come quickly
    c = LocalCluster(tmp_path_factory.mktemp("scrub"), bookies=3,
                     bookie_args=["--set", "scrub_interval_s=0", "--set", "flush_interval_s=0.2"])
    c.start()
    yield c
    c.stop()


async def make(url, stream):
    client = await connect(url)
    await client.create_stream(stream, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=1000)
    p = await client.producer(stream)
    for i in range(N):
        assert await p.append(value(i, stream)) == i  # one record per entry: record i is entry i + 1
    await p.close(seal=True)
    info = await client.describe_stream(stream)
    await client.close()
    return info


async def wait_for(cond, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # polling a condition


def flip_on_disk(cluster, i: int, needle: bytes, timeout_s: float = 30.0) -> None:
    """Flip one byte of ``needle`` in bookie i's entry log, once a flush has put it there."""
    d = cluster.dir / f"bookie-{i}" / "entrylogs"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for _id, path in log_files(d):
            raw = bytearray(path.read_bytes())
            at = raw.find(needle)
            if at >= 0:
                with open(path, "r+b") as fh:
                    fh.seek(at + 3)
                    fh.write(bytes([raw[at + 3] ^ 0x20]))
                return
        time.sleep(0.05)  # polling a condition: the next flush
    raise AssertionError(f"{needle!r} never reached an entry log of bookie-{i}")


async def read_all(url, stream) -> list[bytes]:
    client = await connect(url)
    c = await client.consumer(stream, start="earliest")
    out = []
    while len(out) < N:
        got = await c.read(N, timeout_s=5.0)
        assert got, f"the consumer stalled after {len(out)} records"
        out += [r.value for r in got]
    await client.close()
    return out


async def direct_read(port: int, ledger: int, eid: int):
    async with BookieClient(f"127.0.0.1:{port}") as bc:
        try:
            r = await bc.read(ledger, eid, eid)
        except NoSuchEntryError:
            return "missing"
        except CorruptEntryError:
            return "corrupt"
        return [e.data for e in r.entries]


async def info(port: int):
    async with BookieClient(f"127.0.0.1:{port}") as bc:
        return await bc.info()


async def settled(port: int):
    """Info once the write cache is empty: the flushed copies are served from the entry logs only."""
    async def empty():
        i = await info(port)
        return i if i.write_cache_bytes == 0 else None

    return await wait_for(empty, "an empty write cache")


async def scrub(port: int, passes_before: int):
    async with BookieClient(f"127.0.0.1:{port}") as bc:
        await bc.scrub()

    async def done():
        i = await info(port)
        return i if i.scrub_passes > passes_before and not i.scrub_running else None

    return await wait_for(done, "a scrub pass")


def test_a_flipped_byte_is_found_not_served_and_repaired_from_another_replica(scluster):
    s = "scrubbed"
    info0 = run(make(scluster.metadata_url, s))
    f = info0.fragments[0]
    ledger = info0.meta.ledger_id
    eid = 17  # record 16
    victim = write_set(eid, f.ensemble, 3)[0]  # the replica a reader tries first
    port = port_of(scluster, victim)
    i = int(victim.rsplit("-", 1)[1])
    flip_on_disk(scluster, i, value(eid - 1, s))

    before = run(settled(port))
    after = run(scrub(port, before.scrub_passes))
    assert after.scrub_corrupt == before.scrub_corrupt + 1 and after.scrub_entries > before.scrub_entries
    assert [(x[0], x[1], x[3], x[5]) for x in after.scrub_findings] == [(ledger, eid, "scrub", True)]
    assert f"corrupt copy ledger={ledger} entry={eid}" in (scluster.dir / f"bookie-{i}" / "bookie.log").read_text()
    assert run(direct_read(port, ledger, eid)) == "missing"  # never the bad bytes
    assert run(read_all(scluster.metadata_url, s)) == [value(k, s) for k in range(N)]

    found = cli(scluster, "check", "--stream", s, "--json", check=False)
    assert found.returncode == 1
    frags = json.loads(found.stdout)["fragments"]
    assert [(x["fragment"], x["missing"], x["under_replicated"]) for x in frags] == [(f.index, {victim: 1}, 1)]
    fixed = json.loads(cli(scluster, "check", "--stream", s, "--fix", "--json").stdout)
    assert fixed["ok"] and [x["copied"] for x in fixed["fragments"]] == [1]
    assert json.loads(cli(scluster, "check", "--stream", s, "--json").stdout) == {"fragments": [], "ok": True}
    twin = port_of(scluster, write_set(eid, f.ensemble, 3)[1])
    assert run(direct_read(port, ledger, eid)) == run(direct_read(twin, ledger, eid))  # the good copy again

    again = run(scrub(port, after.scrub_passes))
    assert again.scrub_corrupt == after.scrub_corrupt  # nothing corrupt any more


def test_a_flipped_byte_no_pass_found_yet_is_caught_by_the_read(scluster):
    s = "read-caught"
    info0 = run(make(scluster.metadata_url, s))
    f = info0.fragments[0]
    ledger = info0.meta.ledger_id
    eid = 9
    victim = write_set(eid, f.ensemble, 3)[0]
    port = port_of(scluster, victim)
    i = int(victim.rsplit("-", 1)[1])
    flip_on_disk(scluster, i, value(eid - 1, s))
    before = run(settled(port))
    assert run(direct_read(port, ledger, eid)) in ("corrupt", "missing")  # detected at read time, not served
    assert run(read_all(scluster.metadata_url, s)) == [value(k, s) for k in range(N)]  # the reader fails over

    async def reported():
        x = await info(port)
        return x if x.scrub_corrupt > before.scrub_corrupt else None

    got = run(wait_for(reported, "the read's finding"))
    assert got.scrub_passes == before.scrub_passes  # no pass ran: the read found it
    assert (got.scrub_findings[-1][0], got.scrub_findings[-1][1], got.scrub_findings[-1][3]) == (ledger, eid, "read")
    assert run(direct_read(port, ledger, eid)) == "missing"
    fixed = json.loads(cli(scluster, "check", "--stream", s, "--fix", "--json").stdout)
    assert fixed["ok"] and [x["copied"] for x in fixed["fragments"]] == [1]
    twin = port_of(scluster, write_set(eid, f.ensemble, 3)[1])
    assert run(direct_read(port, ledger, eid)) == run(direct_read(twin, ledger, eid))


def test_scroll_bookie_scrub_reports_repairs_and_keeps_its_counters_across_a_restart(scluster):
    """The operator's command: ``scroll bookie scrub --wait`` starts a pass and shows the bad copy
    (exit 1 while it waits for its repair), ``--repair`` copies it back from a good replica, and a
    restarted bookie still knows its totals (kept in its own index)."""
    s = "scrub-cli"
    info0 = run(make(scluster.metadata_url, s))
    f = info0.fragments[0]
    ledger = info0.meta.ledger_id
    eid = 23
    victim = write_set(eid, f.ensemble, 3)[0]
    port = port_of(scluster, victim)
    i = int(victim.rsplit("-", 1)[1])
    flip_on_disk(scluster, i, value(eid - 1, s))
    before = run(settled(port))

    found = cli(scluster, "bookie", "scrub", "--bookie", victim, "--wait", "--json", check=False)
    assert found.returncode == 1, found.stderr.decode()  # a bad copy waits for its repair
    [b] = json.loads(found.stdout)["bookies"]
    assert b["bookie"] == victim and b["started"] and not b["running"] and b["passes"] == before.scrub_passes + 1
    assert b["corrupt"] == before.scrub_corrupt + 1 and b["awaiting_repair"] == 1 and b["last_pass_end"] >= b["last_pass_start"] > 0
    assert [(x["ledger"], x["entry"], x["found_by"]) for x in b["findings"]][-1] == (ledger, eid, "scrub")
    assert run(direct_read(port, ledger, eid)) == "missing"  # not served

    fixed = cli(scluster, "bookie", "scrub", "--status", "--repair", "--json")
    d = json.loads(fixed.stdout)
    assert d["ok"] and [(r["stream"], r["copied"]) for r in d["repairs"]] == [(s, 1)]
    mine = next(x for x in d["bookies"] if x["bookie"] == victim)
    assert (mine["repaired"], mine["awaiting_repair"]) == (b["repaired"] + 1, 0)
    twin = port_of(scluster, write_set(eid, f.ensemble, 3)[1])
    assert run(direct_read(port, ledger, eid)) == run(direct_read(twin, ledger, eid))  # a good copy again

    scluster.bookies[i].stop()  # restarted: the totals come back from its index
    scluster.start_bookie(i)
    shown = cli(scluster, "bookie", "scrub", "--bookie", victim, "--status")
    assert victim.encode() in shown.stdout and b"awaiting repair" in shown.stdout
    again = json.loads(cli(scluster, "bookie", "scrub", "--status", "--json").stdout)
    after = next(x for x in again["bookies"] if x["bookie"] == victim)
    assert {k: after[k] for k in ("passes", "entries", "corrupt", "repaired", "last_pass_end")} == \
        {k: mine[k] for k in ("passes", "entries", "corrupt", "repaired", "last_pass_end")}
    assert not after["running"] and after["findings"] == []  # the recent findings are since start

    bad = cli(scluster, "bookie", "scrub", "--bookie", "bookie-99", check=False)
    assert bad.returncode != 0 and b"not registered: bookie-99" in bad.stderr
    assert cli(scluster, "bookie", "scrub", check=False).returncode == 2  # says which bookies to name
