"""Admin APIs with confluent-kafka's AdminClient over real TCP against the shim: partitions, configs
(and the retention they set on the streams), consumer groups, the cluster; and the retention floor
committed offsets put on a partition's stream."""

from __future__ import annotations

import asyncio
import time

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition  # noqa: E402
from confluent_kafka.admin import (  # noqa: E402
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from compat_kafka.groups.coordinator import retention_floor  # noqa: E402
from streams.batches import stored_batch  # noqa: E402
from streams.client import connect  # noqa: E402
from streams.topics import partition_stream  # noqa: E402

from .test_groups import assignment, consumer, create_topic, poll_until, produce  # noqa: E402

pytestmark = pytest.mark.process


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})


def error_name(fut) -> str:
    with pytest.raises(KafkaException) as ei:
        fut.result(timeout=20)
    return ei.value.args[0].name()


def stream_info(cluster, name: str):
    """(LedgerMeta.retention, [(entry id, base offset, end offset)] of the batches) of a stream."""
    async def go():
        client = await connect(cluster.metadata_url)
        try:
            info = await client.describe_stream(name)
            c = await client.consumer(name)
            await c.end_position()  # learns the LAC
            last = c.lac
            batches, first = [], c.earliest_entry()
            while first <= last:
                for e in await c.read_raw(first, last):
                    first = e.entry_id + 1
                    b = stored_batch(e.entry_id, e.data)
                    if b is not None:
                        batches.append((b.entry_id, b.base_offset, b.end_offset))
            return info.meta.retention, batches
        finally:
            await client.close()

    return asyncio.run(go())


def floor(cluster, name: str):
    async def go():
        client = await connect(cluster.metadata_url)
        try:
            meta, _ = await client.cluster.ledgers.get_ledger(name)
            return await retention_floor(client, meta)
        finally:
            await client.close()

    return asyncio.run(go())


def test_create_partitions_grows_a_topic_and_never_shrinks(admin, shim, topic):
    create_topic(shim.bootstrap, topic, 2)
    assert error_name(admin.create_partitions([NewPartitions(topic, 1)])[topic]) == "INVALID_PARTITIONS"
    assert error_name(admin.create_partitions([NewPartitions(topic, 2)])[topic]) == "INVALID_PARTITIONS"
    admin.create_partitions([NewPartitions(topic, 5)], validate_only=True)[topic].result(timeout=20)
    assert len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 2  # validate_only: no change
    admin.create_partitions([NewPartitions(topic, 5)])[topic].result(timeout=20)
    assert sorted(admin.list_topics(topic, timeout=10).topics[topic].partitions) == [0, 1, 2, 3, 4]
    produce(shim.bootstrap, topic, 50, 5)  # the new partitions take records
    c = consumer(shim.bootstrap, f"g-{topic}")
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(5)])
        got: list = []
        poll_until([c], lambda: len(got) >= 50, sink=got)
        assert {m.partition() for _, m in got} == set(range(5))
    finally:
        c.close()
    missing = admin.create_partitions([NewPartitions(f"{topic}-missing", 3)])
    assert error_name(missing[f"{topic}-missing"]) == "UNKNOWN_TOPIC_OR_PART"


def test_topic_configs_are_described_altered_and_set_stream_retention(admin, shim, kafka_cluster, topic):
    fs = admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1,
                                       config={"retention.ms": "60000", "max.message.bytes": "100000"})])
    fs[topic].result(timeout=20)
    res = ConfigResource(ResourceType.TOPIC, topic)
    cfg = admin.describe_configs([res])[res].result(timeout=20)
    assert cfg["retention.ms"].value == "60000" and not cfg["retention.ms"].is_default
    assert cfg["retention.bytes"].value == "-1" and cfg["retention.bytes"].is_default
    assert cfg["cleanup.policy"].value == "delete"
    assert cfg["max.message.bytes"].value == "100000"
    for p in (0, 1):
        assert stream_info(kafka_cluster, partition_stream(topic, p))[0] == {"max_age_s": 60.0}

    alter = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("retention.bytes", "1048576", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.ms", None, incremental_operation=AlterConfigOpType.DELETE)])
    admin.incremental_alter_configs([alter])[alter].result(timeout=20)
    cfg = admin.describe_configs([res])[res].result(timeout=20)
    assert (cfg["retention.bytes"].value, cfg["retention.ms"].value) == ("1048576", "-1")
    assert stream_info(kafka_cluster, partition_stream(topic, 1))[0] == {"max_bytes": 1048576}
    # growing the topic gives the new partition the topic's retention too
    admin.create_partitions([NewPartitions(topic, 3)])[topic].result(timeout=20)
    assert stream_info(kafka_cluster, partition_stream(topic, 2))[0] == {"max_bytes": 1048576}

    bad = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("cleanup.policy", "shred", incremental_operation=AlterConfigOpType.SET)])
    assert error_name(admin.incremental_alter_configs([bad])[bad]) == "INVALID_CONFIG"
    bad = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("retention.ms", "soon", incremental_operation=AlterConfigOpType.SET)])
    assert error_name(admin.incremental_alter_configs([bad])[bad]) == "INVALID_CONFIG"
    assert admin.describe_configs([res])[res].result(timeout=20)["retention.bytes"].value == "1048576"  # kept
    fs = admin.create_topics([NewTopic(f"{topic}-x", 1, 1, config={"no.such.config": "1"})])
    assert error_name(fs[f"{topic}-x"]) == "INVALID_CONFIG"
    assert f"{topic}-x" not in admin.list_topics(timeout=10).topics

    broker = ConfigResource(ResourceType.BROKER, "0")
    bcfg = admin.describe_configs([broker])[broker].result(timeout=20)
    assert bcfg["broker.id"].value == "0" and bcfg["group.initial.rebalance.delay.ms"].value == "100"
    assert bcfg["broker.id"].is_read_only and not bcfg["num.partitions"].is_read_only  # dynamic: see below


