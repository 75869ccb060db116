"""Spark connector throughput: rows/s read into Spark from Scroll (one stream with 1 and 4 tasks,
a topic of 4 partitions), rows/s written from Spark (batch, and the exactly-once streaming sink),
and the same read from a local Parquet file for comparison.

    .venv/bin/python bench/spark.py --size 64MB          # quick
    .venv/bin/python bench/spark.py --size 1GB           # the full run

Starts its own LocalCluster (etcd + 3 bookies on 127.0.0.1, E=3 WQ=3 AQ=2) unless --metadata is
given, fills a stream and a topic of ``--partitions`` partitions with the same number of 1 KiB
records (keyed; the producer batches them, ``append_many``; the fills are timed too, as a
reference), then:

* read: ``spark.read.format("scroll")`` of the stream with minPartitions 1 and 4, and of the topic
  (one task per partition), forcing every row through ``count(*), sum(length(value))``;
  rows/s = rows / wall time of the action;
* parquet: the same rows written once to local Parquet, then the same action on
  ``spark.read.parquet``;
* write (batch): the Parquet rows appended to a new stream with ``df.write.format("scroll")``,
  with task outputs inline (the default) and staged, and from the rows cached in Spark's memory
  (the sink without the Parquet decoding);
* write (streaming, exactly once): the Parquet files read as a stream (``readStream.parquet``,
  Trigger.AvailableNow, ``--batch-bytes`` of files per micro-batch) into the ``scroll`` sink with a
  checkpoint; the target is then checked to hold exactly the rows once, and its commit record to
  end at the row count. Its reference, in the same run and just before it: the same stream (same
  files, same files per micro-batch, so the same tasks) into Spark's own exactly-once file sink,
  ``writeStream.format("parquet")``; the sink's record carries ``vs_parquet`` (its rows/s over the
  reference's) and both carry Spark's per-micro-batch ``durationMs``. ``--sink-repeat N`` runs the
  pair N times (the first pays for starting the sink's Python processes); ``--only sink`` runs
  just these (the batch writes are compared with a batch ``write.parquet`` the same way).

The Spark session sets ``spark.sql.files.maxPartitionBytes`` to ``--task-bytes`` (16 MiB: each
write task's output fits the sink's default ``stageInlineBytes``), ``spark.task.maxDirectResultSize``
to 128 MiB and ``spark.driver.maxResultSize`` to 4g (docs/spark.md, tuning).

Tasks build record batches and stage those over ``stageInlineBytes`` in staging streams; the
driver forwards them to the target (see docs/spark.md). Every measurement also reports the CPU
seconds its processes used (this process and its children: bookies, etcd, the Spark JVM, the
Python workers), so a run on a shared machine still says what a row costs. Prints one JSON line
per measurement and a summary table; ``--json FILE`` saves them.
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
sys.path.insert(0, str(ROOT))  # first, even when on PYTHONPATH: bench/bookie.py must not shadow the package


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


async def fill(url: str, name: str, n: int, entry_bytes: int, partitions: int) -> float:
    """Create ``name`` (a stream, or a topic of ``partitions``) and append ``n`` keyed records."""
    from streams import client as aclient

    c = await aclient.connect(url)
    try:
        await c.create_topic(name, partitions, ensemble=3, write_quorum=3, ack_quorum=2)
        p = await c.producer(name)
        pool = memoryview(os.urandom(8 << 20))  # values differ (Parquet must not dictionary-encode them away)
        span = len(pool) - entry_bytes
        t = time.perf_counter()
        chunk = 10_000
        for lo in range(0, n, chunk):
            await p.append_many([{"value": bytes(pool[i * 1031 % span:][:entry_bytes]), "key": str(i % 1000).encode()}
                                 for i in range(lo, min(n, lo + chunk))])
        await p.close()
        return time.perf_counter() - t
    finally:
        await c.close()


def _tree_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process and its descendants (bookies, etcd, the Spark JVM and
    its Python workers), by kind; /proc, Linux only (empty elsewhere)."""
    procs: dict[int, tuple[int, float, str]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        procs[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, cmd)
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
                else "driver" if pid == os.getpid() else "python-workers")
        out[kind] = out.get(kind, 0.0) + secs
    return out


_last_cpu: dict[str, float] = {}


