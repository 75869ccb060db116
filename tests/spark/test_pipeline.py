"""The example pipeline (examples/pipeline.py) end to end: events in a stream, windowed totals out
to Parquet and to another stream."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from .helpers import read_all

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def _pipeline():
    spec = importlib.util.spec_from_file_location("scroll_example_pipeline", ROOT / "examples" / "pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_pipeline_windows_to_parquet_and_stream(spark, spark_cluster, stream_name, tmp_path):
    pipeline = _pipeline()
    url = spark_cluster.metadata_url
    source, sink = stream_name + "-events", stream_name + "-totals"
    args = pipeline.parse_args(["--metadata", url, "--source", source, "--sink", sink, "--out", str(tmp_path)])
    n = 90
    t0 = pipeline.make_demo_events(url, source, sink, n=n)
    for q in pipeline.build(spark, args):
        q.awaitTermination(180)
        assert q.exception() is None
    expected = Counter()
    totals: Counter = Counter()
    for i in range(n):
        ts = t0 + i * 60_000 // n
        w = ts - ts % 10_000
        expected[(w, f"acct-{i % 3}")] += 1
        totals[(w, f"acct-{i % 3}")] += i % 7
    want = sorted((w, a, c, totals[(w, a)]) for (w, a), c in expected.items())
    rows = spark.read.parquet(str(tmp_path / "totals")).collect()
    got = sorted((int(r.window_start.replace(tzinfo=UTC).timestamp() * 1000), r.account, r.events, r.total)
                 for r in rows)
    assert got == want  # every closed window once; the late event's window is still open
    recs = read_all(url, sink)
    from_stream = sorted(
        (int(datetime.fromisoformat(v["window_start"]).replace(tzinfo=UTC).timestamp() * 1000), v["account"],
         v["events"], v["total"]) for v in (json.loads(r.value) for r in recs))
    assert from_stream == want
    assert all(r.key == json.loads(r.value)["account"].encode() for r in recs)
