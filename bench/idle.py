"""The idle cost of ``scroll standalone`` (issue 26): CPU of its whole process tree with many open
partitions and no traffic, against the same tree with ~0 streams, in the same run.

For each case (``--partitions 0`` first, as the reference, then ``--partitions N``): start the real
``scroll standalone`` (a data directory and free ports of its own), create ``--topics`` topics
holding N partitions in all through Kafka, write one record to each partition (so the Kafka
listener opens and owns every one of them), wait ``--settle`` seconds (the first retention,
compaction and offload runs fall in it), then measure over ``--window`` seconds:

* the CPU of every process of the tree (standalone itself, etcd, the bookies, the Kafka listener,
  SeaweedFS, ...), per process and in total, as % of one core (psutil);
* etcd's request counters over the window (its /metrics: gRPC calls by method, mvcc range/txn/put
  totals), per second.

``--profile S`` then records every Python process of the tree for S seconds with py-spy (after the
window, so it does not weigh on the figures) and prints the top frames of each.

    .venv/bin/python bench/idle.py --partitions 2000 --window 60
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _free_block(n: int) -> int:
    """A base port with ``n`` free consecutive ports after it (127.0.0.1)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


def _etcd_counters(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{"):
            m = re.search(r'grpc_method="([^"]+)"', line)
            if m:
                key = "grpc " + m.group(1)
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        for name in ("etcd_mvcc_range_total", "etcd_mvcc_txn_total", "etcd_mvcc_put_total",
                     "etcd_mvcc_delete_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _name(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    exe = os.path.basename(cmd[0]) if cmd else "?"
    if "streams.tools.cli" in cmd:
        sub = cmd[cmd.index("streams.tools.cli") + 1] if cmd.index("streams.tools.cli") + 1 < len(cmd) else "?"
        if sub == "bookie":
            m = re.search(r"bookie-(\d+)", " ".join(cmd))
            return f"bookie-{m.group(1)}" if m else "bookie"
        return {"kafka": "kafka listener"}.get(sub, sub)
    if "compat_kafka.console" in cmd:
        return "console"
    if exe == "etcd":
        return "etcd"
    if "weed" in exe:
        return "seaweedfs " + (cmd[1] if len(cmd) > 1 else "")
    return exe


def _tree(root: psutil.Process) -> list[psutil.Process]:
    return [root, *root.children(recursive=True)]


def _cpu(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _produce(port: int, topics: int, partitions: int) -> float:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    per = partitions // topics
    names = [f"idle-{i}" for i in range(topics)]
    t0 = time.monotonic()
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"})
    for fut in admin.create_topics([NewTopic(n, num_partitions=per, replication_factor=1)
                                     for n in names], request_timeout=300).values():
        fut.result()
    prod = Producer({"bootstrap.servers": f"127.0.0.1:{port}", "acks": "all", "linger.ms": 5,
                     "message.timeout.ms": 600_000})
    failed = []

    def report(err, msg):
        if err is not None:
            failed.append(err)

    for n in names:
        for p in range(per):
            prod.produce(n, b"x" * 100, partition=p, on_delivery=report)
            prod.poll(0)
    left = prod.flush(600)
    if left or failed:
        raise RuntimeError(f"produce: {left} undelivered, {len(failed)} failed ({failed[:3]})")
    return time.monotonic() - t0


def _profile(procs: list[tuple[str, psutil.Process]], seconds: float, out_dir: Path) -> dict[str, list[str]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    runs = []
    for name, p in procs:
        path = out_dir / f"{name.replace(' ', '_')}-{p.pid}.txt"
        runs.append((name, path, subprocess.Popen(
            [spy, "record", "-p", str(p.pid), "-d", str(int(seconds)), "-f", "raw", "-o", str(path), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    tops: dict[str, list[str]] = {}
    for name, path, proc in runs:
        proc.wait(seconds + 60)
        tops[name] = _top_frames(path) if path.exists() else ["(no profile)"]
    return tops


_OURS = ("streams/", "bookie/", "compat_kafka/", "fragments/", "terms/", "aetcd/", "grpc/")


def _top_frames(path: Path, n: int = 6) -> list[str]:
    """From py-spy's raw output: the leaf functions (where the samples were) and our own functions
    most often on the stack (inclusive), line numbers dropped."""
    leaf: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            c = int(count)
        except ValueError:
            continue
        total += c
        frames = [re.sub(r":\d+\)$", ")", fr) for fr in stack.split(";")]
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + c
        for fr in set(frames):
            if any(o in fr for o in _OURS):
                incl[fr] = incl.get(fr, 0) + c
    out = [f"self  {c:5d}/{total} {fr}" for fr, c in sorted(leaf.items(), key=lambda kv: -kv[1])[:n]]
    out += [f"incl  {c:5d}/{total} {fr}" for fr, c in sorted(incl.items(), key=lambda kv: -kv[1])[:n]]
    return out


def start_standalone(data: Path, extra: list[str] | None = None, timeout_s: float = 180.0, root: Path = ROOT):
    """Start the real ``scroll standalone`` (the code of the checkout ``root``) on ``data`` with free
    ports of its own (127.0.0.1) and wait for its ready line: (the Popen, its ports by option name,
    the open log file)."""
    kafka, etcd, peer = (_free_block(1) for _ in range(3))
    bookie, metrics, objstore = _free_block(3), _free_block(5), _free_block(8)
    console = _free_block(1)
    ports = {"kafka": kafka, "etcd": etcd, "etcd-peer": peer, "bookie": bookie, "metrics": metrics,
             "object-store": objstore, "console": console}
    cmd = [sys.executable, "-m", "streams.tools.cli", "standalone", "--data-dir", str(data),
           "--kafka-port", str(kafka), "--etcd-port", str(etcd), "--etcd-peer-port", str(peer),
           "--bookie-port", str(bookie), "--metrics-port", str(metrics), "--object-store-port", str(objstore),
           "--console-port", str(console), "--default-partitions", "1", *(extra or [])]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(data / "standalone.out", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "scroll standalone ready" not in (data / "standalone.out").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("standalone did not start:\n" + (data / "standalone.out").read_text()[-3000:])
            time.sleep(0.5)
    except BaseException:
        stop_standalone(proc, log)
        raise
    return proc, ports, log


def stop_standalone(proc: subprocess.Popen, log) -> None:
    """SIGINT (standalone stops its children itself), SIGKILL to the group after 120 s."""
    try:
        proc.send_signal(signal.SIGINT)
    except ProcessLookupError:
        pass
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def run_case(partitions: int, topics: int, settle: float, window: float, profile: float, keep: bool) -> dict:
    data = Path(tempfile.mkdtemp(prefix=f"idle-{partitions}-"))
    proc, ports, log = start_standalone(data)
    kafka, etcd = ports["kafka"], ports["etcd"]
    try:
        made = _produce(kafka, max(1, topics), partitions) if partitions else 0.0
        print(f"[{partitions} partitions] created and written in {made:.1f} s; settling {settle:g} s", flush=True)
        time.sleep(settle)
        root = psutil.Process(proc.pid)
        procs = _tree(root)
        names = {p.pid: _name(p) for p in procs}
        c0, e0, t0 = _cpu(procs), _etcd_counters(etcd), time.monotonic()
        time.sleep(window)
        c1, e1, dt = _cpu(procs), _etcd_counters(etcd), time.monotonic() - t0
        per: dict[str, float] = {}
        for pid, v in c1.items():
            if pid in c0:
                k = names[pid]
                per[k] = per.get(k, 0.0) + (v - c0[pid]) / dt * 100
        rates = {k: (e1.get(k, 0) - e0.get(k, 0)) / dt for k in sorted(set(e0) | set(e1))}
        out = {"partitions": partitions, "window_s": dt, "cpu_percent_of_a_core": per,
               "total_percent_of_a_core": sum(per.values()),
               "etcd_requests_per_s": {k: v for k, v in rates.items() if v > 0},
               "load": os.getloadavg()}
        if profile:
            pyprocs = [(names[p.pid], p) for p in procs if names[p.pid] != "etcd" and
                       not names[p.pid].startswith("seaweedfs") and p.is_running()]
            pdir = data / "profiles"
            pdir.mkdir()
            out["profile_dir"] = str(pdir)
            out["profile"] = _profile(pyprocs, profile, pdir)
        return out
    finally:
        stop_standalone(proc, log)
        if not keep:
            shutil.rmtree(data, ignore_errors=True)


def _print(r: dict) -> None:
    print(f"\n== {r['partitions']} partitions, {r['window_s']:.0f} s window, load {r['load'][0]:.2f} ==")
    for k, v in sorted(r["cpu_percent_of_a_core"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:6.2f} % of a core")
    print(f"  {'TOTAL':28s} {r['total_percent_of_a_core']:6.2f} % of a core")
    print("  etcd requests/s: " + ", ".join(f"{k} {v:.2f}" for k, v in r["etcd_requests_per_s"].items()))
    for name, lines in (r.get("profile") or {}).items():
        print(f"  py-spy {name}:")
        for line in lines:
            print("     " + line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, default=2000)
    ap.add_argument("--topics", type=int, default=20)
    ap.add_argument("--settle", type=float, default=45.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--profile", type=float, default=0.0, help="py-spy seconds per process after the window")
    ap.add_argument("--no-reference", action="store_true", help="skip the empty-platform reference")
    ap.add_argument("--keep", action="store_true", help="keep the data directories (and profiles)")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    results = {}
    if not args.no_reference:
        results["reference"] = run_case(0, args.topics, args.settle, args.window, args.profile, args.keep)
        _print(results["reference"])
    results["loaded"] = run_case(args.partitions, args.topics, args.settle, args.window, args.profile, args.keep)
    _print(results["loaded"])
    if "reference" in results:
        ref, got = results["reference"]["total_percent_of_a_core"], results["loaded"]["total_percent_of_a_core"]
        print(f"\nratio {args.partitions} partitions / empty: {got:.2f} / {ref:.2f} = {got / ref:.2f}")
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
