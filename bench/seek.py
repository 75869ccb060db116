"""Cost of seeking to a record offset or a timestamp: bookie reads and milliseconds per seek.

A stream of ``--entries`` batches (``--per-batch`` records of 100 B each, one batch per entry) over
``--fragments`` fragments is written once; then a fresh consumer seeks to ``--seeks`` random
offsets (cold: nothing learnt yet, then warm: the same offsets again, answered from the consumer's
``OffsetIndex``) and to as many random timestamps. Reference: log2(entries per fragment), the
reads a binary search over one fragment's entries needs.

Four in-process bookies (real gRPC servers) and the in-memory metadata store, as in
tests/streams/test_inproc.py.

    .venv/bin/python bench/seek.py                     # 20,000 entries, 4 fragments
    .venv/bin/python bench/seek.py --entries 100000 --fragments 10
"""

from __future__ import annotations

import argparse
import asyncio
import math
import pathlib
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from streams.driver import ProducerOptions  # noqa: E402
from tests.streams.test_inproc import start_cluster, stop_cluster  # noqa: E402


async def main(args) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="scroll-seek-"))
    client, servers, regs = await start_cluster(work)
    try:
        per_fragment = math.ceil(args.entries / args.fragments)
        await client.create_stream("s", ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=per_fragment)
        value = b"v" * 100
        size = 61 + args.per_batch * (len(value) + 8)
        p = await client.producer("s", ProducerOptions(batch_bytes=max(1024, size)))
        t0 = time.perf_counter()
        total = args.entries * args.per_batch
        chunk = args.per_batch * 1000
        ts = 1_000_000
        for first in range(0, total, chunk):
            n = min(chunk, total - first)
            await p.append_many([(value, None, None, ts + first + i) for i in range(n)])
        await p.close()
        print(f"wrote {total:,} records in {args.entries:,} entries over {args.fragments} fragments "
              f"({time.perf_counter() - t0:.1f} s)")
        c = await client.consumer("s")
        reads = [0]
        real = c.read_raw

        async def counting(first, last):
            reads[0] += 1
            return await real(first, last)

        c.read_raw = counting
        rng = random.Random(7)
        offsets = [rng.randrange(total) for _ in range(args.seeks)]
        for label, targets in (("offset, cold", offsets), ("offset, warm", offsets)):
            reads[0] = 0
            t0 = time.perf_counter()
            for o in targets:
                await c.seek(o)
            dt = time.perf_counter() - t0
            print(f"seek by {label:<13} {reads[0] / len(targets):5.1f} reads/seek  {dt / len(targets) * 1e3:6.2f} ms/seek")
        reads[0] = 0
        t0 = time.perf_counter()
        for o in offsets:
            assert await c.seek_timestamp(ts + o) == o
        dt = time.perf_counter() - t0
        print(f"seek by {'timestamp':<13} {reads[0] / len(offsets):5.1f} reads/seek  {dt / len(offsets) * 1e3:6.2f} ms/seek")
        print(f"reference: log2(entries per fragment) = {math.log2(per_fragment):.1f}, "
              f"log2(entries) = {math.log2(args.entries):.1f}")
    finally:
        await stop_cluster(client, servers, regs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=20_000)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--per-batch", type=int, default=10)
    ap.add_argument("--seeks", type=int, default=200)
    asyncio.run(main(ap.parse_args()))
