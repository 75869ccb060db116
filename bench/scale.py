"""Scale curves (issue 26): how the cost of Scroll grows with the number of streams, the number of
fragments of one stream, the number of tailing readers of one stream and the number of producers.

One real cluster per phase (``streams.tools.localcluster.LocalCluster``: a real etcd and three real
bookie processes on 127.0.0.1, data in a temporary directory) and the native async client
(``streams.client.connect``). Each phase prints a table and goes into the results JSON; each curve
is given next to a reference measured in the same run (its first point, or the bare etcd):

* ``streams``: create N streams (``--concurrency`` create calls in flight, as a user of the async
  client would), list them, open a producer and append one record on ``--sample`` random streams,
  then the idle CPU of etcd and of the bookies over ``--window`` seconds, etcd's db size (its
  /metrics ``etcd_mvcc_db_total_size_in_bytes`` and ``..._in_use_...``), etcd's RSS and the keys
  and key+value bytes per stream. The sizes grow in one cluster (1k, then 9k more to 10k, ...);
  the reference row is the same cluster with no stream.
* ``fragments``: one stream rolled over to F fragments (``fragment_entries_max`` =
  ``--entries-per-fragment``, one record per entry), then: open a producer (a take-over), open a
  consumer at the earliest offset, seek by offset (middle, end) and by timestamp (middle), describe
  the stream, and a retention run that deletes the first half; the same on a 10-fragment stream
  is the reference.
* ``fanout``: R tailing consumers (start at "latest") of one stream, in ``--fanout-procs``
  worker processes of their own (one Python process cannot decode for 1,000 readers), a producer
  appending a batch of ``--fanout-batch`` records every ``--fanout-batch / --rate`` seconds. The
  record's value carries its append time (time.time()); a reader's delivery latency is its
  receive time minus that. Reported: p50 / p99, delivered records/s, bookie CPU (% of a core and
  CPU-µs per delivered record). 1 reader is the reference.
* ``producers``: P producers on P streams in this process, each appending ``--chunk`` 100-byte
  records per call for ``--duration`` seconds; aggregate records/s and bookie CPU. 1 producer is
  the reference.

    .venv/bin/python bench/scale.py --quick                          # every phase, small sizes (< 2 min)
    .venv/bin/python bench/scale.py --phases streams --streams 1000,10000,30000 --json /tmp/s.json
    .venv/bin/python bench/scale.py --phases fanout --readers 1,10,100,1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

try:
    import psutil
except ImportError:  # the bench extra
    sys.exit("bench/scale.py needs psutil: .venv/bin/pip install -e '.[bench]'")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streams.client import connect  # noqa: E402
from streams.tools.localcluster import LocalCluster  # noqa: E402

VALUE = b"v" * 100


# ------------------------------------------------------------------------------------ helpers
def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _etcd_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = ("etcd_mvcc_db_total_size_in_bytes", "etcd_mvcc_db_total_size_in_use_in_bytes",
            "etcd_debugging_mvcc_keys_total", "etcd_server_quota_backend_bytes")
    out = {}
    for line in text.splitlines():
        for name in want:
            if line.startswith(name + " "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def _procs(cluster: LocalCluster) -> dict[str, psutil.Process]:
    out = {"etcd": psutil.Process(cluster.etcd.popen.pid)}
    for b in cluster.bookies:
        out[b.name] = psutil.Process(b.popen.pid)
    return out


def _cpu(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for k, p in procs.items():
        t = p.cpu_times()
        out[k] = t.user + t.system
    return out


def _bookie_cpu_s(c0: dict, c1: dict) -> float:
    return sum(c1[k] - c0[k] for k in c1 if k.startswith("bookie"))


def _pct(seconds: float, wall: float) -> float:
    return seconds / wall * 100 if wall > 0 else 0.0


def _q(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Cluster:
    """A LocalCluster in a temporary directory and a client of it; stopped on exit, even on error."""

    def __init__(self, tag: str, keep: bool):
        self.dir = Path(tempfile.mkdtemp(prefix=f"scale-{tag}-"))
        self.keep = keep
        self.lc = LocalCluster(self.dir, bookies=3)
        self.client = None

    async def __aenter__(self) -> Cluster:
        await asyncio.to_thread(self.lc.start, 60.0)
        try:
            self.client = await connect(self.lc.metadata_url)
        except BaseException:
            self.lc.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        finally:
            self.lc.stop()
            if not self.keep:
                shutil.rmtree(self.dir, ignore_errors=True)


async def _kv_bytes(store, prefix: str) -> tuple[int, int]:
    items = await store.list_prefix(prefix)
    return len(items), sum(len(k) + len(v.value) for k, v in items)


# ------------------------------------------------------------------------------------ streams
async def phase_streams(args) -> dict:
    sizes = sorted(args.streams)
    rows = []
    async with Cluster("streams", args.keep) as c:
        client, port = c.client, c.lc.etcd_port
        procs = _procs(c.lc)

        async def measure(n: int, created_s: float) -> dict:
            t0 = time.perf_counter()
            listed = await client.list_streams()
            list_s = time.perf_counter() - t0
            assert len(listed) == n, (len(listed), n)
            opens = []
            if n:
                for name in random.Random(n).sample([f"s{i:06d}" for i in range(n)], min(args.sample, n)):
                    t0 = time.perf_counter()
                    p = await client.producer(name)
                    await p.append(VALUE)
                    opens.append(time.perf_counter() - t0)
                    await p.close()
            await asyncio.sleep(args.settle)
            c0, w0 = _cpu(procs), time.monotonic()
            await asyncio.sleep(args.window)
            c1, wall = _cpu(procs), time.monotonic() - w0
            m = _etcd_metrics(port)
            keys, kvb = await _kv_bytes(c.client.cluster.store, "/")
            return {"streams": n, "create_s": created_s, "create_per_s": (n - prev_n) / created_s if created_s else None,
                    "list_s": list_s, "open_append_ms_p50": _q(opens, 0.5) * 1e3 if opens else None,
                    "open_append_ms_p99": _q(opens, 0.99) * 1e3 if opens else None,
                    "idle_cpu_pct": {k: _pct(c1[k] - c0[k], wall) for k in c1},
                    "etcd_rss_mib": procs["etcd"].memory_info().rss / 2**20,
                    "etcd_db_bytes": m.get("etcd_mvcc_db_total_size_in_bytes"),
                    "etcd_db_in_use_bytes": m.get("etcd_mvcc_db_total_size_in_use_in_bytes"),
                    "etcd_keys": m.get("etcd_debugging_mvcc_keys_total"), "kv_keys": keys, "kv_bytes": kvb,
                    "quota_bytes": m.get("etcd_server_quota_backend_bytes"), "load": os.getloadavg()}

        prev_n = 0
        rows.append(await measure(0, 0.0))  # the reference: the same etcd and bookies, no stream
        _print_streams(rows)
        for n in sizes:
            sem = asyncio.Semaphore(args.concurrency)

            async def make(i: int, sem=sem) -> None:
                async with sem:
                    await client.create_stream(f"s{i:06d}", ensemble=3, write_quorum=3, ack_quorum=2)

            t0 = time.perf_counter()
            await asyncio.gather(*(make(i) for i in range(prev_n, n)))
            created = time.perf_counter() - t0
            rows.append(await measure(n, created))
            prev_n = n
            _print_streams(rows)
    return {"rows": rows}


def _print_streams(rows: list[dict]) -> None:
    ref = rows[0]
    print(f"\n{'streams':>8} {'create/s':>9} {'list s':>7} {'open+append ms p50/p99':>23} "
          f"{'idle CPU % etcd':>15} {'bookies':>8} {'etcd RSS MiB':>12} {'db MiB':>7} {'in use':>7} "
          f"{'keys/stream':>11} {'KV B/stream':>11}")
    for r in rows:
        n = r["streams"]
        def per(k: str, r=r, n=n) -> float:
            return (r[k] - ref[k]) / n if n and r[k] is not None else float("nan")

        bookies = sum(v for k, v in r["idle_cpu_pct"].items() if k.startswith("bookie"))
        oa = f"{r['open_append_ms_p50']:.1f}/{r['open_append_ms_p99']:.1f}" if r["open_append_ms_p50"] else "-"
        print(f"{n:>8} {r['create_per_s'] or 0:>9.0f} {r['list_s']:>7.2f} {oa:>23} "
              f"{r['idle_cpu_pct']['etcd']:>15.2f} {bookies:>8.2f} {r['etcd_rss_mib']:>12.1f} "
              f"{r['etcd_db_bytes'] / 2**20:>7.1f} {r['etcd_db_in_use_bytes'] / 2**20:>7.1f} "
              f"{per('kv_keys'):>11.2f} {per('kv_bytes'):>11.0f}")
    print(f"  load {rows[-1]['load'][0]:.2f}; reference row 0 = the same cluster before any stream", flush=True)


# ------------------------------------------------------------------------------------ fragments
IDLE_TAIL_S = 10.0


def _etcd_requests(port: int) -> float:
    """Requests etcd has received so far (its /metrics, every gRPC method but lease keep-alives)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    n = 0.0
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{") and "LeaseKeepAlive" not in line:
            n += float(line.rsplit(" ", 1)[1])
    return n


async def _one_fragment_curve(client, name: str, fragments: int, per: int, etcd_port: int) -> dict:
    from streams.tools.retention import apply

    await client.create_stream(name, ensemble=3, write_quorum=3, ack_quorum=2, fragment_entries_max=per)
    p = await client.producer(name)
    ts0 = 1_700_000_000_000
    t0 = time.perf_counter()
    n = fragments * per
    for i in range(n):  # one record per call: one entry each (sequential, nothing to batch with)
        await p.append(VALUE, timestamp_ms=ts0 + i)
    write_s = time.perf_counter() - t0
    await p.close()
    info = await client.describe_stream(name)
    out = {"fragments": len(info.fragments), "records": n, "write_s": write_s}
    ledger_id = info.meta.ledger_id
    from fragments.ledgers import fragments_prefix

    keys, kvb = await _kv_bytes(client.cluster.store, fragments_prefix(ledger_id))
    out["fragment_key_bytes"] = kvb / max(1, keys)

    async def timed(label: str, coro):
        t = time.perf_counter()
        res = await coro
        out[label] = (time.perf_counter() - t) * 1e3
        return res

    p = await timed("open_producer_ms", client.producer(name))
    await p.close()
    cons = await timed("open_consumer_ms", client.consumer(name, start="earliest"))
    await timed("seek_middle_ms", cons.seek(n // 2))
    got = await cons.read(1)
    assert got and got[0].offset == n // 2, got
    await timed("seek_end_ms", cons.seek(n - 1))
    pos = await timed("seek_timestamp_ms", cons.seek_timestamp(ts0 + n // 3))
    assert pos == n // 3, pos
    await cons.close()
    # an idle tailing consumer (caught up, long-polling for more): this process's CPU and etcd's
    # requests while it waits, per minute
    tail = await client.consumer(name, start="latest")
    m0, cpu0, w0 = _etcd_requests(etcd_port), time.process_time(), time.monotonic()
    while time.monotonic() - w0 < IDLE_TAIL_S:
        await tail.read(100, timeout_s=1.0)
    wall = time.monotonic() - w0
    out["idle_tail_cpu_pct"] = _pct(time.process_time() - cpu0, wall)
    out["idle_tail_etcd_req_per_min"] = (_etcd_requests(etcd_port) - m0) * 60 / wall
    await tail.close()
    await timed("describe_ms", client.describe_stream(name))
    rep = await timed("retention_half_ms", apply(client, name, n // 2, floors=[], respect_consumers=False))
    out["retention_removed_fragments"] = rep.fragments if hasattr(rep, "fragments") else None
    after = await client.describe_stream(name)
    out["fragments_after_retention"] = len(after.fragments)
    return out


async def phase_fragments(args) -> dict:
    rows = []
    async with Cluster("fragments", args.keep) as c:
        for f in (10, args.fragments):
            m0 = _etcd_metrics(c.lc.etcd_port)
            r = await _one_fragment_curve(c.client, f"frag-{f}", f, args.entries_per_fragment, c.lc.etcd_port)
            m1 = _etcd_metrics(c.lc.etcd_port)
            # etcd keeps every revision (nothing compacts its history): what the stream's writes,
            # rollovers and retention cost the db file, per fragment the stream ever had
            r["etcd_db_bytes_per_fragment"] = (m1["etcd_mvcc_db_total_size_in_bytes"]
                                               - m0["etcd_mvcc_db_total_size_in_bytes"]) / f
            r["load"] = os.getloadavg()
            rows.append(r)
    ref, big = rows
    print(f"\n{'':24} {'10 fragments':>14} {big['fragments']:>8} fragments {'ratio':>8}")
    for k in ("write_s", "open_producer_ms", "open_consumer_ms", "seek_middle_ms", "seek_end_ms",
              "seek_timestamp_ms", "idle_tail_cpu_pct", "idle_tail_etcd_req_per_min", "describe_ms", "retention_half_ms", "fragment_key_bytes",
              "fragments_after_retention", "etcd_db_bytes_per_fragment"):
        ratio = big[k] / ref[k] if ref[k] else float("nan")
        print(f"{k:24} {ref[k]:>14.1f} {big[k]:>18.1f} {ratio:>8.1f}")
    print(f"  load {big['load'][0]:.2f}; reference = the same on a 10-fragment stream, same cluster", flush=True)
    return {"rows": rows}


# ------------------------------------------------------------------------------------ fan-out
async def fanout_worker(url: str, stream: str, readers: int, stride: int) -> None:
    """A worker process: ``readers`` tailing consumers; prints "ready", reads until stdin says
    "stop", then prints one JSON line: delivered count, sampled latencies (ms)."""
    client = await connect(url)
    consumers = [await client.consumer(stream, start="latest") for _ in range(readers)]
    delivered = [0]
    lat: list[float] = []
    stop = asyncio.Event()

    async def tail(cons) -> None:
        while not stop.is_set():
            recs = await cons.read(1000, timeout_s=0.5)
            now = time.time()
            delivered[0] += len(recs)
            for r in recs:
                if r.offset % stride == 0:
                    lat.append((now - struct.unpack_from("<d", r.value)[0]) * 1e3)

    tasks = [asyncio.create_task(tail(cons)) for cons in consumers]
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for cons in consumers:
        await cons.close()
    await client.close()
    print(json.dumps({"delivered": delivered[0], "lat_ms": lat}), flush=True)


async def phase_fanout(args) -> dict:
    rows = []
    async with Cluster("fanout", args.keep) as c:
        client = c.client
        procs = _procs(c.lc)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for readers in args.readers:
            name = f"fan-{readers}"
            await client.create_stream(name, ensemble=3, write_quorum=3, ack_quorum=2)
            nproc = max(1, min(args.fanout_procs, readers // 50 + 1))
            split = [readers // nproc + (1 if i < readers % nproc else 0) for i in range(nproc)]
            expected = args.rate * args.duration * readers
            stride = max(1, int(expected // 200_000))
            workers = []
            try:
                for k in split:
                    workers.append(await asyncio.create_subprocess_exec(
                        sys.executable, __file__, "--fanout-worker", c.lc.metadata_url, name, str(k), str(stride),
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT)))
                for w in workers:
                    line = await asyncio.wait_for(w.stdout.readline(), 300)
                    if line.strip() != b"ready":
                        raise RuntimeError(f"fan-out worker did not start: {line!r}")
                p = await client.producer(name)
                interval = args.fanout_batch / args.rate
                c0, w0 = _cpu(procs), time.monotonic()
                sent = 0
                next_t = time.monotonic()
                end = next_t + args.duration
                while time.monotonic() < end:
                    stamp = struct.pack("<d", time.time())
                    await p.append_many([stamp + VALUE] * args.fanout_batch)
                    sent += args.fanout_batch
                    next_t += interval
                    await asyncio.sleep(max(0.0, next_t - time.monotonic()))
                # let readers drain what was sent (bounded): their delivery is what we measure
                await asyncio.sleep(min(5.0, args.duration / 3))
                c1, wall = _cpu(procs), time.monotonic() - w0
                await p.close()
                delivered, lat = 0, []
                for w in workers:
                    w.stdin.write(b"stop\n")
                    await w.stdin.drain()
                for w in workers:
                    out, _ = await asyncio.wait_for(w.communicate(), 300)
                    res = json.loads(out.decode().strip().splitlines()[-1])
                    delivered += res["delivered"]
                    lat += res["lat_ms"]
            finally:
                for w in workers:
                    if w.returncode is None:
                        w.kill()
                        await w.wait()
            bcpu = _bookie_cpu_s(c0, c1)
            rows.append({"readers": readers, "procs": nproc, "sent": sent, "delivered": delivered,
                         "delivered_frac": delivered / max(1, sent * readers),
                         "delivered_per_s": delivered / wall, "p50_ms": _q(lat, 0.5), "p99_ms": _q(lat, 0.99),
                         "bookie_cpu_pct": _pct(bcpu, wall), "etcd_cpu_pct": _pct(c1["etcd"] - c0["etcd"], wall),
                         "bookie_cpu_us_per_delivered": bcpu / max(1, delivered) * 1e6, "load": os.getloadavg()})
            _print_fanout(rows, args)
    return {"rows": rows, "rate": args.rate, "batch": args.fanout_batch}


def _print_fanout(rows: list[dict], args) -> None:
    ref = rows[0]
    print(f"\n{'readers':>8} {'procs':>5} {'delivered':>9} {'deliv/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'p99/ref':>7} {'bookie CPU %':>12} {'µs/deliv':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['readers']:>8} {r['procs']:>5} {r['delivered_frac']:>8.1%} {r['delivered_per_s']:>9.0f} "
              f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['p99_ms'] / ref['p99_ms']:>7.1f} "
              f"{r['bookie_cpu_pct']:>12.1f} {r['bookie_cpu_us_per_delivered']:>8.1f} "
              f"{r['bookie_cpu_us_per_delivered'] / ref['bookie_cpu_us_per_delivered']:>6.2f}")
    print(f"  producer {args.rate} records/s in batches of {args.fanout_batch}; load {rows[-1]['load'][0]:.2f}; "
          "reference = 1 reader", flush=True)


# ------------------------------------------------------------------------------------ producers
async def phase_producers(args) -> dict:
    rows = []
    async with Cluster("producers", args.keep) as c:
        client = c.client
        procs = _procs(c.lc)
        me = psutil.Process()
        for n in args.producers:
            names = [f"prod-{n}-{i}" for i in range(n)]
            sem = asyncio.Semaphore(32)

            async def make(nm: str, sem=sem) -> None:
                async with sem:
                    await client.create_stream(nm, ensemble=3, write_quorum=3, ack_quorum=2)

            await asyncio.gather(*(make(nm) for nm in names))
            prods = []
            for nm in names:
                prods.append(await client.producer(nm))
            chunk = [VALUE] * args.chunk
            counts = [0] * n
            stop = time.monotonic() + args.duration

            async def run(i: int, p, stop=stop, chunk=chunk, counts=counts) -> None:
                while time.monotonic() < stop:
                    await p.append_many(chunk)
                    counts[i] += len(chunk)

            c0, m0, w0 = _cpu(procs), me.cpu_times(), time.monotonic()
            await asyncio.gather(*(run(i, p) for i, p in enumerate(prods)))
            c1, m1, wall = _cpu(procs), me.cpu_times(), time.monotonic() - w0
            for p in prods:
                await p.close()
            total = sum(counts)
            rows.append({"producers": n, "records": total, "records_per_s": total / wall,
                         "min_per_producer_per_s": min(counts) / wall,
                         "bookie_cpu_pct": _pct(_bookie_cpu_s(c0, c1), wall),
                         "etcd_cpu_pct": _pct(c1["etcd"] - c0["etcd"], wall),
                         "client_cpu_pct": _pct(m1.user + m1.system - m0.user - m0.system, wall),
                         "bookie_cpu_us_per_record": _bookie_cpu_s(c0, c1) / max(1, total) * 1e6,
                         "load": os.getloadavg()})
            _print_producers(rows)
    return {"rows": rows, "chunk": args.chunk}


def _print_producers(rows: list[dict]) -> None:
    ref = rows[0]
    print(f"\n{'producers':>9} {'records/s':>10} {'ratio':>6} {'slowest/s':>10} {'bookie CPU %':>12} "
          f"{'µs/record':>9} {'client CPU %':>12} {'etcd CPU %':>10}")
    for r in rows:
        print(f"{r['producers']:>9} {r['records_per_s']:>10.0f} {r['records_per_s'] / ref['records_per_s']:>6.2f} "
              f"{r['min_per_producer_per_s']:>10.0f} {r['bookie_cpu_pct']:>12.1f} {r['bookie_cpu_us_per_record']:>9.1f} "
              f"{r['client_cpu_pct']:>12.1f} {r['etcd_cpu_pct']:>10.1f}")
    print(f"  load {rows[-1]['load'][0]:.2f}; reference = 1 producer", flush=True)


# ------------------------------------------------------------------------------------ main
PHASES = {"streams": phase_streams, "fragments": phase_fragments, "fanout": phase_fanout,
          "producers": phase_producers}


def _ints(text: str) -> list[int]:
    try:
        out = [int(x.replace("_", "").replace("k", "000")) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, not {text!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"positive integers please, not {text!r}")
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--fanout-worker":
        url, stream, readers, stride = sys.argv[2:6]
        asyncio.run(fanout_worker(url, stream, int(readers), int(stride)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated: " + ",".join(PHASES))
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (< 2 min for all phases)")
    ap.add_argument("--streams", type=_ints, help="stream counts (default 1000,10000,30000; quick 200,1000)")
    ap.add_argument("--concurrency", type=int, default=4,
                    help="create calls in flight (more is slower: every create CASes one id counter)")
    ap.add_argument("--sample", type=int, help="streams opened for the open+append time (default 100)")
    ap.add_argument("--settle", type=float, help="seconds before the idle window (default 5)")
    ap.add_argument("--window", type=float, help="idle CPU window, s (default 20)")
    ap.add_argument("--fragments", type=int, help="fragments of the big stream (default 10000)")
    ap.add_argument("--entries-per-fragment", type=int, default=2)
    ap.add_argument("--readers", type=_ints, help="tailing readers (default 1,10,100,1000)")
    ap.add_argument("--fanout-procs", type=int, default=4, help="worker processes for the readers, at most")
    ap.add_argument("--rate", type=int, help="producer records/s in fan-out (default 1000)")
    ap.add_argument("--fanout-batch", type=int, default=10, help="records per fan-out append")
    ap.add_argument("--producers", type=_ints, help="producer counts (default 1,10,100)")
    ap.add_argument("--chunk", type=int, default=1000, help="records per append_many in the producers phase")
    ap.add_argument("--duration", type=float, help="seconds per fan-out / producers case (default 15)")
    ap.add_argument("--keep", action="store_true", help="keep the clusters' data directories")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    q = args.quick
    defaults = {"streams": [200, 1000] if q else [1000, 10000, 30000], "sample": 20 if q else 100,
                "settle": 1.0 if q else 5.0, "window": 3.0 if q else 20.0, "fragments": 100 if q else 10000,
                "readers": [1, 10, 100] if q else [1, 10, 100, 1000], "rate": 200 if q else 1000,
                "producers": [1, 10] if q else [1, 10, 100], "duration": 3.0 if q else 15.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {', '.join(bad)}; choose from {', '.join(PHASES)}")
    results = {"uptime_before": _uptime(), "args": {k: v for k, v in vars(args).items()}}
    print(f"uptime: {results['uptime_before']}", flush=True)
    for ph in phases:
        t0 = time.monotonic()
        print(f"\n=== phase {ph} ===", flush=True)
        results[ph] = asyncio.run(PHASES[ph](args))
        results[ph]["phase_s"] = time.monotonic() - t0
        print(f"  (phase {ph}: {results[ph]['phase_s']:.0f} s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    results["uptime_after"] = _uptime()
    print(f"uptime: {results['uptime_after']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
