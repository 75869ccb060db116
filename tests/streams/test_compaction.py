"""The compaction job (streams/tools/compaction.py) against real etcd + real bookie processes:
Kafka's semantics on a stream, crashes at every step, a reader inside a fragment being replaced,
retention composing with it."""

from __future__ import annotations

import asyncio
import os

import pytest

from fragments.compaction import COMPACTION
from streams.client import connect
from streams.errors import DataRemovedError
from streams.tools import compaction, retention
from streams.tools.localcluster import LocalCluster

pytestmark = pytest.mark.process
COMPACT = {"cleanup_policy": "compact", "delete_retention_ms": 0}


@pytest.fixture(scope="module")
def ccluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("compaction"), bookies=3)
    c.start()
    yield c
    c.stop()


_n = [0]


def name(prefix: str) -> str:
    _n[0] += 1
    return f"{prefix}-{os.getpid()}-{_n[0]}"


def run(coro):
    return asyncio.run(coro)


async def keyed(client, stream, n, keys=5, per_fragment=8, policy=None, start=0):
    """n records cycling over ``keys`` keys, one per entry, fragments of ``per_fragment`` entries;
    returns (producer, {key: (offset, value)} of the latest records)."""
    if start == 0:
        await client.create_stream(stream, fragment_entries_max=per_fragment, retention=policy or dict(COMPACT))
    p = await client.producer(stream)
    latest = {}
    for i in range(start, start + n):
        k = f"k{i % keys}".encode()
        v = f"v{i}".encode()
        (off,) = await p.append_many([(v, k, None, None)])
        latest[k] = (off, v)
    await p.flush()
    return p, latest


async def read_all(client, stream, start="earliest"):
    c = await client.consumer(stream, start)
    end = await c.end_position()
    out = []
    while c.position < end:
        out.extend(await c.read(1000, 2.0))
    await c.close()
    return out


async def data_ledgers(client):
    return [m.name for m in await client.cluster.ledgers.list_ledgers() if compaction.is_data_ledger(m.name)]


