"""Tiered-storage topic configs (KIP-405) over real TCP (confluent-kafka's AdminClient):
remote.storage.enable, local.retention.ms and local.retention.bytes are checked as Kafka 3.9
checks them, stored, described with Kafka's defaults and sources, and become each partition
stream's tier policy (``fragments/tier.py``); the native API (create_stream's retention,
create_topic's configs, alter_topic_configs, set_tier_policy) takes the same, with the same checks."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from streams.client import connect
from streams.errors import InvalidArgument
from streams.topics import partition_stream

from .test_compaction_configs import describe, incremental, ledger

pytestmark = pytest.mark.process


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})

TIER = ("remote.storage.enable", "local.retention.ms", "local.retention.bytes")


def native(cluster, fn):
    async def go():
        client = await connect(cluster.metadata_url)
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(go())


def refused(fut) -> str:
    """The error name and message of a refused admin call."""
    from confluent_kafka import KafkaException

    with pytest.raises(KafkaException) as ei:
        fut.result(timeout=20)
    return f"{ei.value.args[0].name()}: {ei.value.args[0].str()}"


def test_create_describe_and_stream_metas(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 2, 1, config={"remote.storage.enable": "true", "retention.ms": "86400000",
                                                       "local.retention.ms": "3600000",
                                                       "local.retention.bytes": "1073741824"})])[topic].result(timeout=20)
    cfg = describe(admin, topic)
    assert [cfg[n].value for n in TIER] == ["true", "3600000", "1073741824"]
    for n in TIER:
        assert cfg[n].source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value and not cfg[n].is_default, n
    for p in (0, 1):
        assert ledger(kafka_cluster, partition_stream(topic, p)).retention == {
            "max_age_s": 86400.0, "remote_storage_enable": True, "local_retention_ms": 3600000,
            "local_retention_bytes": 1073741824}
    # CreatePartitions: the new partitions get the topic's tier policy
    admin.create_partitions([NewPartitions(topic, 3)])[topic].result(timeout=20)
    assert ledger(kafka_cluster, partition_stream(topic, 2)).retention["remote_storage_enable"] is True
    assert ledger(kafka_cluster, partition_stream(topic, 2)).retention["local_retention_ms"] == 3600000
    # the broker's defaults
    broker = ConfigResource(ResourceType.BROKER, "0")
    bcfg = admin.describe_configs([broker])[broker].result(timeout=20)
    assert bcfg["remote.log.storage.system.enable"].value == "true"
    assert bcfg["log.local.retention.ms"].value == "-2" and bcfg["log.local.retention.bytes"].value == "-2"


def test_defaults_when_unset(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=20)
    cfg = describe(admin, topic)
    assert [cfg[n].value for n in TIER] == ["false", "-2", "-2"]
    for n in TIER:
        assert cfg[n].is_default and cfg[n].source == ConfigSource.DEFAULT_CONFIG.value, n
    assert not any(k in ledger(kafka_cluster, topic).retention for k in ("remote_storage_enable", "local_retention_ms"))


def test_alter_incremental_alter_and_delete(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=20)
    incremental(admin, topic, ("remote.storage.enable", "TRUE", AlterConfigOpType.SET),
                ("local.retention.ms", "60000", AlterConfigOpType.SET)).result(timeout=20)
    cfg = describe(admin, topic)
    assert cfg["remote.storage.enable"].value == "true" and cfg["local.retention.ms"].value == "60000"
    assert ledger(kafka_cluster, partition_stream(topic, 1)).retention == {"remote_storage_enable": True,
                                                                           "local_retention_ms": 60000}
    # DELETE restores the default (-2: as retention.ms)
    incremental(admin, topic, ("local.retention.ms", None, AlterConfigOpType.DELETE),
                ("local.retention.bytes", "-1", AlterConfigOpType.SET)).result(timeout=20)
    cfg = describe(admin, topic)
    assert cfg["local.retention.ms"].value == "-2" and cfg["local.retention.ms"].is_default
    assert ledger(kafka_cluster, topic).retention == {"remote_storage_enable": True, "local_retention_bytes": -1}
    # AlterConfigs replaces the whole set: remote storage must be in it
    res = ConfigResource(ResourceType.TOPIC, topic, set_config={"remote.storage.enable": "true",
                                                                "retention.bytes": "5000000",
                                                                "local.retention.bytes": "1000000"})
    admin.alter_configs([res])[res].result(timeout=20)
    assert ledger(kafka_cluster, partition_stream(topic, 1)).retention == {
        "max_bytes": 5000000, "remote_storage_enable": True, "local_retention_bytes": 1000000}
    assert describe(admin, topic)["local.retention.ms"].is_default


@pytest.mark.parametrize("configs,text", [
    ({"remote.storage.enable": "true", "cleanup.policy": "compact"},
     "Remote log storage is unsupported for the compacted topics"),
    ({"remote.storage.enable": "true", "cleanup.policy": "delete,compact"}, "compacted"),
    ({"remote.storage.enable": "true", "retention.ms": "1000", "local.retention.ms": "2000"},
     "local.retention.ms (2000) must not be more than retention.ms (1000)"),
    ({"remote.storage.enable": "true", "retention.bytes": "1000", "local.retention.bytes": "2000"},
     "local.retention.bytes (2000) must not be more than retention.bytes (1000)"),
    ({"remote.storage.enable": "true", "retention.ms": "1000", "local.retention.ms": "-1"}, "must not be -1"),
    ({"local.retention.ms": "-3"}, "Value must be at least -2"),
    ({"local.retention.bytes": "-3"}, "Value must be at least -2"),
    ({"remote.storage.enable": "yes"}, "not a valid boolean"),
])
def test_refusals_on_create(admin, topic, configs, text):
    err = refused(admin.create_topics([NewTopic(topic, 1, 1, config=configs)])[topic])
    assert err.startswith("INVALID_CONFIG") and text in err, err
    assert topic not in admin.list_topics(timeout=10).topics


def test_refusals_on_alter_change_nothing(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 1, 1, config={"remote.storage.enable": "true", "retention.ms": "600000"})])[
        topic].result(timeout=20)
    before = ledger(kafka_cluster, topic).retention
    cases = [
        ([("remote.storage.enable", "false", AlterConfigOpType.SET)], "disabling remote storage is not supported"),
        ([("remote.storage.enable", None, AlterConfigOpType.DELETE)], "disabling remote storage"),
        ([("cleanup.policy", "compact", AlterConfigOpType.SET)], "unsupported for the compacted topics"),
        ([("local.retention.ms", "600001", AlterConfigOpType.SET)], "must not be more than retention.ms"),
        ([("retention.ms", "1000", AlterConfigOpType.SET), ("local.retention.ms", "5000", AlterConfigOpType.SET)],
         "must not be more than retention.ms (1000)"),
    ]
    for entries, text in cases:
        err = refused(incremental(admin, topic, *entries))
        assert err.startswith("INVALID_CONFIG") and text in err, (entries, err)
    res = ConfigResource(ResourceType.TOPIC, topic, set_config={"retention.ms": "600000"})  # replaces: disables
    err = refused(admin.alter_configs([res])[res])
    assert err.startswith("INVALID_CONFIG") and "disabling remote storage" in err
    assert ledger(kafka_cluster, topic).retention == before
    assert describe(admin, topic)["remote.storage.enable"].value == "true"


def test_validate_only_is_honoured(admin, kafka_cluster, topic):
    admin.create_topics([NewTopic(topic, 1, 1, config={"remote.storage.enable": "true"})],
                        validate_only=True)[topic].result(timeout=20)
    assert topic not in admin.list_topics(timeout=10).topics
    err = refused(admin.create_topics([NewTopic(topic, 1, 1, config={"remote.storage.enable": "true",
                                                                     "cleanup.policy": "compact"})],
                                      validate_only=True)[topic])
    assert err.startswith("INVALID_CONFIG")
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=20)
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("remote.storage.enable", "true", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res], validate_only=True)[res].result(timeout=20)
    assert describe(admin, topic)["remote.storage.enable"].value == "false"
    assert "remote_storage_enable" not in ledger(kafka_cluster, topic).retention


def test_native_paths_agree(admin, kafka_cluster, topic):
    """create_stream(retention=...), create_topic(configs=...), alter_topic_configs and
    set_tier_policy take the same settings with the same checks; remote storage turned on
    natively on a stream stays on through Kafka's AlterConfigs too."""
    s = f"{topic}-s"

    async def go(c):
        info = await c.create_stream(s, retention={"max_age_s": 3600, "remote_storage_enable": True,
                                                   "local_retention_ms": 600_000, "offload_lag_ms": 60_000})
        assert info.meta.retention["offload_lag_ms"] == 60_000
        with pytest.raises(InvalidArgument, match="compacted"):
            await c.create_stream(f"{s}-c", retention={"cleanup_policy": "compact", "remote_storage_enable": True})
        with pytest.raises(InvalidArgument, match="must not be more than retention.ms"):
            await c.create_stream(f"{s}-l", retention={"max_age_s": 1, "remote_storage_enable": True,
                                                       "local_retention_ms": 5000})
        with pytest.raises(InvalidArgument, match="local.retention.ms"):
            await c.create_topic(f"{s}-t", 2, {"remote.storage.enable": "true", "retention.ms": "10",
                                               "local.retention.ms": "20"})
        meta = await c.set_tier_policy(s, local_retention_bytes=1 << 20, offload_lag_ms=0)
        assert meta.retention == {"max_age_s": 3600, "remote_storage_enable": True, "local_retention_ms": 600_000,
                                  "local_retention_bytes": 1 << 20}
        with pytest.raises(InvalidArgument, match="disabling remote storage"):
            await c.set_tier_policy(s, remote_storage_enable=False)
        with pytest.raises(InvalidArgument, match="must not be more than retention.ms"):
            await c.set_tier_policy(s, local_retention_ms=3_600_001)
        with pytest.raises(InvalidArgument, match="offload_lag_ms"):
            await c.set_tier_policy(s, offload_lag_ms=-1)
        # a topic's configs that would turn it off are refused, nothing written
        with pytest.raises(InvalidArgument, match="disabling remote storage"):
            await c.alter_topic_configs(s, {"retention.ms": "7200000"})
        await c.set_tier_policy(s, offload_lag_ms=30_000)
        t = await c.alter_topic_configs(s, {"remote.storage.enable": "true", "local.retention.ms": "1000"})
        assert t.configs == {"remote.storage.enable": "true", "local.retention.ms": "1000"}
        meta, _ = await c.cluster.ledgers.get_ledger(s)
        # the topic configs own the three KIP-405 keys (and retention.ms: none now); offload_lag_ms is kept
        assert meta.retention == {"remote_storage_enable": True, "local_retention_ms": 1000,
                                  "offload_lag_ms": 30_000}
        t2 = f"{s}-topic"
        await c.create_topic(t2, 2, {"remote.storage.enable": "true", "local.retention.bytes": "4096"})
        m1, _ = await c.cluster.ledgers.get_ledger(partition_stream(t2, 1))
        assert m1.retention == {"remote_storage_enable": True, "local_retention_bytes": 4096}

    native(kafka_cluster, go)
    # the Kafka listener refuses what would turn the natively enabled stream off, and shows the configs
    err = refused(incremental(admin, s, ("local.retention.ms", None, AlterConfigOpType.DELETE),
                              ("remote.storage.enable", None, AlterConfigOpType.DELETE)))
    assert err.startswith("INVALID_CONFIG") and "disabling remote storage" in err
    assert describe(admin, s)["local.retention.ms"].value == "1000"


def test_new_partitions_do_not_inherit_partition_zeros_job_state(admin, kafka_cluster, topic):
    """CreatePartitions copies partition 0's policies, not its keep_from (a record offset of its
    own) nor the jobs' bookkeeping."""
    admin.create_topics([NewTopic(topic, 1, 1, config={"remote.storage.enable": "true"})])[topic].result(timeout=20)

    async def mark(c):
        from streams.tools.retention import set_policy

        await set_policy(c, topic, {"keep_from": 50, "offload_lag_ms": 1000, "tier": {"claim": "x"}})

    native(kafka_cluster, mark)
    admin.create_partitions([NewPartitions(topic, 2)])[topic].result(timeout=20)
    assert ledger(kafka_cluster, partition_stream(topic, 1)).retention == {"remote_storage_enable": True,
                                                                           "offload_lag_ms": 1000}
