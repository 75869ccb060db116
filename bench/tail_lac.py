"""Tail delivery and CPU per append with and without the writer's eager LAC push (issue 26).

One LocalCluster (real etcd + 3 real bookie processes on 127.0.0.1, E=3 WQ=3 AQ=2), one process
holding a producer paced at ``--rate`` appends/s (one ``append_future`` per record, so one entry
each) and a consumer tailing the same stream. Modes alternate round by round on fresh streams of
the same cluster, so every figure has a same-run reference:

* ``idle``: ``ProducerOptions(lac_push_eager=False)``: the LAC reaches the bookies on the next add
  or after ``lac_push_idle_s`` (2 ms) without a send (what main did before the eager push);
* ``eager``: the default: pushed as soon as it advances with no add in flight.

Tail delivery = the consumer's receipt - the producer's acknowledgement (one process, one clock).
CPU per append = this process (producer and consumer) and the three bookies, from /proc, over the
measured window.

    .venv/bin/python bench/tail_lac.py --rate 1000 --seconds 5 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fragments import aioloop  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.driver import ProducerOptions  # noqa: E402
from streams.tools.localcluster import LocalCluster  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_round(client, cluster, name: str, eager: bool, rate: float, warmup: float, seconds: float) -> dict:
    await client.create_stream(name, ensemble=3, write_quorum=3, ack_quorum=2)
    producer = await client.producer(name, ProducerOptions(lac_push_eager=eager))
    consumer = await client.consumer(name, start="latest")
    total = int(rate * (warmup + seconds))
    first = int(rate * warmup)
    acked: dict[int, float] = {}
    sent: dict[int, float] = {}
    got: dict[int, float] = {}
    perf = time.perf_counter

    async def tail() -> None:
        while len(got) < total:
            recs = await consumer.read(1000, timeout_s=2.0)
            now = perf()
            if not recs and len(got) >= len(acked) and len(acked) == total:
                return
            for r in recs:
                got[r.offset] = now

    reader = asyncio.create_task(tail())
    pids = [b.popen.pid for b in cluster.bookies]
    start = perf()
    cpu0 = None
    futs = []
    for i in range(total):
        if i == first:
            cpu0 = (time.process_time(), sum(proc_cpu_s(p) for p in pids))
        delay = start + i / rate - perf()
        if delay > 0:
            await asyncio.sleep(delay)
        t = perf()
        fut = await producer.append_future(b"%d" % i)
        fut.add_done_callback(lambda f, t=t: acked.__setitem__(f.result(), perf()) or sent.__setitem__(f.result(), t))
        futs.append(fut)
    await asyncio.gather(*futs)
    cpu1 = (time.process_time(), sum(proc_cpu_s(p) for p in pids))
    await asyncio.wait_for(reader, 30)
    await consumer.close()
    await producer.close()
    n = total - first
    delays = [(got[o] - acked[o]) * 1e3 for o in acked if o >= first and o in got]
    lat = [(acked[o] - sent[o]) * 1e3 for o in acked if o >= first]
    return {
        "tail_p50": pct(delays, 0.5), "tail_p99": pct(delays, 0.99),
        "append_p50": pct(lat, 0.5), "append_p99": pct(lat, 0.99),
        "cli_us": (cpu1[0] - cpu0[0]) / n * 1e6, "srv_us": (cpu1[1] - cpu0[1]) / n * 1e6,
        "early": sum(1 for o in got if o not in acked),
    }


async def amain(args) -> int:
    base = Path(tempfile.mkdtemp(prefix="tail-lac-"))
    cluster = LocalCluster(base, bookies=3)
    cluster.start()
    try:
        client = await connect(cluster.metadata_url)
        try:
            rows = []
            for r in range(args.rounds):
                for mode in ("idle", "eager"):
                    load = os.getloadavg()[0]
                    res = await one_round(client, cluster, f"tl-{mode}-{r}", mode == "eager", args.rate,
                                          args.warmup, args.seconds)
                    res.update(mode=mode, round=r, load=load)
                    rows.append(res)
                    print(f"round {r} {mode:5s} load {load:4.1f}: tail p50 {res['tail_p50']:.2f} p99 "
                          f"{res['tail_p99']:.2f} ms, append p50 {res['append_p50']:.2f} p99 {res['append_p99']:.2f} "
                          f"ms, CPU/append client {res['cli_us']:.0f} + bookies {res['srv_us']:.0f} us, "
                          f"delivered before ack {res['early']}", flush=True)
            for key in ("tail_p50", "tail_p99", "append_p50", "append_p99", "cli_us", "srv_us"):
                e = sorted(x[key] for x in rows if x["mode"] == "eager")
                i = sorted(x[key] for x in rows if x["mode"] == "idle")
                em, im = statistics.median(e), statistics.median(i)
                print(f"{key:10s} idle {im:8.2f}  eager {em:8.2f}  ratio eager/idle {em / im:5.2f}")
        finally:
            await client.close()
    finally:
        cluster.stop()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    return aioloop.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
