"""Benchmark one bookie on loopback: acknowledged adds/s, MB/s and add latency, against a reference.

How this works. For every (entry size, concurrent ledgers) case it starts a fresh ``scroll bookie``
(default configuration, data on a temporary directory of the disk under test, metrics enabled), and
drives it from this process with ``bookie.client.BookieClient``: each ledger is taken over (fence,
truncating no-op at entry 0) and then written by a pipelined writer that keeps ``window`` entries in
flight in groups of ``group`` (``submit_columns``), piggybacking its LAC. Adds acknowledged during
the measured interval count; the latency of an add is the time from its submit to its
acknowledgement. The bookie's own metrics give the journal's group commits (fsyncs and bytes).

The reference: a plain Python loop appending the same payload bytes to a file on the same disk,
with the same batching (the bookie's payload bytes per journal fsync), fdatasync after each batch.
The ratio bookie MB/s / reference MB/s shows how much of the disk path the bookie keeps.

    .venv/bin/python bench/bookie.py            # 1 KiB and 100 B entries, 1/8/64 ledgers, 10 s each
    .venv/bin/python bench/bookie.py --quick    # a few seconds in all
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bookie.client import BookieClient  # noqa: E402
from bookie.runtime import tune_malloc  # noqa: E402
from terms.messages import AddRequest  # noqa: E402

GOAL_ADDS = 100_000


@dataclass
class CaseResult:
    entry_bytes: int
    ledgers: int
    seconds: float
    adds_per_s: float
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    fsyncs_per_s: float
    adds_per_fsync: float
    server_cpu_us_per_add: float
    client_cpu_us_per_add: float
    reference_mb_per_s: float = 0.0
    ratio: float = 0.0


# ------------------------------------------------------------------------------ the bookie


class Bookie:
    def __init__(self, data_dir: Path, extra: list[str]) -> None:
        scroll = Path(sys.executable).with_name("scroll")
        cmd = [str(scroll)] if scroll.exists() else [sys.executable, "-c", "from streams.tools.cli import main; main()"]
        args = [*cmd, "bookie", "--data-dir", str(data_dir), "--port", "0", "--metrics-port", "0", "--log-level", "WARNING", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        m = re.search(r"address=(\S+) .*metrics=(\S+)", line)
        if not m:
            self.proc.kill()
            raise SystemExit(f"bookie did not start: {line!r}")
        self.address, self.metrics_at = m.group(1), m.group(2)

    def metric(self, *names: str) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://{self.metrics_at}/metrics", timeout=10).read().decode()
        out = {}
        for name in names:
            m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
            out[name] = float(m.group(1)) if m else 0.0
        return out

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------ the load


class Load:
    def __init__(self, client: BookieClient, ledgers: int, entry_bytes: int, window: int, group: int) -> None:
        self.client = client
        self.ledgers = list(range(1, ledgers + 1))
        self.window = window
        self.group = group
        self.payload = os.urandom(entry_bytes)
        self.measuring = False
        self.stop = False
        self.acked = 0
        self.latencies: list[tuple[float, int]] = []  # (seconds, adds with that latency)

    async def take_over(self) -> None:
        for lid in self.ledgers:
            await self.client.fence(lid, 1)
            res = await self.client.add(AddRequest(lid, 0, 1, -1, -1, b"\x01", truncate=True))
            assert type(res).__name__ == "AddOk", res

    async def writer(self, lid: int) -> None:
        next_id, lac, inflight = 1, 0, []
        c, g, payload = self.client, self.group, self.payload
        while not self.stop or inflight:
            if not self.stop and len(inflight) * g < self.window:
                ids = list(range(next_id, next_id + g))
                next_id += g
                fut = c.submit_columns([lid] * g, ids, [1] * g, [lac] * g, [lac] * g, [payload] * g)
                inflight.append((time.perf_counter(), fut, ids[-1]))
                continue
            started, fut, last = inflight.pop(0)
            res = await fut
            if not res.all_ok:
                raise SystemExit(f"ledger {lid}: adds failed: {res.error or res.statuses[:5]}")
            lac = last
            if self.measuring:
                self.acked += g
                self.latencies.append((time.perf_counter() - started, g))


def percentile(samples: list[tuple[float, int]], q: float) -> float:
    samples = sorted(samples)
    total = sum(n for _s, n in samples)
    seen = 0
    for value, n in samples:
        seen += n
        if seen >= q * total:
            return value
    return samples[-1][0] if samples else 0.0


async def run_case(bookie: Bookie, entry_bytes: int, ledgers: int, seconds: float, warmup: float, inflight: int) -> CaseResult:
    window = max(32, inflight // ledgers)  # entries in flight per ledger
    group = max(1, min(100, window // 4))
    async with BookieClient(bookie.address, max_batch_adds=4000, max_batch_bytes=8 << 20, max_inflight_batches=8) as client:
        load = Load(client, ledgers, entry_bytes, window, group)
        await load.take_over()
        tasks = [asyncio.ensure_future(load.writer(lid)) for lid in load.ledgers]
        await asyncio.sleep(warmup)
        names = ("scroll_bookie_journal_group_bytes_count", "scroll_bookie_journal_group_bytes_sum")
        before = bookie.metric(*names)
        cpu0, ccpu0, t0 = bookie.cpu_s(), time.process_time(), time.perf_counter()
        load.measuring = True
        await asyncio.sleep(seconds)
        load.measuring = False
        elapsed = time.perf_counter() - t0
        cpu1, ccpu1 = bookie.cpu_s(), time.process_time()
        after = bookie.metric(*names)
        load.stop = True
        await asyncio.gather(*tasks)
    fsyncs = after[names[0]] - before[names[0]]
    adds = max(load.acked, 1)
    return CaseResult(
        entry_bytes=entry_bytes, ledgers=ledgers, seconds=round(elapsed, 2),
        adds_per_s=adds / elapsed, mb_per_s=adds * entry_bytes / elapsed / 1e6,
        p50_ms=percentile(load.latencies, 0.5) * 1e3, p99_ms=percentile(load.latencies, 0.99) * 1e3,
        fsyncs_per_s=fsyncs / elapsed, adds_per_fsync=adds / max(fsyncs, 1),
        server_cpu_us_per_add=(cpu1 - cpu0) / adds * 1e6, client_cpu_us_per_add=(ccpu1 - ccpu0) / adds * 1e6,
    )


# ------------------------------------------------------------------------------ the reference


def reference(directory: Path, payload_bytes: int, batch_bytes: int, seconds: float) -> float:
    """A plain loop: append batch_bytes, fdatasync, repeat, for about `seconds`. Returns MB/s."""
    batch = os.urandom(max(1, batch_bytes))
    path = directory / "reference.dat"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    written, start = 0, time.perf_counter()
    try:
        while written < payload_bytes and time.perf_counter() - start < seconds:
            os.write(fd, batch)
            os.fdatasync(fd)
            written += len(batch)
    finally:
        os.close(fd)
        path.unlink()
    return written / (time.perf_counter() - start) / 1e6


# ------------------------------------------------------------------------------ main


def main() -> int:
    args = parse_args()
    tune_malloc()
    return asyncio.run(amain(args))  # one event loop for every case (grpc.aio keeps a poller per loop)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short cases (about 1.5 s each)")
    ap.add_argument("--seconds", type=float, default=None, help="measured seconds per case (default 10; quick 1.5)")
    ap.add_argument("--sizes", default="1024,100", help="entry sizes in bytes")
    ap.add_argument("--ledgers", default="1,8,64", help="concurrent ledgers per case")
    ap.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="bookie config override")
    ap.add_argument("--inflight", type=int, default=4096, help="adds in flight over all ledgers")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args()


async def amain(args: argparse.Namespace) -> int:
    seconds = args.seconds or (1.5 if args.quick else 10.0)
    warmup = 0.5 if args.quick else 2.0
    base = Path(tempfile.mkdtemp(prefix="bookie-bench-", dir=args.dir))
    extra = [x for kv in args.overrides for x in ("--set", kv)]
    results: list[CaseResult] = []
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} cpus, data under {base}")
    try:
        for size in [int(s) for s in args.sizes.split(",")]:
            for ledgers in [int(n) for n in args.ledgers.split(",")]:
                case_dir = base / f"b{size}-{ledgers}"
                bookie = Bookie(case_dir, extra)
                try:
                    r = await run_case(bookie, size, ledgers, seconds, warmup, args.inflight)
                finally:
                    await asyncio.get_running_loop().run_in_executor(None, bookie.stop)
                    shutil.rmtree(case_dir, ignore_errors=True)
                batch = int(r.adds_per_fsync * size)
                r.reference_mb_per_s = reference(base, int(r.mb_per_s * 1e6 * seconds), batch, seconds)
                r.ratio = r.mb_per_s / r.reference_mb_per_s if r.reference_mb_per_s else 0.0
                results.append(r)
                print_row(r)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summarize(results)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


HEADER = (f"{'entry':>6} {'ledgers':>7} {'adds/s':>9} {'MB/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'fsync/s':>8} "
          f"{'adds/fsync':>10} {'srv us/add':>10} {'cli us/add':>10} {'ref MB/s':>8} {'ratio':>6}")


def print_row(r: CaseResult) -> None:
    if not getattr(print_row, "header", False):
        print(HEADER)
        print_row.header = True
    print(f"{r.entry_bytes:>6} {r.ledgers:>7} {r.adds_per_s:>9.0f} {r.mb_per_s:>7.1f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} "
          f"{r.fsyncs_per_s:>8.0f} {r.adds_per_fsync:>10.0f} {r.server_cpu_us_per_add:>10.1f} "
          f"{r.client_cpu_us_per_add:>10.1f} {r.reference_mb_per_s:>8.1f} {r.ratio:>6.2f}", flush=True)


def summarize(results: list[CaseResult]) -> None:
    kib = [r for r in results if r.entry_bytes == 1024]
    if not kib:
        return
    best = max(kib, key=lambda r: r.adds_per_s)
    print(f"goal: >= {GOAL_ADDS} acknowledged 1 KiB adds/s and >= 50% of the reference MB/s")
    print(f"best 1 KiB case: {best.adds_per_s:.0f} adds/s ({best.ledgers} ledgers), "
          f"{best.ratio:.0%} of the reference -> adds goal {'MET' if best.adds_per_s >= GOAL_ADDS else 'NOT met'}, "
          f"ratio goal {'MET' if best.ratio >= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    raise SystemExit(main())