def timed(fn):
    global _last_cpu
    before = _tree_cpu()
    t = time.perf_counter()
    out = fn()
    secs = time.perf_counter() - t
    after = _tree_cpu()
    _last_cpu = {k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}
    return out, secs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MB", help="bytes of 1 KiB records to read (1GB for the full run)")
    ap.add_argument("--entry-bytes", type=int, default=1024, help="bytes per record value")
    ap.add_argument("--partitions", type=int, default=4, help="partitions of the topic read")
    ap.add_argument("--metadata", help="use this cluster instead of starting a LocalCluster")
    ap.add_argument("--cores", type=int, default=4, help="Spark local[N]")
    ap.add_argument("--only", default="read,write", help="read, write, sink (the streaming sink and its Parquet reference only; comma-separated)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each read")
    ap.add_argument("--task-bytes", type=int, default=16 << 20, help="Parquet bytes per write task")
    ap.add_argument("--batch-bytes", type=int, default=128 << 20, help="Parquet bytes per streaming micro-batch")
    ap.add_argument("--sink-repeat", type=int, default=1,
                    help="runs of the streaming sink, each after a Parquet streaming write of the same rows")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    n = max(1, parse_size(args.size) // args.entry_bytes)
    only = set(args.only.split(","))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="scroll-spark-bench-"))
    cluster = None
    results = []

    def record(name, rows, seconds, **extra):
        cpu = dict(_last_cpu)
        r = {"bench": name, "rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds),
             "mb_per_s": round(rows * args.entry_bytes / seconds / 1e6, 1),
             "cpu_us_per_row": round(sum(cpu.values()) / rows * 1e6, 1), "cpu_s": cpu, **extra}
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
        topic = stream + "-topic"
        _, secs = timed(lambda: asyncio.run(fill(url, stream, n, args.entry_bytes, 1)))
        record("fill stream (async producer, append_many)", n, secs)
        if "read" in only:
            _, secs = timed(lambda: asyncio.run(fill(url, topic, n, args.entry_bytes, args.partitions)))
            record(f"fill topic of {args.partitions} partitions (reference)", n, secs)

        from pyspark.sql import SparkSession

        import spark_stream

        spark = (SparkSession.builder.master(f"local[{args.cores}]").appName("scroll-bench")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.driver.memory", "4g").config("spark.sql.shuffle.partitions", "4")
                 # the write bench's input: one task per ~16 MB of Parquet, so each task's output goes
                 # to the driver in its commit message (the sink's stageInlineBytes, 16 MiB)
                 .config("spark.sql.files.maxPartitionBytes", str(args.task_bytes))
                 .config("spark.sql.files.openCostInBytes", "0")
                 # task outputs up to 16 MiB travel to the driver in commit messages: send them directly
                 # rather than through the block manager (docs/spark.md, tuning), and let a whole-table
                 # batch write send more than the 1 GiB default in all
                 .config("spark.task.maxDirectResultSize", str(128 << 20))
                 .config("spark.driver.maxResultSize", "4g")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        spark_stream.register(spark)

        def scroll_df(**opts):
            r = spark.read.format("scroll").option("metadata", url)
            for k, v in opts.items():
                r = r.option(k, str(v))
            return r.load()

        def consume(df):
            return df.selectExpr("count(*) AS n", "sum(length(value)) AS b").collect()[0]

        # warm up: start the Python workers (one per core) and the JIT before anything is timed
        for _ in range(2):
            consume(scroll_df(streams=stream, minPartitions=args.cores).limit(50_000))
        if "read" in only:
            for name, df in (("scroll read, 1 stream, minPartitions 1", scroll_df(streams=stream)),
                             ("scroll read, 1 stream, minPartitions 4", scroll_df(streams=stream, minPartitions=4)),
                             (f"scroll read, topic of {args.partitions} partitions", scroll_df(topics=topic))):
                for rep in range(args.repeat):
                    row, secs = timed(lambda df=df: consume(df))
                    assert row.n == n, (row.n, n)
                    record(name, row.n, secs, partitions=df.rdd.getNumPartitions(), run=rep + 1)

        pq = str(work / "parquet")
        files = max(4, -(-n * args.entry_bytes // (args.task_bytes // 2)))  # files of about half a task
        _, secs = timed(lambda: scroll_df(streams=stream, minPartitions=4).select("key", "value")
                        .repartition(files).write.parquet(pq))
        record("scroll read + parquet write (setup)", n, secs, files=files)
        pdf = spark.read.parquet(pq)
        row, secs = timed(lambda: consume(pdf))
        record("parquet read (local file)", row.n, secs, partitions=pdf.rdd.getNumPartitions())

        if "write" in only:
            from streams.sync import connect

            cached = spark.read.parquet(pq).cache()
            cached.count()

            def write(target, cache=False, **opts):
                src = cached if cache else spark.read.parquet(pq)
                w = src.write.format("scroll").option("metadata", url).option("stream", target)
                for k, v in opts.items():
                    w = w.option(k, str(v))
                w.mode("append").save()

            warm = f"{stream}-warm"  # the write path's Python workers, started before anything is timed
            with connect(url) as c:
                c.create_stream(warm, ensemble=3, write_quorum=3, ack_quorum=2)
            spark.read.parquet(pq).limit(20_000).repartition(args.cores).write.format("scroll") \
                .option("metadata", url).option("stream", warm).mode("append").save()
            _, secs = timed(lambda: spark.read.parquet(pq).write.parquet(str(work / "parquet-batch-out")))
            pq_batch_rate = n / secs
            record("parquet write (batch, reference)", n, secs, tasks=pdf.rdd.getNumPartitions())
            for name, opts in (("scroll write (batch, inline)", {}),
                               ("scroll write (batch, staged)", {"stageInlineBytes": 0}),
                               ("scroll write (batch, inline, cached input)", {"cache": True})):
                target = f"{stream}-w{len(results)}"
                with connect(url) as c:
                    c.create_stream(target, ensemble=3, write_quorum=3, ack_quorum=2)
                _, secs = timed(lambda target=target, opts=opts: write(target, **opts))
                with connect(url) as c:
                    assert c.consumer(target, start="latest").position == n
                record(name, n, secs, tasks=pdf.rdd.getNumPartitions(), vs_parquet=round(n / secs / pq_batch_rate, 3))

        if "write" in only or "sink" in only:
            from streams.sync import connect

            per_batch = max(1, min(files, args.batch_bytes * files // (n * args.entry_bytes)))

            def stream_write(fmt, ck, **opts):
                w = (spark.readStream.schema(pdf.schema).option("maxFilesPerTrigger", per_batch).parquet(pq)
                     .writeStream.format(fmt).option("checkpointLocation", str(ck)))
                for k, v in opts.items():
                    w = w.option(k, str(v))
                q = w.trigger(availableNow=True).start()
                q.awaitTermination()
                if q.exception() is not None:
                    raise q.exception()
                # per micro-batch: Spark's own split of its wall time (ms), where the sink's commit is
                # inside addBatch with the tasks
                return [{k: v for k, v in p["durationMs"].items() if v} for p in q.recentProgress
                        if p["numInputRows"]]

            # The reference: Spark's own exactly-once file sink writing the same rows (same source
            # files, same files per micro-batch, so the same tasks) to local Parquet, in the same run;
            # the two alternate (--sink-repeat) so a change of load hits both.
            for rep in range(args.sink_repeat):
                out = work / f"parquet-out-{rep}"
                batches, secs = timed(lambda out=out: stream_write("parquet", out.with_suffix(".ck"), path=str(out)))
                assert spark.read.parquet(str(out)).count() == n
                pq_rate = n / secs
                record("parquet write (streaming file sink, reference)", n, secs, micro_batches=len(batches), durations=batches,
                       files_per_batch=per_batch, run=rep + 1)

                streamed = f"{stream}-streamed-{rep}"
                with connect(url) as c:
                    c.create_stream(streamed, ensemble=3, write_quorum=3, ack_quorum=2)
                batches, secs = timed(lambda streamed=streamed, rep=rep: stream_write(
                    "scroll", work / f"ck-{rep}", metadata=url, stream=streamed))
                cpu_of_write = dict(_last_cpu)
                with connect(url) as c:  # exactly once: every row once
                    assert c.consumer(streamed, start="latest").position == n
                    (rec,) = c.describe_stream(streamed).meta.extra["spark"].values()
                    assert rec["end"] == {streamed: n}, rec
                _last_cpu.clear()
                _last_cpu.update(cpu_of_write)
                record("scroll write (streaming sink, exactly once)", n, secs, micro_batches=len(batches), durations=batches,
                       files_per_batch=per_batch, run=rep + 1, vs_parquet=round(n / secs / pq_rate, 3))
        spark.stop()
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{'measurement':46} {'rows':>10} {'s':>8} {'rows/s':>10} {'MB/s':>7} {'CPU us/row':>11}")
    for r in results:
        print(f"{r['bench']:46} {r['rows']:>10} {r['seconds']:>8} {r['rows_per_s']:>10} {r['mb_per_s']:>7} "
              f"{r['cpu_us_per_row']:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
