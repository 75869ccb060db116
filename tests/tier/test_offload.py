"""The offload job (streams/tools/tier.py) against real etcd, real bookie processes and a real
SeaweedFS: fragments reach the object store as Kafka segment bodies, a crash at every step
converges, racing offloaders, retention and stream deletion leave exactly the referenced objects,
and a producer and a tailing consumer run on through it all."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from aiokafka.record.default_records import DefaultRecordBatch

from bookie.errors import NoSuchEntryError
from fragments import tier as tp
from streams.client import connect
from streams.tier.objstore import ObjectStore
from streams.tier.segment import verify
from streams.tools import retention, tier
from streams.tools.localcluster import LocalCluster

pytestmark = pytest.mark.process
RELEASE_NOW = {"remote_storage_enable": True, "local_retention_ms": 0}
KEEP_LOCAL = {"remote_storage_enable": True, "local_retention_ms": -1, "local_retention_bytes": -1}


@pytest.fixture(scope="module")
def tcluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("tier"), bookies=3)
    c.start()
    yield c
    c.stop()


_n = [0]


def name(prefix: str) -> str:
    _n[0] += 1
    return f"{prefix}-{os.getpid()}-{_n[0]}"


def run(coro):
    return asyncio.run(coro)


async def setup(tcluster, seaweed, stream, n=60, per_fragment=10, policy=None):
    client = await connect(tcluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
    objects = ObjectStore(seaweed.tier_config())
    await tier.save_tier_config(client.cluster.store, objects.config)
    await client.create_stream(stream, fragment_entries_max=per_fragment, retention=dict(policy or RELEASE_NOW))
    p = await client.producer(stream)
    for i in range(n):
        await p.append_many([(f"value-{i}".encode() * 5, f"k{i}".encode(), None, 1_000_000 + i)])
    await p.flush()
    return client, objects, p


async def fragments(client, stream):
    meta, _ = await client.cluster.ledgers.get_ledger(stream)
    return meta, await client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                        meta.last_fragment_index)


async def objects_of(objects, ledger_id):
    return sorted(k for k, _s, _m in await objects.list(objects.config.key(f"{ledger_id}/")))


async def referenced(client, stream):
    _, frags = await fragments(client, stream)
    return sorted(f.tier["key"] for f in frags if f.tier)


async def bookie_entries(client, ledger_id, f):
    """How many of f's entries its bookies still hold."""
    n = 0
    for b in f.ensemble:
        try:
            r = await client.cluster.client(b).read(ledger_id, f.first_entry_id, f.last_entry_id)
        except NoSuchEntryError:
            continue
        n += len(r.entries)
    return n


def test_sealed_fragments_become_kafka_segment_objects_and_bookie_copies_go(tcluster, seaweed):
    async def go():
        s = name("off")
        client, objects, p = await setup(tcluster, seaweed, s)
        try:
            rep = await tier.run_tier(client, s)
            meta, frags = await fragments(client, s)
            sealed = [f for f in frags if f.sealed]
            assert len(sealed) >= 5 and rep.streams[0].offloaded == [f.index for f in sealed]
            assert all(tp.remote_only(f) and "trimmed" not in f.tier for f in sealed)
            assert not frags[-1].tier  # the open fragment stays on bookies
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)
            values = []
            for f in sealed:
                assert await bookie_entries(client, meta.ledger_id, f) == 0
                obj = await objects.get(f.tier["key"])
                footer = verify(obj)
                assert footer.size == f.tier["size"] and footer.first_offset == f.first_offset
                body = obj[:footer.body_len]  # a Kafka segment body: any Kafka batch parser reads it
                at = 0
                while at < len(body):
                    length = int.from_bytes(body[at + 8:at + 12], "big") + 12
                    batch = DefaultRecordBatch(bytes(body[at:at + length]))
                    assert batch.validate_crc()
                    values.extend(r.value for r in batch)
                    at += length
            assert values == [f"value-{i}".encode() * 5 for i in range(len(values))]
            again = await tier.run_tier(client, s)  # nothing left to do
            assert again.streams[0].offloaded == [] and again.streams[0].released == []
        finally:
            await p.close()
            await client.close()

    run(go())


