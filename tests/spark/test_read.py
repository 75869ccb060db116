"""Reading Scroll streams into Spark: batch reads, streaming reads with admission control,
checkpoint restarts, a writer take-over during a query, and data removed by retention."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from .helpers import compact, produce, remove_front_fragments

pytestmark = pytest.mark.process


def _recs(n, prefix="v", start=0):
    out = []
    for i in range(start, start + n):
        out.append({
            "value": f"{prefix}{i}".encode(),
            "key": None if i % 5 == 0 else f"k{i % 3}".encode(),
            "headers": [("h", f"x{i}".encode()), ("n", None)] if i % 2 else [],
            "timestamp_ms": 1_700_000_000_000 + i,
        })
    return out


def _reader(spark, url, **opts):
    r = spark.read.format("scroll").option("metadata", url)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_batch_read_equals_what_was_produced(spark, spark_cluster, stream_name):
    url = spark_cluster.metadata_url
    first = _recs(30)
    pos1 = produce(url, stream_name, first, create={"ensemble": 3, "write_quorum": 2, "ack_quorum": 2})
    second = _recs(20, start=30)
    pos2 = produce(url, stream_name, second, per_entry=True)  # a second producer: a take-over (a no-op entry)
    assert pos1 + pos2 == list(range(50)), "record offsets are dense from 0; the take-over's no-op takes none"
    df = _reader(spark, url, streams=stream_name, includeHeaders="true")
    rows = sorted(df.collect(), key=lambda r: r.offset)
    expected = first + second
    assert [r.offset for r in rows] == pos1 + pos2
    for r, e in zip(rows, expected):
        assert (r.key, r.value, r.stream, r.topic, r.partition) == (e["key"], e["value"], stream_name, stream_name, 0)
        assert [(h.key, h.value) for h in r.headers] == list(e["headers"])
        assert r.timestamp.replace(tzinfo=UTC) == datetime.fromtimestamp(e["timestamp_ms"] / 1000, UTC)
    # endingOffsets / startingOffsets as JSON: a half-open range of record offsets (one inside a batch)
    part = _reader(spark, url, streams=stream_name, startingOffsets=json.dumps({stream_name: 5}),
                   endingOffsets=json.dumps({stream_name: 33}))
    assert sorted(r.offset for r in part.collect()) == list(range(5, 33))
    assert "headers" not in part.columns
    # Kafka's form, by topic and partition
    part = _reader(spark, url, topics=stream_name, startingOffsets=json.dumps({stream_name: {"0": 12}}),
                   endingOffsets=json.dumps({stream_name: {"0": 14}}))
    assert sorted(r.offset for r in part.collect()) == [12, 13]
    # by timestamp, as Spark's Kafka source: the first *record* at or after it, inside a batch too
    base = 1_700_000_000_000
    part = _reader(spark, url, streams=stream_name, startingTimestamp=str(base + 7),
                   endingOffsetsByTimestamp=json.dumps({stream_name: base + 33}))
    assert sorted(r.offset for r in part.collect()) == list(range(7, 33))
    part = _reader(spark, url, topics=stream_name, startingOffsetsByTimestamp=json.dumps({stream_name: {"0": base + 41}}))
    assert sorted(r.offset for r in part.collect()) == list(range(41, 50))
    with pytest.raises(Exception, match="no record with a timestamp >= 1700000001000"):
        _reader(spark, url, streams=stream_name, startingTimestamp=str(base + 1000)).collect()
    assert _reader(spark, url, streams=stream_name, startingTimestamp=str(base + 1000),
                   startingOffsetsByTimestampStrategy="latest").collect() == []


def test_topic_with_partitions_reads_every_partition(spark, spark_cluster, sclient, stream_name):
    url = spark_cluster.metadata_url
    sclient.create_topic(stream_name, 3)
    with sclient.producer(stream_name) as p:  # keyed records go to partitions by murmur2, as in Kafka
        placed = p.append_many([{"value": f"v{i}".encode(), "key": f"k{i}".encode()} for i in range(60)])
    want = sorted((part, off, f"v{i}".encode()) for i, (part, off) in enumerate(placed))
    assert {part for part, _, _ in want} == {0, 1, 2}
    rows = _reader(spark, url, topics=stream_name).collect()
    assert sorted((r.partition, r.offset, r.value) for r in rows) == want
    assert {(r.topic, r.partition, r.stream) for r in rows} == {
        (stream_name, 0, stream_name), (stream_name, 1, f"{stream_name}:1"), (stream_name, 2, f"{stream_name}:2")}
    # one partition by its stream name; offsets by topic and partition; a pattern over topic names
    one = _reader(spark, url, streams=f"{stream_name}:2").collect()
    assert sorted((r.partition, r.offset, r.value) for r in one) == [w for w in want if w[0] == 2]
    tail = _reader(spark, url, topicPattern=stream_name.replace("-", ".") + "$",
                   startingOffsets=json.dumps({stream_name: {"1": 3}})).collect()
    assert sorted((r.partition, r.offset, r.value) for r in tail) == [w for w in want if w[0] != 1 or w[1] >= 3]

def test_min_partitions_splits_the_read(spark, spark_cluster, stream_name):
    url = spark_cluster.metadata_url
    recs = [{"value": f"m{i}".encode()} for i in range(200)]
    positions = produce(url, stream_name, recs, create={"fragment_entries_max": 50}, per_entry=True)
    df = _reader(spark, url, streams=stream_name, minPartitions="4")
    assert df.rdd.getNumPartitions() >= 4
    assert sorted(r.offset for r in df.collect()) == positions
    assert df.count() == 200


def test_bad_options_fail_clearly(spark, spark_cluster, stream_name):
    url = spark_cluster.metadata_url
    with pytest.raises(Exception, match="exactly one of the options 'topics', 'topicPattern', 'streams'"):
        _reader(spark, url, streams="a", streamPattern="a.*").collect()
    with pytest.raises(Exception, match="no stream named"):
        _reader(spark, url, streams=stream_name + "-missing").collect()
    with pytest.raises(Exception, match="no topic named"):
        _reader(spark, url, topics=stream_name + "-missing").collect()
    with pytest.raises(Exception, match="maxRecordsPerTrigger"):
        (spark.readStream.format("scroll").option("metadata", url).option("streams", "x")
         .option("maxRecordsPerTrigger", "many").load().writeStream.format("console").start().awaitTermination(30))


def _collect_batches(spark, url, streams, checkpoint, **opts):
    """Run a Trigger.AvailableNow query to the end. Returns the non-empty batches as
    [(batch id, records planned for the batch, [(stream, offset, value)])]."""
    got = {}
    reader = spark.readStream.format("scroll").option("metadata", url)
    if streams is not None:
        reader = reader.option("streams", streams)
    for k, v in opts.items():
        reader = reader.option(k, v)

    def each(df, batch_id):
        got[batch_id] = [(r.stream, r.offset, r.value) for r in df.collect()]

    q = (reader.load().writeStream.foreachBatch(each).option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert not q.isActive
    if q.exception() is not None:
        raise q.exception()
    planned = {}
    for p in q.recentProgress:
        src = p.sources[0]
        start = (json.loads(src.startOffset) if src.startOffset else None) or {}
        end = json.loads(src.endOffset)
        planned[p.batchId] = sum(int(e) - int(start.get(s, 0)) for s, e in end.items())
    return [(b, planned[b], got[b]) for b in sorted(got) if got[b]]


def test_streaming_admission_control_and_restart(spark, spark_cluster, stream_name, tmp_path):
    url = spark_cluster.metadata_url
    a, b = stream_name + "-a", stream_name + "-b"
    pa = produce(url, a, [{"value": f"a{i}".encode()} for i in range(20)], create={})
    pb = produce(url, b, [{"value": f"b{i}".encode()} for i in range(10)], create={})
    ck = str(tmp_path / "ck")
    batches = _collect_batches(spark, url, f"{a},{b}", ck, startingOffsets="earliest", maxRecordsPerTrigger="9")
    # maxRecordsPerTrigger counts records (offsets are dense: a take-over's no-op takes none)
    assert pa == list(range(20)) and pb == list(range(10))
    assert [n for _, n, _ in batches] == [9, 9, 9, 3]
    assert [len(rows) for _, _, rows in batches] == [9, 9, 9, 3]
    # the first batch splits the limit in proportion to the backlogs: 6 of a, 3 of b
    first = batches[0][2]
    assert sorted(o for s, o, _ in first if s == a) == list(range(6))
    assert sorted(o for s, o, _ in first if s == b) == list(range(3))
    # stop; more data; restart from the checkpoint: exactly the new records, nothing again
    pa += produce(url, a, [{"value": f"a{i}".encode()} for i in range(20, 27)])
    pb += produce(url, b, [{"value": f"b{i}".encode()} for i in range(10, 15)])
    again = _collect_batches(spark, url, f"{a},{b}", ck, startingOffsets="earliest", maxRecordsPerTrigger="9")
    assert [n for _, n, _ in again] == [9, 3]
    assert again[0][0] > batches[-1][0]
    rows = [(s, o, v) for _, _, rs in batches + again for s, o, v in rs]
    assert len(rows) == len(set(rows)) == 42
    assert sorted(rows) == sorted([(a, p, f"a{i}".encode()) for i, p in enumerate(pa)]
                                  + [(b, p, f"b{i}".encode()) for i, p in enumerate(pb)])


def test_writer_takeover_during_streaming_read(spark, spark_cluster, stream_name, tmp_path):
    url = spark_cluster.metadata_url
    from streams.errors import StaleTermError
    from streams.sync import connect

    seen = []

    def each(df, batch_id):
        seen.extend((r.offset, r.value) for r in df.collect())

    with connect(url) as c:
        c.create_stream(stream_name)
        p1 = c.producer(stream_name)
        expected = [(p1.append(f"one{i}".encode()), f"one{i}".encode()) for i in range(15)]
        q = (spark.readStream.format("scroll").option("metadata", url).option("streams", stream_name)
             .option("startingOffsets", "earliest").load().writeStream.foreachBatch(each)
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="200 milliseconds").start())
        try:
            _wait(lambda: len(seen) >= 15, q)
            p2 = c.producer(stream_name)  # takes the stream over while the query runs
            with pytest.raises(StaleTermError):
                p1.append(b"fenced")
            expected += [(p2.append(f"two{i}".encode()), f"two{i}".encode()) for i in range(15)]
            p2.close()
            _wait(lambda: len(seen) >= 30, q)
            time.sleep(1.0)  # a few more triggers: nothing else may show up
        finally:
            q.stop()
    assert seen == expected


def _wait(cond, q, timeout=90):
    deadline = time.monotonic() + timeout
    while not cond():
        if q.exception() is not None:
            raise q.exception()
        assert time.monotonic() < deadline, "the streaming query did not catch up"
        time.sleep(0.1)


@pytest.mark.parametrize("fail", [True, False], ids=["fail", "skip"])
def test_data_removed_by_retention(spark, spark_cluster, stream_name, tmp_path, fail):
    url = spark_cluster.metadata_url
    p0 = produce(url, stream_name, [{"value": f"r{i}".encode()} for i in range(5)], create={"fragment_entries_max": 10},
                 per_entry=True)
    ck = str(tmp_path / "ck")
    done = _collect_batches(spark, url, stream_name, ck, startingOffsets="earliest")
    assert [len(rows) for _, _, rows in done] == [5]
    positions = produce(url, stream_name, [{"value": f"r{i}".encode()} for i in range(5, 45)], per_entry=True)
    earliest = remove_front_fragments(url, stream_name, 2)
    resume_at = p0[-1] + 1  # the offset the checkpoint holds
    assert earliest > resume_at
    if fail:
        with pytest.raises(Exception) as info:
            _collect_batches(spark, url, stream_name, ck, startingOffsets="earliest")
        msg = str(info.value)
        assert stream_name in msg and f"offset {resume_at} " in msg and f"earliest offset now is {earliest}" in msg
        with pytest.raises(Exception, match="data loss"):
            _reader(spark, url, streams=stream_name, startingOffsets=json.dumps({stream_name: 0})).collect()
    else:
        after = _collect_batches(spark, url, stream_name, ck, startingOffsets="earliest", failOnDataLoss="false")
        offsets = [o for _, _, rows in after for _, o, _ in rows]
        assert offsets == [p for p in positions if p >= earliest]
        rows = _reader(spark, url, streams=stream_name, failOnDataLoss="false",
                       startingOffsets=json.dumps({stream_name: 0})).collect()
        assert sorted(r.offset for r in rows) == [p for p in positions if p >= earliest]


def test_streaming_topic_reads_partitions_added_later(spark, spark_cluster, sclient, stream_name, tmp_path):
    url = spark_cluster.metadata_url
    sclient.create_topic(stream_name, 2)
    with sclient.producer(stream_name) as w:  # the topic's producer: by key over both partitions
        w.append_many([{"value": f"v{i}".encode(), "key": f"k{i}".encode()} for i in range(6)])
    ck = str(tmp_path / "ck")
    first = _collect_batches(spark, url, None, ck, topics=stream_name, startingOffsets="earliest")
    assert sorted(v for _, _, rows in first for _, _, v in rows) == sorted(f"v{i}".encode() for i in range(6))
    sclient.add_partitions(stream_name, 3)
    with sclient.producer(f"{stream_name}:2") as w:  # the new partition's stream
        w.append_many([{"value": f"p2-{i}".encode()} for i in range(4)])
    again = _collect_batches(spark, url, None, ck, topics=stream_name, startingOffsets="earliest")
    rows = [(s, o, v) for _, _, rs in again for s, o, v in rs]
    assert sorted(rows) == [(f"{stream_name}:2", i, f"p2-{i}".encode()) for i in range(4)]  # from its first offset


def test_a_compacted_stream_reads_with_gaps_and_no_data_loss(spark, spark_cluster, stream_name):
    """As Spark's Kafka source on a compacted topic: the offsets compaction removed are skipped, at
    the same offsets as before, and failOnDataLoss (the default, true) does not fire."""
    url = spark_cluster.metadata_url
    recs = [{"value": f"v{i}".encode(), "key": f"k{i % 4}".encode(), "timestamp_ms": 1_700_000_000_000 + i}
            for i in range(40)]
    pos = produce(url, stream_name, recs, per_entry=True,
                  create={"fragment_entries_max": 8, "retention": {"cleanup_policy": "compact"}})
    report = compact(url, stream_name)
    assert report["records_out"] < report["records_in"]
    rows = sorted(_reader(spark, url, streams=stream_name).collect(), key=lambda r: r.offset)
    cleaned = report["cleaned_to"]
    latest = {}  # each key's latest record below the offset the pass cleaned to
    for r, o in zip(recs, pos):
        if o < cleaned:
            latest[r["key"]] = o
    expected = sorted({o for o in latest.values() if o < cleaned} | {o for o in pos if o >= cleaned})
    assert [r.offset for r in rows] == expected  # gaps below the cleaned offset, every record above it
    assert all(r.value == recs[pos.index(r.offset)]["value"] for r in rows)
    # a range starting at a removed offset begins at the next record that exists
    removed = next(o for o in range(cleaned) if o not in expected)
    part = _reader(spark, url, streams=stream_name, startingOffsets=json.dumps({stream_name: removed}))
    assert sorted(r.offset for r in part.collect()) == [o for o in expected if o >= removed]