def test_dynamic_broker_configs_persist_and_take_effect(admin, shim, kafka_cluster, topic):
    from confluent_kafka.admin import ConfigSource

    from compat_kafka.broker import Broker, BrokerConfig

    def alter(name: str, *entries):
        if name == "":  # the cluster default: librdkafka will not send an empty resource name, so by hand
            return _RawAlter(shim, entries)
        res = ConfigResource(ResourceType.BROKER, name, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET if v is not None else
                        AlterConfigOpType.DELETE) for k, v in entries])
        return admin.incremental_alter_configs([res])[res]

    def broker_cfg():
        res = ConfigResource(ResourceType.BROKER, "0")
        return admin.describe_configs([res])[res].result(timeout=20)

    own, other = f"{topic}-own", f"{topic}-dflt"
    admin.create_topics([NewTopic(own, 1, 1, config={"retention.ms": "60000"}),
                         NewTopic(other, 1, 1)])[own].result(timeout=20)
    try:
        # the cluster default (resource name "") and one listener's own setting
        alter("", ("num.partitions", "3"), ("log.retention.ms", "3600000")).result(timeout=20)
        cfg = broker_cfg()
        assert cfg["num.partitions"].value == "3" and not cfg["num.partitions"].is_read_only
        assert cfg["num.partitions"].source == ConfigSource.DYNAMIC_DEFAULT_BROKER_CONFIG.value
        # topics without a retention of their own follow log.retention.ms; the others keep theirs
        assert stream_info(kafka_cluster, other)[0] == {"max_age_s": 3600.0}
        assert stream_info(kafka_cluster, own)[0] == {"max_age_s": 60.0}
        tcfg = admin.describe_configs([ConfigResource(ResourceType.TOPIC, other)])
        assert list(tcfg.values())[0].result(timeout=20)["retention.ms"].value == "3600000"
        # an auto-created topic gets num.partitions
        produce(shim.bootstrap, f"{topic}-auto", 1, 1)
        assert len(admin.list_topics(f"{topic}-auto", timeout=10).topics[f"{topic}-auto"].partitions) == 3

        alter("0", ("auto.create.topics.enable", "false")).result(timeout=20)
        assert broker_cfg()["auto.create.topics.enable"].source == ConfigSource.DYNAMIC_BROKER_CONFIG.value
        md = admin.list_topics(f"{topic}-never", timeout=10)
        assert md.topics[f"{topic}-never"].error is not None
        assert f"{topic}-never" not in admin.list_topics(timeout=10).topics

        # persisted in the metadata store: another listener starting now has the same settings
        async def fresh_listener():
            client = await connect(kafka_cluster.metadata_url)
            try:
                b = Broker(client, BrokerConfig(node_id=0))
                return await b.admin.default_partitions(), await b.admin.auto_create_topics()
            finally:
                await client.close()

        assert asyncio.run(fresh_listener()) == (3, False)

        # the rest: Kafka's errors, nothing written
        assert error_name(alter("", ("broker.id", "7"))) == "INVALID_REQUEST"  # static
        assert error_name(alter("", ("no.such.setting", "1"))) == "INVALID_CONFIG"
        assert error_name(alter("", ("num.partitions", "lots"))) == "INVALID_CONFIG"
        assert error_name(alter("", ("num.partitions", "0"))) == "INVALID_CONFIG"
        assert broker_cfg()["num.partitions"].value == "3"
    finally:
        alter("0", ("auto.create.topics.enable", None)).result(timeout=20)
        alter("", ("num.partitions", None), ("log.retention.ms", None)).result(timeout=20)
    cfg = broker_cfg()
    assert (cfg["num.partitions"].value, cfg["auto.create.topics.enable"].value) == ("1", "true")
    assert cfg["num.partitions"].source == ConfigSource.STATIC_BROKER_CONFIG.value
    assert stream_info(kafka_cluster, other)[0] == {}


