"""The compaction policy through the streams API on a real cluster (etcd + bookie processes):
create_stream / create_topic store it, a compacted stream's producer refuses records without a key
(KeyRequired), alter_topic_configs changes it, segment.ms rolls fragments over with no size pressure
(also for a writer that is live when the cap is set), and the retention job removes nothing by age
from a compact stream while it does from a delete one."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from streams.client import connect
from streams.errors import InvalidArgument, KeyRequired
from streams.tools import retention

pytestmark = pytest.mark.process

_n = [0]


def name(prefix: str) -> str:
    _n[0] += 1
    return f"{prefix}-{os.getpid()}-{_n[0]}"


def run(coro):
    return asyncio.run(coro)


def test_create_stream_stores_the_policy_and_refuses_keyless_records(cluster):
    async def go():
        c = await connect(cluster.metadata_url)
        try:
            s = name("compact")
            info = await c.create_stream(s, cleanup_policy="compact", min_compaction_lag_ms=5000,
                                         max_compaction_lag_ms=3_600_000, min_cleanable_dirty_ratio=0.2,
                                         retention={"keep_from": 0})
            assert info.meta.retention == {"keep_from": 0, "cleanup_policy": "compact",
                                           "min_compaction_lag_ms": 5000, "max_compaction_lag_ms": 3_600_000,
                                           "min_cleanable_dirty_ratio": 0.2}
            assert info.meta.config.fragment_age_max_ms == 3_600_000  # the max lag rolls the open fragment
            p = await c.producer(s)
            try:
                assert await p.append(b"v", key=b"k") == 0
                with pytest.raises(KeyRequired):
                    await p.append(b"v")
                with pytest.raises(ValueError):  # KeyRequired is a ValueError too
                    await p.append_many([(b"a", b"k"), b"no key"])
                assert await p.append_many([(b"a", b"k1"), {"value": b"b", "key": b"k2"}]) == [1, 2]
            finally:
                await p.close()
            with pytest.raises(InvalidArgument):
                await c.create_stream(name("bad"), cleanup_policy="shred")
            with pytest.raises(InvalidArgument):
                await c.create_stream(name("bad"), cleanup_policy="compact", min_cleanable_dirty_ratio=2.0)
            # a delete stream takes keyless records as ever
            d = name("delete")
            await c.create_stream(d)
            p = await c.producer(d)
            try:
                assert await p.append(b"v") == 0
            finally:
                await p.close()
        finally:
            await c.close()

    run(go())


def test_create_topic_configs_and_alter(cluster):
    async def go():
        c = await connect(cluster.metadata_url)
        try:
            t = name("topic")
            await c.create_topic(t, 2, {"cleanup.policy": "delete,compact", "segment.ms": "60000",
                                        "segment.bytes": str(2 << 20), "retention.ms": "3600000"})
            for s in (t, f"{t}:1"):
                meta = (await c.describe_stream(s)).meta
                assert meta.retention == {"cleanup_policy": "compact,delete", "max_age_s": 3600.0}
                assert (meta.config.fragment_bytes_max, meta.config.fragment_age_max_ms) == (2 << 20, 60000)
            assert (await c.describe_topic(t)).configs["cleanup.policy"] == "compact,delete"
            got = await c.alter_topic_configs(t, {"cleanup.policy": "compact"}, delete=["segment.ms"])
            assert got.configs == {"cleanup.policy": "compact", "segment.bytes": str(2 << 20),
                                   "retention.ms": "3600000"}
            meta = (await c.describe_stream(f"{t}:1")).meta
            assert meta.retention == {"cleanup_policy": "compact", "max_age_s": 3600.0}
            assert meta.config.fragment_age_max_ms is None
            with pytest.raises(InvalidArgument):
                await c.alter_topic_configs(t, {"min.cleanable.dirty.ratio": "7"})
            with pytest.raises(InvalidArgument):
                await c.create_topic(name("bad"), 1, {"cleanup.policy": "both"})
        finally:
            await c.close()

    run(go())


def test_segment_ms_rolls_fragments_without_size_pressure(cluster):
    async def go():
        c = await connect(cluster.metadata_url)
        try:
            s = name("aged")
            await c.create_topic(s, 1, {"segment.ms": "300"})
            p = await c.producer(s)
            try:
                for i in range(8):  # a few tiny records, far below every size cap
                    await p.append(b"x", key=b"k%d" % i)
                    await asyncio.sleep(0.15)
                await asyncio.sleep(0.5)
                n = len((await c.describe_stream(s)).fragments)
                assert n >= 3, n
                # idle now: the fragment holding nothing new never rolls (no churn)
                await asyncio.sleep(1.0)
                idle = len((await c.describe_stream(s)).fragments)
                await asyncio.sleep(1.0)
                assert len((await c.describe_stream(s)).fragments) == idle
            finally:
                await p.close()
            c2 = await c.consumer(s)
            got = []
            while len(got) < 8:
                got.extend(await c2.read(100, timeout_s=5))
            assert [r.value for r in got] == [b"x"] * 8
        finally:
            await c.close()

    run(go())


def test_segment_ms_set_under_a_live_writer_applies(cluster, monkeypatch):
    import streams.driver

    monkeypatch.setattr(streams.driver, "CAPS_REFRESH_S", 0.2)
    monkeypatch.setattr(streams.driver, "PLACEMENT_REFRESH_S", 0.2)

    async def go():
        c = await connect(cluster.metadata_url)
        try:
            s = name("live")
            await c.create_topic(s, 1)
            p = await c.producer(s)
            try:
                await p.append(b"x", key=b"k")
                assert len((await c.describe_stream(s)).fragments) == 1
                await c.alter_topic_configs(s, {"segment.ms": "200"})
                deadline = time.monotonic() + 10
                while len((await c.describe_stream(s)).fragments) < 2 and time.monotonic() < deadline:
                    await p.append(b"y", key=b"k")
                    await asyncio.sleep(0.1)
                assert len((await c.describe_stream(s)).fragments) >= 2
            finally:
                await p.close()
        finally:
            await c.close()

    run(go())


def test_retention_removes_nothing_by_age_from_a_compact_stream(cluster):
    async def go():
        c = await connect(cluster.metadata_url)
        try:
            out = {}
            for policy in ("compact", "compact,delete"):
                s = name("ret")
                await c.create_stream(s, fragment_entries_max=3, retention={"max_age_s": 0.001},
                                      cleanup_policy=policy)
                p = await c.producer(s)
                for i in range(12):
                    await p.append(b"v", key=b"k%d" % i, timestamp_ms=1000)  # ancient
                await p.flush()
                before = len((await c.describe_stream(s)).fragments)
                rep = await retention.run_retention(c, s, floors=[])
                after = len((await c.describe_stream(s)).fragments)
                await p.close()
                out[policy] = (before, after, rep.streams[0].kept_because)
            before, after, why = out["compact"]
            assert before == after and before >= 4 and "compact" in why
            before, after, _ = out["compact,delete"]
            assert after < before
        finally:
            await c.close()

    run(go())
