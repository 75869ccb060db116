"""Spark connector throughput: rows/s read into Spark from a Scroll stream (1 and 4 partitions),
rows/s written from Spark to a stream, and the same read from a local Parquet file for comparison.

    .venv/bin/python bench/spark.py --size 64MB          # quick
    .venv/bin/python bench/spark.py --size 1GB           # the full run

Starts its own LocalCluster (etcd + 3 bookies on 127.0.0.1, E=3 WQ=3 AQ=2) unless --metadata is
given, fills a stream with 1 KiB entries (the fill is timed too, as a reference), then:

* read: ``spark.read.format("scroll")`` with minPartitions 1 and 4, forcing every row through
  ``sum(length(value))``; rows/s = rows / wall time of the action;
* parquet: the same rows written once to local Parquet, then the same action on
  ``spark.read.parquet``;
* write: the Parquet rows appended to a new stream with ``df.write.format("scroll")`` (tasks stage,
  the driver copies: see docs/spark.md).

Prints one JSON line per measurement and a summary table; ``--json FILE`` saves them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


async def fill(url: str, stream: str, n: int, entry_bytes: int) -> float:
    from streams import client as aclient

    c = await aclient.connect(url)
    try:
        await c.create_stream(stream, ensemble=3, write_quorum=3, ack_quorum=2)
        p = await c.producer(stream)
        payload = os.urandom(entry_bytes)
        t = time.perf_counter()
        futs = []
        for i in range(n):
            futs.append(await p.append_future(payload, key=str(i % 1000).encode()))
            if len(futs) >= 5000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
        await p.close()
        return time.perf_counter() - t
    finally:
        await c.close()


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MB", help="bytes of 1 KiB entries to read (1GB for the full run)")
    ap.add_argument("--entry-bytes", type=int, default=1024)
    ap.add_argument("--metadata", help="use this cluster instead of starting a LocalCluster")
    ap.add_argument("--cores", type=int, default=4, help="Spark local[N]")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    n = max(1, parse_size(args.size) // args.entry_bytes)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="scroll-spark-bench-"))
    cluster = None
    results = []

    def record(name, rows, seconds, **extra):
        r = {"bench": name, "rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds),
             "mb_per_s": round(rows * args.entry_bytes / seconds / 1e6, 1), **extra}
        results.append(r)
        print(json.dumps(r), flush=True)

    try:
        if args.metadata:
            url = args.metadata
        else:
            from streams.tools.localcluster import LocalCluster

            cluster = LocalCluster(work / "cluster", bookies=3).start()
            url = cluster.metadata_url
        stream = f"bench-spark-{int(time.time())}"
        secs = asyncio.run(fill(url, stream, n, args.entry_bytes))
        record("fill (async producer, reference)", n, secs)

        from pyspark.sql import SparkSession

        import spark_stream

        spark = (SparkSession.builder.master(f"local[{args.cores}]").appName("scroll-bench")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.driver.memory", "4g").config("spark.sql.shuffle.partitions", "4")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        spark_stream.register(spark)

        def scroll_df(parts):
            return (spark.read.format("scroll").option("metadata", url).option("streams", stream)
                    .option("minPartitions", str(parts)).load())

        def consume(df):
            return df.selectExpr("count(*) AS n", "sum(length(value)) AS b").collect()[0]

        consume(scroll_df(1).limit(1000))  # warm up the Python workers
        for parts in (1, 4):
            df = scroll_df(parts)
            row, secs = timed(lambda df=df: consume(df))
            assert row.n == n, (row.n, n)
            record(f"scroll read, {parts} partition(s)", row.n, secs, partitions=df.rdd.getNumPartitions())

        pq = str(work / "parquet")
        _, secs = timed(lambda: scroll_df(4).write.parquet(pq))
        record("scroll read + parquet write (setup)", n, secs)
        pdf = spark.read.parquet(pq)
        row, secs = timed(lambda: consume(pdf))
        record("parquet read (local file)", row.n, secs, partitions=pdf.rdd.getNumPartitions())

        target = stream + "-written"
        from streams.sync import connect

        with connect(url) as c:
            c.create_stream(target, ensemble=3, write_quorum=3, ack_quorum=2)
        _, secs = timed(lambda: spark.read.parquet(pq).select("key", "value").write.format("scroll")
                        .option("metadata", url).option("stream", target).mode("append").save())
        record("scroll write (batch)", n, secs)
        spark.stop()
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'measurement':44} {'rows':>10} {'s':>8} {'rows/s':>10} {'MB/s':>7}")
    for r in results:
        print(f"{r['bench']:44} {r['rows']:>10} {r['seconds']:>8} {r['rows_per_s']:>10} {r['mb_per_s']:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
