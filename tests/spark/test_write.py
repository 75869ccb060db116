"""Writing to Scroll streams from Spark: batch writes, and the exactly-once streaming sink across
failed commits and restarts from the checkpoint."""

from __future__ import annotations

import pytest
from pyspark.errors import StreamingQueryException

from .helpers import produce, read_all, stream_names

pytestmark = pytest.mark.process


def _writer(df, url, stream, **opts):
    w = df.write.format("scroll").option("metadata", url).option("stream", stream)
    for k, v in opts.items():
        w = w.option(k, v)
    return w


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "staged"])
def test_batch_write_appends_every_row(spark, spark_cluster, sclient, stream_name, inline):
    url = spark_cluster.metadata_url
    sclient.create_stream(stream_name)
    rows = [(f"k{i % 4}", f"value-{i}".encode(), [("h", f"{i}".encode())]) for i in range(300)]
    df = spark.createDataFrame(rows, "key string, value binary, headers array<struct<key:string,value:binary>>")
    _writer(df.repartition(3), url, stream_name, stageInlineBytes="1000000" if inline else "0").mode("append").save()
    got = read_all(url, stream_name)
    assert sorted((r.key, r.value, r.headers) for r in got) == sorted(
        (k.encode(), v, tuple(h)) for k, v, h in rows)
    assert not [n for n in stream_names(url) if n.startswith("_spark.")], "staging streams were left behind"


def test_write_to_a_topic_partitions_by_key(spark, spark_cluster, sclient, stream_name):
    from streams.topics import partition_for

    url = spark_cluster.metadata_url
    sclient.create_topic(stream_name, 3)
    rows = [(f"k{i % 7}", f"value-{i}".encode()) for i in range(200)] + [(None, b"keyless")]
    df = spark.createDataFrame(rows, "key string, value binary").repartition(2)
    _writer(df, url, stream_name).mode("append").save()
    got = {p: read_all(url, f"{stream_name}:{p}" if p else stream_name) for p in range(3)}
    assert sorted((r.key or b"-", r.value) for recs in got.values() for r in recs) == sorted(
        ((k or "-").encode(), v) for k, v in rows)
    for p, recs in got.items():  # Kafka's default partitioner: the same key lands where a Kafka client puts it
        assert all(partition_for(r.key, 3) == p for r in recs if r.key is not None)
        assert [r.offset for r in recs] == list(range(len(recs)))


def test_bad_input_is_refused_and_appends_nothing(spark, spark_cluster, sclient, stream_name):
    url = spark_cluster.metadata_url
    with pytest.raises(Exception, match="no stream named"):
        _writer(spark.createDataFrame([(b"x",)], "value binary"), url, stream_name + "-nope").mode("append").save()
    sclient.create_stream(stream_name)
    with pytest.raises(Exception, match="needs a 'value' column"):
        _writer(spark.createDataFrame([(b"x",)], "v binary"), url, stream_name).mode("append").save()
    with pytest.raises(Exception, match="value is null"):
        df = spark.createDataFrame([(b"a",), (None,), (b"c",)], "value binary").repartition(2)
        _writer(df, url, stream_name).mode("append").save()
    assert read_all(url, stream_name) == []
    # createStream=true creates a missing target
    _writer(spark.createDataFrame([("x",)], "value string"), url, stream_name + "-new",
            createStream="true").mode("append").save()
    assert [r.value for r in read_all(url, stream_name + "-new")] == [b"x"]


def _run_copy(spark, url, source, target, ck, **opts):
    """Copy ``source`` to ``target`` with a Trigger.AvailableNow query, 10 records per batch."""
    q = (spark.readStream.format("scroll").option("metadata", url).option("streams", source)
         .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", "10").load()
         .selectExpr("key", "value", "timestamp")
         .writeStream.format("scroll").option("metadata", url).option("stream", target)
         .option("checkpointLocation", ck))
    for k, v in opts.items():
        q = q.option(k, v)
    q = q.trigger(availableNow=True).start()
    try:
        q.awaitTermination(120)
    except StreamingQueryException as exc:
        return exc
    assert not q.isActive
    return q.exception()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "staged"])
