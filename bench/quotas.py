"""Client quotas and overload on the Kafka listener, over a real Scroll cluster (etcd + 3 bookies).

How this works. ``LocalCluster`` starts etcd and three bookie processes; ``scroll kafka`` runs as
its own process (``--max-connections 20000``, ``--max-inflight-produce-bytes``). Phases, same run:

* quota: a latency-sensitive pair (a producer paced at ``--paced-rate`` records/s of 100 B and a
  consumer tailing the topic; end-to-end latency = receive time - CreateTime) runs for
  ``--seconds`` (i) alone, (ii) beside a greedy producer (client id ``greedy``, its own process,
  acks=all, 10 KB values, as fast as it can) with no quota, (iii) beside the same producer bound by
  ``producer_byte_rate`` = ``--quota`` (``scroll kafka quotas alter``), started ``--warmup`` s before
  the pair so its rate windows have filled. Reported: the consumer's p50/p99 in each, the greedy
  producer's MB/s unbound and bound (counted after its warmup), as JSON and as a table.
* idle: ``--idle-connections`` TCP connections to the listener, each having sent one ApiVersions;
  the listener's RSS before and with them, and its CPU% over ``--idle-seconds``.
* flood: ``--flood-clients`` confluent-kafka producers (processes of 10 producers each) sending
  max-size produce requests (batch.size = message.max.bytes = 1 MB, 100 KB values, acks=all) for
  ``--flood-seconds``; the listener's and bookies' RSS sampled every 100 ms (peaks vs their bounds:
  the listener's in-flight produce bytes, the bookies' write + read caches); then every
  acknowledged record is read back (a consumer from offset 0, values carry unique ids).

    .venv/bin/python bench/quotas.py
    .venv/bin/python bench/quotas.py --phases idle --idle-connections 10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compat_kafka.wire import codec  # noqa: E402
from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def wait_port(port: int, proc) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError("listener exited")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("listener not listening")


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic].result(timeout=60)


# ---------------------------------------------------------------- quota phase
def producer_proc(bootstrap, topic, client_id, seconds, value_bytes, out) -> None:
    from confluent_kafka import Producer

    delivered, throttles = [], []
    p = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all", "linger.ms": 5,
                  "batch.size": 100_000, "throttle_cb": lambda ev: throttles.append(ev.throttle_time)})
    value = b"x" * value_bytes

    def report(err, msg):
        if err is None:
            delivered.append((time.time(), len(msg.value())))

    start = time.time()
    while time.time() - start < seconds:
        if len(p) < 200:
            p.produce(topic, value, on_delivery=report)
            p.poll(0)
        else:
            p.poll(0.01)
    p.flush(60)
    out.put({"client_id": client_id, "start": start, "delivered": delivered, "throttles": throttles})


def paced_pair(bootstrap, topic, rate, seconds) -> list[float]:
    """A producer at ``rate`` records/s and a consumer tailing: end-to-end latencies (ms)."""
    from confluent_kafka import Consumer, Producer

    lat: list[float] = []
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lat-{time.time()}", "auto.offset.reset": "latest",
                  "fetch.wait.max.ms": 100, "enable.auto.commit": False})
    c.subscribe([topic])
    stop = time.time() + seconds
    started = threading.Event()

    def consume():
        while time.time() < stop + 2:
            m = c.poll(0.1)
            if m is None:
                continue
            if c.assignment():
                started.set()
            if m.error() is None and m.value() != b"warm":
                lat.append(time.time() * 1000 - m.timestamp()[1])

    t = threading.Thread(target=consume)
    t.start()
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0, "client.id": "paced"})
    while not started.is_set() and time.time() < stop:  # until the consumer is assigned and reading
        p.produce(topic, b"warm")
        p.flush(5)
        time.sleep(0.2)
    n, t0 = 0, time.time()
    while time.time() < stop:
        p.produce(topic, b"y" * 100)
        p.poll(0)
        n += 1
        time.sleep(max(0.0, t0 + n / rate - time.time()))
    p.flush(30)
    t.join()
    c.close()
    return lat


def set_quota(url, client_id, key, value) -> None:
    change = ["--add-config", f"{key}={value}"] if value is not None else ["--delete-config", key]
    r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "quotas", "alter", "--entity-type",
                        "clients", "--entity-name", client_id, *change, "--metadata", url], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def beside_producer(args, bootstrap, client_id, warmup) -> tuple[list[float], dict]:
    """The paced pair's latencies beside a producer (``client_id``, 10 KB values, as fast as it
    goes) started ``warmup`` seconds before it, and that producer's record."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=producer_proc, args=(bootstrap, "greedy", client_id, warmup + args.seconds + 2, 10_000,
                                                   out))
    proc.start()
    time.sleep(warmup)
    lat = paced_pair(bootstrap, "lat", args.paced_rate, args.seconds)
    got = out.get(timeout=180)
    proc.join(30)
    return lat, got


