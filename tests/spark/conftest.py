"""Shared fixtures for the Spark connector tests: one real LocalCluster (etcd + 3 bookie processes)
and one local SparkSession (local[2], UI off, everything bound to 127.0.0.1) for the whole session.

Spark's Python workers run the data source on the executors: they are started with this
interpreter (PYSPARK_PYTHON), which has the project installed in editable mode.
"""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from streams.tools.localcluster import LocalCluster  # noqa: E402


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("spark-cluster"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import spark_stream

    session = (SparkSession.builder.master("local[2]").appName("scroll-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.streaming.stopTimeout", "30s")
               # a loaded 2-core CI machine can take longer than the default 15 s to start a
               # Python worker that connects back
               .config("spark.python.authenticate.socketTimeout", "120s")
               .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("warehouse")))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    spark_stream.register(session)
    yield session
    for q in session.streams.active:
        q.stop()
    session.stop()


@pytest.fixture()
def sclient(spark_cluster):
    from streams.sync import connect

    c = connect(spark_cluster.metadata_url)
    yield c
    c.close()


_n = itertools.count(1)


@pytest.fixture()
def stream_name(request):
    return f"sp{next(_n)}-{request.node.name[:40].replace('[', '-').replace(']', '')}"
