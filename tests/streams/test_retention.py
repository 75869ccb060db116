"""The retention job (streams/tools/retention.py) against real etcd + real bookie processes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from bookie.client import BookieClient
from bookie.errors import NoSuchEntryError, NoSuchLedgerError
from fragments.ledgers import fragment_key, fragments_prefix
from fragments.model import Fragment
from fragments.retention import DELETING
from streams.client import connect
from streams.errors import DataRemovedError
from streams.tools import retention
from streams.tools.localcluster import LocalCluster

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.tools.cli"]
NO_FLOORS: list = []


@pytest.fixture(scope="module")
def rcluster(tmp_path_factory):
    """3 bookies that run GC every 0.5 s (so disk reclamation is observable quickly)."""
    c = LocalCluster(tmp_path_factory.mktemp("retention"), bookies=3,
                     bookie_args=["--set", "gc_interval_s=0.5", "--set", "journal_file_bytes=20000000"])
    c.start()
    yield c
    c.stop()


_n = [0]


def name(prefix: str) -> str:
    _n[0] += 1
    return f"{prefix}-{os.getpid()}-{_n[0]}"


def run(coro):
    return asyncio.run(coro)


async def make(client, stream, n, per_fragment=10, per_entry=1, value=b"v", retention_=None, timestamps=None):
    """A stream with n records, ``per_entry`` records per entry (one batch each), fragments of
    ``per_fragment`` entries; returns the still open producer. Entry 0 is the first take-over's
    no-op (it takes no offset), so fragment k >= 1 starts at offset (per_fragment * k - 1) * per_entry."""
    await client.create_stream(stream, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=per_fragment,
                               retention=retention_)
    p = await client.producer(stream)
    for start in range(0, n, per_entry):
        await p.append_many([(value if isinstance(value, bytes) else value(i), None, None,
                              (timestamps or {}).get(i)) for i in range(start, min(n, start + per_entry))])
    await p.flush()
    return p


async def bookie_entries(cluster, ledger_id, upto):
    """Per bookie, the entry ids < upto it still stores (read directly)."""
    out = {}
    for i, port in enumerate(cluster.bookie_ports):
        async with BookieClient(f"127.0.0.1:{port}") as bc:
            held = []
            for eid in range(upto):
                try:
                    await bc.read(ledger_id, eid, eid)
                    held.append(eid)
                except (NoSuchEntryError, NoSuchLedgerError):
                    pass
            out[f"bookie-{i}"] = held
    return out


async def assert_consistent(client, cluster, stream):
    """No mark, no fragment record below the first one, nothing below the earliest on any bookie,
    and every visible entry readable."""
    meta, _ = await client.cluster.ledgers.get_ledger(stream)
    assert DELETING not in meta.retention
    keys = [k for k, _ in await client.cluster.store.list_prefix(fragments_prefix(meta.ledger_id))]
    indexes = sorted(int(k.rsplit("/", 1)[1]) for k in keys)
    assert indexes == list(range(meta.first_fragment_index, meta.last_fragment_index + 1))
    info = await client.describe_stream(stream)
    earliest_entry = info.fragments[0].first_entry_id
    assert await bookie_entries(cluster, meta.ledger_id, earliest_entry) == {f"bookie-{i}": [] for i in range(3)}
    c = await client.consumer(stream, start="earliest")
    earliest = c.position
    assert earliest == await c.earliest_offset() == info.fragments[0].first_offset  # known without reading data
    end = await c.end_position()
    got = []
    while c.position < end:
        got.extend(await c.read(1000))
    return earliest, got


def test_keep_from_bytes_and_age_remove_exactly_the_expected_sealed_fragments(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        now = int(time.time() * 1000)
        s_keep, s_bytes, s_age, s_all = name("keep"), name("bytes"), name("age"), name("all")
        producers = [
            # 3 records per entry: fragments hold offsets 0..26 | 27..56 | 57..86 | 87..89 (open)
            await make(client, s_keep, 90, per_entry=3, retention_={"keep_from": 60}),
            await make(client, s_bytes, 45, value=b"x" * 100, retention_={"max_bytes": 2200}),
            # records 0..24 are two hours old, the rest new; offsets 0..8 | 9..18 | 19..28 | ...
            await make(client, s_age, 45, timestamps={i: now - 7_200_000 for i in range(25)},
                       retention_={"max_age_s": 3600}),
            await make(client, s_all, 45, retention_={"keep_from": 10_000}),
        ]
        before = {s: await client.describe_stream(s) for s in (s_keep, s_bytes, s_age, s_all)}
        assert [f.first_offset for f in before[s_keep].fragments] == [0, 27, 57, 87]
        report = await retention.run_retention(client, floors=NO_FLOORS)
        by = {r.stream: r for r in report.streams}
        # fragment 2 starts at offset 57 and holds 60: it stays; 0..1 hold only offsets below 60
        assert by[s_keep].fragments == [0, 1] and by[s_keep].new_earliest == 57
        assert by[s_keep].kept_because == "keep_from 60" and by[s_keep].records == 57 and by[s_keep].entries == 20
        assert (by[s_keep].first_entry, by[s_keep].last_entry, by[s_keep].new_earliest_entry) == (0, 19, 20)
        sizes = [f.size_bytes for f in before[s_bytes].fragments]
        expect = [i for i in range(len(sizes) - 1) if sum(s or 0 for s in sizes[i + 1:]) >= 2200]
        assert by[s_bytes].fragments == expect and expect == list(range(len(expect))) and expect
        assert by[s_bytes].bytes == sum(sizes[: len(expect)])
        assert by[s_age].fragments == [0, 1] and by[s_age].new_earliest == 19  # 19..28 holds offset 25 (new)
        last = before[s_all].fragments[-1]
        assert not last.sealed and by[s_all].fragments == [f.index for f in before[s_all].fragments[:-1]]
        for s, n in ((s_keep, 90), (s_bytes, 45), (s_age, 45), (s_all, 45)):
            earliest, got = await assert_consistent(client, rcluster, s)
            assert earliest == by[s].new_earliest
            assert [r.offset for r in got] == list(range(earliest, n))
        # the open fragment stays whatever the policy, and the producer keeps writing
        assert await producers[3].append(b"after") == 45
        again = await retention.run_retention(client, s_keep, floors=NO_FLOORS)
        assert again.streams[0].fragments == []
        for p in producers:
            await p.close()
        await client.close()

    run(go())


def test_reader_below_the_kept_offsets_gets_data_removed_error_with_the_new_earliest(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("reader")
        p = await make(client, s, 60, per_entry=2)  # offsets 0..17 | 18..37 | 38..57 | 58..59 (open)
        # (without read-ahead: one would hold the next range, read before the removal)
        old = await client.consumer(s, start=1, read_ahead=False)
        assert [r.offset for r in await old.read(3)] == [1, 2, 3]  # caches fragments 0..3
        rep = await retention.apply(client, s, keep_from=40, floors=NO_FLOORS)
        assert rep.fragments == [0, 1] and rep.new_earliest == 38 and rep.records == 38
        got = []
        with pytest.raises(DataRemovedError) as e:
            for _ in range(10):
                got.extend(r.offset for r in await old.read(5))  # what it had read before, then the gap
        assert e.value.earliest == 38 and got == list(range(4, 4 + len(got)))
        with pytest.raises(DataRemovedError) as e:
            await client.consumer(s, start=5)
        assert e.value.earliest == 38
        first = await client.consumer(s, start="earliest")
        assert first.position == 38 and [r.offset for r in await first.read(3)] == [38, 39, 40]
        assert [r.offset for r in await (await client.consumer(s, start=38)).read(1)] == [38]
        await p.close()
        await client.close()

    run(go())


def test_the_mark_records_the_first_offset_the_kept_fragment_lacked(rcluster):
    """A fragment record written by a writer that did not know its first offset (one placed
    during a take-over's recovery) gets it from the mark's transaction, so the new earliest offset
    is known from metadata alone."""
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("fill")
        p = await make(client, s, 45, per_entry=2)  # offsets 0..17 | 18..37 | 38..44 (open, from entry 20)
        meta, _ = await client.cluster.ledgers.get_ledger(s)
        f1 = await client.cluster.ledgers.get_fragment(meta.ledger_id, 1)
        assert f1.sealed and f1.first_offset == 18
        key = fragment_key(meta.ledger_id, 1)
        unknown = dataclasses.replace(f1, first_offset=None)
        await client.cluster.store.txn({}, {key: unknown.to_json().encode()}, ())
        assert Fragment.from_json(unknown.to_json()).first_offset is None
        rep = await retention.apply(client, s, keep_from=30, floors=NO_FLOORS)
        assert rep.fragments == [0] and rep.new_earliest == 18  # learnt from the entries
        assert (await client.cluster.ledgers.get_fragment(meta.ledger_id, 1)).first_offset == 18
        earliest, got = await assert_consistent(client, rcluster, s)
        assert earliest == 18 and [r.offset for r in got] == list(range(18, 45))
        await p.close()
        await client.close()

    run(go())


async def registered(client, bookie_id, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while bookie_id not in [r.bookie_id for r in await client.live_bookies()]:
        assert time.monotonic() < deadline, f"{bookie_id} did not register again"
        await asyncio.sleep(0.1)


def _disk(cluster, i):
    total = 0
    for root, _dirs, files in os.walk(cluster.dir / f"bookie-{i}" / "entrylogs"):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def test_disk_space_is_reclaimed_on_the_bookies(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("disk")
        p = await make(client, s, 600, per_fragment=100, value=lambda i: os.urandom(8000))  # offsets 100k - 1 ..
        await p.close()
        await asyncio.sleep(1.5)  # flushed to entry logs
        before = [_disk(rcluster, i) for i in range(3)]
        rep = await retention.apply(client, s, keep_from=550, floors=NO_FLOORS)
        assert rep.fragments == [0, 1, 2, 3, 4] and rep.bytes >= 499 * 8000 and rep.new_earliest == 499
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            after = [_disk(rcluster, i) for i in range(3)]
            if all(b - a >= 0.8 * rep.bytes for a, b in zip(after, before)):
                break
            await asyncio.sleep(0.25)
        assert all(b - a >= 0.8 * rep.bytes for a, b in zip(after, before)), (before, after, rep.bytes)
        earliest, got = await assert_consistent(client, rcluster, s)
        assert earliest == 499 and len(got) == 101
        await client.close()

    run(go())


class Crash(BaseException):
    """Stands for the process dying at a fault point (nothing catches it)."""


@pytest.mark.parametrize("point", ["marked", "trimmed:first", "trimmed"])
def test_a_crash_after_any_phase_is_finished_by_the_next_run(rcluster, point):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("crash")
        p = await make(client, s, 45)
        meta0, _ = await client.cluster.ledgers.get_ledger(s)
        seen = []

        def fault(where):
            seen.append(where)
            if where == point or (point == "trimmed:first" and where.startswith("trimmed:")):
                raise Crash(where)

        with pytest.raises(Crash):
            await retention.apply(client, s, keep_from=30, floors=NO_FLOORS, _fault=fault)
        meta, _ = await client.cluster.ledgers.get_ledger(s)
        # readers already see the new earliest; the mark says what is left to do
        assert meta.first_fragment_index == 3 and meta.retention[DELETING]["below_entry"] == 30
        assert meta.retention[DELETING]["below_offset"] == 29
        assert meta.term == meta0.term and meta.last_fragment_index == meta0.last_fragment_index
        c = await client.consumer(s, start="earliest")
        assert c.position == 29
        # the next run (any run) finishes the job before evaluating policies
        rep = (await retention.run_retention(client, s, floors=NO_FLOORS)).streams[0]
        assert rep.completed_pending == [0, 1, 2] and rep.fragments == []
        earliest, got = await assert_consistent(client, rcluster, s)
        assert earliest == 29 and [r.offset for r in got] == list(range(29, 45))
        assert await p.append(b"still writing") == 45
        await p.close()
        await client.close()

    run(go())


def test_a_bookie_down_keeps_the_mark_and_the_next_run_trims_it(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("down")
        p = await make(client, s, 35)
        await p.close()
        rcluster.bookies[2].stop()  # SIGTERM: leaves the live set at once
        try:
            c2 = await connect(rcluster.metadata_url)
            rep = await retention.apply(c2, s, keep_from=20, floors=NO_FLOORS)
            assert rep.pending is not None and "bookie-2" in rep.skipped
            meta, _ = await c2.cluster.ledgers.get_ledger(s)
            assert meta.retention[DELETING]["below_entry"] == 20 and meta.first_fragment_index == 2
            await c2.close()
        finally:
            rcluster.start_bookie(2)
        await registered(client, "bookie-2")
        rep = (await retention.run_retention(client, s, floors=NO_FLOORS)).streams[0]
        assert rep.completed_pending == [0, 1] and rep.skipped is None
        earliest, got = await assert_consistent(client, rcluster, s)  # bookie-2 holds nothing below 20
        assert earliest == 19 and len(got) == 16
        await client.close()

    run(go())


def test_dry_run_changes_nothing(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("dry")
        p = await make(client, s, 35, retention_={"keep_from": 30})
        meta, version = await client.cluster.ledgers.get_ledger(s)
        rep = (await retention.run_retention(client, s, dry_run=True, floors=NO_FLOORS)).streams[0]
        assert rep.dry_run and rep.fragments == [0, 1, 2] and rep.new_earliest == 29
        assert await client.cluster.ledgers.get_ledger(s) == (meta, version)
        assert (await bookie_entries(rcluster, meta.ledger_id, 3))["bookie-0"] == [0, 1, 2]
        await p.close()
        await client.close()

    run(go())


def test_floors_are_honoured_and_a_failing_floor_deletes_nothing(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s, s2 = name("floor"), name("floor-off")
        p = await make(client, s, 45, retention_={"keep_from": 40})
        p2 = await make(client, s2, 45, retention_={"keep_from": 40, "respect_consumers": False})
        asked = []

        async def slowest_group(c, meta):
            asked.append(meta.name)
            return 15 if meta.name in (s, s2) else None

        assert "kafka-groups" in [n for n, _ in retention.load_floors()]  # the entry point group is read
        floors = retention.load_floors(extra=[slowest_group], include_entry_points=False)
        rep = (await retention.run_retention(client, s, floors=floors)).streams[0]
        assert rep.fragments == [0] and rep.kept_because == "consumer floor 15" and rep.floors == [15]
        rep2 = (await retention.run_retention(client, s2, floors=floors)).streams[0]
        assert rep2.fragments == [0, 1, 2, 3] and s2 not in asked  # not even asked

        async def broken(c, meta):
            raise ConnectionError("coordinator unreachable")

        meta, version = await client.cluster.ledgers.get_ledger(s)
        rep = (await retention.run_retention(client, s, floors=[("broken", broken)])).streams[0]
        assert rep.fragments == [] and "coordinator unreachable" in rep.skipped
        assert await client.cluster.ledgers.get_ledger(s) == (meta, version)
        for x in (p, p2):
            await x.close()
        await client.close()

    run(go())


def test_retention_does_not_disturb_an_active_producer(rcluster):
    async def go():
        client = await connect(rcluster.metadata_url)
        s = name("active")
        await client.create_stream(s, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=20)
        p = await client.producer(s)
        term = p.term
        acked = []
        stop = asyncio.Event()

        async def produce():
            i = 0
            while not stop.is_set():
                acked.append(await p.append(b"%d" % i))
                i += 1

        task = asyncio.create_task(produce())
        runs = 0
        deadline = time.monotonic() + 20
        while runs < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.15)
            if acked:
                rep = await retention.apply(client, s, keep_from=max(0, acked[-1] - 30), floors=NO_FLOORS)
                runs += 1 if rep.fragments else 0
        stop.set()
        await task
        assert runs == 8
        assert p.term == term and acked == list(range(len(acked)))
        await p.close()  # quiescent first: the last append may still roll the fragment over
        earliest, got = await assert_consistent(client, rcluster, s)
        assert [r.offset for r in got] == list(range(earliest, acked[-1] + 1))
        await client.close()

    run(go())


def cli(cluster, *args, check=True):
    env = dict(os.environ, SCROLL_METADATA=cluster.metadata_url)
    p = subprocess.run([*SCROLL, *args], capture_output=True, env=env, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"scroll {' '.join(args)} failed ({p.returncode}): {p.stderr.decode()}")
    return p


def test_cli_set_show_run(rcluster):
    s = name("cli")

    async def setup():
        client = await connect(rcluster.metadata_url)
        p = await make(client, s, 35)
        await p.close()
        await client.close()

    run(setup())
    out = json.loads(cli(rcluster, "retention", "set", s, "--max-age", "7d", "--max-bytes", "10GiB", "--json").stdout)
    assert out["retention"] == {"max_age_s": 604800.0, "max_bytes": 10 << 30, "respect_consumers": True}
    cli(rcluster, "retention", "set", s, "--clear", "--keep-from", "20", "--ignore-consumers")
    shown = json.loads(cli(rcluster, "retention", "show", s, "--json").stdout)
    assert shown["retention"] == {"keep_from": 20, "respect_consumers": False} and shown["earliest_offset"] == 0
    assert shown["end_offset"] == 35
    dry = json.loads(cli(rcluster, "retention", "run", "--stream", s, "--dry-run", "--json").stdout)
    assert dry["dry_run"] and dry["streams"][0]["fragments"] == [0, 1] and dry["entries"] == 20
    assert dry["records"] == 19 and dry["streams"][0]["new_earliest"] == 19
    human = cli(rcluster, "retention", "run", "--stream", s).stdout.decode()
    assert "removed 2 fragments, 19 records (20 entries)" in human and "retention" in human and "0..18" in human
    assert json.loads(cli(rcluster, "retention", "show", s, "--json").stdout)["earliest_offset"] == 19
    below = cli(rcluster, "consume", s, "--from", "3", check=False)
    assert below.returncode == 1 and b"offset 3 of" in below.stderr and b"the earliest is 19" in below.stderr
    assert cli(rcluster, "consume", s, "--from", "19", "--max", "1").stdout == b"v\n"
    bad = cli(rcluster, "retention", "set", s, "--max-age", "a week", check=False)
    assert bad.returncode == 2 and b"not a duration" in bad.stderr and b"Traceback" not in bad.stderr
    missing = cli(rcluster, "retention", "run", "--stream", "no-such-stream", check=False)
    assert missing.returncode == 1 and b"no stream named" in missing.stderr
