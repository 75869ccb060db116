"""Fetch CPU with many partitions: incremental fetch sessions (KIP-227) on and off, in one run.

How this works. ``LocalCluster`` starts etcd and three bookies; for each mode a ``scroll kafka``
listener runs as its own process (``--no-fetch-sessions`` for "off", the old behaviour: every fetch
names and answers every partition). A topic of ``--partitions`` partitions is written once per
partition (so every partition is open and writable), then a kafka-python consumer (its fetcher uses
KIP-227 sessions when the broker grants one) is assigned every partition and consumes:

* idle: no new records for ``--seconds``;
* trickle: a producer (another process, linger 100 ms) writes ``--rate`` records/s spread over the
  partitions.

For each phase: the listener's and the bookies' CPU (from /proc) as a percentage of one core,
fetch requests per second (the consumer's own fetch-rate metric, a windowed estimate), and records
received. The same-run ratio is sessions-on CPU / sessions-off CPU. Then, on the sessions-on listener,
raw fetches isolate the cost of one fetch: back-to-back Fetch requests (max wait 0) for every
partition at its end, sessionless full fetches versus one session's incremental fetches (nothing
changed: nothing named, nothing answered): fetches/s and listener CPU per fetch, and their ratio.

    .venv/bin/python bench/kafka_fetch.py                      # 100 partitions, 10 s phases
    .venv/bin/python bench/kafka_fetch.py --partitions 200 --json bench/results/kafka-fetch.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/kafka.py would shadow the kafka (kafka-python) package: this directory is not a source of imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trickle(bootstrap: str, topic: str, partitions: int, rate: float, seconds: float) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 100})
    start, n = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        due = int((time.monotonic() - start) * rate)
        while n < due:
            p.produce(topic, value=b"x" * 100, partition=n % partitions)
            n += 1
        p.poll(0)
        time.sleep(0.005)
    p.flush(30)


def run_mode(cluster: LocalCluster, base: Path, sessions: bool, args) -> dict:
    port = free_port()
    log = open(base / f"shim-{'on' if sessions else 'off'}.log", "wb")
    argv = [sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url, "--port",
            str(port), "--node-id", "0"]
    if not sessions:
        argv.append("--no-fetch-sessions")
    shim = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    out: dict = {}
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        from confluent_kafka import Producer
        from confluent_kafka.admin import AdminClient, NewTopic
        from kafka import KafkaConsumer, TopicPartition

        topic = f"fetch-{'on' if sessions else 'off'}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=args.partitions, replication_factor=1)])[topic].result(
            timeout=60)
        p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        for i in range(args.partitions):
            p.produce(topic, value=b"open", partition=i)
        assert p.flush(120) == 0
        c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                          fetch_max_wait_ms=args.fetch_wait_ms)
        c.assign([TopicPartition(topic, i) for i in range(args.partitions)])
        c.seek_to_beginning()
        got = 0
        deadline = time.monotonic() + 120
        while got < args.partitions and time.monotonic() < deadline:
            got += sum(len(v) for v in c.poll(200).values())
        bookie_pids = [b.popen.pid for b in cluster.bookies]

        def phase(name: str, producer_seconds: float) -> None:
            ctx = mp.get_context("spawn")
            prod = None
            if producer_seconds:
                prod = ctx.Process(target=trickle, args=(bootstrap, topic, args.partitions, args.rate,
                                                         producer_seconds))
                prod.start()
            t0, s0, b0 = time.monotonic(), cpu_s(shim.pid), sum(cpu_s(x) for x in bookie_pids)
            received = 0
            while time.monotonic() - t0 < args.seconds:
                received += sum(len(v) for v in c.poll(100).values())
            dt = time.monotonic() - t0
            shim_pct = (cpu_s(shim.pid) - s0) / dt * 100
            bookies_pct = (sum(cpu_s(x) for x in bookie_pids) - b0) / dt * 100
            fetches = _fetch_rate(c)
            if prod is not None:
                prod.join(60)
            out[name] = {"listener_cpu_pct": shim_pct, "bookies_cpu_pct": bookies_pct, "fetches_per_s": fetches,
                         "records": received}
            print(f"  sessions {'on ' if sessions else 'off'} {name:7s}: listener {shim_pct:5.1f}% of a core, "
                  f"bookies {bookies_pct:5.1f}%, {fetches:5.1f} fetches/s, {received} records", flush=True)

        phase("idle", 0)
        if sessions:  # before the trickle: every partition holds one record, so offset 1 is its end
            for mode in ("full", "incremental"):
                out[f"raw_{mode}"] = r = raw_fetches(bootstrap, topic, args.partitions, mode == "incremental",
                                                     args.seconds, shim.pid)
                print(f"  raw fetches, {mode:11s}: {r['fetches_per_s']:7.1f} fetches/s, listener "
                      f"{r['listener_cpu_us_per_fetch']:6.0f} µs CPU per fetch of {args.partitions} partitions",
                      flush=True)
        phase("trickle", args.seconds)
        c.close()
    finally:
        shim.terminate()
        shim.wait(30)
    return out


def raw_fetches(bootstrap: str, topic: str, partitions: int, incremental: bool, seconds: float, pid: int) -> dict:
    """Back-to-back fetches (max wait 0) of every partition at its end, over one socket: sessionless
    full fetches (epoch -1), or one session's incremental fetches (nothing changed: nothing sent
    and nothing answered). Listener CPU per fetch."""
    import datetime
    import struct

    from kio.schema.fetch.v12 import FetchRequest
    from kio.schema.fetch.v12.request import FetchPartition, FetchTopic

    from compat_kafka.wire import codec

    host, port = bootstrap.split(":")
    sock = socket.create_connection((host, int(port)))

    def recv(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def call(req, corr: int):
        sock.sendall(codec.encode_request(req, corr))
        (n,) = struct.unpack(">i", recv(4))
        return codec.decode_response(recv(n), 1, 12)[1]

    def request(sid: int, epoch: int, parts) -> FetchRequest:
        return FetchRequest(replica_id=-1, max_wait=datetime.timedelta(0), min_bytes=1, max_bytes=1 << 20,
                            isolation_level=0, session_id=sid, session_epoch=epoch, rack_id="",
                            forgotten_topics_data=(), topics=(FetchTopic(topic=topic, partitions=tuple(FetchPartition(
                                partition=i, current_leader_epoch=-1, fetch_offset=1, last_fetched_epoch=-1,
                                log_start_offset=-1, partition_max_bytes=1 << 20) for i in parts)),) if parts else ())

    everything = range(partitions)
    sid, epoch = 0, -1
    if incremental:
        sid, epoch = call(request(0, 0, everything), 0).session_id, 1
        assert sid, "no session granted"
    t0, c0, n = time.monotonic(), cpu_s(pid), 0
    while time.monotonic() - t0 < seconds:
        resp = call(request(sid, epoch, () if incremental else everything), n + 1)
        assert resp.error_code == 0
        n += 1
        if incremental:
            epoch += 1
    dt = time.monotonic() - t0
    used = cpu_s(pid) - c0
    sock.close()
    return {"fetches_per_s": n / dt, "listener_cpu_us_per_fetch": used / n * 1e6}


def _fetch_rate(consumer) -> float:
    m = consumer.metrics().get("consumer-fetch-manager-metrics", {})
    return float(m.get("fetch-rate", 0.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=200.0, help="records/s of the trickle phase")
    ap.add_argument("--fetch-wait-ms", type=int, default=100, help="the consumer's fetch.max.wait.ms")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-kafka-fetch-"))
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    results: dict = {"args": vars(args), "load_avg_start": os.getloadavg()}
    try:
        print(f"{args.partitions} partitions, kafka-python consumer, {args.seconds:g} s per phase", flush=True)
        results["off"] = run_mode(cluster, base, False, args)
        results["on"] = run_mode(cluster, base, True, args)
        for ph in ("idle", "trickle"):
            on, off = results["on"][ph]["listener_cpu_pct"], results["off"][ph]["listener_cpu_pct"]
            ratio = on / off if off else float("nan")
            results[f"{ph}_ratio"] = ratio
            print(f"{ph}: listener CPU with sessions / without = {ratio:.2f}", flush=True)
        inc, full = (results["on"][f"raw_{m}"]["listener_cpu_us_per_fetch"] for m in ("incremental", "full"))
        results["raw_ratio"] = inc / full
        print(f"raw: listener CPU per fetch, incremental session / full = {inc / full:.2f}", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
