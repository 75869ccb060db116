"""Planning without Spark running: option parsing, admission-control shares, range splitting."""

from __future__ import annotations

import pytest

from spark_stream.options import ReadOptions, ScrollOptionError, WriteOptions
from spark_stream.source import allocate, split_ranges

URL = "etcd://127.0.0.1:2379"


def test_allocate_is_proportional_exact_and_bounded():
    assert allocate(10, {"a": 30, "b": 10, "c": 0}) == {"a": 8, "b": 2, "c": 0}
    assert allocate(100, {"a": 3, "b": 4}) == {"a": 3, "b": 4}  # less backlog than the limit: all of it
    for limit in range(1, 40):
        share = allocate(limit, {"a": 17, "b": 5, "c": 1})
        assert sum(share.values()) == min(limit, 23)
        assert share["a"] <= 17 and share["b"] <= 5 and share["c"] <= 1


def test_split_ranges_prefers_fragment_boundaries_then_even_cuts():
    frags = {"a": list(range(0, 100, 10))}
    pieces = split_ranges({"a": (0, 100)}, frags, 4)
    assert [(f, last) for _, f, last in pieces] == [(0, 19), (20, 49), (50, 69), (70, 99)]
    assert all(f % 10 == 0 for _, f, _ in pieces)  # every cut on a fragment boundary
    assert [(f, last) for _, f, last in split_ranges({"a": (0, 100)}, {}, 3)] == [(0, 32), (33, 65), (66, 99)]
    assert split_ranges({"a": (0, 100), "b": (7, 7)}, frags, None) == [("a", 0, 99)]  # empty ranges vanish
    # every offset exactly once, whatever the split
    for k in range(1, 12):
        pieces = split_ranges({"a": (5, 95), "b": (0, 3)}, {"a": [0, 50, 60]}, k)
        covered = [(s, p) for s, f, last in pieces for p in range(f, last + 1)]
        assert sorted(covered) == sorted([("a", p) for p in range(5, 95)] + [("b", p) for p in range(3)])
        assert len(pieces) >= min(k, 93)


@pytest.mark.parametrize("opts, message", [
    ({"streams": "a"}, "option 'metadata' is required"),
    ({"metadata": URL}, "exactly one of the options"),
    ({"metadata": URL, "streams": "a", "streamPattern": "b"}, "exactly one of the options"),
    ({"metadata": URL, "topics": "a", "streams": "b"}, "exactly one of the options"),
    ({"metadata": URL, "topicPattern": "["}, "'topicPattern' is not a valid regular expression"),
    ({"metadata": URL, "topics": "a", "startingOffsets": '{"a": {"x": 1}}'}, "partition 'x' of topic 'a'"),
    ({"metadata": URL, "topics": "a", "startingOffsets": '{"a": {"0": "1"}}'}, "must be an integer >= 0"),
    ({"metadata": URL, "streamPattern": "("}, "not a valid regular expression"),
    ({"metadata": URL, "streams": "a", "startingOffsets": "{bad"}, "startingOffsets"),
    ({"metadata": URL, "streams": "a", "startingOffsets": '{"a": -7}'}, "must be an integer >= 0"),
    ({"metadata": URL, "streams": "a", "maxRecordsPerTrigger": "0"}, "must be >= 1"),
    ({"metadata": URL, "streams": "a", "failOnDataLoss": "maybe"}, "true or false"),
    ({"metadata": URL, "streams": "a", "endingOffsets": "latest"}, "batch queries only"),
])
def test_bad_read_options_name_the_option(opts, message):
    with pytest.raises(ScrollOptionError, match=message):
        ReadOptions.parse(opts, streaming=True)


def test_read_option_defaults_and_kafka_style_json():
    o = ReadOptions.parse({"METADATA": URL, "Streams": "a, b,a"}, streaming=True)
    assert o.streams == ("a", "b") and o.starting == "latest" and o.fail_on_data_loss and not o.include_headers
    b = ReadOptions.parse({"metadata": URL, "streams": "a", "endingOffsets": '{"a": 10}'}, streaming=False)
    assert b.starting == "earliest" and b.ending == {"a": 10}
    with pytest.raises(ScrollOptionError, match="not allowed in batch"):
        ReadOptions.parse({"metadata": URL, "streams": "a", "startingOffsets": '{"a": -1}'}, streaming=False)
    k = ReadOptions.parse({"metadata": URL, "topics": "a,b", "startingOffsets": '{"a": {"0": 5, "2": -2}, "b:1": 7}'},
                          streaming=True)
    assert k.topics == ("a", "b") and k.streams is None
    assert k.starting == {"a": 5, "a:2": -2, "b:1": 7}  # Kafka's topic/partition form, by partition stream
    with pytest.raises(ScrollOptionError, match="cannot be 'latest'"):
        ReadOptions.parse({"metadata": URL, "streams": "a", "startingOffsets": "latest"}, streaming=False)


def test_bad_write_options():
    with pytest.raises(ScrollOptionError, match="'stream' \\(or 'topic'\\) is required"):
        WriteOptions.parse({"metadata": URL})
    assert WriteOptions.parse({"metadata": URL, "topic": "t"}).stream == "t"
    with pytest.raises(ScrollOptionError, match="batchBytes"):
        WriteOptions.parse({"metadata": URL, "stream": "t", "batchBytes": str(2 << 20)})
    with pytest.raises(ScrollOptionError, match="reserved for staging"):
        WriteOptions.parse({"metadata": URL, "stream": "_spark.x"})
    with pytest.raises(ScrollOptionError, match="ensemble >= writeQuorum"):
        WriteOptions.parse({"metadata": URL, "stream": "t", "ensemble": "2", "writeQuorum": "3"})