def test_the_local_policy_keeps_copies_and_dry_run_changes_nothing(tcluster, seaweed):
    async def go():
        s = name("keep")
        client, objects, p = await setup(tcluster, seaweed, s, policy=KEEP_LOCAL)
        try:
            dry = await tier.run_tier(client, s, dry_run=True)
            assert dry.streams[0].to_offload and not dry.streams[0].offloaded
            assert await referenced(client, s) == []
            await tier.run_tier(client, s)
            meta, frags = await fragments(client, s)
            sealed = [f for f in frags if f.sealed]
            assert all(tp.offloaded(f) and tp.local(f) for f in sealed)
            assert all([await bookie_entries(client, meta.ledger_id, f) > 0 for f in sealed])
            # local.retention.bytes: the newest ~2 fragments stay on bookies
            size = sum(f.size_bytes for f in sealed[-2:])
            meta, version = await client.cluster.ledgers.get_ledger(s)
            await client.cluster.ledgers.cas_ledger(
                meta.with_(retention={**meta.retention, "local_retention_bytes": size}), (), version)
            rep = await tier.run_tier(client, s)
            _, frags = await fragments(client, s)
            released = [f.index for f in frags if tp.remote_only(f)]
            assert released == rep.streams[0].released and released == [f.index for f in sealed[:len(released)]]
            assert 0 < len(released) < len(sealed)
        finally:
            await p.close()
            await client.close()

    run(go())


STEPS = ["intent", "put", "offloaded", "released", "trimmed"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_at_any_step_is_resumed_or_undone_and_a_rerun_converges(tcluster, seaweed, step):
    async def go():
        s = name(f"crash-{step}")
        client, objects, p = await setup(tcluster, seaweed, s, n=30)
        try:
            def fault(at, f):
                if at == step:
                    raise Crash(at)

            with pytest.raises(Crash):
                await tier.run_tier(client, s, _fault=fault, now_ms=1_000_000_000_000)
            meta, frags = await fragments(client, s)
            # a later run, after the crashed run's intent expired, finishes the job
            later = 1_000_000_000_000 + int(tier.INTENT_TTL_S * 1000) + 1
            await tier.run_tier(client, s, now_ms=later)
            await tier.run_tier(client, None, now_ms=later + int(tier.GRACE_S * 1000) * 1000, grace_s=0)
            meta, frags = await fragments(client, s)
            sealed = [f for f in frags if f.sealed]
            assert all(tp.remote_only(f) and "trimmed" not in f.tier for f in sealed)
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)
            for f in sealed:
                assert await bookie_entries(client, meta.ledger_id, f) == 0
                verify(await objects.get(f.tier["key"]))
        finally:
            await p.close()
            await client.close()

    run(go())


def test_two_offloaders_racing_leave_exactly_one_object_per_fragment(tcluster, seaweed):
    async def go():
        s = name("race")
        client, objects, p = await setup(tcluster, seaweed, s, n=20, policy=KEEP_LOCAL)
        paused, resume = asyncio.Event(), asyncio.Event()
        try:
            async def hold_after_put(at, f):
                if at == "put" and not paused.is_set():
                    paused.set()
                    await resume.wait()

            # A uploads the first fragment and stops after its PUT; B comes later than A's intent lives
            a = asyncio.create_task(tier.tier_stream(client, objects, s, _fault=hold_after_put))
            await paused.wait()
            later = 10 ** 13
            b = await tier.tier_stream(client, objects, s, now_ms=later)
            assert b.adopted  # B found A's whole object and switched it in
            resume.set()
            await a
            meta, frags = await fragments(client, s)
            assert all(tp.offloaded(f) for f in frags if f.sealed)
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)

            # the other order: A stopped after its intent, before any byte; B redoes it under a new key
            s2 = name("race2")
            await client.create_stream(s2, fragment_entries_max=5, retention=dict(KEEP_LOCAL))
            p2 = await client.producer(s2)
            for i in range(12):
                await p2.append(b"x%d" % i)
            await p2.flush()
            paused.clear()
            resume.clear()

            async def hold_after_intent(at, f):
                if at == "intent" and not paused.is_set():
                    paused.set()
                    await resume.wait()

            a = asyncio.create_task(tier.tier_stream(client, objects, s2, _fault=hold_after_intent))
            await paused.wait()
            b = await tier.tier_stream(client, objects, s2, now_ms=later)
            assert b.offloaded and not b.adopted
            resume.set()
            await a  # A's PUT lands, its switch is refused, it deletes its own object
            meta, frags = await fragments(client, s2)
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s2)
            await p2.close()
        finally:
            resume.set()
            await p.close()
            await client.close()

    run(go())


