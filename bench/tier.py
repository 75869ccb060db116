"""Tiered storage: offload, backlog reads from the object store, Kafka fetch, bytes kept on bookies.

How this works. ``LocalCluster`` starts etcd and three bookies (their GC every 2 s, so released
space shows up in the run), and an embedded SeaweedFS S3 server (``streams.tier.seaweed``, signed
requests) is named as the cluster's tier. One single-partition topic (its partition-0 stream has
the topic's name) with ``remote.storage.enable=true``, ``local.retention.ms=-1`` (keep the bookie
copies for now) and ``segment.bytes`` = ``--fragment-mb`` gets ``--mb`` MB of 1 KiB records from
the native producer, which then closes the stream (its last fragment sealed too). Then, in the
same run, on the same bytes:

1. **offload**: one ``run_tier(client, stream)`` (read from the bookies, build, conditional PUT,
   HEAD + tail GET, CAS), input MB/s, with the time split (bookie reads, segment build, PUT,
   verify, rest = metadata) measured by wrapping those calls during that run; **reference**: the
   same number of objects of the same sizes, random bytes, ``put_if_absent`` sequentially through
   the same ``ObjectStore``. Ratio offload / raw PUT (goal >= 0.5).
2. **bookie read** (context): the native consumer reads the whole stream from its bookie copies;
   then the **Kafka fetch from bookies**: a ``scroll kafka`` listener process and a confluent-kafka
   consumer read the partition from the beginning (the reference for 5).
3. **bytes per bookie**: ``local_retention_bytes`` = stream size / 10, ``run_tier`` releases the
   rest, the bookies' GC runs; each bookie's data directory (entry logs, index, journal) against
   the stream size and the object bytes.
4. **backlog read**: ``local_retention_ms=0``, ``run_tier`` releases everything; the native consumer
   reads the whole stream from the objects: records/s and MB/s (of object bytes; goal >= 150k 1 KiB
   records/s and >= 0.5 of raw GET); **reference**: raw GETs of every object, sequential whole-object
   ``get`` and 4 concurrent ranged GETs of 4 MiB; the ratio is against the better of the two.
5. **Kafka fetch from objects**: the same listener command, client and settings as in 2 on the
   now offloaded partition: records/s, MB/s, ratio to the same raw GET and to the fetch from bookies
   (which says how much of the gap to raw GET is the tier's and how much the listener path's own).
   Each Kafka read also reports the listener's CPU seconds (of one core), this process's (the
   client's) and librdkafka's statistics of its last second (Fetch requests, bytes per Fetch, round
   trips). ``--no-kafka``: skip both.

``--profile DIR``: after each timed Kafka read, a second, untimed one with py-spy sampling the
listener (``py-spy record --format raw``, 100 Hz; ``.venv/bin/pip install py-spy``): raw stacks in
DIR, and the top functions printed (self, and total among the project's own code). py-spy counts a
thread-pool worker waiting for work (``_worker``, thread.py:81) and a call blocked in native code
with the GIL released (``obstore.get_range``) as busy: read those as waits.

    .venv/bin/python bench/tier.py                       # 512 MB, 64 MB fragments
    .venv/bin/python bench/tier.py --mb 128 --json out.json
    .venv/bin/python bench/tier.py --profile /tmp/tier-prof  # + listener profiles

Spark reading the offloaded prefix against the same prefix on bookies: ``bench/tier_spark.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/kafka.py would shadow the kafka packages: this directory is not a source of imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fragments import tier as tierpolicy  # noqa: E402
from streams import consumer as consumer_mod  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.tier.objstore import ObjectStore  # noqa: E402
from streams.tier.seaweed import SeaweedS3  # noqa: E402
from streams.tools import tier as tierjob  # noqa: E402
from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

TOPIC = "bench-tier"
RANGE = 4 << 20


def mbs(nbytes: float, s: float) -> float:
    return nbytes / 1e6 / s if s > 0 else float("nan")


async def fill(client, mb: int, value_bytes: int, fragment_mb: int) -> int:
    await client.create_topic(TOPIC, 1, configs={"remote.storage.enable": "true", "local.retention.ms": "-1",
                                                 "segment.bytes": str(fragment_mb << 20)})
    p = await client.producer(TOPIC)
    value = os.urandom(value_bytes)
    n = (mb << 20) // value_bytes
    batch = 1000
    for start in range(0, n, batch):
        await p.append_many([value] * (min(n, start + batch) - start))
    await p.close(seal=True)
    return n


async def fragments(client):
    meta, _ = await client.cluster.ledgers.get_ledger(TOPIC)
    return await client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)


class Timers:
    """Wraps the offload's parts for one run: seconds per part."""

    def __init__(self):
        self.t: dict[str, float] = {"bookie read": 0.0, "build": 0.0, "put": 0.0, "verify": 0.0}
        self._undo = []

    def _wrap(self, owner, name: str, part: str, is_async: bool):
        orig = getattr(owner, name)
        t = self.t
        if is_async:
            async def wrapped(*a, **k):
                t0 = time.perf_counter()
                try:
                    return await orig(*a, **k)
                finally:
                    t[part] += time.perf_counter() - t0
        else:
            def wrapped(*a, **k):
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    t[part] += time.perf_counter() - t0
        setattr(owner, name, wrapped)
        self._undo.append((owner, name, orig))

    def __enter__(self):
        self._wrap(consumer_mod.Consumer, "read_raw", "bookie read", True)
        self._wrap(tierjob.SegmentBuilder, "add", "build", False)
        self._wrap(tierjob.SegmentBuilder, "finish", "build", False)
        self._wrap(ObjectStore, "put_if_absent", "put", True)
        self._wrap(ObjectStore, "head", "verify", True)
        self._wrap(ObjectStore, "get_range", "verify", True)
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


