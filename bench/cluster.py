"""Throughput on the cluster test's topology: 5 bookies vs 3, and with delay between hosts.

Hosts are network namespaces (tests/cluster/topology.py): 3 etcd members, the bookies on hosts of
their own in racks, 2 Kafka listeners on hosts of their own, and a client host that runs every
load below (so every byte crosses the virtual network). Each case brings a topology up, measures,
and tears it down. Streams and topics are created with E=3 WQ=3 AQ=2 in every case, so "5 vs 3
bookies" is the same replication spread over more hosts.

* python produce: the streams client (async ``Producer.append_future``, pipelined) appends
  ``--records`` records of ``--value-bytes`` to a fresh stream: records/s.
* kafka produce: confluent-kafka (acks=all, linger.ms=5, idempotent) sends ``--records`` records
  to a topic of ``--partitions`` partitions through both listeners: records/s.
* kafka consume: a fresh confluent-kafka consumer (assigned every partition) reads the whole
  topic: records/s from assign() to the last record.

The reference (ratio 1.00) is the first case: 3 bookies, no added delay. Delay: this machine's
kernel has no ``sch_netem`` (CONFIG_NET_SCH_NETEM is not set, no module), so ``tc netem`` cannot
run here. ``--delay-ms D`` instead links every host to the network through VDE (Debian's vde2: one
``vde_switch`` per host holding the host's tap device, plugged into a central ``vde_switch``
through a ``wirefilter -d D/2`` per host, so host to host is D ms one way, as netem's delay on each
host's egress). VDE forwards in user space, so the bench also runs VDE with no delay: the delay's
own cost is the ratio between those two, not against the kernel bridge.

    sudo .venv/bin/python bench/cluster.py                       # 3 vs 5 bookies (kernel bridge)
    sudo .venv/bin/python bench/cluster.py --delay-ms 2          # + VDE 0 ms and VDE 2 ms, 5 bookies
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


# ---------------------------------------------------------------------- loads (run on the client host)
async def py_produce(metadata: str, stream: str, n: int, size: int) -> dict:
    from streams.client import connect

    client = await connect(metadata)
    try:
        await client.create_stream(stream, ensemble=3, write_quorum=3, ack_quorum=2)
        async with await client.producer(stream) as p:
            value = os.urandom(size)
            t0 = time.perf_counter()
            futs = [await p.append_future(value) for _ in range(n)]
            await asyncio.gather(*futs)
            dt = time.perf_counter() - t0
        return {"records": n, "seconds": dt, "records_per_s": n / dt}
    finally:
        await client.close()


def kafka_produce(bootstrap: str, topic: str, n: int, size: int) -> dict:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5, "enable.idempotence": True,
                  "queue.buffering.max.messages": 200_000})
    value = os.urandom(size)
    failed = []
    t0 = time.perf_counter()
    for _ in range(n):
        while True:
            try:
                p.produce(topic, value, on_delivery=lambda err, _m: err and failed.append(err))
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    p.flush(300)
    dt = time.perf_counter() - t0
    return {"records": n, "seconds": dt, "records_per_s": n / dt, "failed": len(failed)}


def kafka_consume(bootstrap: str, topic: str, n: int) -> dict:
    """From assign() (every partition, from the beginning; no group join) to the n-th record."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{time.time_ns()}",
                  "enable.auto.commit": False})
    parts = c.list_topics(topic, timeout=30).topics[topic].partitions
    got = 0
    t0 = time.perf_counter()
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        got += sum(1 for m in c.consume(10_000, 1.0) if m.error() is None)
    dt = time.perf_counter() - t0
    c.close()
    return {"records": got, "seconds": dt, "records_per_s": got / dt}


def load_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what")
    ap.add_argument("--metadata")
    ap.add_argument("--bootstrap")
    ap.add_argument("--name")
    ap.add_argument("--records", type=int)
    ap.add_argument("--value-bytes", type=int)
    a = ap.parse_args(argv)
    if a.what == "py-produce":
        out = asyncio.run(py_produce(a.metadata, a.name, a.records, a.value_bytes))
    elif a.what == "kafka-produce":
        out = kafka_produce(a.bootstrap, a.name, a.records, a.value_bytes)
    else:
        out = kafka_consume(a.bootstrap, a.name, a.records)
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------- one case
def run_case(label: str, bookies: int, delay_ms: float | None, args, base: Path) -> dict:
    from tests.cluster.topology import BOOKIE_RACKS, ScrollCluster

    c = ScrollCluster(base / "".join(ch if ch.isalnum() else "-" for ch in label), prefix=f"scb{os.getpid() % 1000}",
                      bookie_hosts=tuple(BOOKIE_RACKS)[:bookies], listeners=2, vde_delay_ms=delay_ms)
    out: dict = {"case": label, "bookies": bookies, "delay_ms": delay_ms}
    try:
        c.start()
        common = ["--metadata", c.metadata_url, "--bootstrap", c.bootstrap(), "--records", str(args.records),
                  "--value-bytes", str(args.value_bytes)]
        c.scroll("topic", "create", "bench", "--partitions", str(args.partitions), "--ensemble", "3",
                 "--write-quorum", "3", "--ack-quorum", "2")
        for what, name in (("py-produce", "pybench"), ("kafka-produce", "bench"), ("kafka-consume", "bench")):
            r = c.run("c1", [c.python, str(Path(__file__).resolve()), "--load", what, "--name", name, *common],
                      timeout_s=900)
            out[what] = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{label:<28} {what:<14} {out[what]['records_per_s']:9.0f} records/s", flush=True)
    finally:
        c.stop()
        shutil.rmtree(c.base, ignore_errors=True)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        return load_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--delay-ms", type=float, default=None, help="also run 5 bookies through VDE: 0 ms and this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tests.cluster.topology import have_netns

    why = have_netns()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    cases = [("3 bookies", 3, None), ("5 bookies", 5, None)]
    if args.delay_ms is not None:
        if not shutil.which("vde_switch") or not shutil.which("wirefilter"):
            print("--delay-ms needs vde2 (apt-get install vde2): the kernel has no netem", file=sys.stderr)
            return 2
        cases += [("5 bookies, VDE 0 ms", 5, 0.0), (f"5 bookies, VDE {args.delay_ms:g} ms", 5, args.delay_ms)]
    base = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    results: dict = {"args": vars(args), "load_avg_start": os.getloadavg(), "cases": []}
    try:
        for label, bookies, delay in cases:
            results["cases"].append(run_case(label, bookies, delay, args, base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ref = results["cases"][0]
    print(f"\n{'case':<28} {'python produce':>16} {'kafka produce':>16} {'kafka consume':>16}   (ratio to {ref['case']})")
    for case in results["cases"]:
        cells = [f"{case[w]['records_per_s']:8.0f} ({case[w]['records_per_s'] / ref[w]['records_per_s']:.2f})"
                 for w in ("py-produce", "kafka-produce", "kafka-consume")]
        print(f"{case['case']:<28} " + " ".join(f"{c:>16}" for c in cells))
    results["load_avg_end"] = os.getloadavg()
    print(f"load average {results['load_avg_start'][0]:.2f} -> {results['load_avg_end'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