def test_retention_or_deletion_racing_an_upload_leaves_no_object(tcluster, seaweed):
    async def go():
        s = name("ret-race")
        client, objects, p = await setup(tcluster, seaweed, s, n=30, policy=KEEP_LOCAL)
        paused, resume = asyncio.Event(), asyncio.Event()
        try:
            async def hold(at, f):
                if at == "put" and not paused.is_set():
                    paused.set()
                    await resume.wait()

            meta, _ = await fragments(client, s)
            a = asyncio.create_task(tier.tier_stream(client, objects, s, _fault=hold))
            await paused.wait()
            # retention removes every sealed fragment but the last while the first one's upload waits
            m, version = await client.cluster.ledgers.get_ledger(s)
            await client.cluster.ledgers.cas_ledger(m.with_(retention={**m.retention, "max_bytes": 1}), (), version)
            await retention.run_retention(client, s)
            resume.set()
            await a
            await tier.run_tier(client, s)
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)

            # the stream deleted while an upload waits after its intent: the upload's object goes too
            s2 = name("del-race")
            await client.create_stream(s2, fragment_entries_max=5, retention=dict(KEEP_LOCAL))
            p2 = await client.producer(s2)
            for i in range(12):
                await p2.append(b"y%d" % i)
            await p2.flush()
            await p2.close()
            m2, _ = await fragments(client, s2)
            paused.clear()
            resume.clear()

            async def hold_intent(at, f):
                if at == "intent" and not paused.is_set():
                    paused.set()
                    await resume.wait()

            a = asyncio.create_task(tier.tier_stream(client, objects, s2, _fault=hold_intent))
            await paused.wait()
            await client.delete_stream(s2)
            resume.set()
            with contextlib.suppress(tier.TierIncomplete):  # its entries may be gone before it reads them
                await a
            assert await objects_of(objects, m2.ledger_id) == []
        finally:
            resume.set()
            await p.close()
            await client.close()

    run(go())


def test_the_sweep_deletes_only_unreferenced_objects_after_the_grace(tcluster, seaweed):
    async def go():
        s = name("sweep")
        client, objects, p = await setup(tcluster, seaweed, s, n=20, policy=KEEP_LOCAL)
        try:
            await tier.run_tier(client, s)
            meta, _ = await fragments(client, s)
            stray = objects.config.key(tp.object_name(meta.ledger_id, 0, "deadbeef0000"))
            gone_stream = objects.config.key(tp.object_name(10 ** 9, 3, "abc"))
            await objects.put_if_absent(stray, b"cut upload")
            await objects.put_if_absent(gone_stream, b"deleted stream")
            assert await tier.sweep(client, objects) == []  # young: spared
            swept = await tier.sweep(client, objects, grace_s=0)
            assert sorted(swept) == sorted([stray, gone_stream])
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)
        finally:
            await p.close()
            await client.close()

    run(go())


def test_a_producer_at_full_rate_and_a_tailing_consumer_run_on_while_the_stream_offloads(tcluster, seaweed):
    async def go():
        s = name("live")
        client, objects, p = await setup(tcluster, seaweed, s, n=10, per_fragment=50)
        stop = asyncio.Event()
        written, errors = [], []
        try:
            async def produce():
                i = 10
                while not stop.is_set():
                    try:
                        offs = await p.append_many([(b"live-%d" % (i + k), None, None, None) for k in range(20)])
                        written.extend(offs)
                        i += 20
                    except Exception as exc:  # noqa: BLE001 - any error is the test's failure
                        errors.append(exc)
                        return

            c = await client.consumer(s, "earliest")
            seen = []

            produced = asyncio.Event()  # set once every append has returned: written is final

            async def tail():
                while not produced.is_set() or len(seen) < len(written) + 10:
                    got = await c.read(500, 0.5)
                    seen.extend(r.offset for r in got)

            prod = asyncio.create_task(produce())
            cons = asyncio.create_task(tail())
            passes = 0
            while passes < 4 or len(written) < 4000:
                rep = await tier.run_tier(client, s)
                passes += 1
                assert not rep.streams[0].skipped, rep.streams[0].skipped
            stop.set()
            await prod
            await p.flush()
            produced.set()
            await asyncio.wait_for(cons, 60)
            await c.close()
            assert not errors, errors
            assert seen == list(range(len(seen))) and len(seen) >= 10 + len(written)
            _, frags = await fragments(client, s)
            assert sum(tp.remote_only(f) for f in frags) >= 3
        finally:
            stop.set()
            await p.close()
            await client.close()

    run(go())


