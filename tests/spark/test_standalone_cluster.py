"""examples/pipeline.py on a Spark standalone cluster: a master and two workers started with
spark_stream.standalone on 127.0.0.1, the driver a separate process (``--master spark://...``) with
PYSPARK_PYTHON set to this environment's Python (the same environment on every worker: they share
this filesystem). Exactly once across two runs, the second resuming from the checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from spark_stream import standalone
from streams.sync import connect
from streams.tools.localcluster import free_port

from .helpers import produce, read_all

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
WINDOW_MS = 10_000


def _events(t_start: int, n: int, mover_ts: int) -> list[dict]:
    """``n`` events over one minute from ``t_start`` (key acct-0..2, amount i % 7), then one event at
    ``mover_ts`` that moves the watermark (30 s) past all of them."""
    evs = [{"value": str(i % 7).encode(), "key": f"acct-{i % 3}".encode(), "timestamp_ms": t_start + i * 60_000 // n}
           for i in range(n)]
    evs.append({"value": b"4", "key": b"acct-1", "timestamp_ms": mover_ts})
    return evs


def _expected(events: list[dict]) -> list[tuple]:
    counts: Counter = Counter()
    sums: Counter = Counter()
    for e in events:
        w = e["timestamp_ms"] - e["timestamp_ms"] % WINDOW_MS
        counts[(w, e["key"].decode())] += 1
        sums[(w, e["key"].decode())] += int(e["value"])
    return sorted((w, a, c, sums[(w, a)]) for (w, a), c in counts.items())


def _parquet_rows(out: Path) -> list[tuple]:
    import pyarrow.parquet as pq

    t = pq.read_table(out / "totals")  # _spark_metadata is skipped (a leading "_")
    return sorted((int(r["window_start"].replace(tzinfo=UTC).timestamp() * 1000), r["account"], r["events"],
                   r["total"]) for r in t.to_pylist())


def _stream_rows(url: str, sink: str) -> list[tuple]:
    return sorted((int(datetime.fromisoformat(v["window_start"]).replace(tzinfo=UTC).timestamp() * 1000),
                   v["account"], v["events"], v["total"]) for v in (json.loads(r.value) for r in read_all(url, sink)))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SCROLL_SOAK"), reason="~2 min: CI runs the pipeline on a standalone cluster "
                    "in tests/cluster (hosts in network namespaces); this loopback run twice over is for make soak")
def test_pipeline_on_a_standalone_cluster(spark_cluster, stream_name, tmp_path):
    url = spark_cluster.metadata_url
    source, sink = stream_name + "-events", stream_name + "-totals"
    python = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
    # the executors import this checkout's code (the venv's editable install may point elsewhere)
    code_env = {"PYTHONPATH": str(ROOT)}
    host = "127.0.0.1"
    logs = tmp_path / "spark-logs"
    procs: list[standalone.SparkProcess] = []
    try:
        master = standalone.start_master(host, free_port(), free_port(), log_dir=logs, pyspark_python=python,
                                         env=code_env)
        procs.append(master)
        # the workers start with the master (they retry until it answers): the JVMs start in parallel
        workers = [standalone.start_worker(master.url, host, cores=1, memory="1g", webui_port=free_port(),
                                           work_dir=tmp_path / f"work-{i}", log_dir=logs, pyspark_python=python,
                                           env=code_env, name=f"worker-{i}")
                   for i in range(2)]
        procs.extend(workers)
        t0 = (int(datetime.now(UTC).timestamp()) // 60 - 20) * 60_000
        run1 = _events(t0, 60, t0 + 120_000)            # closes the windows of [t0, t0+60 s)
        run2 = _events(t0 + 150_000, 60, t0 + 330_000)  # closes everything up to t0+300 s, run1's mover included
        produce(url, source, run1, create={})
        with connect(url) as c:
            c.create_stream(sink)
        master.wait_ready(120)
        for w in workers:
            w.wait_registered(120)
        assert len(master.wait_workers(2, 30)) == 2
        out = tmp_path / "out"

        def run_driver(n: int) -> None:
            env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_DRIVER_PYTHON",)}
            env.update(code_env, PYSPARK_PYTHON=python, SPARK_LOCAL_IP=host)
            cmd = [python, str(ROOT / "examples" / "pipeline.py"), "--master", master.url, "--metadata", url,
                   "--source", source, "--sink", sink, "--out", str(out),
                   "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
                   "--conf", "spark.cores.max=2", "--conf", "spark.python.authenticate.socketTimeout=120s"]
            with open(tmp_path / f"driver-{n}.log", "w") as log:
                r = subprocess.run(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, timeout=240)
            text = (tmp_path / f"driver-{n}.log").read_text(errors="replace")
            assert r.returncode == 0, text[-4000:]

        run_driver(1)
        want1 = _expected(run1[:-1])
        assert _parquet_rows(out) == want1
        assert _stream_rows(url, sink) == want1

        produce(url, source, run2)
        run_driver(2)  # resumes from the checkpoints: run1's windows are not emitted again
        want2 = _expected(run1 + run2[:-1])
        assert _parquet_rows(out) == want2
        assert _stream_rows(url, sink) == want2
        assert len(read_all(url, sink)) == len(want2)
        # totals per key over everything the pipeline emitted = the input's (the open window's aside)
        per_key: Counter = Counter()
        for _, a, _c, s in _stream_rows(url, sink):
            per_key[a] += s
        want_key: Counter = Counter()
        for e in run1 + run2[:-1]:
            want_key[e["key"].decode()] += int(e["value"])
        assert per_key == want_key

        # the tasks ran on the standalone executors: two finished applications, each with executors
        # whose logs show tasks
        state = master.state()
        apps = [a for a in state.get("completedapps", []) if a.get("name") == "scroll-pipeline"]
        assert len(apps) == 2, state
        ran = [d for w in workers for d in w.executor_dirs()]
        assert {d.parent.name for d in ran} == {a["id"] for a in apps}, (ran, apps)
        assert any("Running task" in (d / "stderr").read_text(errors="replace") for d in ran if (d / "stderr").exists())
    finally:
        standalone.stop_all(procs)
    for p in procs:
        assert not p.alive()
    # nothing of theirs is left: executors and their Python workers were in the JVMs' process groups
    assert not _group_members({p.pid for p in procs})


def _group_members(pgids: set[int]) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) in pgids and fields[0] != "Z":
            out.append(f"{d.name} {cmd}")
    return out


def test_launcher_reports_the_bound_port_and_stops_everything(tmp_path):
    """A taken master port: Spark binds the next one, and the launcher's URL follows; a worker
    registers there; stop() leaves nothing of either process group."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        procs: list[standalone.SparkProcess] = []
        try:
            master = standalone.start_master("127.0.0.1", taken, free_port(), log_dir=tmp_path)
            procs.append(master)
            master.wait_ready(120)
            assert master.port != taken and master.url == f"spark://127.0.0.1:{master.port}"
            worker = standalone.start_worker(master.url, "127.0.0.1", cores=1, memory="512m", webui_port=free_port(),
                                             work_dir=tmp_path / "work", log_dir=tmp_path)
            procs.append(worker)
            worker.wait_registered(120)
            assert [w["host"] for w in master.wait_workers(1, 30)] == ["127.0.0.1"]
        finally:
            standalone.stop_all(procs)
    assert not any(p.alive() for p in procs)
    assert not _group_members({p.pid for p in procs})
