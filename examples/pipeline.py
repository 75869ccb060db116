"""A Spark Structured Streaming pipeline on Scroll streams.

Reads a stream of events (key = account, value = an amount as text, timestamp = event time),
counts and sums the amounts per key in tumbling event-time windows with a watermark, and writes
each closed window both to Parquet files and to another Scroll stream (exactly once, as JSON).
Both streams are one-partition topics (Kafka clients read them through the Kafka listener too);
the source's checkpointed offsets are record offsets, as in Spark's Kafka source.

    scroll standalone &                                    # etcd + 3 bookies on 127.0.0.1
    .venv/bin/python examples/pipeline.py --demo           # make sample events, run to the end
    .venv/bin/python examples/pipeline.py --follow         # keep running on new events

Options: ``--metadata`` (default etcd://127.0.0.1:2379 or $SCROLL_METADATA), ``--source``,
``--sink``, ``--out`` (Parquet directory and checkpoints), ``--window``, ``--watermark``, ``--master``
(default local[2]; ``spark://host:7077`` runs it on a standalone cluster, see docs/spark.md) and
``--conf KEY=VALUE`` (Spark settings, e.g. ``spark.driver.host`` when the executors are on other
machines). Without
``--follow`` it uses Trigger.AvailableNow: it processes what is there, emits the windows the
watermark has closed, and exits; run it again later and it resumes from its checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metadata", default=os.environ.get("SCROLL_METADATA", "etcd://127.0.0.1:2379"))
    p.add_argument("--source", default="events")
    p.add_argument("--sink", default="event-totals")
    p.add_argument("--out", default="pipeline-out", help="directory for the Parquet output and the checkpoints")
    p.add_argument("--window", default="10 seconds")
    p.add_argument("--watermark", default="30 seconds")
    p.add_argument("--follow", action="store_true", help="keep running (a trigger every --interval)")
    p.add_argument("--interval", default="5 seconds")
    p.add_argument("--demo", action="store_true", help="create the streams and append sample events first")
    p.add_argument("--master", default="local[2]",
                   help="Spark master URL (default local[2]); e.g. spark://host:7077 for a standalone cluster")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark setting, applied after the defaults (repeatable), e.g. spark.executor.memory=512m")
    return p.parse_args(argv)


def make_demo_events(metadata: str, source: str, sink: str, n: int = 600) -> int:
    """Create the streams (if missing) and append ``n`` events spread over one minute of event time,
    plus one event two minutes later that moves the watermark past all of them. Returns the event
    time (ms) of the first event."""
    from streams.errors import StreamExists
    from streams.sync import connect

    with connect(metadata) as c:
        for name in (source, sink):
            try:
                c.create_stream(name)
            except StreamExists:
                pass
        t0 = (int(time.time()) // 60 - 10) * 60 * 1000  # a whole minute, in the past
        events = [{"value": str(i % 7).encode(), "key": f"acct-{i % 3}".encode(), "timestamp_ms": t0 + i * 60_000 // n}
                  for i in range(n)]
        events.append({"value": b"0", "key": b"acct-0", "timestamp_ms": t0 + 180_000})
        with c.producer(source) as p:
            p.append_many(events)  # record batches: many events per entry
    return t0


def build(spark, args):
    """The windowed aggregation and its two sinks; returns the started queries."""
    from pyspark.sql import functions as F

    events = (spark.readStream.format("scroll").option("metadata", args.metadata).option("streams", args.source)
              .option("startingOffsets", "earliest").load()
              .select(F.col("key").cast("string").alias("account"),
                      F.col("value").cast("string").cast("long").alias("amount"),
                      F.col("timestamp")))
    totals = (events.withWatermark("timestamp", args.watermark)
              .groupBy(F.window("timestamp", args.window), "account")
              .agg(F.count("*").alias("events"), F.sum("amount").alias("total"))
              .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                      "account", "events", "total"))
    out = Path(args.out).resolve()

    def start(writer, name):
        writer = writer.outputMode("append").option("checkpointLocation", str(out / "checkpoints" / name))
        writer = writer.trigger(processingTime=args.interval) if args.follow else writer.trigger(availableNow=True)
        return writer.queryName(name).start()

    to_parquet = start(totals.writeStream.format("parquet").option("path", str(out / "totals")), "totals_parquet")
    as_records = totals.select(
        F.col("account").cast("binary").alias("key"),
        F.to_json(F.struct("window_start", "window_end", "account", "events", "total")).cast("binary").alias("value"),
        F.col("window_end").alias("timestamp"))
    to_stream = start(as_records.writeStream.format("scroll").option("metadata", args.metadata)
                      .option("stream", args.sink), "totals_stream")
    return [to_parquet, to_stream]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import spark_stream

    if args.demo:
        make_demo_events(args.metadata, args.source, args.sink)
    builder = (SparkSession.builder.master(args.master).appName("scroll-pipeline")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.session.timeZone", "UTC"))
    for kv in args.conf:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--conf {kv!r}: expected KEY=VALUE")
        builder = builder.config(key.strip(), value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark_stream.register(spark)
    try:
        queries = build(spark, args)
        for q in queries:
            q.awaitTermination()
        totals = spark.read.parquet(str(Path(args.out).resolve() / "totals"))
        totals.orderBy("window_start", "account").show(50, truncate=False)
        from streams.sync import connect

        with connect(args.metadata) as c:
            recs = c.consumer(args.sink).read(5)
        for r in recs:
            print(f"{args.sink}@{r.offset}: {r.key.decode()} {json.loads(r.value)}")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
