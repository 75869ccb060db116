"""PySpark data source for Scroll streams: ``spark.read``/``readStream``/``write``/``writeStream``
with ``format("scroll")``.

    import spark_stream
    spark_stream.register(spark)
    df = (spark.readStream.format("scroll")
          .option("metadata", "etcd://127.0.0.1:2379").option("streams", "orders")
          .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", 10000).load())
    (df.writeStream.format("scroll").option("metadata", "etcd://127.0.0.1:2379")
       .option("stream", "orders-copy").option("checkpointLocation", "/tmp/ck").start())

Built on Spark's Python Data Source API (``pyspark.sql.datasource``, Spark >= 4.2 for admission
control). The reading side is in ``spark_stream.source``, the exactly-once writing side in
``spark_stream.sink``, options in ``spark_stream.options``. See docs/spark.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid

from pyspark.sql.datasource import DataSource

from .options import ReadOptions, ScrollOptionError, WriteOptions
from .sink import ScrollBatchWriter, ScrollStreamWriter, check_schema, ensure_target
from .source import ScrollBatchReader, ScrollDataLossError, ScrollStreamReader, schema_for

__all__ = ["ScrollDataSource", "ScrollDataLossError", "ScrollOptionError", "ScrollWorkerPythonError", "register"]

FORMAT = "scroll"


class ScrollDataSource(DataSource):
    """The ``scroll`` format. Options: see ``spark_stream.options`` and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def _include_headers(self) -> bool:
        v = self.options.get("includeHeaders")
        return str(v).strip().lower() in ("true", "1", "yes") if v is not None else False

    def schema(self):
        return schema_for(self._include_headers())

    def reader(self, schema):
        return ScrollBatchReader(ReadOptions.parse(self.options, streaming=False))

    def streamReader(self, schema):
        return ScrollStreamReader(ReadOptions.parse(self.options, streaming=True))

    def writer(self, schema, overwrite: bool):
        opts = WriteOptions.parse(self.options)
        cols = check_schema(schema)
        ensure_target(opts)
        return ScrollBatchWriter(opts, cols)

    def streamWriter(self, schema, overwrite: bool):
        opts = WriteOptions.parse(self.options)
        cols = check_schema(schema)
        ensure_target(opts)
        return ScrollStreamWriter(opts, cols)


class ScrollWorkerPythonError(RuntimeError):
    """The Python that Spark runs on the executors cannot import the connector (see ``register``)."""


log = logging.getLogger(__name__)

# the worker check's outcome per SparkContext (its applicationId): None (fine) or the error message
_checked: dict[str, str | None] = {}
_checked_lock = threading.Lock()
CHECK_TIMEOUT_S = 120.0

# What the connector imports on an executor: its own packages and their third-party dependencies
# (pyspark and py4j come with Spark).
WORKER_MODULES = ("spark_stream", "streams", "fragments", "terms", "bookie", "grpc", "google.protobuf", "aetcd",
                  "aiokafka", "cramjam", "crc32c", "pyarrow")

# The probe runs on an executor's Python worker. It is compiled here in a namespace of its own (a
# module name that is not importable), so cloudpickle ships it by value: unpickling it needs
# nothing but the standard library, and a missing module is reported by the probe, not by Spark's
# unpickler as a long Java trace. It looks the modules up (importlib.util.find_spec) without
# running them: ~1 ms, where importing them all takes 0.5-2 s on a loaded machine.
_PROBE_SRC = """
def probe(_):
    import importlib.util
    import sys
    missing = []
    for name in MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except Exception:  # a parent package is missing (google.protobuf) or broken
            found = False
        if not found:
            missing.append(name)
    return {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3], "missing": missing}
"""


def _probe_function():
    ns = {"__name__": "_scroll_worker_probe", "MODULES": WORKER_MODULES}
    exec(compile(_PROBE_SRC, "<scroll worker probe>", "exec"), ns)
    return ns["probe"]


def _advice(python: str) -> str:
    return (f"Run the executors with this environment's Python ({sys.executable}): export "
            f"PYSPARK_PYTHON={sys.executable} before starting the driver (or set os.environ['PYSPARK_PYTHON'] "
            f"before the SparkSession is created), or build the session with "
            f".config(\"spark.pyspark.python\", sys.executable) (spark-submit: --conf spark.pyspark.python=...). "
            f"On a cluster whose machines do not share this environment, install it at the same path on every "
            f"worker, or ship a packed virtualenv with spark.archives (docs/spark.md, 'Running on a Spark "
            f"cluster'). Spark's Python here: {python!r}"
            + (" (PYSPARK_PYTHON and spark.pyspark.python unset: 'python3' from the PATH)"
               if python == "python3" and not os.environ.get("PYSPARK_PYTHON") else "")
            + ". To skip this check: spark_stream.register(spark, check_workers=False).")