def phase_quota(args, bootstrap, url, results) -> None:
    """The latency-sensitive consumer (i) alone, (ii) beside the greedy producer with no quota,
    (iii) beside the same producer (same client id) bound by ``producer_byte_rate`` = ``--quota``,
    its rate windows filled first (``--warmup`` s)."""
    create_topic(bootstrap, "greedy", 1)
    create_topic(bootstrap, "lat", 1)
    alone = paced_pair(bootstrap, "lat", args.paced_rate, args.seconds)
    unbound, greedy = beside_producer(args, bootstrap, "greedy", 1.0)
    set_quota(url, "greedy", "producer_byte_rate", args.quota)
    time.sleep(2)  # the listener applies it through its watch (within about a second)
    bound, capped = beside_producer(args, bootstrap, "greedy", args.warmup)
    set_quota(url, "greedy", "producer_byte_rate", None)

    def rate(d, after):  # acknowledged bytes/s from ``after`` s after its start
        t0 = d["start"] + after
        xs = [(t, n) for t, n in d["delivered"] if t >= t0]
        return sum(n for _t, n in xs) / max(xs[-1][0] - t0, 1e-3) if xs else 0.0

    def lat(xs):
        return {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}

    res = {"quota_bytes_per_s": args.quota,
           "greedy_unbound_mb_per_s": rate(greedy, 1.0) / 1e6,
           "greedy_unbound_throttle_responses": len(greedy["throttles"]),
           "greedy_bound_mb_per_s": rate(capped, args.warmup) / 1e6,
           "greedy_bound_throttle_responses": len(capped["throttles"]),
           "greedy_bound_max_throttle_ms": max([t * 1000 for t in capped["throttles"]], default=0),
           "consumer_alone_ms": lat(alone),
           "consumer_beside_unbound_ms": lat(unbound),
           "consumer_beside_bound_ms": lat(bound)}
    results["quota"] = res
    print(json.dumps({"quota": res}, indent=1), flush=True)
    rows = [("alone", alone, "-"), ("beside greedy, no quota", unbound, f"{res['greedy_unbound_mb_per_s']:.1f} MB/s"),
            (f"beside greedy, quota {args.quota / 1e6:g} MB/s", bound, f"{res['greedy_bound_mb_per_s']:.2f} MB/s")]
    print("| consumer | p50 ms | p99 ms | n | greedy producer |\n|---|---:|---:|---:|---:|")
    for name, xs, prod in rows:
        print(f"| {name} | {pct(xs, 0.5):.1f} | {pct(xs, 0.99):.1f} | {len(xs)} | {prod} |", flush=True)


