"""``scroll standalone`` at rest (issue 26): its periodic work must not read the metadata store in
proportion to what is stored. Its loop (gauges, retention, compaction) runs with short intervals
against the session's real etcd, and etcd's own request counters (/metrics) are read around an
idle window that holds the same number of job runs, first with N streams, then with 5N."""

from __future__ import annotations

import asyncio
import re
import urllib.request
import uuid

from fragments.model import Fragment, LedgerConfig
from streams.client import connect
from streams.tools.localcluster import free_port
from streams.tools.standalone import Standalone, StandaloneConfig

N = 30
RUNS = 6  # job runs of each kind in a measured window
RETENTION = {"max_age_s": 604800}  # what a Kafka topic gets (retention.ms 7 days)


def _etcd_requests(cluster) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.etcd_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _standalone(cluster, tmp_path) -> Standalone:
    sa = Standalone(StandaloneConfig(data_dir=tmp_path, etcd_port=cluster.etcd_port, metrics_port=free_port(),
                                     object_store=False, autorecovery=False, restart_children=False,
                                     retention_interval_s=0.2, compaction_interval_s=0.2))
    sa.start_metrics()
    return sa


def _runs(sa: Standalone) -> float:
    reg = sa._registry
    return min(reg.get_sample_value("scroll_retention_runs_total", {"outcome": "ok"}) or 0,
               reg.get_sample_value("scroll_compaction_runs_total", {"outcome": "ok"}) or 0)


async def _wait(cond, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _create(client, prefix: str, first: int, n: int) -> None:
    ledgers = client.cluster.ledgers
    for i in range(first, first + n):
        await ledgers.create_ledger(f"{prefix}-{i}", LedgerConfig(1, 1, 1), ("bookie-x",), retention=RETENTION)


async def _window(cluster, sa: Standalone) -> dict[str, float]:
    """etcd requests while each job runs RUNS more times (after two runs to settle)."""
    start = _runs(sa)
    await _wait(lambda: _runs(sa) >= start + 2, what="the jobs to run")
    before, start = _etcd_requests(cluster), _runs(sa)
    await _wait(lambda: _runs(sa) >= start + RUNS, what="the jobs to run")
    after = _etcd_requests(cluster)
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_idle_metadata_reads_do_not_grow_with_streams(cluster, tmp_path):
    async def main():
        client = await connect(cluster.metadata_url)
        sa = _standalone(cluster, tmp_path)
        stop = asyncio.Event()
        prefix = f"idle-{uuid.uuid4().hex[:8]}"
        try:
            await _create(client, prefix, 0, N)
            loop = asyncio.create_task(sa.run_forever(stop))
            few = await _window(cluster, sa)
            await _create(client, prefix, N, 4 * N)
            many = await _window(cluster, sa)
        finally:
            stop.set()
            if "loop" in locals():
                await loop
            sa.stop()  # its metrics endpoint (nothing else of it was started)
            await client.close()
        for method in ("Range", "Txn"):
            # the same job runs over 5x the streams: no more reads or transactions (a little slack
            # for the session's bookies and the bookie gauge's 10 s listing)
            assert many.get(method, 0) <= few.get(method, 0) + 10, (method, few.get(method), many.get(method))

    asyncio.run(main())


def test_stream_gauges_follow_the_metadata_store(cluster, tmp_path):
    """scroll_streams and scroll_stream_bytes follow creations, sealed fragments and deletions
    (from the catalog's watch, not a 10 s listing)."""

    async def main():
        client = await connect(cluster.metadata_url)
        sa = _standalone(cluster, tmp_path)
        stop = asyncio.Event()
        name = f"gauge-{uuid.uuid4().hex[:8]}"
        reg = sa._registry

        def stream_bytes():
            return reg.get_sample_value("scroll_stream_bytes", {"stream": name})

        try:
            loop = asyncio.create_task(sa.run_forever(stop))
            await _wait(lambda: _runs(sa) >= 1, what="the loop to start")
            streams = reg.get_sample_value("scroll_streams")
            ledgers = client.cluster.ledgers
            meta, version = await ledgers.create_ledger(name, LedgerConfig(1, 1, 1), ("bookie-x",))
            await _wait(lambda: stream_bytes() == 0, timeout_s=5, what="the new stream's gauge")
            assert reg.get_sample_value("scroll_streams") == streams + 1
            # a writer seals fragment 0 (1234 bytes) and opens fragment 1
            sealed = Fragment(0, 0, ("bookie-x",), 0, last_entry_id=9, size_bytes=1234, first_offset=0)
            opened = Fragment(1, 10, ("bookie-x",), 0, first_offset=10)
            assert await ledgers.cas_ledger(meta.with_(last_fragment_index=1), (sealed, opened), version)
            await _wait(lambda: stream_bytes() == 1234, timeout_s=5, what="the sealed fragment's bytes")
            await ledgers.delete_ledger(name)
            await _wait(lambda: stream_bytes() is None, timeout_s=5, what="the deleted stream's gauge to go")
            assert reg.get_sample_value("scroll_streams") == streams
        finally:
            stop.set()
            if "loop" in locals():
                await loop
            sa.stop()
            await client.close()

    asyncio.run(main())


def test_catalog_lists_again_when_its_watch_revision_was_compacted(cluster):
    """etcd compacts the revision the catalog's watch starts from (between its listing and the
    watch's creation, held there deterministically): the catalog lists again and misses nothing,
    instead of watching "from now" without the changes in between."""
    from fragments.ledgers import LedgerStore
    from streams.catalog import StreamCatalog

    class CompactedBeforeWatching:
        """The real store; its first listing is followed, before the watch starts, by a new stream
        and a compaction of etcd's history up to now."""

        def __init__(self, store, name):
            self._store, self._name, self.compacted = store, name, False

        def __getattr__(self, attr):
            return getattr(self._store, attr)

        async def list_and_watch(self, prefix):
            items, watch = await self._store.list_and_watch(prefix)
            if not self.compacted:
                self.compacted = True
                await LedgerStore(self._store).create_ledger(self._name, LedgerConfig(1, 1, 1), ("bookie-x",))
                await self._store._client.compact(await self._store.ping())
            return items, watch

    async def main():
        client = await connect(cluster.metadata_url)
        name = f"compacted-{uuid.uuid4().hex[:8]}"
        catalog = StreamCatalog(CompactedBeforeWatching(client.cluster.store, name))
        try:
            await catalog.start()
            assert name not in {m.name for m in catalog.streams()}  # created after the first listing
            await _wait(lambda: name in {m.name for m in catalog.streams()}, timeout_s=10,
                        what="the catalog to list again")
            assert catalog.relists == 1
        finally:
            await catalog.close()
            await client.close()

    asyncio.run(main())