async def raw_put(objects: ObjectStore, sizes: list[int]) -> float:
    total = 0.0
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        t0 = time.perf_counter()
        await objects.put_if_absent(f"bench-raw/{i}.bin", data)
        total += time.perf_counter() - t0
    for i in range(len(sizes)):
        await objects.delete(f"bench-raw/{i}.bin")
    return total


async def raw_get_whole(objects: ObjectStore, keys: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for k in keys:
        n += len(await objects.get(k))
    return time.perf_counter() - t0, n


async def raw_get_ranged(objects: ObjectStore, objs: list[tuple[str, int]], workers: int = 4) -> tuple[float, int]:
    todo = [(k, s, min(size, s + RANGE)) for k, size in objs for s in range(0, size, RANGE)]
    todo.reverse()
    got = [0]

    async def worker():
        while todo:
            k, s, e = todo.pop()
            data = await objects.get_range(k, s, e)
            got[0] += len(data)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return time.perf_counter() - t0, got[0]


async def read_all(client, expect: int) -> tuple[float, int, int]:
    """Native consumer from the earliest offset to the end: (seconds, records, value bytes)."""
    t0 = time.perf_counter()
    c = await client.consumer(TOPIC, "earliest")
    n = nbytes = 0
    try:
        while n < expect:
            got = await c.read(10000, 1.0)
            if not got:
                if c.position >= expect:
                    break
                continue
            n += len(got)
            nbytes += sum(len(r.value) for r in got)
    finally:
        await c.close()
    return time.perf_counter() - t0, n, nbytes


def bookie_dirs(cluster: LocalCluster) -> list[dict[str, int]]:
    """Per bookie: bytes under each top-level entry of its data directory (its own log left out)."""
    out = []
    for i in range(cluster.n):
        d = cluster.dir / f"bookie-{i}"
        parts: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(d):
            rel = Path(dirpath).relative_to(d).parts
            top = rel[0] if rel else "."
            for name in files:
                if not rel and name == "bookie.log":
                    continue
                try:
                    parts[top] = parts.get(top, 0) + os.stat(os.path.join(dirpath, name)).st_size
                except OSError:
                    pass
        out.append(parts)
    return out


def bookie_bytes(cluster: LocalCluster) -> list[int]:
    return [sum(p.values()) for p in bookie_dirs(cluster)]


async def settled_bookie_bytes(cluster: LocalCluster, timeout_s: float = 40.0) -> list[int]:
    """Bookie bytes once their GC has had its go (the same figure three samples running, 2 s apart)."""
    deadline = time.monotonic() + timeout_s
    last, same = None, 0
    while time.monotonic() < deadline:
        now = bookie_bytes(cluster)
        same = same + 1 if now == last else 0
        if same >= 2:
            break
        last = now
        await asyncio.sleep(2.0)
    return bookie_bytes(cluster)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_PROJECT = ("compat_kafka/", "streams/", "bookie/", "fragments/", "terms/")


def top_frames(raw: Path, n: int = 12) -> dict:
    """py-spy's raw (collapsed) output, lines folded into functions (``name (file)``): the ``n``
    functions with the most samples on top of the stack (self), and the ``n`` of the project's own
    code (compat_kafka, streams, bookie, ...) with the most samples anywhere in it (total; the
    entry points left out), each as (share of samples, function)."""
    selfs: dict[str, int] = {}
    totals: dict[str, int] = {}
    samples = main = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        samples += k
        if stack.startswith("_run_module_as_main"):  # the listener's main thread: its event loop
            main += k
        frames = [f.rsplit(":", 1)[0] + ")" if f.endswith(")") and ":" in f else f for f in stack.split(";") if f]
        frames = frames[1:] if frames and frames[0].startswith(("process ", "thread ")) else frames
        if frames:
            selfs[frames[-1]] = selfs.get(frames[-1], 0) + k
        for f in set(frames):
            if any(f"({d}" in f for d in _PROJECT) and "cli/" not in f and "tools/cli" not in f:
                totals[f] = totals.get(f, 0) + k

    def top(d):
        return [(round(v / samples, 3), f) for f, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]

    return {"samples": samples, "main_thread_samples": main, "self": top(selfs),
            "total": top(totals)} if samples else {"samples": 0}


def kafka_read(cluster: LocalCluster, base: Path, expect: int, profile: Path | None = None) -> dict:
    """A ``scroll kafka`` listener process and a confluent-kafka consumer reading the partition from
    the beginning: seconds, records, bytes, the first record's delay and the listener's CPU seconds
    during the read; with ``profile``, py-spy samples the listener meanwhile (raw collapsed stacks
    written there; that read is slowed by the sampling and is not the timed one)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    stats, reading = [None], [True]  # librdkafka's statistics, the last ones while the read was on
    port = free_port()
    log = open(base / "kafka.log", "ab")
    argv = [sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", cluster.metadata_url, "--host",
            "127.0.0.1", "--port", str(port), "--node-id", "0"]
    shim = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    spy = None
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        if profile is not None:
            spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw",
                                    "--rate", "100", "-o", str(profile), "--pid", str(shim.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        c = Consumer({"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "bench-tier", "enable.auto.commit": False,
                      "fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 16 << 20,
                      "queued.max.messages.kbytes": 256 << 10, "statistics.interval.ms": 1000,
                      "stats_cb": lambda js: stats.__setitem__(0, js) if reading[0] else None})
        c.assign([TopicPartition(TOPIC, 0, OFFSET_BEGINNING)])
        n = nbytes = 0
        cpu0, me0 = _cpu_s(shim.pid), _cpu_s(os.getpid())
        t0 = time.perf_counter()
        idle_since = time.monotonic()
        first_at = None
        while n < expect:
            msgs = c.consume(10000, 1.0)
            if not msgs:
                if time.monotonic() - idle_since > 60:
                    break
                continue
            idle_since = time.monotonic()
            for m in msgs:
                if m.error():
                    raise RuntimeError(str(m.error()))
                if first_at is None:
                    first_at = time.perf_counter()
                n += 1
                nbytes += len(m.value())
        s = time.perf_counter() - t0
        reading[0] = False
        cpu, me = _cpu_s(shim.pid) - cpu0, _cpu_s(os.getpid()) - me0
        c.close()
        out = {"seconds": s, "records": n, "bytes": nbytes, "first_record_s": (first_at or t0) - t0,
               "listener_cpu_s": cpu, "client_cpu_s": me}
        if stats[0]:  # librdkafka's view (its last second of the read): Fetch requests sent, their round trips
            for b in json.loads(stats[0]).get("brokers", {}).values():
                fetches = (b.get("req") or {}).get("Fetch", 0)
                if fetches:
                    out.update(fetch_requests=fetches, fetch_rtt_avg_ms=b["rtt"]["avg"] / 1000,
                               fetch_rtt_p99_ms=b["rtt"]["p99"] / 1000, rx_bytes=b.get("rxbytes", 0))
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            spy.wait(60)
            out["profile"] = top_frames(profile)
        return out
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        shim.terminate()
        try:
            shim.wait(10)
        except subprocess.TimeoutExpired:
            shim.kill()
        log.close()


def kafka_pass(cluster: LocalCluster, base: Path, records: int, where: str, args) -> dict:
    """The timed Kafka read of the partition (from ``where``: bookies or objects), then, with
    ``--profile``, a second one under py-spy. Prints and returns the figures."""
    k = kafka_read(cluster, base, records)
    rate = k["records"] / k["seconds"]
    print(f"kafka fetch from {where} (confluent-kafka): {k['records']:,} records in {k['seconds']:.2f} s = "
          f"{rate:,.0f} records/s (first record after {k['first_record_s']:.2f} s; listener CPU "
          f"{k['listener_cpu_s']:.1f} s = {k['listener_cpu_s'] / k['seconds']:.2f} of a core; this process (client) "
          f"{k['client_cpu_s']:.1f} s; {k.get('fetch_requests', 0)} Fetch requests, "
          f"{k.get('rx_bytes', 0) / max(1, k.get('fetch_requests', 0)) / 1e6:.1f} MB each, round trip avg "
          f"{k.get('fetch_rtt_avg_ms', 0):.0f} ms, p99 {k.get('fetch_rtt_p99_ms', 0):.0f} ms)", flush=True)
    if args.profile:
        prof = Path(args.profile) / f"listener-{where}.txt"
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        p = kafka_read(cluster, base, records, prof)
        k["profile"] = p.get("profile", {})
        k["profiled_seconds"] = p["seconds"]
        top = k["profile"]
        print(f"  listener profile ({where}, {top.get('samples', 0)} samples, raw stacks in {prof}; that read "
              f"took {p['seconds']:.2f} s; the event loop thread busy in "
              f"{top.get('main_thread_samples', 0) / (100 * (p['seconds'] + 1.0)):.0%} of it):", flush=True)
        for kind in ("self", "total"):
            for share, frame in top.get(kind, []):
                print(f"    {kind:5} {100 * share:5.1f}%  {frame}", flush=True)
    return k


async def run(cluster: LocalCluster, seaweed: SeaweedS3, base: Path, args) -> dict:
    cfg = seaweed.tier_config()
    objects = ObjectStore(cfg)
    client = await connect(cluster.metadata_url)
    out: dict = {"mb": args.mb, "fragment_mb": args.fragment_mb, "value_bytes": args.value_bytes}
    try:
        await tierjob.save_tier_config(client.cluster.store, cfg)
        t0 = time.perf_counter()
        records = await fill(client, args.mb, args.value_bytes, args.fragment_mb)
        fill_s = time.perf_counter() - t0
        frags = await fragments(client)
        stream_bytes = sum(f.size_bytes or 0 for f in frags)
        out.update(records=records, stream_bytes=stream_bytes, fragments=len(frags), fill_s=fill_s)
        print(f"filled {records:,} records ({stream_bytes / 1e6:,.0f} MB in {len(frags)} fragments) in {fill_s:.1f} s "
              f"= {mbs(stream_bytes, fill_s):,.1f} MB/s", flush=True)
        disk_full = await settled_bookie_bytes(cluster)
        print(f"  bookie directories: {bookie_dirs(cluster)}", flush=True)
        out["bookie_bytes_before"] = disk_full

        # 1. offload vs raw PUT
        with Timers() as tm:
            t0 = time.perf_counter()
            rep = await tierjob.run_tier(client, TOPIC, objects=objects)
            off_s = time.perf_counter() - t0
        st = rep.streams[0]
        frags = await fragments(client)
        sizes = [int(f.tier["size"]) for f in frags if tierpolicy.offloaded(f)]
        obj_keys = [(f.tier["key"], int(f.tier["size"])) for f in frags if tierpolicy.offloaded(f)]
        left = [f for f in frags if not tierpolicy.offloaded(f) and (f.size_bytes or 0) > 0]
        assert not left, f"fragments with data not offloaded: {[f.index for f in left]}: {st}"
        object_bytes = sum(sizes)
        parts = dict(tm.t)
        parts["rest (metadata, CAS, offsets)"] = off_s - sum(parts.values())
        off_mbs = mbs(stream_bytes, off_s)
        print(f"offload: {len(st.offloaded)} fragments, {stream_bytes / 1e6:,.0f} MB in {off_s:.2f} s = "
              f"{off_mbs:,.1f} MB/s ({object_bytes / 1e6:,.0f} MB of objects)", flush=True)
        print("  where the time goes: " + ", ".join(f"{k} {v:.2f} s ({100 * v / off_s:.0f}%)"
                                                    for k, v in parts.items()), flush=True)
        put_s = await raw_put(objects, sizes)
        put_mbs = mbs(object_bytes, put_s)
        print(f"raw PUT: {len(sizes)} objects, {object_bytes / 1e6:,.0f} MB in {put_s:.2f} s = {put_mbs:,.1f} MB/s",
              flush=True)
        ratio_off = off_mbs / put_mbs
        print(f"offload / raw PUT: {ratio_off:.2f} (goal >= 0.5)", flush=True)
        out.update(offload_s=off_s, offload_mb_s=off_mbs, offload_parts_s=parts, object_bytes=object_bytes,
                   objects=len(sizes), raw_put_s=put_s, raw_put_mb_s=put_mbs, offload_ratio=ratio_off)

        # 2. the same stream from its bookie copies (context)
        s, n, vb = await read_all(client, records)
        print(f"bookie read (before release): {n:,} records in {s:.2f} s = {n / s:,.0f} records/s, "
              f"{mbs(stream_bytes, s):,.1f} MB/s", flush=True)
        out.update(bookie_read_s=s, bookie_read_records=n, bookie_read_rec_s=n / s,
                   bookie_read_mb_s=mbs(stream_bytes, s))
        kb = None
        if not args.no_kafka:
            try:
                kb = await asyncio.to_thread(kafka_pass, cluster, base, records, "bookies", args)
                out.update(kafka_bookies_s=kb["seconds"], kafka_bookies_records=kb["records"],
                           kafka_bookies_rec_s=kb["records"] / kb["seconds"],
                           kafka_bookies_mb_s=mbs(stream_bytes * kb["records"] / records, kb["seconds"]),
                           kafka_bookies_listener_cpu_s=kb["listener_cpu_s"],
                           kafka_bookies_profile=kb.get("profile"))
            except Exception as exc:  # noqa: BLE001
                print(f"kafka fetch from bookies: FAILED: {type(exc).__name__}: {exc}", flush=True)
                out["kafka_bookies_error"] = f"{type(exc).__name__}: {exc}"

        # 3. bytes per bookie with a local policy of 1/10 of the stream
        local_cap = stream_bytes // 10
        await client.set_tier_policy(TOPIC, local_retention_bytes=local_cap)
        rep = await tierjob.run_tier(client, TOPIC, objects=objects)
        frags = await fragments(client)
        local = [f for f in frags if tierpolicy.local(f)]
        local_bytes = sum(f.size_bytes or 0 for f in local)
        disk = await settled_bookie_bytes(cluster)
        print(f"  bookie directories after release: {bookie_dirs(cluster)}", flush=True)
        out["bookie_dirs_after"] = bookie_dirs(cluster)
        meta, _ = await client.cluster.ledgers.get_ledger(TOPIC)
        wq = meta.config.write_quorum
        expected = local_bytes * wq / cluster.n
        print(f"local policy {local_cap / 1e6:,.0f} MB: released {len(rep.streams[0].released)} fragments, "
              f"{len(local)} kept ({local_bytes / 1e6:,.0f} MB); per bookie on disk: before "
              f"{', '.join(f'{b / 1e6:,.0f}' for b in disk_full)} MB -> after "
              f"{', '.join(f'{b / 1e6:,.0f}' for b in disk)} MB (kept fragments x {wq} / {cluster.n} bookies = "
              f"{expected / 1e6:,.0f} MB); stream {stream_bytes / 1e6:,.0f} MB, objects {object_bytes / 1e6:,.0f} MB",
              flush=True)
        out.update(local_retention_bytes=local_cap, local_fragments=len(local), local_bytes=local_bytes,
                   bookie_bytes_after=disk, bookie_bytes_expected=expected)

        # 4. backlog read from the objects vs raw GET
        await client.set_tier_policy(TOPIC, local_retention_ms=0)
        rep = await tierjob.run_tier(client, TOPIC, objects=objects)
        frags = await fragments(client)
        remote = sum(1 for f in frags if tierpolicy.remote_only(f))
        print(f"released the rest: {remote} of {len(sizes)} fragments now only in the object store", flush=True)
        gs, gn = await raw_get_whole(objects, [k for k, _ in obj_keys])
        rs, rn = await raw_get_ranged(objects, obj_keys)
        g_mbs, r_mbs = mbs(gn, gs), mbs(rn, rs)
        best = max(g_mbs, r_mbs)
        print(f"raw GET: sequential whole objects {g_mbs:,.1f} MB/s ({gs:.2f} s); 4 concurrent 4 MiB ranges "
              f"{r_mbs:,.1f} MB/s ({rs:.2f} s)", flush=True)
        out.update(raw_get_mb_s=g_mbs, raw_get_ranged_mb_s=r_mbs, remote_only_fragments=remote)
        try:
            s, n, vb = await asyncio.wait_for(read_all(client, records), args.read_timeout)
            if n != records:
                raise RuntimeError(f"read {n:,} of {records:,} records")
            r_mb = mbs(object_bytes, s)
            ratio_read = r_mb / best
            print(f"object read (native consumer): {n:,} records in {s:.2f} s = {n / s:,.0f} records/s, "
                  f"{r_mb:,.1f} MB/s; / raw GET (best) {ratio_read:.2f} (goals: >= 150,000 records/s, >= 0.5)",
                  flush=True)
            out.update(object_read_s=s, object_read_rec_s=n / s, object_read_mb_s=r_mb, object_read_ratio=ratio_read)
        except Exception as exc:  # noqa: BLE001 -- the read path may not be there yet
            print(f"object read (native consumer): FAILED: {type(exc).__name__}: {exc}", flush=True)
            out["object_read_error"] = f"{type(exc).__name__}: {exc}"

        # 5. Kafka fetch of the offloaded partition
        if not args.no_kafka:
            try:
                k = await asyncio.to_thread(kafka_pass, cluster, base, records, "objects", args)
                k_mb = mbs(object_bytes * k["records"] / records, k["seconds"])
                rate = k["records"] / k["seconds"]
                vs = f"; / from bookies {rate / out['kafka_bookies_rec_s']:.2f}" if kb else ""
                print(f"kafka fetch from objects: {k_mb:,.1f} MB/s; / raw GET (best) {k_mb / best:.2f}{vs}", flush=True)
                out.update(kafka_s=k["seconds"], kafka_records=k["records"], kafka_rec_s=rate,
                           kafka_mb_s=k_mb, kafka_ratio=k_mb / best, kafka_listener_cpu_s=k["listener_cpu_s"],
                           kafka_profile=k.get("profile"))
                if kb:
                    out["kafka_objects_vs_bookies"] = rate / out["kafka_bookies_rec_s"]
            except Exception as exc:  # noqa: BLE001
                print(f"kafka fetch from objects: FAILED: {type(exc).__name__}: {exc}", flush=True)
                out["kafka_error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        await client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--fragment-mb", type=int, default=64)
    ap.add_argument("--read-timeout", type=float, default=600.0)
    ap.add_argument("--no-kafka", action="store_true")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after each timed Kafka read, a second one with py-spy sampling the listener (stacks in DIR)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-tier-"))
    cluster = LocalCluster(base / "scroll", bookies=3, bookie_args=["--set", "gc_interval_s=2"]).start()
    seaweed = SeaweedS3(base / "seaweed", s3_port=free_port(), master_port=free_port(), volume_port=free_port(),
                        filer_port=free_port(), credentials=("bench", secrets.token_urlsafe(24)))
    try:
        seaweed.start()
        out = asyncio.run(run(cluster, seaweed, base, args))
    finally:
        seaweed.stop()
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)
        shutil.rmtree(base / "seaweed", ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
