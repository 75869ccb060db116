"""Tiered storage and Spark: a batch query over the same stream prefix read from its bookie copies,
then from its objects once the bookie copies are released (issue 24: "Spark reading an offloaded
1 GB prefix against the same prefix on bookies, not slower").

``LocalCluster`` (etcd, 3 bookies, E=3 WQ=3 AQ=2) and the embedded SeaweedFS S3 server
(``streams.tier.seaweed``, signed requests) named as the cluster's tier. A single-partition topic
(``remote.storage.enable=true``, ``local.retention.ms=-1``, ``segment.bytes`` = ``--fragment-mb``)
gets ``--spark-mb`` MB of keyed 1 KiB records from the native producer (values from a random pool,
as ``bench/spark.py`` writes them), which closes it (its last fragment sealed). A Spark session set
up as ``bench/spark.py`` does (``local[--cores]``, the ``scroll`` source registered) then runs
``count(*), sum(length(value))`` over ``spark.read.format("scroll")`` of the stream:

1. **bookies**: ``--repeat`` runs with ``minPartitions`` 1 and with ``minPartitions`` = ``--cores``
   (the planner cuts at fragment boundaries first), after two warm-up queries;
2. ``run_tier`` offloads every fragment, then ``local_retention_ms=0`` and a second ``run_tier``
   release every bookie copy (all fragments ``remote_only``);
3. **objects**: the same queries; each task's ``Consumer`` reads its fragments straight from their
   objects (``streams/tier/reader.py``, read-ahead of 4 MiB ranges).

Ratio objects / bookies of rows/s, the best run of each (goal >= 1.0). Every run also reports the
CPU seconds of this process tree by kind (the Spark JVM, its Python workers, bookies, etcd, the S3
server), so that a run on a shared machine still says what a row costs.

    .venv/bin/python bench/tier_spark.py                      # 1024 MB, 64 MB fragments
    .venv/bin/python bench/tier_spark.py --spark-mb 128 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

# bench/kafka.py would shadow the kafka packages: this directory is not a source of imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fragments import tier as tierpolicy  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.tier.objstore import ObjectStore  # noqa: E402
from streams.tier.seaweed import SeaweedS3  # noqa: E402
from streams.tools import tier as tierjob  # noqa: E402
from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

TOPIC = "bench-tier-spark"


async def fill(client, mb: int, value_bytes: int, fragment_mb: int) -> int:
    await client.create_topic(TOPIC, 1, ensemble=3, write_quorum=3, ack_quorum=2,
                              configs={"remote.storage.enable": "true", "local.retention.ms": "-1",
                                       "segment.bytes": str(fragment_mb << 20)})
    p = await client.producer(TOPIC)
    pool = memoryview(os.urandom(8 << 20))
    span = len(pool) - value_bytes
    n = (mb << 20) // value_bytes
    chunk = 10_000
    for lo in range(0, n, chunk):
        await p.append_many([{"value": bytes(pool[i * 1031 % span:][:value_bytes]), "key": str(i % 1000).encode()}
                             for i in range(lo, min(n, lo + chunk))])
    await p.close(seal=True)
    return n


async def fragments(client):
    meta, _ = await client.cluster.ledgers.get_ledger(TOPIC)
    return await client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)


def tree_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process and its descendants, by kind (/proc, Linux)."""
    procs: dict[int, tuple[int, float, str]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                st = f.read()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        procs[int(p)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
    mine, todo = {os.getpid()}, [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, (ppid, _, _) in procs.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                todo.append(pid)
    out: dict[str, float] = {}
    for pid in mine:
        _, secs, cmd = procs.get(pid, (0, 0.0, ""))
        kind = ("spark-jvm" if "java" in cmd else "bookies" if "bookie" in cmd else "etcd" if "etcd" in cmd
                else "s3" if "weed" in cmd else "driver" if pid == os.getpid() else "python-workers")
        out[kind] = out.get(kind, 0.0) + secs
    return out


def spark_session(cores: int):
    from pyspark.sql import SparkSession

    import spark_stream

    spark = (SparkSession.builder.master(f"local[{cores}]").appName("scroll-bench-tier")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "4g").config("spark.sql.shuffle.partitions", str(cores))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_stream.register(spark)
    return spark


def queries(spark, url: str, n: int, cores: int, repeat: int, where: str, value_bytes: int) -> list[dict]:
    def df(**opts):
        r = spark.read.format("scroll").option("metadata", url).option("streams", TOPIC)
        for k, v in opts.items():
            r = r.option(k, str(v))
        return r.load()

    out = []
    for parts in sorted({1, cores}):
        d = df(minPartitions=parts)
        for rep in range(repeat):
            before = tree_cpu()
            t0 = time.perf_counter()
            row = d.selectExpr("count(*) AS n", "sum(length(value)) AS b").collect()[0]
            s = time.perf_counter() - t0
            after = tree_cpu()
            assert row.n == n and row.b == n * value_bytes, (row.n, row.b, n)
            cpu = {k: round(v - before.get(k, 0.0), 1) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0.05}
            r = {"where": where, "min_partitions": parts, "tasks": d.rdd.getNumPartitions(), "run": rep + 1,
                 "rows": row.n, "seconds": round(s, 3), "rows_per_s": round(row.n / s),
                 "mb_per_s": round(row.b / s / 1e6, 1), "cpu_s": cpu}
            out.append(r)
            print(f"spark from {where}, minPartitions {parts} ({r['tasks']} tasks), run {rep + 1}: {row.n:,} rows in "
                  f"{s:.2f} s = {r['rows_per_s']:,} rows/s, {r['mb_per_s']:,} MB/s; CPU s {cpu}", flush=True)
    return out


async def offload_and_release(client, objects: ObjectStore) -> tuple[int, int, float]:
    t0 = time.perf_counter()
    await tierjob.run_tier(client, TOPIC, objects=objects)
    off_s = time.perf_counter() - t0
    await client.set_tier_policy(TOPIC, local_retention_ms=0)
    await tierjob.run_tier(client, TOPIC, objects=objects)
    frags = await fragments(client)
    with_data = [f for f in frags if (f.size_bytes or 0) > 0]
    remote = [f for f in with_data if tierpolicy.remote_only(f)]
    assert len(remote) == len(with_data), f"{len(with_data) - len(remote)} fragments with data not remote-only"
    return len(remote), sum(int(f.tier["size"]) for f in remote), off_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spark-mb", type=int, default=1024, help="MB of records in the prefix read")
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--fragment-mb", type=int, default=64)
    ap.add_argument("--cores", type=int, default=4, help="Spark local[N] (bench/spark.py's default)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each query")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-tier-spark-"))
    cluster = LocalCluster(base / "scroll", bookies=3).start()
    seaweed = SeaweedS3(base / "seaweed", s3_port=free_port(), master_port=free_port(), volume_port=free_port(),
                        filer_port=free_port(), credentials=("bench", secrets.token_urlsafe(24)))
    out: dict = {"spark_mb": args.spark_mb, "fragment_mb": args.fragment_mb, "value_bytes": args.value_bytes,
                 "cores": args.cores}
    spark = None
    try:
        seaweed.start()
        cfg = seaweed.tier_config()
        objects = ObjectStore(cfg)
        url = cluster.metadata_url

        async def setup():
            c = await connect(url)
            try:
                await tierjob.save_tier_config(c.cluster.store, cfg)
                t0 = time.perf_counter()
                n = await fill(c, args.spark_mb, args.value_bytes, args.fragment_mb)
                return n, time.perf_counter() - t0, len(await fragments(c))
            finally:
                await c.close()

        n, fill_s, nfrags = asyncio.run(setup())
        print(f"filled {n:,} records ({n * args.value_bytes / 1e6:,.0f} MB of values, {nfrags} fragments) in "
              f"{fill_s:.1f} s", flush=True)
        out.update(records=n, fill_s=fill_s)
        spark = spark_session(args.cores)
        # warm up: the Python workers (one per core) and the JIT before anything is timed
        for _ in range(2):
            (spark.read.format("scroll").option("metadata", url).option("streams", TOPIC)
             .option("minPartitions", str(args.cores)).load().limit(50_000).count())
        runs = queries(spark, url, n, args.cores, args.repeat, "bookies", args.value_bytes)

        async def tier():
            c = await connect(url)
            try:
                return await offload_and_release(c, objects)
            finally:
                await c.close()

        nobj, obj_bytes, off_s = asyncio.run(tier())
        print(f"offloaded in {off_s:.1f} s and released: {nobj} fragments only in the object store "
              f"({obj_bytes / 1e6:,.0f} MB of objects)", flush=True)
        out.update(objects=nobj, object_bytes=obj_bytes, offload_s=off_s)
        runs += queries(spark, url, n, args.cores, args.repeat, "objects", args.value_bytes)
        out["runs"] = runs
        ratios = {}
        for parts in sorted({1, args.cores}):
            best = {w: max(r["rows_per_s"] for r in runs if r["where"] == w and r["min_partitions"] == parts)
                    for w in ("bookies", "objects")}
            ratios[parts] = best["objects"] / best["bookies"]
            print(f"minPartitions {parts}: bookies {best['bookies']:,} rows/s, objects {best['objects']:,} rows/s "
                  f"(best of {args.repeat}); objects / bookies {ratios[parts]:.2f} (goal >= 1.0)", flush=True)
        out["ratio_objects_bookies"] = ratios
    finally:
        if spark is not None:
            spark.stop()
        seaweed.stop()
        cluster.stop()
        shutil.rmtree(base / "scroll", ignore_errors=True)
        shutil.rmtree(base / "seaweed", ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