def test_compaction_keeps_the_latest_record_per_key_at_the_same_offsets(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("kafka-semantics")
        p, latest = await keyed(client, s, 60)
        before = await read_all(client, s)
        rep = await compaction.run_compaction(client, s, force=True, grace_s=0)
        r = rep.streams[0]
        assert r.rewritten_fragments and r.records_out < r.records_in and r.bytes_reclaimed > 0
        after = await read_all(client, s)
        # offsets never change, order is kept, the compacted part has gaps
        old = {x.offset: x for x in before}
        assert all(old[x.offset] == x for x in after)
        assert [x.offset for x in after] == sorted(x.offset for x in after)
        assert len(after) < len(before)
        assert {x.key: (x.offset, x.value) for x in after} == latest
        # the open fragment (the uncompacted head) is read whole
        head = [x for x in before if x.offset >= r.cleaned_to]
        assert [x for x in after if x.offset >= r.cleaned_to] == head
        # a seek to a removed offset lands on the next record that exists; earliest is the log start
        removed = next(o for o in range(r.cleaned_to) if o not in {x.offset for x in after})
        c = await client.consumer(s, removed)
        got = await c.read(1, 2.0)
        assert got[0].offset == min(x.offset for x in after if x.offset > removed)
        await c.close()
        c = await client.consumer(s)
        assert await c.earliest_offset() == 0
        await c.close()
        # an incremental pass starts from the previous output: new values of old keys remove the old ones
        await p.close()
        p, newer = await keyed(client, s, 30, start=60)
        await p.close()
        await compaction.run_compaction(client, s, force=True, grace_s=0)
        again = await read_all(client, s)
        assert {x.key: (x.offset, x.value) for x in again} == newer
        assert len([x for x in again if x.offset < 60]) == 0  # every key was written again since
        # the data ledgers of the first pass were superseded and deleted; only referenced ones remain
        info = await client.describe_stream(s)
        referenced = {f.data_ledger for f in info.fragments if f.data_ledger is not None}
        left = {(await client.cluster.ledgers.get_ledger(n))[0].ledger_id for n in await data_ledgers(client)
                if n.startswith(f"{compaction.DATA_PREFIX}{info.meta.ledger_id:012d}/")}
        assert left == referenced
        assert not info.meta.retention[COMPACTION].get("superseded")
        await client.close()
    run(go())


def test_a_pass_is_due_by_dirty_ratio_and_young_records_wait_for_min_compaction_lag(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("scheduling")
        p, _ = await keyed(client, s, 40, policy={**COMPACT, "min_compaction_lag_ms": 3_600_000})
        await p.close()
        rep = (await compaction.run_compaction(client, s, grace_s=0)).streams[0]
        assert not rep.rewritten_fragments and not rep.cleanable_fragments  # every record is younger than 1 h
        await retention.set_policy(client, s, {"min_compaction_lag_ms": 0, "min_cleanable_dirty_ratio": 0.99})
        rep = (await compaction.run_compaction(client, s, grace_s=0)).streams[0]
        assert rep.cleanable_fragments and rep.dirty_ratio == 1.0 and rep.due  # all dirty: 1.0 > 0.99
        rep = (await compaction.run_compaction(client, s, grace_s=0)).streams[0]
        assert not rep.due  # nothing dirty left
        await client.close()
    run(go())


@pytest.mark.parametrize("step", ["claimed", "written", "switched", "trimmed"])
def test_a_crash_at_any_step_leaves_the_old_or_the_new_view_and_a_rerun_converges(ccluster, step):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name(f"crash-{step}")
        p, latest = await keyed(client, s, 50)
        await p.close()
        before = await read_all(client, s)

        class Crash(Exception):
            pass

        def fault(at):
            if at == step:
                raise Crash(at)

        with pytest.raises(Crash):
            await compaction.compact_stream(client, s, force=True, _fault=fault)
        view = await read_all(client, s)
        assert {x.key: (x.offset, x.value) for x in view} == latest
        assert view == before or len(view) < len(before)  # old view or new, never a mix that lost a latest
        # the crashed pass's claim lapses (here: a claim TTL of 0 on the rerun's clock) and the rerun finishes
        now = None
        meta, _ = await client.cluster.ledgers.get_ledger(s)
        claim = (meta.retention.get(COMPACTION) or {}).get("claim")
        if claim:
            now = claim["until_ms"] + 1
        await compaction.compact_stream(client, s, force=True, now_ms=now)
        after = await read_all(client, s)
        assert {x.key: (x.offset, x.value) for x in after} == latest and len(after) < len(before)
        await compaction.sweep(client, grace_s=0)
        info = await client.describe_stream(s)
        referenced = {f.data_ledger for f in info.fragments if f.data_ledger is not None}
        mine = [n for n in await data_ledgers(client) if n.startswith(f"{compaction.DATA_PREFIX}{info.meta.ledger_id:012d}/")]
        ids = {(await client.cluster.ledgers.get_ledger(n))[0].ledger_id for n in mine}
        assert ids == referenced  # no orphan left
        assert not (info.meta.retention.get(COMPACTION) or {}).get("superseded")
        await client.close()
    run(go())


def test_a_reader_inside_a_fragment_being_replaced_skips_and_repeats_nothing(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("paused-reader")
        p, latest = await keyed(client, s, 48, keys=4)
        await p.close()
        c = await client.consumer(s, 0, max_read_entries=2, read_ahead=False)
        first = await c.read(3, 2.0)  # the reader stands inside fragment 0 (its copies still the originals)
        assert [x.offset for x in first] == [0, 1, 2]
        await compaction.compact_stream(client, s, force=True)  # switch + trim of the originals, meanwhile
        end = await c.end_position()
        rest = []
        while c.position < end:
            rest.extend(await c.read(100, 2.0))
        await c.close()
        offsets = [x.offset for x in first + rest]
        assert offsets == sorted(set(offsets))  # nothing repeated, order kept
        surviving = {x.offset for x in await read_all(client, s)}
        assert surviving - {x.offset for x in rest} <= {0, 1, 2}  # nothing surviving skipped
        assert {x.key: (x.offset, x.value) for x in first + rest} == latest
        await client.close()
    run(go())


def test_retention_and_compaction_compose_and_removed_compacted_fragments_take_their_data(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("compose")
        p, latest = await keyed(client, s, 60, policy={**COMPACT, "cleanup_policy": "compact,delete"})
        await p.close()
        await compaction.run_compaction(client, s, force=True, grace_s=0)
        info = await client.describe_stream(s)
        gone = [f for f in info.fragments[:3]]
        assert all(f.data_ledger is not None for f in gone)
        keep_from = info.fragments[3].first_offset
        await retention.apply(client, s, keep_from, floors=[])
        info = await client.describe_stream(s)
        assert info.fragments[0].first_offset == keep_from  # the log start moved forward
        names = await data_ledgers(client)
        ids = {(await client.cluster.ledgers.get_ledger(n))[0].ledger_id for n in names}
        assert not ids & {f.data_ledger for f in gone}  # their data ledgers were deleted with them
        c = await client.consumer(s, keep_from)
        with pytest.raises(DataRemovedError):
            await c.seek(0)
        await c.close()
        after = await read_all(client, s)
        assert {x.key: (x.offset, x.value) for x in after} == {k: v for k, v in latest.items() if v[0] >= keep_from}
        # compaction after retention: the log start stays where retention put it
        await compaction.run_compaction(client, s, force=True, grace_s=0)
        assert (await client.describe_stream(s)).fragments[0].first_offset == keep_from
        await client.close()
    run(go())


def test_a_fragment_left_as_it_was_keeps_its_entries_when_later_ones_are_replaced(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("unchanged-first")
        await client.create_stream(s, fragment_entries_max=8, retention=dict(COMPACT))
        p = await client.producer(s)
        for i in range(7):  # fragment 0: the take-over's no-op and 7 keys written once: nothing to remove
            await p.append_many([(b"once", f"u{i}".encode(), None, None)])
        for i in range(30):  # then one key over and over
            await p.append_many([(f"v{i}".encode(), b"k", None, None)])
        await p.close()
        rep = (await compaction.run_compaction(client, s, force=True, grace_s=0)).streams[0]
        assert 0 not in rep.rewritten_fragments and rep.rewritten_fragments
        info = await client.describe_stream(s)
        assert info.fragments[0].data_ledger is None  # still the stream's own entries ...
        got = await read_all(client, s)
        assert [x.key for x in got[:7]] == [f"u{i}".encode() for i in range(7)]  # ... and they were not trimmed
        assert got[-1].value == b"v29"
        await client.close()
    run(go())


def test_a_pass_whose_claim_lapsed_before_its_switch_switches_nothing(ccluster):
    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("lapsed")
        p, latest = await keyed(client, s, 40)
        await p.close()
        before = await read_all(client, s)
        ledgers = client.cluster.ledgers
        lapse = asyncio.Event()

        def fault(step):
            if step == "written":
                lapse.set()

        async def expire():  # the pass is stopped at "written" while its claim runs out
            def edit(_meta, state):
                state["claim"] = {**state["claim"], "until_ms": 0}
                return True
            await compaction._edit_state(ledgers, (await ledgers.get_ledger(s))[0].ledger_id, edit)

        orig = compaction._switch

        async def switch_after_lapse(*a, **kw):
            assert lapse.is_set()
            await expire()
            return await orig(*a, **kw)

        compaction._switch = switch_after_lapse
        try:
            with pytest.raises(compaction.CompactionIncomplete, match="lapsed"):
                await compaction.compact_stream(client, s, force=True, _fault=fault)
        finally:
            compaction._switch = orig
        assert await read_all(client, s) == before  # the old view, whole
        info = await client.describe_stream(s)
        assert all(f.data_ledger is None for f in info.fragments)
        mine = [n for n in await data_ledgers(client)
                if n.startswith(f"{compaction.DATA_PREFIX}{info.meta.ledger_id:012d}/")]
        assert mine == []  # its unused data ledgers were deleted
        await client.close()
    run(go())


def test_a_crash_between_two_switch_chunks_leaves_a_readable_prefix_and_a_rerun_converges(ccluster, monkeypatch):
    async def go():
        monkeypatch.setattr(compaction, "_SWITCH_BATCH", 2)
        client = await connect(ccluster.metadata_url)
        s = name("chunks")
        p, latest = await keyed(client, s, 60)
        await p.close()

        class Crash(Exception):
            pass

        def fault(step):
            if step == "switched a chunk":
                raise Crash(step)

        with pytest.raises(Crash):
            await compaction.compact_stream(client, s, force=True, _fault=fault)
        info = await client.describe_stream(s)
        assert [f.data_ledger is not None for f in info.fragments[:3]] == [True, True, False]  # one chunk in
        assert {x.key: (x.offset, x.value) for x in await read_all(client, s)} == latest
        mine = [n for n in await data_ledgers(client)
                if n.startswith(f"{compaction.DATA_PREFIX}{info.meta.ledger_id:012d}/")]
        assert len(mine) == 2  # the switched chunk's; the others were deleted when the pass failed
        meta, _ = await client.cluster.ledgers.get_ledger(s)
        claim = meta.retention[COMPACTION].get("claim")  # released unless the process died
        await compaction.compact_stream(client, s, force=True, now_ms=claim["until_ms"] + 1 if claim else None)
        after = await read_all(client, s)
        assert {x.key: (x.offset, x.value) for x in after} == latest
        await client.close()
    run(go())


def test_check_and_fix_see_a_compacted_fragments_copies_in_its_data_ledger(ccluster):
    """``scroll check`` counts a compacted fragment's copies where they live, and ``--fix`` puts a
    lost copy back there (not under the stream's own ledger id)."""
    from bookie.client import BookieClient
    from streams.tools import admin

    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("check-fix")
        p, latest = await keyed(client, s, 30)
        await p.close()
        await compaction.compact_stream(client, s, force=True)
        assert await admin.check(client, stream=s) == []  # every copy found, in the data ledgers
        f = (await client.describe_stream(s)).fragments[0]
        victim = f.ensemble[0]
        port = ccluster.bookie_ports[int(victim.rsplit("-", 1)[1])]
        async with BookieClient(f"127.0.0.1:{port}") as bc:
            await bc.delete_ledger(f.data_ledger)  # one replica of fragment 0's data lost
        (rep,) = await admin.check(client, stream=s)
        assert rep["fragment"] == f.index and rep["under_replicated"] == f.last_entry_id - f.first_entry_id + 1
        (fixed,) = await admin.check(client, fix=True, stream=s)
        assert fixed["copied"] == rep["under_replicated"] and not fixed.get("error"), fixed
        assert await admin.check(client, stream=s) == []
        async with BookieClient(f"127.0.0.1:{port}") as bc:
            r = await bc.read(f.data_ledger, f.data_first_entry, f.data_first_entry)
            assert r.entries  # the copy is back in the data ledger on that bookie
        assert {x.key: (x.offset, x.value) for x in await read_all(client, s)} == latest
        await client.close()
    run(go())


def test_the_sweep_deletes_a_dead_passs_data_ledgers_only_after_the_grace_and_its_claim(ccluster):
    """A pass that died after writing leaves data ledgers nothing references: the sweep keeps them
    while younger than the grace or while their pass holds the stream's claim, then deletes them."""
    import time as _time

    async def go():
        client = await connect(ccluster.metadata_url)
        s = name("sweep")
        p, _ = await keyed(client, s, 20)
        await p.close()
        meta, _ = await client.cluster.ledgers.get_ledger(s)
        f = (await client.describe_stream(s)).fragments[0]
        reader = await compaction._reader(client, meta, [f])
        entries = [e.data async for e in compaction._entries(reader, f)]
        made = int(_time.time() * 1000)
        orphan = await compaction._write_data_ledger(client, meta, f, entries, made, "deadpass")  # then it "died"
        names = [n for n in await data_ledgers(client) if "-deadpass-" in n]
        assert len(names) == 1
        assert await compaction.sweep(client, grace_s=3600) == []  # younger than the grace
        claimed = await compaction._claim(client.cluster.ledgers, meta.ledger_id, "deadpass", made, 3600)
        assert claimed is not None
        assert await compaction.sweep(client, grace_s=0) == []  # its pass still holds the claim
        await compaction._release(client.cluster.ledgers, meta.ledger_id, "deadpass")
        report = await compaction.run_compaction(client, grace_s=0)
        assert names[0] in report.swept
        assert [n for n in await data_ledgers(client) if "-deadpass-" in n] == []
        from bookie.client import BookieClient
        from bookie.errors import NoSuchEntryError, NoSuchLedgerError
        for b in orphan.ensemble:  # and its entries are gone from its bookies
            port = ccluster.bookie_ports[int(b.rsplit("-", 1)[1])]
            async with BookieClient(f"127.0.0.1:{port}") as bc:
                with pytest.raises((NoSuchEntryError, NoSuchLedgerError)):
                    await bc.read(orphan.data_ledger, orphan.data_first_entry, orphan.data_first_entry)
        await client.close()
    run(go())
