"""More real clients over real TCP against the shim: aiokafka and kafka-python, each producing,
consuming in a group, committing, and resuming where the group left off (a new member of the same
group sees every record exactly once across the two); kafka-python's admin client too."""

from __future__ import annotations

import asyncio
import time

import pytest

from .conftest import kafka_python_admin
from .test_groups import create_topic

pytestmark = pytest.mark.process


def check_exactly_once(seen: list[tuple[int, int, bytes]], n: int, partitions: int):
    """A commit-and-resume run: what both consumers saw covers every (partition, offset)
    of n records exactly once."""
    per = n // partitions
    want = {(p, o) for p in range(partitions) for o in range(per)}
    got = [(p, o) for p, o, _ in seen]
    assert len(got) == len(set(got)) == n, f"{len(got)} records, {len(set(got))} distinct"
    assert set(got) == want


# ---------------------------------------------------------------- aiokafka
def test_aiokafka_group_consume_commit_and_resume(shim, topic):
    import aiokafka  # installed by the test extra: missing fails, never skips
    from aiokafka.structs import OffsetAndMetadata, TopicPartition

    n, parts = 120, 2
    create_topic(shim.bootstrap, topic, parts)
    group = f"g-{topic}"

    async def main():
        producer = aiokafka.AIOKafkaProducer(bootstrap_servers=shim.bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(n):
                await producer.send(topic, f"v{i}".encode(), partition=i % parts)
            await producer.flush()
        finally:
            await producer.stop()

        def new_consumer():
            return aiokafka.AIOKafkaConsumer(
                topic, bootstrap_servers=shim.bootstrap, group_id=group, enable_auto_commit=False,
                auto_offset_reset="earliest", session_timeout_ms=6000, heartbeat_interval_ms=300,
                fetch_max_wait_ms=100)

        seen: list[tuple[int, int, bytes]] = []
        c = new_consumer()
        await c.start()
        try:
            processed: dict[int, int] = {}
            deadline = time.monotonic() + 30
            while min(processed.get(p, -1) for p in range(parts)) < 19:  # 20+ of each partition
                assert time.monotonic() < deadline
                for tp, msgs in (await c.getmany(timeout_ms=200)).items():
                    for m in msgs:
                        if m.offset < 20:  # "process" the first 20 of each partition only
                            seen.append((tp.partition, m.offset, m.value))
                        processed[tp.partition] = max(processed.get(tp.partition, -1), m.offset)
            await c.commit({TopicPartition(topic, p): OffsetAndMetadata(20, "aio") for p in range(parts)})
            committed = await c.committed(TopicPartition(topic, 0))
            assert committed == 20
        finally:
            await c.stop()

        c = new_consumer()
        await c.start()
        try:
            deadline = time.monotonic() + 30
            while len(seen) < n:
                assert time.monotonic() < deadline
                for tp, msgs in (await c.getmany(timeout_ms=200)).items():
                    seen.extend((tp.partition, m.offset, m.value) for m in msgs)
            extra = await c.getmany(timeout_ms=300)
            seen.extend((tp.partition, m.offset, m.value) for tp, msgs in extra.items() for m in msgs)
        finally:
            await c.stop()
        return seen

    seen = asyncio.run(main())
    check_exactly_once(seen, n, parts)
    assert sorted(v for _, _, v in seen) == sorted(f"v{i}".encode() for i in range(n))


# ---------------------------------------------------------------- kafka-python
def test_kafka_python_producer_group_consumer_and_resume(shim, topic):
    import kafka  # installed by the test extra: missing fails, never skips
    from kafka.structs import OffsetAndMetadata, TopicPartition

    n, parts = 90, 3
    create_topic(shim.bootstrap, topic, parts)
    producer = kafka.KafkaProducer(bootstrap_servers=shim.bootstrap, acks="all", linger_ms=5)
    try:
        for i in range(n):
            producer.send(topic, f"k{i}".encode(), partition=i % parts)
        producer.flush(30)
    finally:
        producer.close()

    def new_consumer():
        return kafka.KafkaConsumer(topic, bootstrap_servers=shim.bootstrap, group_id=f"g-{topic}",
                                   enable_auto_commit=False, auto_offset_reset="earliest",
                                   session_timeout_ms=6000, heartbeat_interval_ms=300, fetch_max_wait_ms=100)

    seen: list[tuple[int, int, bytes]] = []
    c = new_consumer()
    try:
        processed: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while min(processed.get(p, -1) for p in range(parts)) < 9:
            assert time.monotonic() < deadline
            for tp, msgs in c.poll(timeout_ms=200).items():
                for m in msgs:
                    if m.offset < 10:
                        seen.append((tp.partition, m.offset, m.value))
                    processed[tp.partition] = max(processed.get(tp.partition, -1), m.offset)
        c.commit({TopicPartition(topic, p): OffsetAndMetadata(10, "kp", -1) for p in range(parts)})
        assert c.committed(TopicPartition(topic, 2)) == 10
    finally:
        c.close()

    c = new_consumer()
    try:
        deadline = time.monotonic() + 30
        while len(seen) < n:
            assert time.monotonic() < deadline
            for tp, msgs in c.poll(timeout_ms=200).items():
                seen.extend((tp.partition, m.offset, m.value) for m in msgs)
        for tp, msgs in c.poll(timeout_ms=300).items():
            seen.extend((tp.partition, m.offset, m.value) for m in msgs)
    finally:
        c.close()
    check_exactly_once(seen, n, parts)
    assert sorted(v for _, _, v in seen) == sorted(f"k{i}".encode() for i in range(n))


def test_kafka_python_admin_create_list_delete_topics_and_groups(shim, topic):
    import kafka  # installed by the test extra: missing fails, never skips
    from kafka.admin import ConfigResource, NewPartitions, NewTopic

    admin = kafka_python_admin(shim.bootstrap)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
        assert topic in admin.list_topics()
        described = admin.describe_topics([topic])
        assert len(described[0]["partitions"]) == 3
        cluster = admin.describe_cluster()  # DescribeCluster
        assert cluster["cluster_id"] == "scroll" and shim.port in [b["port"] for b in cluster["brokers"]]
        res = ConfigResource("TOPIC", topic, {"retention.ms": "5000", "retention.bytes": "4096"})
        assert admin.alter_configs([res], incremental=False) == {"topic": {topic: "OK"}}  # AlterConfigs
        cfg = admin.describe_configs([ConfigResource("TOPIC", topic)])["topic"][topic]
        assert (cfg["retention.ms"]["value"], cfg["retention.bytes"]["value"]) == ("5000", "4096")
        admin.create_partitions({topic: NewPartitions(4)})
        assert len(admin.describe_topics([topic])[0]["partitions"]) == 4
        c = kafka.KafkaConsumer(bootstrap_servers=shim.bootstrap, group_id=f"g-{topic}")
        try:
            c.assign([kafka.TopicPartition(topic, 1)])
            c.commit({kafka.TopicPartition(topic, 1): kafka.OffsetAndMetadata(0, "", -1)})
        finally:
            c.close()
        group = f"g-{topic}"
        assert group in [g["group_id"] for g in admin.list_groups()]
        offsets = admin.list_group_offsets(group)[group]
        assert {tp.partition: om.offset for tp, om in offsets.items()} == {1: 0}
        assert admin.describe_groups([group])[group]["group_state"] == "Empty"
        assert admin.delete_groups([group]) == {group: "OK"}
        assert group not in [g["group_id"] for g in admin.list_groups()]
        admin.delete_topics([topic])
        deadline = time.monotonic() + 10
        while topic in admin.list_topics():
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        admin.close()
