"""Compaction throughput against a plain read + write of the same bytes, and the space it reclaims.

How this works. ``LocalCluster`` starts etcd and three bookie processes. One stream with
``cleanup.policy=compact`` gets ``--mb`` MB of keyed records (``--value-bytes`` values, keys cycling
over ``--keys``) from the native producer; its fragments are ``--fragment-mb`` MB. Then, in the same
run, on the same bytes:

1. **reference**: every sealed fragment's entries are read from the bookies (the compaction job's
   own reader) and written, unchanged, into a fresh ledger per fragment through an ordinary writer
   (replicated to the write quorum, sealed): a plain read + write of the input;
2. **compaction**: one forced pass of ``streams.tools.compaction.compact_stream`` (scan, rewrite,
   write the data ledgers, read them back, switch, trim).

Printed: input MB/s of both, the ratio compaction / reference (goal >= 0.5), and the stream's
stored bytes before and after (per replica), with the records kept.

    .venv/bin/python bench/compaction.py                 # 1 GB, 10,000 keys
    .venv/bin/python bench/compaction.py --mb 200 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fragments.model import LedgerConfig  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.driver import ProducerOptions, WriterDriver  # noqa: E402
from streams.tools import compaction  # noqa: E402
from streams.tools.localcluster import LocalCluster  # noqa: E402

STREAM = "bench-compacted"


async def fill(client, mb: int, value_bytes: int, keys: int, fragment_mb: int) -> int:
    await client.create_stream(STREAM, fragment_bytes_max=fragment_mb << 20,
                               retention={"cleanup_policy": "compact"})
    p = await client.producer(STREAM)
    value = os.urandom(value_bytes)
    key_list = [f"key-{i:08d}".encode() for i in range(keys)]
    n = (mb << 20) // value_bytes
    batch = 1000
    for start in range(0, n, batch):
        await p.append_many([(value, key_list[i % keys], None, None) for i in range(start, min(n, start + batch))])
    await p.close(seal=False)
    return n


async def stored_bytes(client) -> tuple[int, int]:
    info = await client.describe_stream(STREAM)
    sealed = [f for f in info.fragments if f.sealed]
    return sum(f.size_bytes or 0 for f in sealed), len(sealed)


async def reference(client) -> tuple[float, int]:
    """Read every sealed fragment and write it, unchanged, into a ledger of its own."""
    meta, _ = await client.cluster.ledgers.get_ledger(STREAM)
    frags = await client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
    frags = frags[:-1]  # the open fragment is not compacted either
    reader = await compaction._reader(client, meta, frags)
    await client.cluster.refresh_bookies()
    ens = tuple(b.bookie_id for b in client.cluster.live())[:meta.config.write_quorum]
    c = meta.config
    t0 = time.perf_counter()
    nbytes = 0
    for f in frags:
        entries = [e async for e in compaction._entries(reader, f)]
        name = f"bench-copy-{f.index}"
        await client.cluster.ledgers.create_ledger(name, LedgerConfig(c.write_quorum, c.write_quorum, c.ack_quorum,
                                                                      1 << 62, 1 << 62), ens)
        d = WriterDriver(client.cluster, name, ProducerOptions())
        await d.open()
        futs = []
        for e in entries:
            payload = bytes(e.data[1:])
            while not d.can_append(len(payload) + 1):
                await d.wait_for_space()
            futs.append(d.append_nowait(payload))
            nbytes += len(e.data)
        await asyncio.gather(*futs)
        await d.close(seal=True)
    return time.perf_counter() - t0, nbytes


async def run(url: str, args) -> dict:
    client = await connect(url)
    try:
        t0 = time.perf_counter()
        records = await fill(client, args.mb, args.value_bytes, args.keys, args.fragment_mb)
        fill_s = time.perf_counter() - t0
        before, fragments = await stored_bytes(client)
        print(f"filled {records:,} records ({before / 1e6:,.0f} MB in {fragments} sealed fragments) in {fill_s:.1f} s",
              flush=True)
        ref_s, ref_bytes = await reference(client)
        print(f"reference read + write: {ref_bytes / 1e6:,.0f} MB in {ref_s:.1f} s = {ref_bytes / 1e6 / ref_s:,.1f} MB/s",
              flush=True)
        t0 = time.perf_counter()
        rep = await compaction.compact_stream(client, STREAM, force=True)
        comp_s = time.perf_counter() - t0
        after, _ = await stored_bytes(client)
        print(f"compaction: {rep.bytes_in / 1e6:,.0f} MB in {comp_s:.1f} s = {rep.bytes_in / 1e6 / comp_s:,.1f} MB/s; "
              f"records {rep.records_in:,} -> {rep.records_out:,}", flush=True)
        ratio = (rep.bytes_in / comp_s) / (ref_bytes / ref_s)
        print(f"compaction / reference: {ratio:.2f} (goal >= 0.5)")
        print(f"space: {before / 1e6:,.1f} MB -> {after / 1e6:,.2f} MB per replica "
              f"({100 * (1 - after / before):.2f}% reclaimed)")
        return {"mb": args.mb, "keys": args.keys, "records": records, "reference_mb_s": ref_bytes / 1e6 / ref_s,
                "compaction_mb_s": rep.bytes_in / 1e6 / comp_s, "ratio": ratio, "bytes_before": before,
                "bytes_after": after, "records_out": rep.records_out, "compaction_s": comp_s, "reference_s": ref_s}
    finally:
        await client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--fragment-mb", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-compaction-"))
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    try:
        out = asyncio.run(run(cluster.metadata_url, args))
    finally:
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
