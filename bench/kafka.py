"""The Kafka shim under confluent-kafka load, over a real Scroll cluster (etcd + 3 bookies, E=3 WQ=3 AQ=2).

How this works. ``LocalCluster`` starts etcd and three bookie processes; one ``scroll kafka`` shim
runs as its own process. Then, on a fresh topic of ``--partitions`` partitions:

* reference: the streams client (this process) appending one-record batches of ``--value-bytes``
  with ``Producer.append_batch`` to a fresh stream for ``--ref-seconds``: entries/s and this
  process's CPU per append. The listener stores each Kafka batch with one such append, so this is
  the per-entry cost the shim pays.
* produce: a confluent-kafka producer (acks=all, linger.ms=5, ``--value-bytes`` values) sends
  ``--records`` records as fast as it can while a confluent-kafka consumer in another process tails
  the topic. records/s and MB/s count from the first produce() to the last delivery report;
  produce latency is each record's delivery-report latency (``Message.latency()``: produce() to
  acknowledgement); end-to-end latency is the consumer's receive time minus the record's
  CreateTime (producer wall clock, ms resolution; same machine).
* paced: the same producer and tailing consumer at a fixed ``--rate`` (records/s) for
  ``--paced-seconds``, each record produced at its time (as the native paced phase): delivery and
  end-to-end latency when the shim keeps up (at full speed the latencies above are mostly time
  queued in the producer), and the shim's CPU per record (its tailing consumer's fetches included).
* consume only: a fresh consumer reads the whole topic from offset 0: records/s, MB/s.

CPU seconds (from /proc) per record are given for the shim and for the three bookies together.
``--profile`` runs py-spy (``--py-spy PATH``) on the shim during each produce, paced and consume
phase and writes a flame graph SVG and the raw stacks (``shim-<phase>.{svg,txt}``).

    .venv/bin/python bench/kafka.py                                # 300k records, 4 partitions
    .venv/bin/python bench/kafka.py --records 100000 --json bench/results/kafka.json
    .venv/bin/python bench/kafka.py --profile --py-spy /tmp/pyspy/bin/py-spy

Many partitions (``--phases open,failover,idle``; each phase starts listeners of its own):

* open: the first produce to a new topic of ``--open-partitions`` partitions
  (``--records-per-partition`` records each, confluent-kafka, acks=all): wall time from the first
  produce() to the last delivery report, and records/s; then the same produce again, once the
  partitions are open, for comparison.
* failover: listener A (node 1) alone takes ``--failover-partitions`` partitions with a first
  produce; listener B (node 2) starts; A is SIGKILLed. The time from A's lease expiry (its broker
  key vanishing from etcd, polled every 10 ms) until one record more has been acknowledged on every
  partition through B (a confluent-kafka producer started at the expiry), and B's log of partitions
  opened.
* idle: the CPU of the listener, the three bookies and etcd over ``--idle-seconds`` (from /proc,
  as a share of one core) with no partition open; then topics of 500 partitions are opened by
  first produces until ``--idle-partitions`` are open on the listener (each first produce timed:
  the last one runs on a listener already holding the others), and the same CPU is measured again
  with no traffic.

    .venv/bin/python bench/kafka.py --phases open,failover,idle
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fragments import aioloop  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

GOAL_PRODUCE = 50_000
GOAL_CONSUME = 100_000
GOAL_VS_NATIVE = 0.9  # issue 26: Kafka produce records/s / the native producer's, same run
GOAL_PACED_ABOVE_LINGER_MS = 2.0  # issue 26: paced delivery p50 <= the producer's linger.ms + this
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------- reference: the raw streams client
async def reference(url: str, value_bytes: int, seconds: float) -> dict:
    """One-record batches appended with ``Producer.append_batch``, as the listener stores each
    produce batch: the per-entry cost of the streams client."""
    from compat_kafka.partitions.partition import LISTENER_PRODUCER
    from streams.batches import BatchBuilder

    client = await connect(url)
    try:
        name = f"bench-ref-{int(time.time())}"
        await client.create_stream(name, 3, 3, 2)
        p = await client.producer(name, LISTENER_PRODUCER)  # the listener's options
        b = BatchBuilder(0, 1 << 20)
        b.append(os.urandom(value_bytes), None, [], None)
        batch = bytes(b.build(0))
        futs, n = [], 0
        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            if not p.has_space():
                await p.wait_for_space()
            futs.append(p.append_batch(batch)[1])
            n += 1
            if len(futs) >= 2000:
                await asyncio.gather(*futs)
                futs.clear()
        await asyncio.gather(*futs)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        await p.close()
        await client.delete_stream(name)
        return {"entries_per_s": n / dt, "mb_per_s": n * value_bytes / dt / 1e6, "client_cpu_us_per_append": cpu / n * 1e6}
    finally:
        await client.close()


# ---------------------------------------------------------------- native: the streams producer, same records
async def native(url: str, value_bytes: int, seconds: float, rate: float, paced_seconds: float) -> dict:
    """The native producer on the same cluster: ``Producer.append_many`` calls of 2,000
    ``value_bytes`` records, up to 20,000 in flight, for ``seconds`` (records/s acknowledged, as
    bench/e2e.py's full speed); then ``append_future`` per record paced at ``rate`` for
    ``paced_seconds`` (append latency: submit to acknowledgement, as e2e's fixed rate)."""
    client = await connect(url)
    try:
        name = f"bench-native-{int(time.time())}"
        await client.create_stream(name, 3, 3, 2)
        p = await client.producer(name)
        value = os.urandom(value_bytes)
        chunk, window = 2000, 20_000
        pending: set[asyncio.Future] = set()
        done = [0]

        def on_done(f: asyncio.Future) -> None:
            pending.discard(f)
            if not f.cancelled() and f.exception() is None:
                done[0] += chunk

        t0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            if len(pending) * chunk >= window:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                continue
            f = asyncio.ensure_future(p.append_many([value] * chunk))
            pending.add(f)
            f.add_done_callback(on_done)
            await asyncio.sleep(0)
        if pending:
            await asyncio.wait(pending, timeout=60)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        out = {"records": done[0], "records_per_s": done[0] / dt, "mb_per_s": done[0] * value_bytes / dt / 1e6,
               "client_cpu_us_per_record": cpu / max(1, done[0]) * 1e6}
        lat: list[float] = []
        n = int(rate * paced_seconds)
        futs = []
        t0 = time.perf_counter()
        for i in range(n):
            ahead = t0 + i / rate - time.perf_counter()
            if ahead > 0:
                await asyncio.sleep(ahead)
            t = time.perf_counter()
            f = await p.append_future(value)
            f.add_done_callback(lambda _f, t=t: lat.append(time.perf_counter() - t))
            futs.append(f)
        await asyncio.gather(*futs)
        out.update(paced_rate=rate, paced_p50_ms=pct(lat, 0.5) * 1000, paced_p99_ms=pct(lat, 0.99) * 1000)
        await p.close()
        await client.delete_stream(name)
        return out
    finally:
        await client.close()


# ---------------------------------------------------------------- the tailing consumer (a child process)
def tail_consumer(bootstrap: str, topic: str, partitions: int, count: int, ready, out) -> None:
    from confluent_kafka import OFFSET_END, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-tail", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 10, "fetch.min.bytes": 1})
    c.assign([TopicPartition(topic, p, OFFSET_END) for p in range(partitions)])
    c.consume(1, timeout=1.0)  # connect and resolve the end offsets before the producer starts
    ready.set()
    lat, got = [], 0
    deadline = time.monotonic() + 600
    while got < count and time.monotonic() < deadline:
        msgs = c.consume(1000, timeout=0.005)  # consume() waits for all 1000 or the timeout: keep it short
        now_ms = time.time() * 1000
        for m in msgs:
            if m.error() is None:
                got += 1
                if got % 10 == 0:  # a sample is plenty
                    lat.append(now_ms - m.timestamp()[1])
    c.close()
    out.put({"received": got, "e2e_ms": lat})


# ---------------------------------------------------------------- phases
def produce(bootstrap: str, topic: str, partitions: int, records: int, value_bytes: int,
            rate: float | None = None, conf: dict | None = None, shim_pid: int | None = None) -> dict:
    from confluent_kafka import Producer

    settings = {"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                "queue.buffering.max.messages": 1_000_000, "queue.buffering.max.kbytes": 2_097_151, **(conf or {})}
    settings = {k: v for k, v in settings.items() if v is not None}  # None: librdkafka's default
    stats: list[dict] = []  # paced: librdkafka's statistics, for its count of Produce requests sent
    if rate is not None:
        settings.update({"statistics.interval.ms": 500, "stats_cb": lambda s: stats.append(json.loads(s))})
    p = Producer(settings)
    linger_ms = float(settings.get("linger.ms", 5))  # librdkafka's default is 5 ms
    value = os.urandom(value_bytes)
    lat: list[float] = []
    errors = [0]

    def report(err, msg):
        if err is not None:
            errors[0] += 1
        else:
            lat.append(msg.latency())

    p.list_topics(topic, timeout=10)
    t0 = time.perf_counter()
    for i in range(records):
        # paced: each record at its time, as the native paced phase (poll() returns as soon as it has
        # served a delivery report, so it is called until the time has come)
        while rate is not None and (ahead := t0 + i / rate - time.perf_counter()) > 0:
            p.poll(ahead)
        while True:
            try:
                p.produce(topic, value=value, partition=i % partitions, on_delivery=report)
                break
            except BufferError:
                p.poll(0.005)
        if i % 1000 == 0:
            p.poll(0)
    left = p.flush(120)
    dt = time.perf_counter() - t0
    shim_cpu_at_flush = cpu_s(shim_pid) if shim_pid is not None else None
    produce_requests = None
    if rate is not None:  # the statistics of a moment after the last delivery: every request counted
        seen, until = len(stats), time.monotonic() + 3
        while len(stats) <= seen + 1 and time.monotonic() < until:
            p.poll(0.1)
        if len(stats) > seen + 1:
            produce_requests = sum(b.get("req", {}).get("Produce", 0) for b in stats[-1]["brokers"].values())
    return {"produce_requests": produce_requests, "shim_cpu_at_flush": shim_cpu_at_flush,"records": records, "seconds": dt, "records_per_s": records / dt,
            "mb_per_s": records * value_bytes / dt / 1e6, "errors": errors[0] + left,
            "p50_ms": pct(lat, 0.5) * 1000, "p99_ms": pct(lat, 0.99) * 1000, "linger_ms": linger_ms}


def consume_all(bootstrap: str, topic: str, partitions: int, records: int, value_bytes: int,
                conf: dict | None = None) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-read", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 100, "fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 8 << 20,
                  "queued.max.messages.kbytes": 1 << 20, **(conf or {})})
    c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got = 0
    t0 = time.perf_counter()
    deadline = time.monotonic() + 600
    while got < records and time.monotonic() < deadline:
        for m in c.consume(10_000, timeout=0.5):
            if m.error() is None:
                got += 1
    dt = time.perf_counter() - t0
    c.close()
    return {"records": got, "seconds": dt, "records_per_s": got / dt, "mb_per_s": got * value_bytes / dt / 1e6}


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"listener exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port} after {timeout_s}s")