def test_exactly_once_across_failed_commits_and_restarts(spark, spark_cluster, sclient, stream_name, tmp_path,
                                                         inline):
    url = spark_cluster.metadata_url
    source, target = stream_name + "-src", stream_name + "-dst"
    positions = produce(url, source, [{"value": f"e{i}".encode(), "key": f"k{i % 3}".encode()} for i in range(30)],
                        create={})
    sclient.create_stream(target)
    ck = str(tmp_path / "ck")
    stage = {"stageInlineBytes": "1000000" if inline else "0"}
    assert positions == list(range(30))
    in_batch = [10, 10, 10]
    # run 1: batch 0 commits; batch 1 dies after 4 of its records reached the target (batchBytes=100:
    # one record per record batch, so the copy can stop between records)
    err = _run_copy(spark, url, source, target, ck, testFailpoint="mid-copy:1:4", batchBytes="100", **stage)
    assert err is not None and "failpoint" in str(err)
    assert len(read_all(url, target)) == in_batch[0] + 4
    # run 2: batch 1 is replayed and completed (its 10 rows now come in one record batch, 4 of whose
    # records are there already: the other 6 are appended); batch 2 dies after its commit record is written
    err = _run_copy(spark, url, source, target, ck, testFailpoint="after-commit:2", **stage)
    assert err is not None and "failpoint" in str(err)
    assert len(read_all(url, target)) == sum(in_batch[:3])
    # run 3: Spark replays batch 2, which is already committed: nothing is appended twice
    assert _run_copy(spark, url, source, target, ck, **stage) is None
    assert len(read_all(url, target)) == 30
    # more data later, with a take-over of the target by another producer in between: still exactly once
    produce(url, source, [{"value": b"e30", "key": b"k0"}])
    produce(url, target, [])
    assert _run_copy(spark, url, source, target, ck, **stage) is None
    got = read_all(url, target)
    assert sorted(r.value for r in got) == sorted(f"e{i}".encode() for i in range(31))
    assert all(r.key == f"k{int(r.value[1:]) % 3}".encode() for r in got)
    assert [r.offset for r in got] == list(range(31))
    batch_of = {f"e{i}".encode(): p // 10 for i, p in enumerate(positions)} | {b"e30": 3}
    assert all(dict(r.headers)["scroll.spark.batch"].decode().endswith(f":{batch_of[r.value]}") for r in got)
    assert not [n for n in stream_names(url) if n.startswith("_spark.")], "staging streams were left behind"
    (rec,) = sclient.describe_stream(target).meta.extra["spark"].values()
    assert rec == {"batch": 3, "end": {target: 31}}


def test_exactly_once_into_a_topic_across_a_failed_commit(spark, spark_cluster, sclient, stream_name, tmp_path):
    from streams.topics import partition_for

    url = spark_cluster.metadata_url
    source, target = stream_name + "-src", stream_name + "-dst"
    produce(url, source, [{"value": f"e{i}".encode(), "key": f"k{i}".encode()} for i in range(20)], create={})
    sclient.create_topic(target, 3)
    ck = str(tmp_path / "ck")
    parts = [target, f"{target}:1", f"{target}:2"]
    # batch 1 dies after 4 of its records (one per record batch) reached the partitions
    err = _run_copy(spark, url, source, target, ck, testFailpoint="mid-copy:1:4", batchBytes="100")
    assert err is not None and "failpoint" in str(err)
    assert sum(len(read_all(url, p)) for p in parts) == 14
    (rec,) = sclient.describe_stream(target).meta.extra["spark"].values()
    assert rec["pending"] == 1 and set(rec["from"]) == set(parts)  # the intent names every partition
    # the restart completes batch 1 exactly, whatever partitions its records went to
    assert _run_copy(spark, url, source, target, ck) is None
    got = {p: read_all(url, p) for p in parts}
    assert sorted(r.value for rs in got.values() for r in rs) == sorted(f"e{i}".encode() for i in range(20))
    for i, p in enumerate(parts):
        assert all(partition_for(r.key, 3) == i for r in got[p])
        assert [r.offset for r in got[p]] == list(range(len(got[p])))
    (rec,) = sclient.describe_stream(target).meta.extra["spark"].values()
    assert rec == {"batch": 1, "end": {p: len(got[p]) for p in parts}}
