"""Real clients over real TCP against the shim over a real cluster: kcat and confluent-kafka."""

from __future__ import annotations

import subprocess
import time

import confluent_kafka  # installed by the test extra: missing fails, never skips
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

pytestmark = pytest.mark.process


def kcat(shim, *args, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["kcat", "-b", shim.bootstrap, *args], input=input, capture_output=True, text=True,
                          timeout=30, check=True)


def test_kcat_metadata_names_us_leader_and_controller(shim, topic):
    out = kcat(shim, "-L", "-t", topic).stdout  # auto-creates the topic
    assert f"broker 0 at {shim.bootstrap} (controller)" in out
    assert f'topic "{topic}" with 1 partitions' in out
    assert "partition 0, leader 0" in out


def test_kcat_produce_with_keys_and_consume_to_end(shim, topic):
    kcat(shim, "-P", "-t", topic, "-K:", input="k1:v1\nk2:v2\nk3:v3\n")
    kcat(shim, "-P", "-t", topic, "-K:", "-z", "lz4", input="k4:v4\n")  # a compressed batch, stored as is
    out = kcat(shim, "-C", "-t", topic, "-e", "-f", "%k=%s@%o\n").stdout
    assert out.splitlines() == ["k1=v1@0", "k2=v2@1", "k3=v3@2", "k4=v4@3"]
    out = kcat(shim, "-C", "-t", topic, "-o", "2", "-e", "-f", "%s@%o\n").stdout  # from the middle of a batch
    assert out.splitlines() == ["v3@2", "v4@3"]


def test_kcat_headers_round_trip(shim, topic):
    kcat(shim, "-P", "-t", topic, "-H", "source=web", input="hello\n")
    out = kcat(shim, "-C", "-t", topic, "-e", "-f", "%h %s\n").stdout
    assert out.strip() == "source=web hello"


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})


def test_admin_create_and_delete_topics(admin, topic):
    fs = admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)], operation_timeout=10)
    fs[topic].result(timeout=20)
    md = admin.list_topics(topic, timeout=10)
    assert sorted(md.topics[topic].partitions) == [0, 1, 2]
    again = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    with pytest.raises(KafkaException) as ei:
        again[topic].result(timeout=20)
    assert ei.value.args[0].name() == "TOPIC_ALREADY_EXISTS"
    admin.delete_topics([topic], operation_timeout=10)[topic].result(timeout=20)
    assert topic not in admin.list_topics(timeout=10).topics
    gone = admin.delete_topics([topic])
    with pytest.raises(KafkaException) as ei:
        gone[topic].result(timeout=20)
    assert ei.value.args[0].name() == "UNKNOWN_TOPIC_OR_PART"


def test_confluent_acks_all_producer_and_assigned_consumer(admin, shim, topic):
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(timeout=20)
    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "linger.ms": 5})
    delivered = []
    n = 400
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, key=b"k%d" % i, partition=i % 2,
                  on_delivery=lambda err, msg: delivered.append((err, msg.partition(), msg.offset())))
        if i % 100 == 0:
            p.poll(0)
    assert p.flush(30) == 0
    assert all(err is None for err, _, _ in delivered)
    for part in (0, 1):  # dense offsets per partition: 0..n/2-1
        assert sorted(o for _, pp, o in delivered if pp == part) == list(range(n // 2))

    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "unused", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 100})
    try:
        c.assign([TopicPartition(topic, 0, 0), TopicPartition(topic, 1, 150)])
        got = {0: [], 1: []}
        deadline = time.monotonic() + 30
        while (len(got[0]) < n // 2 or len(got[1]) < 50) and time.monotonic() < deadline:
            for m in c.consume(500, timeout=0.5):
                assert m.error() is None, m.error()
                got[m.partition()].append((m.offset(), m.key(), m.value()))
        assert [o for o, _, _ in got[0]] == list(range(n // 2))
        assert [o for o, _, _ in got[1]] == list(range(150, n // 2))
        assert got[0][3][1:] == (b"k6", b"v6")
        low, high = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (low, high) == (0, n // 2)
    finally:
        c.close()


def test_consumer_waits_for_new_records(admin, shim, topic):
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=20)
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "unused", "enable.auto.commit": False,
                  "fetch.wait.max.ms": 500})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        assert c.consume(10, timeout=1.0) == []
        p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all"})
        p.produce(topic, value=b"late")
        assert p.flush(20) == 0
        deadline = time.monotonic() + 15
        got = []
        while not got and time.monotonic() < deadline:
            got = [m for m in c.consume(10, timeout=0.5) if m.error() is None]
        assert [m.value() for m in got] == [b"late"]
    finally:
        c.close()


def test_offset_out_of_range_resets(admin, shim, topic):
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=20)
    kcat(shim, "-P", "-t", topic, input="a\nb\n")
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "unused", "enable.auto.commit": False,
                  "auto.offset.reset": "error"})
    try:
        c.assign([TopicPartition(topic, 0, 50)])
        deadline = time.monotonic() + 15
        err = None
        while err is None and time.monotonic() < deadline:
            for m in c.consume(10, timeout=0.5):
                if m.error() is not None:
                    err = m.error()
        assert err is not None and err.code() == confluent_kafka.KafkaError._AUTO_OFFSET_RESET
    finally:
        c.close()