class _RawAlter:
    """IncrementalAlterConfigs of the broker resource "" over a raw socket, with a future's result()."""

    def __init__(self, shim, entries):
        from kio.schema.incremental_alter_configs.v1 import IncrementalAlterConfigsRequest
        from kio.schema.incremental_alter_configs.v1.request import AlterableConfig, AlterConfigsResource

        from .test_bad_input import call, connect

        req = IncrementalAlterConfigsRequest(validate_only=False, resources=(AlterConfigsResource(
            resource_type=4, resource_name="", configs=tuple(
                AlterableConfig(name=k, config_operation=0 if v is not None else 1, value=v) for k, v in entries)),))
        with connect(shim) as sock:
            self.resp = call(sock, req, 1).responses[0]

    def result(self, timeout=None):
        if self.resp.error_code != 0:
            raise KafkaException(_KafkaErrorLike(self.resp.error_code))


class _KafkaErrorLike:
    def __init__(self, code):
        from kio.schema.errors import ErrorCode

        self._name = ErrorCode(code).name.upper()

    def name(self):
        return self._name


def test_delete_records_moves_the_log_start_and_sets_retention(admin, shim, kafka_cluster, topic):
    from confluent_kafka import Consumer

    from compat_kafka.partitions.partition import PartitionConfig, PartitionLog

    create_topic(shim.bootstrap, topic, 1)
    for part in range(3):  # three batches of 10
        produce(shim.bootstrap, topic, 10, 1, prefix=f"b{part}-")
    got = admin.delete_records([TopicPartition(topic, 0, 15)])
    (res,) = got.values()
    assert res.result(timeout=20).low_watermark == 15
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": f"g-{topic}", "auto.offset.reset": "earliest"})
    try:
        assert c.get_watermark_offsets(TopicPartition(topic, 0), timeout=20) == (15, 30)
        c.assign([TopicPartition(topic, 0, 3)])  # below the log start: reset to earliest, 15
        seen = []
        deadline = time.monotonic() + 30
        while len(seen) < 15 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                seen.append(m.offset())
        assert seen == list(range(15, 30))
    finally:
        c.close()
    assert stream_info(kafka_cluster, topic)[0]["keep_from"] == 15  # the retention job removes what is below

    # an offset past the end is refused; -1 deletes up to the high watermark; lower is a no-op
    (res,) = admin.delete_records([TopicPartition(topic, 0, 31)]).values()
    assert error_name(res) == "OFFSET_OUT_OF_RANGE"
    (res,) = admin.delete_records([TopicPartition(topic, 0, 10)]).values()
    assert res.result(timeout=20).low_watermark == 15
    (res,) = admin.delete_records([TopicPartition(topic, 0, -1)]).values()
    assert res.result(timeout=20).low_watermark == 30

    async def fresh_listener():  # the log start survives a listener fail-over: a partition opened anew has it
        from streams.tools import retention

        client = await connect(kafka_cluster.metadata_url)
        # a late, lower DeleteRecords (as from another connection) cannot lower the stored log start
        assert (await retention.raise_keep_from(client, topic, 12)).retention["keep_from"] == 30
        plog = PartitionLog(client, topic, 0, PartitionConfig(), writable=False)
        try:
            await plog.open()
            return plog.log_start, plog.high_watermark
        finally:
            await plog.close()
            await client.close()

    assert asyncio.run(fresh_listener()) == (30, 30)


def test_describe_cluster_names_this_shim_controller(admin, shim):
    cluster = admin.describe_cluster().result(timeout=20)
    assert cluster.cluster_id == "scroll"
    assert (cluster.controller.id, cluster.controller.port) == (0, shim.port)
    assert any(n.port == shim.port for n in cluster.nodes)


def test_consumer_groups_listed_described_and_deleted_only_when_empty(admin, shim, topic):
    create_topic(shim.bootstrap, topic, 2)
    group = f"g-{topic}"
    c = consumer(shim.bootstrap, group, **{"client.id": "describe-me"})
    try:
        c.subscribe([topic])
        poll_until([c], lambda: len(assignment(c)) == 2)
        c.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
        listed = {g.group_id: g for g in admin.list_consumer_groups().result(timeout=20).valid}
        assert group in listed and not listed[group].is_simple_consumer_group
        assert listed[group].state.name == "STABLE"
        d = admin.describe_consumer_groups([group])[group].result(timeout=20)
        assert d.state.name == "STABLE" and d.partition_assignor in ("range", "roundrobin")
        assert [m.client_id for m in d.members] == ["describe-me"]
        assert {tp.partition for tp in d.members[0].assignment.topic_partitions} == {0, 1}
        assert error_name(admin.delete_consumer_groups([group])[group]) == "NON_EMPTY_GROUP"
    finally:
        c.close()
    offsets = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(timeout=20)
    assert [(tp.topic, tp.partition, tp.offset) for tp in offsets.topic_partitions] == [(topic, 0, 0)]
    d = admin.describe_consumer_groups([group])[group].result(timeout=20)
    assert d.state.name == "EMPTY" and not d.members
    admin.delete_consumer_groups([group])[group].result(timeout=20)
    assert group not in {g.group_id for g in admin.list_consumer_groups().result(timeout=20).valid}
    assert error_name(admin.delete_consumer_groups([group])[group]) == "GROUP_ID_NOT_FOUND"


