"""register() checks the Python that Spark runs on the executors: a driver started as
``.venv/bin/python script.py`` (venv not activated, PYSPARK_PYTHON unset) makes Spark start its
workers with ``python3`` from the PATH, which has none of the connector's dependencies. register()
must say so clearly (what to set) instead of letting the first query fail inside the executors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession

    import spark_stream

    mode, url, stream = sys.argv[1], sys.argv[2], sys.argv[3]
    b = (SparkSession.builder.master("local[1]").appName("worker-python")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.python.authenticate.socketTimeout", "120s"))
    if mode == "conf":
        b = b.config("spark.pyspark.python", sys.executable)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        try:
            spark_stream.register(spark, check_workers=(mode != "nocheck"))
        except spark_stream.ScrollWorkerPythonError as e:
            print("REGISTER-ERROR:", e, flush=True)
            try:  # the outcome is cached per SparkContext: the same error, without a second job
                spark_stream.register(spark)
            except spark_stream.ScrollWorkerPythonError as e2:
                print("SECOND-ERROR-SAME:", str(e2) == str(e), spark.sparkContext.statusTracker().getJobIdsForGroup(),
                      flush=True)
            sys.exit(3)
        print("REGISTERED", flush=True)
        if mode == "write":
            df = spark.createDataFrame([(b"k%d" % i, b"v%d" % i) for i in range(5)], "key binary, value binary")
            (df.write.format("scroll").option("metadata", url).option("stream", stream)
             .option("createStream", "true").mode("append").save())
            rows = (spark.read.format("scroll").option("metadata", url).option("streams", stream).load()
                    .orderBy("offset").collect())
            print("READ", [(r.key.decode(), r.value.decode()) for r in rows], flush=True)
    finally:
        spark.stop()
""")


def _system_python_without_grpc() -> str:
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(p) and subprocess.run([p, "-c", "import grpc"], capture_output=True).returncode != 0:
            return p
    pytest.skip("no system python3 without grpc to stand in for a worker's interpreter")


def _run(tmp_path, mode: str, url: str, stream: str, pyspark_python: str | None) -> subprocess.CompletedProcess:
    system_python = _system_python_without_grpc()
    bindir = tmp_path / "bin"  # a PATH whose python3 is the system one (what Spark runs when nothing is set)
    bindir.mkdir(exist_ok=True)
    if not (bindir / "python3").exists():
        (bindir / "python3").symlink_to(system_python)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "VIRTUAL_ENV", "PYTHONHOME")}
    java = shutil.which("java")
    env["PATH"] = os.pathsep.join([str(bindir), str(Path(java).resolve().parent) if java else "", "/usr/bin", "/bin"])
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, on the driver and on the workers
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    if pyspark_python:
        env["PYSPARK_PYTHON"] = pyspark_python
    venv_python = ROOT / ".venv" / "bin" / "python"
    exe = str(venv_python) if venv_python.exists() else sys.executable
    return subprocess.run([exe, str(script), mode, url, stream], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)


def test_worker_python_without_the_connector_is_a_clear_error(tmp_path, spark_cluster):
    r = _run(tmp_path, "check", spark_cluster.metadata_url, "unused", None)
    assert r.returncode == 3, (r.stdout, r.stderr[-3000:])
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("REGISTER-ERROR:"))
    assert "PYSPARK_PYTHON" in line and "spark.pyspark.python" in line, line
    assert "'grpc'" in line, line  # names what is missing
    assert str(ROOT / ".venv" / "bin" / "python") in line or sys.executable in line, line  # the Python to use
    assert "spark.archives" in line, line
    assert "SECOND-ERROR-SAME: True [0]" in r.stdout, r.stdout  # one job in all: the first check


def test_check_workers_false_skips_the_check(tmp_path, spark_cluster):
    r = _run(tmp_path, "nocheck", spark_cluster.metadata_url, "unused", None)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert "REGISTERED" in r.stdout


def test_with_pyspark_python_set_it_works(tmp_path, spark_cluster, stream_name):
    r = _run(tmp_path, "write", spark_cluster.metadata_url, stream_name, str(ROOT / ".venv" / "bin" / "python"))
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert "REGISTERED" in r.stdout
    read = next(ln for ln in r.stdout.splitlines() if ln.startswith("READ "))
    assert read == "READ " + str([(f"k{i}", f"v{i}") for i in range(5)]), read


def test_spark_pyspark_python_on_the_builder_works(tmp_path, spark_cluster):
    r = _run(tmp_path, "conf", spark_cluster.metadata_url, "unused", None)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert "REGISTERED" in r.stdout
