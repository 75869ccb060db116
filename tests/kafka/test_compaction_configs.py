"""Compaction topic configs over real TCP (confluent-kafka's AdminClient and Producer, aiokafka):
cleanup.policy and the compaction settings are checked as Kafka does, stored, described with
Kafka's defaults and sources, and become each partition stream's compaction policy; segment.bytes /
segment.ms become the rollover caps; a compacted topic refuses records without a key
(INVALID_RECORD with record_errors), other partitions and topics unaffected."""

from __future__ import annotations

import asyncio
import time

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
    ResourceType,
)

from streams.client import connect
from streams.topics import partition_stream

from .test_admin import error_name

pytestmark = pytest.mark.process


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})


def ledger(cluster, name: str):
    async def go():
        client = await connect(cluster.metadata_url)
        try:
            meta, _ = await client.cluster.ledgers.get_ledger(name)
            return meta
        finally:
            await client.close()

    return asyncio.run(go())


def describe(admin, topic: str):
    res = ConfigResource(ResourceType.TOPIC, topic)
    return admin.describe_configs([res])[res].result(timeout=20)


def incremental(admin, topic: str, *entries):
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry(name, value, incremental_operation=op) for name, value, op in entries])
    return admin.incremental_alter_configs([res])[res]


def test_create_compact_topic_described_as_compact_with_kafka_defaults(admin, shim, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 2, 1, config={"cleanup.policy": "compact",
                                                       "min.compaction.lag.ms": "1000",
                                                       "segment.ms": "600000"})])[topic].result(timeout=20)
    cfg = describe(admin, topic)
    assert cfg["cleanup.policy"].value == "compact"  # what Kafka Connect checks, exactly
    assert cfg["cleanup.policy"].source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value and not cfg["cleanup.policy"].is_default
    assert cfg["min.compaction.lag.ms"].value == "1000"
    defaults = {"max.compaction.lag.ms": "9223372036854775807", "min.cleanable.dirty.ratio": "0.5",
                "delete.retention.ms": "86400000", "segment.bytes": str(64 << 20)}
    for name, value in defaults.items():
        assert cfg[name].value == value and cfg[name].is_default, name
        assert cfg[name].source == ConfigSource.DEFAULT_CONFIG.value
    for p in (0, 1):
        meta = ledger(kafka_cluster, partition_stream(topic, p))
        assert meta.retention == {"cleanup_policy": "compact", "min_compaction_lag_ms": 1000}
        assert meta.config.fragment_age_max_ms == 600000
    # the broker's log.* defaults agree
    broker = ConfigResource(ResourceType.BROKER, "0")
    bcfg = admin.describe_configs([broker])[broker].result(timeout=20)
    assert bcfg["log.cleanup.policy"].value == "delete"
    assert bcfg["log.cleaner.min.cleanable.ratio"].value == "0.5"
    assert bcfg["log.cleaner.delete.retention.ms"].value == "86400000"


@pytest.mark.parametrize("policy,stored", [("compact,delete", "compact,delete"), ("delete, compact", "compact,delete"),
                                           ("delete", "delete")])
def test_cleanup_policy_lists_in_any_order(admin, kafka_cluster, topic, policy, stored):
    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": policy})])[topic].result(timeout=20)
    assert describe(admin, topic)["cleanup.policy"].value == stored
    retention = ledger(kafka_cluster, topic).retention
    assert retention.get("cleanup_policy", "delete") == stored


@pytest.mark.parametrize("name,value", [
    ("cleanup.policy", "shred"), ("cleanup.policy", ""), ("cleanup.policy", "compact,shred"),
    ("min.compaction.lag.ms", "-1"), ("max.compaction.lag.ms", "0"), ("min.cleanable.dirty.ratio", "1.5"),
    ("min.cleanable.dirty.ratio", "-0.1"), ("min.cleanable.dirty.ratio", "half"), ("delete.retention.ms", "-5"),
    ("segment.ms", "0"), ("segment.bytes", "100"), ("segment.bytes", "4294967296"),
])
def test_invalid_values_are_refused(admin, topic, name, value):
    fs = admin.create_topics([NewTopic(topic, 1, 1, config={name: value})])
    assert error_name(fs[topic]) == "INVALID_CONFIG"
    assert topic not in admin.list_topics(timeout=10).topics


