"""Client CPU per append of the streams producer, pipelined: 1 KiB raw entries, E=3 WQ=3 AQ=2, over
a LocalCluster (etcd + 3 bookie processes on 127.0.0.1). Prints appends/s and client CPU µs per
append for each round (CPU time of this process only: the bookies are other processes).

    .venv/bin/python bench/append_cpu.py [--appends 20000] [--rounds 3]

Used for the driver's per-bookie coalescing of adds (docs/benchmarks.md, "End to end").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from streams.client import connect  # noqa: E402
from streams.tools.localcluster import LocalCluster  # noqa: E402


async def run(url: str, appends: int, rounds: int) -> None:
    client = await connect(url)
    try:
        payload = b"\x00" + os.urandom(1024)
        for r in range(rounds):
            name = f"append-cpu-{r}"
            await client.create_stream(name, 3, 3, 2)
            p = await client.producer(name)
            futs = []
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(appends):
                futs.append(await p.append_raw(payload))
                if len(futs) >= 2000:
                    await asyncio.gather(*futs)
                    futs.clear()
            await asyncio.gather(*futs)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"round {r + 1}: {appends / dt:,.0f} appends/s, {cpu / appends * 1e6:.0f} µs client CPU per append")
            await p.close()
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cluster = LocalCluster(tempfile.mkdtemp(prefix="bench-append-cpu-"), bookies=3)
    cluster.start()
    try:
        asyncio.run(run(cluster.metadata_url, args.appends, args.rounds))
    finally:
        cluster.stop()
        shutil.rmtree(cluster.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