def _apply_pyspark_python(sc) -> None:
    """Honour ``spark.pyspark.python`` set on the session builder. Spark gives it precedence over
    PYSPARK_PYTHON, but only spark-submit applies it; a driver started as a plain Python script
    reads only the environment variable (``SparkContext.pythonExec``), which every Python function
    shipped afterwards (this data source's included) carries to the executors."""
    conf = sc.getConf().get("spark.pyspark.python", None)
    if conf and sc.pythonExec != conf:
        sc.pythonExec = conf


def _check_workers(sc, timeout: float = CHECK_TIMEOUT_S) -> None:
    """Run one task (one partition) that looks up the connector's modules (WORKER_MODULES) in an
    executor's Python; raise ScrollWorkerPythonError if any is missing, or if Spark cannot run that
    Python or it is of another version. Cached per SparkContext; skipped with a warning when no
    executor runs the task within ``timeout``."""
    key = sc.applicationId
    with _checked_lock:
        if key in _checked:
            if _checked[key] is not None:
                raise ScrollWorkerPythonError(_checked[key])
            return
    python = sc.pythonExec
    tag = f"scroll-worker-check-{uuid.uuid4().hex[:8]}"
    prev_desc = sc.getLocalProperty("spark.job.description")
    timer = threading.Timer(timeout, lambda: sc.cancelJobsWithTag(tag))
    timer.daemon = True
    t0 = time.monotonic()
    sc.addJobTag(tag)
    sc.setLocalProperty("spark.job.description", "scroll: check the executors' Python")
    timer.start()
    try:
        res = sc.parallelize([0], 1).map(_probe_function()).collect()[0]
        message = None
        if res["missing"]:
            message = (f"scroll: the Python that Spark runs on the executors ({res['executable']}, Python "
                       f"{res['version']}) cannot import the Scroll connector: no module named "
                       + ", ".join(repr(m) for m in res["missing"]) + ". " + _advice(python))
    except Exception as e:  # noqa: BLE001 - classified below
        text = str(e)
        if time.monotonic() - t0 >= timeout and "cancel" in text.lower():
            log.warning("scroll: the executors' Python check did not finish in %.0f s (no executors?); skipped",
                        timeout)
            return
        if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
            message = (f"scroll: the Python that Spark runs on the executors is not this Python's version "
                       f"({sys.version_info.major}.{sys.version_info.minor}). " + _advice(python))
        elif "Cannot run program" in text:
            message = f"scroll: Spark cannot start the executors' Python ({python!r}). " + _advice(python)
        elif "ModuleNotFoundError" in text or "ImportError" in text:
            first = next((ln.strip() for ln in text.splitlines()
                          if "ModuleNotFoundError" in ln or "ImportError" in ln), "")
            message = ("scroll: the Python that Spark runs on the executors cannot import what the Scroll "
                       f"connector needs ({first}). " + _advice(python))
        else:
            raise
    finally:
        timer.cancel()
        sc.removeJobTag(tag)
        sc.setLocalProperty("spark.job.description", prev_desc)
    log.info("scroll: executors' Python checked in %.0f ms", (time.monotonic() - t0) * 1000)
    with _checked_lock:
        _checked[key] = message
    if message is not None:
        raise ScrollWorkerPythonError(message)


def register(spark, *, check_workers: bool = True) -> None:
    """Make ``format("scroll")`` available in ``spark`` (a SparkSession).

    With ``check_workers`` (the default) it first runs one tiny Spark job (one task) that looks up the
    connector's modules in an executor's Python, and raises ``ScrollWorkerPythonError`` saying what to set
    (PYSPARK_PYTHON / spark.pyspark.python, or a packed virtualenv) if that Python cannot: otherwise
    the first query would fail inside the executors with a long Java trace. The result is cached per
    SparkContext. ``spark.pyspark.python`` set on the session builder is applied (see
    ``_apply_pyspark_python``)."""
    try:
        sc = spark.sparkContext
    except Exception:  # noqa: BLE001 - Spark Connect: no SparkContext here, the server runs the Python
        sc = None
    if sc is not None:
        _apply_pyspark_python(sc)
        if check_workers:
            _check_workers(sc)
    spark.dataSource.register(ScrollDataSource)