def test_retention_floor_is_the_lowest_committed_offset(admin, shim, kafka_cluster, topic):
    create_topic(shim.bootstrap, topic, 2)
    stream = partition_stream(topic, 1)
    assert floor(kafka_cluster, stream) is None  # no group committed anything
    for i in range(6):  # one batch (one entry) per flush: offsets 0..5, one each
        produce(shim.bootstrap, topic, 1, 1, prefix=f"b{i}-", partition=1)
    # a reader sees an acknowledged entry once its LAC reached the bookies (piggybacked on the next
    # add, or an idle LAC push a few ms later): wait for the last batch to become visible
    deadline = time.monotonic() + 15
    while len(batches := stream_info(kafka_cluster, stream)[1]) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [(b, e) for _, b, e in batches] == [(i, i + 1) for i in range(6)]

    def commit(group: str, offset: int, partition: int = 1) -> None:
        c = consumer(shim.bootstrap, group)
        try:
            c.commit(offsets=[TopicPartition(topic, partition, offset)], asynchronous=False)
        finally:
            c.close()

    commit(f"a-{topic}", 4)
    assert floor(kafka_cluster, stream) == 4  # a record offset, as retention's keep_from
    commit(f"b-{topic}", 2)
    assert floor(kafka_cluster, stream) == 2  # the lowest group wins
    commit(f"c-{topic}", 0, partition=0)  # another partition's commits do not count here
    assert floor(kafka_cluster, stream) == 2
    assert floor(kafka_cluster, topic) == 0  # partition 0 is the stream named like the topic
    admin.delete_consumer_groups([f"b-{topic}"])[f"b-{topic}"].result(timeout=20)
    assert floor(kafka_cluster, stream) == 4
    commit(f"a-{topic}", 6)  # consumed everything
    assert floor(kafka_cluster, stream) == 6


def test_streams_and_topics_of_the_python_api_are_kafka_topics(admin, shim, kafka_cluster, topic):
    """One set of topics: a stream created alone, a topic created with the Python API and one
    created with CreateTopics are the same kind of thing for both APIs."""
    async def create(client):
        await client.create_stream(topic)
        await client.create_topic(f"{topic}.py", 2, {"retention.ms": "60000"})

    async def describe(client, name):
        return await client.describe_topic(name)

    def run(fn, *args):
        async def go():
            client = await connect(kafka_cluster.metadata_url)
            try:
                return await fn(client, *args)
            finally:
                await client.close()

        return asyncio.run(go())

    run(create)
    listed = admin.list_topics(timeout=10).topics
    assert sorted(listed[topic].partitions) == [0] and sorted(listed[f"{topic}.py"].partitions) == [0, 1]
    res = ConfigResource(ResourceType.TOPIC, f"{topic}.py")
    assert admin.describe_configs([res])[res].result(timeout=20)["retention.ms"].value == "60000"

    # the stream created alone: its configs and partitions change like any topic's
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("retention.bytes", "4096", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result(timeout=20)
    assert stream_info(kafka_cluster, topic)[0] == {"max_bytes": 4096}
    admin.create_partitions([NewPartitions(topic, 3)])[topic].result(timeout=20)
    t = run(describe, topic)
    assert (t.partitions, t.configs) == (3, {"retention.bytes": "4096"})
    assert stream_info(kafka_cluster, partition_stream(topic, 2))[0] == {"max_bytes": 4096}
    assert sorted(admin.list_topics(topic, timeout=10).topics[topic].partitions) == [0, 1, 2]

    # CreateTopics on a name that is already a stream: TOPIC_ALREADY_EXISTS; DeleteTopics removes all
    assert error_name(admin.create_topics([NewTopic(topic, 1, 1)])[topic]) == "TOPIC_ALREADY_EXISTS"
    admin.delete_topics([topic])[topic].result(timeout=20)

    async def gone(client):
        return {m.name for m in await client.list_streams()} & {topic, partition_stream(topic, 1),
                                                                 partition_stream(topic, 2)}

    assert run(gone) == set()