# ---------------------------------------------------------------- idle connections
def phase_idle(args, port, pid, results) -> None:
    before = rss(pid)
    socks = []
    body = codec.build(codec.request_schema(18, 3), client_software_name="idle", client_software_version="1")
    frame = codec.encode_request(body, 1)
    t0 = time.monotonic()
    for i in range(args.idle_connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(frame)
        socks.append(s)
        if i % 500 == 499:  # read the answers, so that every connection has been served once
            for x in socks[-500:]:
                x.settimeout(30)
                x.recv(65536)
    opened_s = time.monotonic() - t0
    time.sleep(2)
    with_conns = rss(pid)
    c0, w0 = cpu_s(pid), time.monotonic()
    time.sleep(args.idle_seconds)
    cpu_pct = (cpu_s(pid) - c0) / (time.monotonic() - w0) * 100
    alive = 0
    for s in socks[:: max(1, len(socks) // 100)]:  # still served: a sample answers ApiVersions
        s.sendall(codec.encode_request(body, 2))
        s.settimeout(30)
        alive += bool(s.recv(65536))
    for s in socks:
        s.close()
    res = {"connections": len(socks), "open_seconds": opened_s, "rss_before_mb": before / 2**20,
           "rss_with_mb": with_conns / 2**20, "kb_per_connection": (with_conns - before) / len(socks) / 1024,
           "cpu_pct_idle": cpu_pct, "idle_seconds": args.idle_seconds, "sampled_still_answering": alive}
    results["idle"] = res
    print(json.dumps({"idle": res}, indent=1), flush=True)


# ---------------------------------------------------------------- flood
def flood_proc(bootstrap, topic, first, n, seconds, out) -> None:
    from confluent_kafka import Producer

    acked, errors = [], 0
    prods = [Producer({"bootstrap.servers": bootstrap, "client.id": f"flood-{first + i}", "acks": "all",
                       "linger.ms": 50, "batch.size": 1_000_000, "message.max.bytes": 1_000_000,
                       "queue.buffering.max.kbytes": 4096, "message.timeout.ms": 120_000}) for i in range(n)]
    pad = b"z" * 99_000

    def report(err, msg):
        nonlocal errors
        if err is None:
            acked.append(msg.value()[:24].decode())
        else:
            errors += 1

    seq, stop = 0, time.time() + seconds
    while time.time() < stop:
        for i, p in enumerate(prods):
            try:
                p.produce(topic, f"{first + i:06d}-{seq:017d}".encode() + pad, on_delivery=report)
            except BufferError:
                pass
            p.poll(0)
        seq += 1
        time.sleep(0.001)
    for p in prods:
        p.flush(180)
    out.put({"acked": acked, "errors": errors})


def read_all(bootstrap, topic, partitions) -> tuple[set[str], int, int]:
    """Every record of the topic, read from offset 0 up to each partition's high watermark:
    (the ids seen, records read, the high watermarks' sum)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"readback-{time.time()}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    seen: set[str] = set()
    read = 0
    done = {p for p, e in ends.items() if e == 0}
    deadline = time.time() + 600
    while len(done) < partitions and time.time() < deadline:
        for m in c.consume(500, 1.0):
            if m.error() is None:
                seen.add(m.value()[:24].decode())
                read += 1
                if m.offset() + 1 >= ends[m.partition()]:
                    done.add(m.partition())
    c.close()
    return seen, read, sum(ends.values())


def phase_flood(args, bootstrap, pid, cluster, results) -> None:
    parts = 10
    create_topic(bootstrap, "flood", parts)
    bookie_pids = [b.popen.pid for b in cluster.bookies] if hasattr(cluster, "bookies") else []
    base = {"listener": rss(pid), **{f"bookie{i}": rss(p) for i, p in enumerate(bookie_pids)}}
    peaks = dict(base)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for k, p in [("listener", pid)] + [(f"bookie{i}", p) for i, p in enumerate(bookie_pids)]:
                try:
                    peaks[k] = max(peaks[k], rss(p))
                except OSError:
                    pass
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per = 10
    procs = [ctx.Process(target=flood_proc, args=(bootstrap, "flood", i * per, per, args.flood_seconds, out))
             for i in range(args.flood_clients // per)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    got = [out.get(timeout=args.flood_seconds + 600) for _ in procs]
    for p in procs:
        p.join(30)
    wall = time.monotonic() - t0
    stop.set()
    sampler.join()
    listener_alive = True
    acked = {a for g in got for a in g["acked"]}
    seen, read, hw = read_all(bootstrap, "flood", parts)
    res = {"clients": args.flood_clients, "seconds": wall, "acked_records": len(acked),
           "acked_mb": len(acked) * 0.099024, "delivery_errors": sum(g["errors"] for g in got),
           "acked_missing_on_readback": len(acked - seen), "records_read_back": read, "high_watermarks_sum": hw,
           "listener_alive": listener_alive,
           "rss_base_mb": {k: v / 2**20 for k, v in base.items()},
           "rss_peak_mb": {k: v / 2**20 for k, v in peaks.items()},
           "listener_max_inflight_produce_mb": args.max_inflight_produce_bytes / 2**20,
           "listener_growth_mb": (peaks["listener"] - base["listener"]) / 2**20,
           "listener_growth_over_bound": (peaks["listener"] - base["listener"]) / max(args.max_inflight_produce_bytes, 1),
           "bookie_write_plus_read_cache_mb": 128 + 64}
    results["flood"] = res
    print(json.dumps({"flood": res}, indent=1), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="quota,idle,flood")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=12.0,
                    help="seconds the bound producer runs before the pair starts (and its rate counts)")
    ap.add_argument("--quota", type=int, default=1_000_000, help="the bound producer's producer_byte_rate")
    ap.add_argument("--paced-rate", type=float, default=100.0)
    ap.add_argument("--idle-connections", type=int, default=10_000)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--flood-clients", type=int, default=50)
    ap.add_argument("--flood-seconds", type=float, default=20.0)
    ap.add_argument("--max-inflight-produce-bytes", type=int, default=64 << 20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the listener
    phases = args.phases.split(",")
    results: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        cluster = LocalCluster(Path(d) / "cluster", bookies=3)
        cluster.start()
        port = free_port()
        log = open(Path(d) / "listener.log", "wb")
        shim = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                                 "--port", str(port), "--node-id", "0", "--max-connections", "20000",
                                 "--max-inflight-produce-bytes", str(args.max_inflight_produce_bytes)],
                                stdout=log, stderr=subprocess.STDOUT)
        bootstrap = f"127.0.0.1:{port}"
        try:
            wait_port(port, shim)
            if "quota" in phases:
                phase_quota(args, bootstrap, cluster.metadata_url, results)
            if "idle" in phases:
                phase_idle(args, port, shim.pid, results)
            if "flood" in phases:
                phase_flood(args, bootstrap, shim.pid, cluster, results)
                results["flood"]["listener_alive"] = shim.poll() is None
        finally:
            shim.terminate()
            shim.wait(30)
            cluster.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    _ = statistics
    return 0


if __name__ == "__main__":
    sys.exit(main())
