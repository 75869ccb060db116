"""The web console's cost: a stream-list page with 2,000 partitions, its idle CPU, and producers with it open.

How this works. One real cluster (``LocalCluster``: etcd + 3 bookies with their /metrics), the Kafka
listener as a ``scroll kafka`` process (with its group-lag /metrics) and the console as
``python -m compat_kafka.console`` sampling all of them every 10 s, as ``scroll standalone`` runs it.

* render: a topic of ``--partitions`` (2,000) partitions; the stream list (``/streams``, 25 rows a
  page by default, ``--page-size``: earliest/latest offsets and bytes of each row read on view) is fetched ``--renders`` times:
  first views (each a page not shown before, nothing cached), repeat views of one page (rows kept
  5 s) and searches (``wide:1x``, up to 11 rows each), over HTTP from this process (request to
  last byte). Reference in the same run: ``/healthz`` (the HTTP floor). Goal: <= 200 ms.
* idle: CPU seconds of the console process over ``--idle-seconds`` with nothing open (its sampler
  running), as % of one core; reference: the mean bookie process over the same interval. Goal: <= 1%.
* producers: a Kafka producer (confluent-kafka, acks=all) writes for ``--produce-seconds`` per
  phase, phases alternating without / with the console "open" (what an open page's JavaScript asks:
  a live tail of the produced topic polling /api/records every second, three graphs every 10 s);
  records/s of each phase and the with/without ratio. Goal: no slow-down (ratio ~1).

    .venv/bin/python bench/console.py                    # ~3 min
    .venv/bin/python bench/console.py --quick            # smaller, shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def get(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return time.perf_counter() - t0, len(body)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            get(url)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} does not answer")


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def produce_for(bootstrap: str, topic: str, seconds: float, value_bytes: int) -> float:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                  "queue.buffering.max.messages": 200_000})
    value = os.urandom(value_bytes)
    done = [0]

    def report(err, _msg):
        if err is None:
            done[0] += 1

    p.list_topics(topic, timeout=10)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            p.produce(topic, value=value, on_delivery=report)
        except BufferError:
            p.poll(0.005)
        p.poll(0)
    p.flush(30)
    return done[0] / (time.perf_counter() - t0)


class OpenPage(threading.Thread):
    """What an open console page asks of the server by itself (its JavaScript): a live tail polls
    /api/records every second and its graphs /api/series every 10 s (pages are not reloaded)."""

    def __init__(self, url: str, stream: str):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.stop = threading.Event()
        self.requests = 0

    def run(self) -> None:
        n = 0
        nxt = None
        while not self.stop.is_set():
            # as console.js: the page opens at the tail, then asks for what came after it
            tail = f"/api/records?stream={self.stream}&limit=50" + ("&mode=tail" if nxt is None else f"&live=1&offset={nxt}")
            paths = [tail]
            if n % 10 == 0:
                paths += ["/api/series?s=rate:bookie_add_bytes", "/api/series?s=rate:bookie_reads",
                          "/api/series?s=rate:errors"]
            for p in paths:
                try:
                    with urllib.request.urlopen(self.url + p, timeout=30) as r:
                        body = r.read()
                    self.requests += 1
                    if p is tail:
                        d = json.loads(body)
                        nxt = d["next"]
                except (OSError, ValueError, KeyError):
                    pass
            n += 1
            self.stop.wait(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=int, default=2000)
    ap.add_argument("--renders", type=int, default=20)
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--produce-seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--value-bytes", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=25, help="rows of the stream-list page (the console's default)")
    ap.add_argument("--render-only", action="store_true", help="only the render case")
    ap.add_argument("--no-render", action="store_true", help="skip the render case (no wide topic)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.partitions, a.renders, a.idle_seconds, a.produce_seconds, a.rounds = 500, 10, 20.0, 5.0, 1
    print(f"load before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="bench-console-") as tmp:
        tmp = Path(tmp)
        bm = [free_port() for _ in range(3)]
        cluster = LocalCluster(tmp / "cluster", bookies=3, bookie_metrics_ports=bm)
        cluster.start()
        procs = []
        try:
            kport, kmetrics, cport = free_port(), free_port(), free_port()
            kafka = start(["-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url, "--port", str(kport),
                           "--metrics-port", str(kmetrics)], tmp / "kafka.log")
            procs.append(kafka)
            sources = [f"kafka=http://127.0.0.1:{kmetrics}/metrics"] + [
                f"bookie-{i}=http://127.0.0.1:{p}/metrics" for i, p in enumerate(bm)]
            console = start(["-m", "compat_kafka.console", "--metadata", cluster.metadata_url, "--port", str(cport),
                             "--bootstrap", f"127.0.0.1:{kport}", *(x for s in sources for x in ("--metrics", s))],
                            tmp / "console.log")
            procs.append(console)
            url = f"http://127.0.0.1:{cport}"
            wait_http(url + "/healthz", console)
            wait_http(f"http://127.0.0.1:{kmetrics}/metrics", kafka)

            # ---------------------------------------------------------------- render
            async def create():
                from streams.client import connect

                c = await connect(cluster.metadata_url)
                try:
                    t0 = time.perf_counter()
                    await c.create_topic("wide", partitions=a.partitions)
                    return time.perf_counter() - t0
                finally:
                    await c.close()

            render, floor_ms = {}, 0.0
            if not a.no_render:
                took = asyncio.run(create())
                print(f"created topic 'wide' of {a.partitions} partitions in {took:.1f} s")
                get(url + "/streams?q=warm")  # the first listing of the ledger records (kept 2 s)
                n = a.page_size
                npages = a.partitions // n
                pages = {"first view": [f"/streams?size={n}&page={1 + i % npages}" for i in range(a.renders)],
                         "repeat view": [f"/streams?size={n}&page=1"] * a.renders,
                         "search": [f"/streams?q=wide:{10 + i}&size={n}" for i in range(a.renders)]}
                render = {}
                floor = [get(url + "/healthz")[0] for _ in range(a.renders)]
                for name, paths in pages.items():
                    times = [get(url + path)[0] for path in paths]
                    render[name] = {"median_ms": statistics.median(times) * 1000,
                                    "p90_ms": sorted(times)[int(len(times) * 0.9) - 1] * 1000}
                floor_ms = statistics.median(floor) * 1000
                print(f"load: {os.getloadavg()}")
                for name, r in render.items():
                    print(f"render ({n} rows) {name:12s} median {r['median_ms']:7.1f} ms  p90 {r['p90_ms']:7.1f} ms  "
                          f"(healthz floor {floor_ms:.1f} ms; ratio {r['median_ms'] / floor_ms:.1f}x; goal <= 200 ms)")

            if a.render_only:
                return 0
            # ---------------------------------------------------------------- idle
            time.sleep(2)
            bookie_pids = [b.popen.pid for b in cluster.bookies]
            c0, b0, t0 = cpu_s(console.pid), [cpu_s(p) for p in bookie_pids], time.monotonic()
            time.sleep(a.idle_seconds)
            dt = time.monotonic() - t0
            idle = (cpu_s(console.pid) - c0) / dt * 100
            bookie_idle = statistics.mean((cpu_s(p) - x) / dt * 100 for p, x in zip(bookie_pids, b0))
            print(f"idle: console {idle:.2f}% of a core over {dt:.0f} s (a bookie: {bookie_idle:.2f}%; "
                  f"ratio {idle / bookie_idle if bookie_idle else float('nan'):.2f}); goal <= 1%  load {os.getloadavg()}")

            # ---------------------------------------------------------------- producers
            bootstrap = f"127.0.0.1:{kport}"
            produce_for(bootstrap, "bench-produce", 1.0, a.value_bytes)  # warm-up, creates the topic
            without, with_open = [], []
            cpu = {"without": [0.0, 0.0], "with": [0.0, 0.0]}  # console, bookies: CPU seconds
            for _ in range(a.rounds):
                for phase in ("without", "with"):
                    page = OpenPage(url, "bench-produce") if phase == "with" else None
                    if page is not None:
                        page.start()
                    c0, b0 = cpu_s(console.pid), sum(cpu_s(p) for p in bookie_pids)
                    rate = produce_for(bootstrap, "bench-produce", a.produce_seconds, a.value_bytes)
                    cpu[phase][0] += cpu_s(console.pid) - c0
                    cpu[phase][1] += sum(cpu_s(p) for p in bookie_pids) - b0
                    (with_open if page is not None else without).append(rate)
                    if page is not None:
                        page.stop.set()
                        page.join(10)
            w, o = statistics.mean(without), statistics.mean(with_open)
            for phase, (cc, bc) in cpu.items():
                secs = a.rounds * a.produce_seconds
                print(f"  {phase:7s} the console open: console CPU {cc / secs * 100:.1f}% of a core, bookies "
                      f"{bc / secs * 100:.0f}%")
            print(f"producer: {w:,.0f} records/s without the console open, {o:,.0f} with it open "
                  f"(ratio {o / w:.3f}; rounds {[round(x) for x in without]} / {[round(x) for x in with_open]})  "
                  f"load {os.getloadavg()}")
            if a.json:
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                Path(a.json).write_text(json.dumps({"partitions": a.partitions, "render": render,
                                                    "healthz_ms": floor_ms, "idle_pct": idle,
                                                    "bookie_idle_pct": bookie_idle, "produce_without": without,
                                                    "produce_with_console": with_open}, indent=2))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
