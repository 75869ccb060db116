"""Transactional produce throughput through the Kafka listener, against idempotent produce in the
same run, over a real Scroll cluster (etcd + 3 bookies, E=3 WQ=3 AQ=2) and one `scroll kafka`
listener process.

How this works. On a fresh topic of ``--partitions`` partitions, confluent-kafka (acks=all,
linger.ms=5, ``--value-bytes`` values, keys spread over the partitions):

* idempotent: ``enable.idempotence`` producer, ``--records`` records as fast as it can;
* transactional: a ``transactional.id`` producer, the same number of records in transactions of
  ``--per-txn`` records each (begin, produce, commit_transaction — which waits for the markers), one
  run per size given (comma-separated); commit latency is commit_transaction's wall time;
* a read_committed consumer then reads the whole topic and checks it got every record of both
  phases (control records are skipped; aborted ones there are none).

Printed: records/s of each phase, the transactional/idempotent ratio of this run, commit latency
p50/p99 and the listener's CPU per record (from /proc; also less the listener's idle CPU over the
phase, measured for 3 s with the partitions open and no traffic: a slow phase pays more of it).

    .venv/bin/python bench/kafka_txn.py                       # 100k records, 100 and 1000 per txn
    .venv/bin/python bench/kafka_txn.py --records 50000 --per-txn 100 --json /tmp/txn.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def idempotent(bootstrap: str, topic: str, records: int, value: bytes) -> dict:
    from confluent_kafka import Producer

    errors = []
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5})
    t0 = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value, key=b"%d" % i,
                          on_delivery=lambda err, _m: errors.append(err) if err else None)
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    assert p.flush(120) == 0
    dt = time.perf_counter() - t0
    return {"records": records, "seconds": dt, "records_per_s": records / dt, "errors": len(errors)}


def transactional(bootstrap: str, topic: str, records: int, per_txn: int, value: bytes, txn_id: str) -> dict:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "acks": "all", "linger.ms": 5})
    p.init_transactions(30)
    commits = []
    t0 = time.perf_counter()
    sent = 0
    while sent < records:
        n = min(per_txn, records - sent)
        p.begin_transaction()
        for i in range(sent, sent + n):
            while True:
                try:
                    p.produce(topic, value, key=b"%d" % i)
                    break
                except BufferError:
                    p.poll(0.01)
        c0 = time.perf_counter()
        p.commit_transaction(60)
        commits.append((time.perf_counter() - c0) * 1000)
        sent += n
    dt = time.perf_counter() - t0
    return {"records": records, "per_txn": per_txn, "transactions": len(commits), "seconds": dt,
            "records_per_s": records / dt, "txns_per_s": len(commits) / dt,
            "commit_p50_ms": pct(commits, 0.5), "commit_p99_ms": pct(commits, 0.99)}


def read_committed_count(bootstrap: str, topic: str, partitions: int, expect: int) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-txn-check", "enable.auto.commit": False,
                  "isolation.level": "read_committed", "fetch.wait.max.ms": 50})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + 300
    while got < expect and time.monotonic() < deadline:
        got += sum(1 for m in c.consume(10_000, timeout=0.5) if m.error() is None)
    dt = time.perf_counter() - t0
    got += sum(1 for m in c.consume(10_000, timeout=1.0) if m.error() is None)  # nothing more expected
    c.close()
    return {"received": got, "expected": expect, "records_per_s": got / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000, help="records per phase")
    ap.add_argument("--per-txn", default="100,1000", help="records per transaction (comma-separated sizes)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="cluster directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--profile", action="store_true", help="py-spy the listener during the transactional phases")
    ap.add_argument("--py-spy", default="py-spy")
    args = ap.parse_args()
    sizes = [int(x) for x in args.per_txn.split(",") if x]

    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-kafka-txn-"))
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    port = free_port()
    log = open(base / "shim.log", "wb")
    shim = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                             "--port", str(port), "--node-id", "0"], stdout=log, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    results: dict = {"args": vars(args), "load_avg_start": os.getloadavg()}
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        from confluent_kafka.admin import AdminClient, NewTopic

        topic = "bench-txn"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=args.partitions, replication_factor=1)])[topic].result(
            timeout=30)
        value = os.urandom(args.value_bytes)
        idempotent(bootstrap, topic, min(5000, args.records), value)  # warm-up: partitions open
        warm = min(5000, args.records)
        c0, t0 = cpu_s(shim.pid), time.monotonic()
        time.sleep(3.0)  # the listener's CPU with the partitions open and no traffic (timers)
        idle = (cpu_s(shim.pid) - c0) / (time.monotonic() - t0)
        results["listener_idle_cpu_pct"] = idle * 100
        print(f"listener idle: {idle * 100:.1f}% of a core", flush=True)

        c0 = cpu_s(shim.pid)
        results["idempotent"] = idem = idempotent(bootstrap, topic, args.records, value)
        idem["shim_cpu_us_per_record"] = (cpu_s(shim.pid) - c0) / args.records * 1e6
        print(f"idempotent: {idem['records_per_s']:,.0f} records/s ({args.records} records, "
              f"{args.value_bytes} B, {args.partitions} partitions), listener CPU "
              f"{idem['shim_cpu_us_per_record']:.1f} µs/record, errors {idem['errors']}", flush=True)
        results["transactional"] = []
        for n in sizes:
            spy = None
            if args.profile:
                spy = subprocess.Popen([args.py_spy, "record", "-p", str(shim.pid), "-f", "raw", "-o",
                                        str(base / f"listener-txn-{n}.txt"), "--nonblocking", "-r", "100"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            c0 = cpu_s(shim.pid)
            tx = transactional(bootstrap, topic, args.records, n, value, f"bench-txn-{n}")
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
                print(f"profile: {base / f'listener-txn-{n}.txt'}", flush=True)
            tx["shim_cpu_us_per_record"] = (cpu_s(shim.pid) - c0) / args.records * 1e6
            tx["shim_cpu_us_per_record_less_idle"] = tx["shim_cpu_us_per_record"] - idle * tx["seconds"] / args.records * 1e6
            tx["ratio_to_idempotent"] = tx["records_per_s"] / idem["records_per_s"]
            results["transactional"].append(tx)
            print(f"transactional, {n} records/txn: {tx['records_per_s']:,.0f} records/s "
                  f"({tx['ratio_to_idempotent']:.2f}x idempotent), {tx['txns_per_s']:,.1f} txn/s, commit p50 "
                  f"{tx['commit_p50_ms']:.1f} ms p99 {tx['commit_p99_ms']:.1f} ms, listener CPU "
                  f"{tx['shim_cpu_us_per_record']:.1f} µs/record ({tx['shim_cpu_us_per_record_less_idle']:.1f} "
                  "less idle)", flush=True)
        expect = warm + args.records * (1 + len(sizes))
        results["read_committed"] = rc = read_committed_count(bootstrap, topic, args.partitions, expect)
        print(f"read_committed consume: {rc['received']} of {rc['expected']} records, "
              f"{rc['records_per_s']:,.0f} records/s", flush=True)
        results["load_avg_end"] = os.getloadavg()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0 if rc["received"] == rc["expected"] else 1
    finally:
        shim.terminate()
        try:
            shim.wait(15)
        except subprocess.TimeoutExpired:
            shim.kill()
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)  # the data; logs and profiles stay


if __name__ == "__main__":
    sys.exit(main())
