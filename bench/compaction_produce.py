"""The produce cost of a compacted topic: the same keyed records through the Kafka listener to a
``delete`` topic and to a ``compact`` topic, in the same run.

How this works. ``LocalCluster`` starts etcd and three bookie processes; one ``scroll kafka``
listener runs as its own process. Two topics of ``--partitions`` partitions are created, one with
``cleanup.policy=delete`` and one with ``cleanup.policy=compact``. A confluent-kafka producer
(acks=all, linger.ms=5) sends ``--records`` keyed records of ``--value-bytes`` (keys cycle over
``--keys`` distinct ones) to each, alternating delete / compact for ``--rounds`` rounds (so drift of
the machine hits both alike). A produce to a compacted topic decodes each batch (aiokafka's C
parser) to refuse records without a key; a delete topic's batches are stored undecoded. Printed per
topic: records/s (best and median of the rounds), the listener's CPU seconds per 1,000 records (from
/proc), and the ratio compact / delete (goal: compact at most 20% slower).

    .venv/bin/python bench/compaction_produce.py
    .venv/bin/python bench/compaction_produce.py --records 100000 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"listener exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port}")


def produce(bootstrap: str, topic: str, partitions: int, records: int, value_bytes: int, keys: int) -> dict:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                  "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 2_097_151})
    value = os.urandom(value_bytes)
    key_list = [f"key-{i:08d}".encode() for i in range(keys)]
    errors = [0]

    def report(err, msg):
        if err is not None:
            errors[0] += 1

    p.list_topics(topic, timeout=10)
    t0 = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value=value, key=key_list[i % keys], partition=i % partitions, on_delivery=report)
                break
            except BufferError:
                p.poll(0.005)
        if i % 1000 == 0:
            p.poll(0)
    left = p.flush(120)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "records_per_s": records / dt, "errors": errors[0] + left}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-compaction-"))
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    port = free_port()
    log = open(base / "listener.log", "wb")
    shim = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                             "--port", str(port), "--node-id", "0"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    bootstrap = f"127.0.0.1:{port}"
    runs: dict[str, list[dict]] = {"delete": [], "compact": []}
    try:
        wait_port(port, shim)
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": bootstrap})
        for policy in runs:
            admin.create_topics([NewTopic(f"bench-{policy}", args.partitions, 1,
                                          config={"cleanup.policy": policy})])[f"bench-{policy}"].result(timeout=60)
        # warm-up: open every partition (take-overs) and the producer path, not measured
        for policy in runs:
            produce(bootstrap, f"bench-{policy}", args.partitions, 2000, args.value_bytes, args.keys)
        for r in range(args.rounds):
            order = ("delete", "compact") if r % 2 == 0 else ("compact", "delete")
            for policy in order:
                c0 = cpu_s(shim.pid)
                got = produce(bootstrap, f"bench-{policy}", args.partitions, args.records, args.value_bytes, args.keys)
                got["listener_cpu_ms_per_1k"] = (cpu_s(shim.pid) - c0) / args.records * 1e6
                runs[policy].append(got)
                print(f"round {r + 1} {policy:>7}: {got['records_per_s']:>9,.0f} records/s, listener "
                      f"{got['listener_cpu_ms_per_1k']:.1f} ms CPU / 1k records, errors {got['errors']}", flush=True)
    finally:
        shim.terminate()
        try:
            shim.wait(30)
        except subprocess.TimeoutExpired:
            shim.kill()
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)
    summary = {}
    for policy, rs in runs.items():
        rates = [x["records_per_s"] for x in rs]
        summary[policy] = {"best": max(rates), "median": statistics.median(rates),
                           "cpu_ms_per_1k": statistics.median(x["listener_cpu_ms_per_1k"] for x in rs),
                           "errors": sum(x["errors"] for x in rs)}
    ratio = summary["compact"]["median"] / summary["delete"]["median"]
    cpu_ratio = summary["compact"]["cpu_ms_per_1k"] / summary["delete"]["cpu_ms_per_1k"]
    for policy, s in summary.items():
        print(f"{policy:>7}: median {s['median']:>9,.0f} records/s (best {s['best']:,.0f}), listener "
              f"{s['cpu_ms_per_1k']:.1f} ms CPU / 1k records")
    print(f"compact / delete: {ratio:.3f} of the records/s ({(1 - ratio) * 100:+.1f}% slower), listener CPU per "
          f"record x{cpu_ratio:.3f}; goal: at most 20% slower -> {'met' if ratio >= 0.8 else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary,
                                               "ratio": ratio, "cpu_ratio": cpu_ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
