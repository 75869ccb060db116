"""The etcd that ``LocalCluster`` and ``scroll standalone`` start compacts its history: every
compare-and-set leaves a revision behind, and without compaction etcd's db grows until its quota
refuses every write (NOSPACE)."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

from fragments.stores import open_store
from streams.tools.localcluster import LocalCluster


def _compact_revision(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        m = re.search(r"^etcd_debugging_mvcc_compact_revision (\S+)$", r.read().decode(), re.M)
    return int(float(m.group(1))) if m else 0


def test_the_clusters_etcd_compacts_old_revisions_and_watches_go_on(tmp_path):
    c = LocalCluster(tmp_path, bookies=0, etcd_compaction_retention="1s")  # (the default: 1h)
    c.start_etcd()
    try:
        async def body():
            store = await open_store(c.metadata_url)
            try:
                watch = store.watch_prefix("/t/")
                seen: list[bytes] = []

                async def follow():
                    async for ev in watch:
                        seen.append(ev.value)

                follower = asyncio.create_task(follow())  # a live watch across the compactions
                await store.put("/t/k", b"0")
                while not seen:
                    await asyncio.sleep(0.01)
                deadline = time.monotonic() + 60
                n = 0
                while _compact_revision(c.etcd_port) < 5:  # a key rewritten until etcd compacted
                    assert time.monotonic() < deadline, "etcd never compacted its history"
                    n += 1
                    await store.put("/t/k", b"%d" % n)
                    await asyncio.sleep(0.05)  # (pacing the writes; what is awaited is the compaction)
                assert (await store.get("/t/k")).value == b"%d" % n
                await store.put("/t/k", b"after")
                while seen[-1:] != [b"after"]:
                    assert time.monotonic() < deadline, seen[-3:]
                    await asyncio.sleep(0.01)
                assert seen == [b"%d" % i for i in range(n + 1)] + [b"after"]  # none lost, none twice
                follower.cancel()
                await watch.aclose()
            finally:
                await store.close()

        asyncio.run(body())
    finally:
        c.stop()