def start_listener(cluster, base: Path, node_id: int, lease_ttl_s: float = 10.0) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(base / f"listener-{node_id}-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                             "--port", str(port), "--node-id", str(node_id), "--lease-ttl", str(lease_ttl_s)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_port(port, proc)
    return proc, port


def stop_listener(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def create_topic(bootstrap: str, topic: str, partitions: int) -> float:
    from confluent_kafka.admin import AdminClient, NewTopic

    t0 = time.perf_counter()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                        request_timeout=120)[topic].result(timeout=180)
    return time.perf_counter() - t0


def produce_each(bootstrap: str, topic: str, partitions: int, per_partition: int, value_bytes: int = 100) -> dict:
    """``per_partition`` records to every partition (acks=all): seconds from the first produce()
    to the last delivery report, records/s, errors."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                  "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 2_097_151})
    value = os.urandom(value_bytes)
    errors: list[str] = []
    delivered = [0]
    first_ack: dict[int, float] = {}

    def report(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            delivered[0] += 1
            first_ack.setdefault(msg.partition(), time.perf_counter())

    p.list_topics(topic, timeout=30)
    t0 = time.perf_counter()
    for _ in range(per_partition):
        for part in range(partitions):
            while True:
                try:
                    p.produce(topic, value=value, partition=part, on_delivery=report)
                    break
                except BufferError:
                    p.poll(0.005)
        p.poll(0)
    left = p.flush(600)
    dt = time.perf_counter() - t0
    n = partitions * per_partition
    every = max(first_ack.values()) - t0 if len(first_ack) == partitions else float("nan")
    return {"partitions": partitions, "records": n, "seconds": dt, "records_per_s": n / dt,
            "all_partitions_acked_s": every,
            "delivered": delivered[0], "errors": len(errors) + left, "first_error": errors[0] if errors else None}


def py_spy(args, pid: int, prefix: Path) -> list:
    """py-spy on ``pid`` (with ``--profile``): a flame graph and raw stacks at ``prefix``.{svg,txt}."""
    if not args.profile:
        return []
    return [subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-f", fmt, "-o", f"{prefix}.{ext}",
                              "--nonblocking", "-r", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for fmt, ext in (("flamegraph", "svg"), ("raw", "txt"))]


def stop_py_spy(spies: list) -> None:
    for sp in spies:
        sp.send_signal(2)
        sp.wait(30)


def phase_open(args, cluster, base: Path, results: dict) -> None:
    proc, port = start_listener(cluster, base, node_id=0)
    bootstrap = f"127.0.0.1:{port}"
    try:
        n = args.open_partitions
        created = create_topic(bootstrap, "bench-open", n)
        others = {"bookies": [b.popen.pid for b in cluster.bookies], "etcd": [cluster.etcd.popen.pid]}
        c0, o0 = cpu_s(proc.pid), {k: sum(cpu_s(p) for p in v) for k, v in others.items()}
        spies = py_spy(args, proc.pid, base / "listener-open") + py_spy(args, cluster.bookies[0].popen.pid,
                                                                       base / "bookie0-open")
        first = produce_each(bootstrap, "bench-open", n, args.records_per_partition)
        stop_py_spy(spies)
        first["listener_cpu_s"] = cpu_s(proc.pid) - c0
        for k, v in others.items():
            first[f"{k}_cpu_s"] = sum(cpu_s(p) for p in v) - o0[k]
        c0, o0 = cpu_s(proc.pid), {k: sum(cpu_s(p) for p in v) for k, v in others.items()}
        again = produce_each(bootstrap, "bench-open", n, args.records_per_partition)
        again["listener_cpu_s"] = cpu_s(proc.pid) - c0
        for k, v in others.items():
            again[f"{k}_cpu_s"] = sum(cpu_s(p) for p in v) - o0[k]
        results["open"] = {"create_topic_s": created, "first_produce": first, "open_produce": again}
        print(f"open: first produce to {n} new partitions ({args.records_per_partition} records each, acks=all): "
              f"{first['seconds']:.2f} s, {first['records_per_s']:,.0f} records/s, every partition's first record "
              f"acknowledged after {first['all_partitions_acked_s']:.2f} s, errors {first['errors']}, "
              f"CPU s: listener {first['listener_cpu_s']:.1f}, bookies {first['bookies_cpu_s']:.1f}, etcd "
              f"{first['etcd_cpu_s']:.1f} (topic created in {created:.1f} s); the same produce "
              f"once open: {again['seconds']:.2f} s, {again['records_per_s']:,.0f} records/s, CPU s: listener "
              f"{again['listener_cpu_s']:.1f}, bookies {again['bookies_cpu_s']:.1f}, etcd {again['etcd_cpu_s']:.1f}",
              flush=True)
    finally:
        stop_listener(proc)


async def _wait_key_gone(url: str, key: str, timeout_s: float) -> float:
    """time.perf_counter() at which ``key`` was first seen absent (polled every 10 ms)."""
    client = await connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await client.cluster.store.get(key) is None:
                return time.perf_counter()
            await asyncio.sleep(0.01)
        raise RuntimeError(f"{key} still present after {timeout_s}s")
    finally:
        await client.close()


def phase_failover(args, cluster, base: Path, results: dict) -> None:
    n, ttl = args.failover_partitions, args.lease_ttl
    a, a_port = start_listener(cluster, base, node_id=1, lease_ttl_s=ttl)
    b = None
    try:
        topic = "bench-failover"
        create_topic(f"127.0.0.1:{a_port}", topic, n)
        first = produce_each(f"127.0.0.1:{a_port}", topic, n, args.records_per_partition)
        print(f"failover: listener A took {n} partitions with a first produce in {first['seconds']:.2f} s "
              f"(errors {first['errors']})", flush=True)
        b, b_port = start_listener(cluster, base, node_id=2, lease_ttl_s=ttl)
        time.sleep(1.0)  # B's registration is listed
        a.kill()
        killed = time.perf_counter()
        a.wait(10)
        spies = py_spy(args, b.pid, base / "listener-failover")  # --profile: the survivor's take-over
        expired = asyncio.run(_wait_key_gone(cluster.metadata_url, "kafka/brokers/1", 3 * ttl + 30))
        again = produce_each(f"127.0.0.1:{b_port}", topic, n, 1)
        serving = time.perf_counter()
        stop_py_spy(spies)
        results["failover"] = {"partitions": n, "lease_ttl_s": ttl, "kill_to_expiry_s": expired - killed,
                               "expiry_to_all_serving_s": serving - expired, "produce_after": again}
        print(f"failover: SIGKILL -> lease expiry {expired - killed:.2f} s (TTL {ttl} s); lease expiry -> every one "
              f"of {n} partitions acknowledged a record on the survivor: {serving - expired:.2f} s "
              f"(errors {again['errors']}{', ' + again['first_error'] if again['first_error'] else ''})", flush=True)
    finally:
        if b is not None:
            stop_listener(b)
        stop_listener(a)


def phase_idle(args, cluster, base: Path, results: dict) -> None:
    proc, port = start_listener(cluster, base, node_id=3)
    bootstrap = f"127.0.0.1:{port}"
    out: dict = {"first_produces": []}
    pids = {"listener": proc.pid, "etcd": cluster.etcd.popen.pid,
            **{f"bookie-{i}": bk.popen.pid for i, bk in enumerate(cluster.bookies)}}

    def idle_cpu(seconds: float) -> dict:
        c0 = {k: cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        time.sleep(seconds)
        dt = time.perf_counter() - t0
        return {k: (cpu_s(p) - c0[k]) / dt * 100 for k, p in pids.items()}

    try:
        time.sleep(args.idle_settle_seconds)
        base_share = idle_cpu(args.idle_seconds)  # the same processes with no partition open
        out["baseline_cpu_percent_of_a_core"] = base_share
        print("idle: no partition open, " f"{args.idle_seconds:.0f} s: listener + bookies + etcd use "
              f"{sum(base_share.values()):.2f}% of a core (" + ", ".join(f"{k} {v:.2f}%" for k, v in base_share.items())
              + ")", flush=True)
        opened, k = 0, 0
        while opened < args.idle_partitions:
            n = min(500, args.idle_partitions - opened)
            topic = f"bench-idle-{k}"
            create_topic(bootstrap, topic, n)
            r = produce_each(bootstrap, topic, n, args.records_per_partition)
            r["already_open"] = opened
            out["first_produces"].append(r)
            print(f"idle: first produce to {n} new partitions with {opened} open: {r['seconds']:.2f} s, "
                  f"{r['records_per_s']:,.0f} records/s, errors {r['errors']}", flush=True)
            opened += n
            k += 1
        time.sleep(args.idle_settle_seconds)
        share = idle_cpu(args.idle_seconds)
        out.update(partitions=opened, seconds=args.idle_seconds, cpu_percent_of_a_core=share,
                   total_percent=sum(share.values()))
        results["idle"] = out
        print(f"idle: {opened} open partitions, no traffic, {args.idle_seconds:.0f} s: listener + bookies + etcd use "
              f"{out['total_percent']:.2f}% of a core (" + ", ".join(f"{k} {v:.2f}%" for k, v in share.items()) + ")",
              flush=True)
    finally:
        stop_listener(proc)


def phase_tls(args, cluster, base: Path, results: dict) -> None:
    """The cost of TLS (and SASL over it): one listener process serving PLAINTEXT, SSL and SASL_SSL
    side by side (certificates from a local CA, ``streams.tools.pki``); the same produce and
    consume over each, in turn, in this run. Ratios are against PLAINTEXT."""
    from streams.tools.pki import LocalPki

    pki = LocalPki(base / "pki").ensure()
    subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", "add", "bench", "--password",
                    "bench-pw", "--metadata", cluster.metadata_url], check=True, capture_output=True)
    ports = {proto: free_port() for proto in ("PLAINTEXT", "SSL", "SASL_SSL")}
    log = open(base / "shim-tls.log", "wb")
    shim = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                             "--node-id", "7", "--ssl-cert", str(pki.server_cert), "--ssl-key", str(pki.server_key),
                             "--sasl-mechanisms", "SCRAM-SHA-256",
                             *(a for proto, port in ports.items() for a in ("--listener", f"{proto}://127.0.0.1:{port}"))],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    tls = {"ssl.ca.location": str(pki.ca)}
    confs = {"PLAINTEXT": {}, "SSL": {"security.protocol": "SSL", **tls},
             "SASL_SSL": {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
                          "sasl.username": "bench", "sasl.password": "bench-pw", **tls}}
    out: dict = {}
    try:
        wait_port(ports["SASL_SSL"], shim)
        for proto, port in ports.items():
            bootstrap = f"127.0.0.1:{port}"
            topic = f"bench-tls-{proto.lower()}"
            create_topic(f"127.0.0.1:{ports['PLAINTEXT']}", topic, args.partitions)
            prod = produce(bootstrap, topic, args.partitions, args.tls_records, args.value_bytes, conf=confs[proto])
            cons = consume_all(bootstrap, topic, args.partitions, args.tls_records, args.value_bytes, conf=confs[proto])
            out[proto] = {"produce": prod, "consume": cons}
            print(f"tls phase {proto:>9}: produce {prod['records_per_s']:,.0f} rec/s ({prod['mb_per_s']:.1f} MB/s, "
                  f"p50 {prod['p50_ms']:.1f} ms, errors {prod['errors']}), consume {cons['records_per_s']:,.0f} rec/s",
                  flush=True)
        plain = out["PLAINTEXT"]
        for proto in ("SSL", "SASL_SSL"):
            r = out[proto]
            r["produce_ratio"] = r["produce"]["records_per_s"] / plain["produce"]["records_per_s"]
            r["consume_ratio"] = r["consume"]["records_per_s"] / plain["consume"]["records_per_s"]
            print(f"tls phase {proto:>9} vs PLAINTEXT: produce {r['produce_ratio']:.2f}x, consume "
                  f"{r['consume_ratio']:.2f}x", flush=True)
        results["tls"] = out
    finally:
        stop_listener(shim)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--ref-seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=5000.0, help="records/s of the paced phase")
    ap.add_argument("--paced-seconds", type=float, default=5.0)
    ap.add_argument("--paced-lingers", default="0,default",
                    help="the paced phase once per producer linger.ms (comma-separated; 'default': librdkafka's)")
    ap.add_argument("--native-seconds", type=float, default=5.0, help="the native producer's full-speed run")
    ap.add_argument("--loops", default="",
                    help="comma-separated event loops (uvloop,asyncio): run every phase once per loop, each on a "
                         "fresh cluster (SCROLL_EVENT_LOOP for every process), and print the ratios")
    ap.add_argument("--profile", action="store_true", help="py-spy the shim during the produce phase")
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--dir", default=None, help="cluster directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--phases", default="throughput",
                    help="comma-separated: throughput (reference, produce, paced, consume), open, failover, idle")
    ap.add_argument("--open-partitions", type=int, default=500)
    ap.add_argument("--records-per-partition", type=int, default=100)
    ap.add_argument("--failover-partitions", type=int, default=500)
    ap.add_argument("--lease-ttl", type=float, default=5.0, help="listeners' lease TTL in the failover phase")
    ap.add_argument("--idle-partitions", type=int, default=2000)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--idle-settle-seconds", type=float, default=5.0)
    ap.add_argument("--tls-records", type=int, default=100_000, help="records per listener in the tls phase")
    args = ap.parse_args()
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - {"throughput", "open", "failover", "idle", "tls"}
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}")

    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-kafka-"))
    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    if not loops:
        results = run_phases(args, phases, base)
    else:
        results = {"args": vars(args), "loops": {}}
        keys = []
        for i, loop in enumerate(loops):  # a loop named twice runs twice (A B A B: interleaved under load)
            os.environ[aioloop.ENV] = loop  # every process started from here, and this one's loops
            key = loop if loop not in keys else f"{loop}#{i}"
            keys.append(key)
            print(f"---- event loop {key}", flush=True)
            results["loops"][key] = run_phases(args, phases, base / key)
        _print_loop_ratios(results["loops"], keys)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def run_phases(args, phases: list[str], base: Path) -> dict:
    base.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    results: dict = {"args": vars(args), "load_avg_start": os.getloadavg()}
    try:
        for phase in phases:
            {"throughput": throughput, "open": phase_open, "failover": phase_failover, "idle": phase_idle,
             "tls": phase_tls}[phase](args, cluster, base, results)
        results["load_avg_end"] = os.getloadavg()
        print(f"load average {results['load_avg_start'][0]:.2f} -> {results['load_avg_end'][0]:.2f}", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)  # the data; logs and profiles stay
    return results


def _print_loop_ratios(by_loop: dict, loops: list[str]) -> None:
    """Each throughput figure of the first loop over the same figure of the others (same run)."""
    first = by_loop[loops[0]]
    figures = [("native records/s", ("native", "records_per_s")),
               ("Kafka produce (no tail) records/s", ("produce_alone", "records_per_s")),
               ("listener CPU µs/record (produce, no tail)", ("produce_alone", "shim_cpu_us_per_record")),
               ("Kafka produce records/s", ("produce", "records_per_s")),
               ("listener CPU µs/record (produce)", ("produce", "shim_cpu_us_per_record")),
               ("bookies CPU µs/record (produce)", ("produce", "bookies_cpu_us_per_record")),
               ("paced delivery p50 ms", ("paced", "p50_ms")), ("consume records/s", ("consume", "records_per_s"))]
    for other in loops[1:]:
        for label, (k1, k2) in figures:
            a, b = first.get(k1, {}).get(k2), by_loop[other].get(k1, {}).get(k2)
            if a is not None and b:
                print(f"{label}: {loops[0]} {a:,.1f} / {other} {b:,.1f} = {a / b:.2f}", flush=True)


def throughput(args, cluster, base: Path, results: dict) -> None:
    port = free_port()
    log = open(base / "shim.log", "wb")
    shim = subprocess.Popen([sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url,
                             "--port", str(port), "--node-id", "0"], stdout=log, stderr=subprocess.STDOUT)
    bootstrap = f"127.0.0.1:{port}"
    try:
        import socket

        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        from confluent_kafka.admin import AdminClient, NewTopic

        topic = "bench"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=args.partitions, replication_factor=1)])[topic].result(
            timeout=30)

        results["reference"] = aioloop.run(reference(cluster.metadata_url, args.value_bytes, args.ref_seconds))
        print(f"reference (streams client, {args.value_bytes} B entries): "
              f"{results['reference']['entries_per_s']:,.0f} appends/s, "
              f"{results['reference']['client_cpu_us_per_append']:.0f} µs client CPU per append", flush=True)
        bookie_pids = [b.popen.pid for b in cluster.bookies]
        b0 = sum(cpu_s(pid) for pid in bookie_pids)
        results["native"] = nat = aioloop.run(native(cluster.metadata_url, args.value_bytes, args.native_seconds,
                                                     args.rate, args.paced_seconds))
        nat["bookies_cpu_us_per_record_incl_paced"] = (sum(cpu_s(pid) for pid in bookie_pids) - b0) / max(
            1, nat["records"] + int(args.rate * args.paced_seconds)) * 1e6
        print(f"native producer (streams client, append_many of 2,000 x {args.value_bytes} B, 20,000 in flight): "
              f"{nat['records_per_s']:,.0f} records/s, {nat['client_cpu_us_per_record']:.1f} µs client CPU/record, "
              f"bookies {nat['bookies_cpu_us_per_record_incl_paced']:.1f} µs/record (with the paced part); "
              f"paced at {args.rate:,.0f}/s: append p50 {nat['paced_p50_ms']:.2f} ms p99 {nat['paced_p99_ms']:.2f} ms",
              flush=True)

        def start_spy(phase: str) -> list:
            if not args.profile:
                return []
            return [subprocess.Popen([args.py_spy, "record", "-p", str(shim.pid), "-f", fmt, "-o",
                                      str(base / f"shim-{phase}.{ext}"), "--nonblocking", "-r", "50"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for fmt, ext in (("flamegraph", "svg"), ("raw", "txt"))]

        def stop_spy(spies: list) -> None:
            for sp in spies:
                sp.send_signal(2)
                sp.wait(30)

        bookie_pids = [b.popen.pid for b in cluster.bookies]

        def bookies_cpu() -> float:
            return sum(cpu_s(pid) for pid in bookie_pids)

        # the same produce with no consumer tailing the topic: what the native producer above does
        spies = start_spy("produce-alone")
        c0, b0 = cpu_s(shim.pid), bookies_cpu()
        results["produce_alone"] = alone = produce(bootstrap, topic, args.partitions, args.records, args.value_bytes)
        alone["shim_cpu_us_per_record"] = (cpu_s(shim.pid) - c0) / args.records * 1e6
        alone["bookies_cpu_us_per_record"] = (bookies_cpu() - b0) / args.records * 1e6
        stop_spy(spies)
        print(f"produce (no tailing consumer): {alone['records_per_s']:,.0f} records/s, {alone['mb_per_s']:.1f} MB/s, "
              f"delivery latency p50 {alone['p50_ms']:.1f} ms, errors {alone['errors']}, shim CPU "
              f"{alone['shim_cpu_us_per_record']:.1f} µs/record, bookies {alone['bookies_cpu_us_per_record']:.1f} "
              f"µs/record", flush=True)

        ctx = mp.get_context("spawn")
        ready, out = ctx.Event(), ctx.Queue()
        tail = ctx.Process(target=tail_consumer, args=(bootstrap, topic, args.partitions, args.records, ready, out))
        tail.start()
        ready.wait(60)
        spies = start_spy("produce")
        c0, b0 = cpu_s(shim.pid), bookies_cpu()
        results["produce"] = prod = produce(bootstrap, topic, args.partitions, args.records, args.value_bytes)
        prod["shim_cpu_us_per_record"] = (cpu_s(shim.pid) - c0) / args.records * 1e6
        prod["bookies_cpu_us_per_record"] = (bookies_cpu() - b0) / args.records * 1e6
        stop_spy(spies)
        tail_res = out.get(timeout=120)
        tail.join(10)
        results["tail"] = {"received": tail_res["received"], "e2e_p50_ms": pct(tail_res["e2e_ms"], 0.5),
                           "e2e_p99_ms": pct(tail_res["e2e_ms"], 0.99)}
        print(f"produce: {prod['records_per_s']:,.0f} records/s, {prod['mb_per_s']:.1f} MB/s, "
              f"delivery latency p50 {prod['p50_ms']:.1f} ms p99 {prod['p99_ms']:.1f} ms, errors {prod['errors']}, "
              f"shim CPU {prod['shim_cpu_us_per_record']:.1f} µs/record, bookies "
              f"{prod['bookies_cpu_us_per_record']:.1f} µs/record", flush=True)
        print(f"end to end (tailing consumer): p50 {results['tail']['e2e_p50_ms']:.1f} ms, "
              f"p99 {results['tail']['e2e_p99_ms']:.1f} ms ({tail_res['received']} records received)", flush=True)

        paced_n = int(args.rate * args.paced_seconds)
        lingers = [x.strip() for x in args.paced_lingers.split(",") if x.strip()] if paced_n else []
        results["paced_by_linger"] = {}
        for linger in lingers:
            conf = {} if linger == "default" else {"linger.ms": float(linger)}
            if linger == "default":
                conf["linger.ms"] = None  # drop the 5 ms produce() passes: librdkafka's own default
            ready, out = ctx.Event(), ctx.Queue()
            tail = ctx.Process(target=tail_consumer, args=(bootstrap, topic, args.partitions, paced_n, ready, out))
            tail.start()
            ready.wait(60)
            spies = start_spy(f"paced-linger{linger}")
            c0 = cpu_s(shim.pid)
            paced = produce(bootstrap, topic, args.partitions, paced_n, args.value_bytes, rate=args.rate, conf=conf,
                            shim_pid=shim.pid)
            shim_cpu_s = paced["shim_cpu_at_flush"] - c0  # the tail's reads included
            paced["shim_cpu_us_per_record"] = shim_cpu_s / paced_n * 1e6
            reqs = paced["produce_requests"]
            paced["shim_cpu_us_per_produce_request"] = shim_cpu_s / reqs * 1e6 if reqs else None
            stop_spy(spies)
            results["paced_by_linger"][linger] = paced
            results.setdefault("paced", paced)
            tail_res = out.get(timeout=120)
            tail.join(10)
            paced.update(e2e_p50_ms=pct(tail_res["e2e_ms"], 0.5), e2e_p99_ms=pct(tail_res["e2e_ms"], 0.99),
                         linger_ms=paced["linger_ms"])
            print(f"paced at {args.rate:,.0f}/s, linger.ms={linger} ({paced['linger_ms']:g}): "
                  f"{paced['records_per_s']:,.0f} records/s, delivery latency p50 "
                  f"{paced['p50_ms']:.1f} ms p99 {paced['p99_ms']:.1f} ms (p50 - linger.ms: "
                  f"{paced['p50_ms'] - paced['linger_ms']:.1f} ms; native append p50 {nat['paced_p50_ms']:.2f} ms); "
                  f"end to end p50 {paced['e2e_p50_ms']:.1f} ms p99 {paced['e2e_p99_ms']:.1f} ms; shim CPU "
                  f"{paced['shim_cpu_us_per_record']:.1f} µs/record (tailed)" + (
                      f"; {reqs:,} Produce requests ({paced_n / reqs:.2f} records each), shim CPU "
                      f"{paced['shim_cpu_us_per_produce_request']:.1f} µs/request" if reqs else ""), flush=True)

        spies = start_spy("consume")
        c0, b0 = cpu_s(shim.pid), bookies_cpu()
        results["consume"] = cons = consume_all(bootstrap, topic, args.partitions, 2 * args.records + paced_n * len(lingers),
                                                args.value_bytes)
        stop_spy(spies)
        cons["shim_cpu_us_per_record"] = (cpu_s(shim.pid) - c0) / max(1, cons["records"]) * 1e6
        cons["bookies_cpu_us_per_record"] = (bookies_cpu() - b0) / max(1, cons["records"]) * 1e6
        print(f"consume only: {cons['records_per_s']:,.0f} records/s, {cons['mb_per_s']:.1f} MB/s "
              f"({cons['records']} records), shim CPU {cons['shim_cpu_us_per_record']:.1f} µs/record, bookies "
              f"{cons['bookies_cpu_us_per_record']:.1f} µs/record", flush=True)
        results["load_avg_end"] = os.getloadavg()
        ratio = alone["records_per_s"] / nat["records_per_s"]
        results["produce_vs_native"] = ratio
        results["tailed_produce_vs_native"] = prod["records_per_s"] / nat["records_per_s"]
        paced_ok = None if not results["paced_by_linger"] else all(
            r["p50_ms"] - r["linger_ms"] <= GOAL_PACED_ABOVE_LINGER_MS for r in results["paced_by_linger"].values())
        print(f"issue 26: Kafka produce (no tail) / native producer records/s = {alone['records_per_s']:,.0f} / "
              f"{nat['records_per_s']:,.0f} = {ratio:.2f} (goal >= {GOAL_VS_NATIVE}: "
              f"{'met' if ratio >= GOAL_VS_NATIVE else 'NOT met'}); paced delivery p50 <= linger.ms + "
              f"{GOAL_PACED_ABOVE_LINGER_MS:g} ms: {'not run' if paced_ok is None else 'met' if paced_ok else 'NOT met'}; tailed produce / native "
              f"{results['tailed_produce_vs_native']:.2f}", flush=True)
        print(f"goals: produce >= {GOAL_PRODUCE:,}/s: {'met' if prod['records_per_s'] >= GOAL_PRODUCE else 'NOT met'}; "
              f"consume >= {GOAL_CONSUME:,}/s: {'met' if cons['records_per_s'] >= GOAL_CONSUME else 'NOT met'}; "
              f"load average {results['load_avg_start'][0]:.1f} -> {results['load_avg_end'][0]:.1f}")
        if args.profile:
            print(f"profiles: {base}/shim-{{produce,consume}}.{{svg,txt}}")
    finally:
        shim.terminate()
        try:
            shim.wait(15)
        except subprocess.TimeoutExpired:
            shim.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
