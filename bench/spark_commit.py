"""The Spark sink's driver commit alone, without Spark: ``spark_stream.sink._commit`` of one
micro-batch of 16 task outputs of 8 192 keyed 1 KiB rows each (131 072 rows, 128 record batches of
~1 MiB, inline) into a fresh stream (E=3 WQ=3 AQ=2), on a LocalCluster of 3 bookies; the copy's
in-flight window 16 (the sink's) and 64, alternated in the same run.

    PYTHONPATH=$PWD .venv/bin/python bench/spark_commit.py --repeat 2

Prints, per commit, its wall time and the CPU of this process (the commit's client side), and the
load average: the bookies' share is the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # first: bench/bookie.py must not shadow the package


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--windows", default="16,64", help="in-flight windows to alternate")
    args = ap.parse_args(argv)
    import pyarrow as pa

    from spark_stream import sink
    from spark_stream.options import WriteOptions
    from streams.driver import ProducerOptions
    from streams.sync import connect
    from streams.tools.localcluster import LocalCluster

    windows = [int(w) for w in args.windows.split(",")]
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="scroll-spark-commit-")), bookies=3).start()
    try:
        url = cluster.metadata_url
        pool, n = os.urandom(8 << 20), 8192
        values = [pool[i * 1031 % (len(pool) - 1024):][:1024] for i in range(n)]
        keys = [str(i % 1000).encode() for i in range(n)]
        rb = pa.RecordBatch.from_arrays([pa.array(keys, pa.binary()), pa.array(values, pa.binary())], ["key", "value"])
        base = WriteOptions.parse({"metadata": url, "stream": "t:0", "stageInlineBytes": str(64 << 20)})
        msgs = [sink.write_task(base, ("key", "value"), [rb], "q", 0, tagged=True, partition=i, attempt=0)
                for i in range(16)]
        rows = sum(m.count for m in msgs)
        default = sink._COPY_OPTIONS
        try:
            for rep in range(args.repeat):
                for w in windows:
                    name = f"commit-{w}-{rep}"
                    with connect(url) as c:
                        c.create_stream(name, ensemble=3, write_quorum=3, ack_quorum=2)
                    sink._COPY_OPTIONS = ProducerOptions(max_inflight_batches=w)
                    t, cpu = time.perf_counter(), time.process_time()
                    sink._commit(dataclasses.replace(base, stream=name), msgs, 0, exactly_once=True)
                    secs, cpu = time.perf_counter() - t, time.process_time() - cpu
                    print(f"window {w:3} run {rep + 1}: {rows} rows in {secs:.2f} s ({rows / secs:,.0f} rows/s), "
                          f"client CPU {cpu:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            sink._COPY_OPTIONS = default
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