def test_with_the_local_policy_at_zero_and_every_bookie_stopped_the_offloaded_prefix_reads_byte_for_byte(
        tcluster, seaweed):
    import signal

    async def go():
        s = name("nobookie")
        client, objects, p = await setup(tcluster, seaweed, s, n=40)
        before = [(r.offset, r.key, r.value, r.timestamp_ms) for r in await _read(client, s, 40)]
        await p.close()
        await tier.run_tier(client, s)
        _, frags = await fragments(client, s)
        prefix_end = max(f.tier["end_offset"] for f in frags if tp.remote_only(f))
        assert prefix_end >= 30
        stopped = [b.popen.pid for b in tcluster.bookies]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            fresh = await connect(tcluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
            try:
                got = await asyncio.wait_for(_read(fresh, s, prefix_end), 60)
            finally:
                await fresh.close()
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        assert [(r.offset, r.key, r.value, r.timestamp_ms) for r in got] == before[:prefix_end]
        await client.close()

    run(go())


async def _read(client, stream, n):
    c = await client.consumer(stream, "earliest")
    out = []
    while len(out) < n:
        out.extend(await c.read(n - len(out), 1.0))
    await c.close()
    return out


def test_a_silent_store_during_an_upload_stops_the_run_in_time_keeps_bookie_copies_and_a_rerun_converges(
        tcluster, seaweed):
    import dataclasses
    import signal
    import time

    async def go():
        s = name("silent")
        client, objects, p = await setup(tcluster, seaweed, s, n=30)
        fast = ObjectStore(dataclasses.replace(seaweed.tier_config(), connect_timeout_s=1.0, request_timeout_s=1.0,
                                               retries=1, retry_timeout_s=2.0))
        try:
            os.kill(seaweed.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                rep = await asyncio.wait_for(tier.run_tier(client, s, objects=fast), 120)
                took = time.monotonic() - t0
            finally:
                os.kill(seaweed.pid, signal.SIGCONT)
            assert rep.streams[0].skipped and took < 4 * fast.config.deadline_s
            meta, frags = await fragments(client, s)
            assert not any(tp.offloaded(f) for f in frags)  # nothing verified: nothing released
            assert all([await bookie_entries(client, meta.ledger_id, f) > 0 for f in frags if f.sealed])
            later = int(time.time() * 1000) + int(tier.INTENT_TTL_S * 1000) + 1
            await tier.run_tier(client, s, objects=objects, now_ms=later)
            await tier.run_tier(client, None, objects=objects, now_ms=later, grace_s=0)
            meta, frags = await fragments(client, s)
            assert all(tp.remote_only(f) for f in frags if f.sealed)
            assert await objects_of(objects, meta.ledger_id) == await referenced(client, s)
        finally:
            await p.close()
            await client.close()

    run(go())


def test_wrong_credentials_or_a_missing_bucket_fail_the_run_fast_without_the_secret(tcluster, seaweed, tmp_path):
    import dataclasses
    import json

    async def go():
        s = name("badcreds")
        client, objects, p = await setup(tcluster, seaweed, s, n=15)
        creds = tmp_path / "wrong.json"
        secret = "wrong-Secret-Never-Printed-42"
        creds.write_text(json.dumps({"access_key_id": "scroll-test", "secret_access_key": secret}))
        try:
            for bad in (dataclasses.replace(seaweed.tier_config(), credentials_file=str(creds)),
                        seaweed.tier_config(bucket="no-such-bucket")):
                rep = await asyncio.wait_for(tier.run_tier(client, s, objects=ObjectStore(bad)), 60)
                why = rep.streams[0].skipped
                assert why and secret not in why and ("bucket" in why.lower() or "denied" in why.lower()
                                                      or "signature" in why.lower() or "403" in why), why
                _, frags = await fragments(client, s)
                assert not any(f.tier for f in frags)  # the failed attempt's intent is withdrawn
        finally:
            await p.close()
            await client.close()

    run(go())


def test_scroll_tier_run_and_status_from_the_command_line(tcluster, seaweed):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def scroll(*args):
        r = subprocess.run([sys.executable, "-m", "streams.tools.cli", *args, "--metadata", tcluster.metadata_url],
                           capture_output=True, text=True, timeout=120, cwd=root,
                           env={**os.environ, "PYTHONPATH": str(root)})
        assert r.returncode == 0, r.stderr
        return r.stdout

    async def make():
        s = name("cli")
        client, objects, p = await setup(tcluster, seaweed, s, n=25)
        await p.close()
        await client.close()
        return s

    s = run(make())
    dry = json.loads(scroll("tier", "run", "--stream", s, "--dry-run", "--json"))
    assert dry["dry_run"] and dry["streams"][0]["to_offload"] and not dry["streams"][0]["offloaded"]
    done = json.loads(scroll("tier", "run", "--stream", s, "--json"))
    assert done["streams"][0]["offloaded"] == dry["streams"][0]["to_offload"] and done["bytes_offloaded"] > 0
    row = json.loads(scroll("tier", "status", "--stream", s, "--json"))[0]
    assert row["remote_only"] == len(done["streams"][0]["offloaded"]) and row["bytes_remote"] > 0
    table = scroll("tier", "status", "--stream", s)
    assert s in table