def test_min_lag_above_max_lag_is_refused(admin, topic):
    fs = admin.create_topics([NewTopic(topic, 1, 1, config={"min.compaction.lag.ms": "5000",
                                                            "max.compaction.lag.ms": "1000"})])
    assert error_name(fs[topic]) == "INVALID_CONFIG"


def test_alter_and_incremental_alter_round_trip(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=20)
    assert describe(admin, topic)["cleanup.policy"].value == "delete"
    # APPEND to the list config: delete (the default) + compact
    incremental(admin, topic, ("cleanup.policy", "compact", AlterConfigOpType.APPEND)).result(timeout=20)
    assert describe(admin, topic)["cleanup.policy"].value == "compact,delete"
    assert ledger(kafka_cluster, partition_stream(topic, 1)).retention == {"cleanup_policy": "compact,delete"}
    # SUBTRACT delete: compact alone
    incremental(admin, topic, ("cleanup.policy", "delete", AlterConfigOpType.SUBTRACT),
                ("max.compaction.lag.ms", "120000", AlterConfigOpType.SET),
                ("min.cleanable.dirty.ratio", "0.25", AlterConfigOpType.SET)).result(timeout=20)
    cfg = describe(admin, topic)
    assert cfg["cleanup.policy"].value == "compact" and cfg["min.cleanable.dirty.ratio"].value == "0.25"
    meta = ledger(kafka_cluster, partition_stream(topic, 1))
    assert meta.retention == {"cleanup_policy": "compact", "max_compaction_lag_ms": 120000,
                              "min_cleanable_dirty_ratio": 0.25}
    assert meta.config.fragment_age_max_ms == 120000  # KIP-354: the active fragment rolls for the max lag
    # subtracting the last value leaves no policy: refused, nothing changed
    bad = incremental(admin, topic, ("cleanup.policy", "compact", AlterConfigOpType.SUBTRACT))
    assert error_name(bad) == "INVALID_CONFIG"
    assert describe(admin, topic)["cleanup.policy"].value == "compact"
    # segment.* become the caps; the lower of segment.ms and the max lag wins
    incremental(admin, topic, ("segment.ms", "60000", AlterConfigOpType.SET),
                ("segment.bytes", str(2 << 20), AlterConfigOpType.SET)).result(timeout=20)
    meta = ledger(kafka_cluster, topic)
    assert (meta.config.fragment_bytes_max, meta.config.fragment_age_max_ms) == (2 << 20, 60000)
    # AlterConfigs replaces the whole set: back to delete and no caps
    res = ConfigResource(ResourceType.TOPIC, topic, set_config={"retention.ms": "3600000"})
    admin.alter_configs([res])[res].result(timeout=20)  # (deprecated in the client, still Kafka's API)
    cfg = describe(admin, topic)
    assert cfg["cleanup.policy"].value == "delete" and cfg["cleanup.policy"].is_default
    meta = ledger(kafka_cluster, partition_stream(topic, 1))
    assert meta.retention == {"max_age_s": 3600.0}
    assert (meta.config.fragment_bytes_max, meta.config.fragment_age_max_ms) == (64 << 20, None)
    res = ConfigResource(ResourceType.TOPIC, topic, set_config={"cleanup.policy": "compact"})
    admin.alter_configs([res])[res].result(timeout=20)  # (deprecated in the client, still Kafka's API)
    assert describe(admin, topic)["cleanup.policy"].value == "compact"
    assert ledger(kafka_cluster, topic).retention == {"cleanup_policy": "compact"}


def _deliveries(p: Producer, sends) -> list:
    out: list = []
    for topic, partition, key, value in sends:
        p.produce(topic, value=value, key=key, partition=partition,
                  on_delivery=lambda err, msg, out=out: out.append((msg.partition(), msg.key(), err)))
        p.flush(30)  # one batch per record: each is refused or stored on its own
    return out


def test_keyless_records_are_refused_on_compacted_topics_only(admin, shim, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 2, 1, config={"cleanup.policy": "compact"}),
                         NewTopic(f"{topic}-d", 1, 1)])[topic].result(timeout=20)
    time.sleep(0.5)
    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "linger.ms": 0, "retries": 0,
                  "enable.idempotence": False})
    got = _deliveries(p, [(topic, 0, b"k", b"v1"), (topic, 0, None, b"nokey"), (topic, 1, b"k2", b"v2"),
                          (topic, 1, None, b"nokey"), (f"{topic}-d", 0, None, b"fine")])
    errs = [(part, key, err.code() if err else None) for part, key, err in got]
    assert errs == [(0, b"k", None), (0, None, KafkaError.INVALID_RECORD), (1, b"k2", None),
                    (1, None, KafkaError.INVALID_RECORD), (0, None, None)]
    assert got[1][2].name() == "INVALID_RECORD"  # (librdkafka reports its own text for the code)


