"""Consumer read rate of a striped stream (E=3 WQ=2) against an unstriped one (E=WQ=3), with the
striped range reads one run at a time (the old behaviour, ``STRIPED_RUNS = 1``) and concurrent.

    .venv/bin/python bench/striped_read.py [--entries 5000]

Four in-process bookies (real gRPC servers) and the in-memory metadata store, as in
tests/streams/test_inproc.py; the figures are entries/s read by ``Consumer.read(1000)``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import streams.consumer as consumer_mod  # noqa: E402
from streams.driver import ProducerOptions  # noqa: E402
from tests.streams.test_inproc import start_cluster, stop_cluster  # noqa: E402


async def main(entries: int) -> None:
    work = pathlib.Path(tempfile.mkdtemp(prefix="scroll-striped-"))
    client, servers, regs = await start_cluster(work)
    try:
        for name, e, wq in (("striped", 3, 2), ("plain", 3, 3)):
            await client.create_stream(name, ensemble=e, write_quorum=wq, ack_quorum=2)
            p = await client.producer(name, ProducerOptions(batch_bytes=1024))  # one 1 KiB record per entry
            await p.append_many([b"x" * 1024] * entries)
            await p.close()
        default = consumer_mod.STRIPED_RUNS
        for runs in (1, default):
            consumer_mod.STRIPED_RUNS = runs
            for name in ("striped", "plain"):
                c = await client.consumer(name)
                t0, n = time.perf_counter(), 0
                while got := await c.read(1000):
                    n += len(got)
                dt = time.perf_counter() - t0
                print(f"striped runs at once={runs:>2}  stream={name:<8} {n} entries in {dt:6.2f} s = {n / dt:8.0f}/s")
        consumer_mod.STRIPED_RUNS = default
    finally:
        await stop_cluster(client, servers, regs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=5000)
    asyncio.run(main(ap.parse_args().entries))