def test_record_errors_name_each_keyless_record_aiokafka(admin, shim, topic):
    """aiokafka's raw send of one batch with two keyless records among keyed ones: the whole batch is
    refused with INVALID_RECORD; the response's record_errors give each index (ProduceResponse v8+)."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder
    from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData

    from .test_bad_input import call
    from .test_bad_input import connect as raw_connect

    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": "compact"})])[topic].result(timeout=20)
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=-1,
                                  producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i, key in enumerate([b"a", None, b"b", None]):
        b.append(i, timestamp=None, key=key, value=b"v", headers=[])
    records = bytes(b.build())
    import datetime

    req = ProduceRequest(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=10),
                         topic_data=(TopicProduceData(name=topic, partition_data=(
                             PartitionProduceData(index=0, records=records),)),))
    with raw_connect(shim) as s:
        resp = call(s, req, 7)
    part = resp.responses[0].partition_responses[0]
    assert part.error_code.value == KafkaError.INVALID_RECORD
    assert [e.batch_index for e in part.record_errors] == [1, 3]
    assert "Compacted topic cannot accept message without key" in part.error_message
    assert f"{topic}-0" in part.error_message


def test_aiokafka_keyless_send_fails_keyed_send_succeeds(admin, shim, topic):
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError as AioKafkaError

    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": "compact"})])[topic].result(timeout=20)

    async def go():
        p = AIOKafkaProducer(bootstrap_servers=shim.bootstrap, acks="all")
        await p.start()
        try:
            ok = await p.send_and_wait(topic, b"v", key=b"k")
            with pytest.raises(AioKafkaError) as ei:
                await p.send_and_wait(topic, b"v")
            return ok, ei.value
        finally:
            await p.stop()

    ok, err = asyncio.run(go())
    assert ok.offset >= 0
    # aiokafka has no class for INVALID_RECORD (87): it raises UnknownError, not retried
    assert type(err).__name__ in ("UnknownError", "InvalidRecordError") or getattr(err, "errno", None) == 87


def test_a_compacted_partition_over_kafka_gaps_skip_in_fetch_and_list_offsets(admin, shim, kafka_cluster, topic):
    """After a compaction pass: ListOffsets earliest is the log start, ListOffsets by timestamp lands on
    the first record that exists at or after it, a fetch from a removed offset gets the next record."""
    from confluent_kafka import Consumer, TopicPartition

    from streams.tools import compaction

    # segment.ms=1: each acknowledged batch's fragment is rolled over by the next one, so all but the
    # last fragment are sealed and cleanable
    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": "compact", "segment.ms": "1"})])[
        topic].result(timeout=30)
    base = 1_700_000_000_000
    p = Producer({"bootstrap.servers": shim.bootstrap, "linger.ms": 0})
    for i in range(40):  # one batch each: k0..k3 over and over
        p.produce(topic, key=f"k{i % 4}".encode(), value=f"v{i}".encode(), timestamp=base + i)
        p.flush(10)

    async def compact_now():
        client = await connect(kafka_cluster.metadata_url)
        try:
            return await compaction.compact_stream(client, partition_stream(topic, 0), force=True)
        finally:
            await client.close()

    rep = asyncio.run(compact_now())
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": f"g-{topic}", "enable.auto.commit": False})
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (lo, hi) == (0, 40)
        assert rep.cleaned_to >= 8, rep
        survivors = set(range(rep.cleaned_to - 4, 40))  # each key's latest below the cleaned offset, and the head
        gap = 1  # v1 (k1) was superseded by v5, v9, ...
        (got,) = c.offsets_for_times([TopicPartition(topic, 0, base + gap)], timeout=10)
        assert got.offset == min(o for o in survivors if o >= gap)
        c.assign([TopicPartition(topic, 0, gap)])
        msg = c.poll(10)
        assert msg is not None and msg.offset() == min(o for o in survivors if o >= gap)
    finally:
        c.close()
