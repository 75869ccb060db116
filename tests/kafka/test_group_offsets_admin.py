"""Group admin calls over real TCP against the shim: OffsetDelete (KIP-496) with Kafka's errors
(kafka-python's ``delete_group_offsets``: confluent-kafka's Python AdminClient does not wrap
librdkafka's DeleteConsumerGroupOffsets), and the protocol type of consumer groups in
confluent-kafka's ListGroups/DescribeGroups, active and Empty."""

from __future__ import annotations

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient
from kafka import TopicPartition as KpTopicPartition
from kafka.errors import KafkaError

from .conftest import kafka_python_admin
from .test_groups import assignment, consumer, create_topic, poll_until

pytestmark = pytest.mark.process


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})


def committed(admin: AdminClient, group: str) -> dict[tuple[str, int], int]:
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(timeout=20)
    return {(tp.topic, tp.partition): tp.offset for tp in res.topic_partitions}


@pytest.fixture()
def kp_admin(shim):
    a = kafka_python_admin(shim.bootstrap, request_timeout_ms=20_000)
    yield a
    a.close()


def delete_offsets(kp_admin, group: str, tps: list[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
    """Per-partition error names (None: deleted); raises a KafkaError for a group error."""
    res = kp_admin.delete_group_offsets(group, [KpTopicPartition(t, p) for t, p in tps])
    return {(tp.topic, tp.partition): (None if err.errno == 0 else err.__name__) for tp, err in res.items()}


def group_error(kp_admin, group: str, tps: list[tuple[str, int]]) -> str:
    with pytest.raises(KafkaError) as info:
        delete_offsets(kp_admin, group, tps)
    return type(info.value).__name__


def test_offset_delete_refuses_subscribed_topics_of_an_active_group_and_deletes_the_rest(admin, kp_admin, shim, topic):
    other = f"{topic}-other"
    create_topic(shim.bootstrap, topic, 2)
    create_topic(shim.bootstrap, other, 1)
    group = f"g-{topic}"
    c = consumer(shim.bootstrap, group)
    try:
        c.subscribe([topic])
        poll_until([c], lambda: len(assignment(c)) == 2)
        c.commit(offsets=[TopicPartition(topic, 0, 5), TopicPartition(topic, 1, 7), TopicPartition(other, 0, 3)],
                 asynchronous=False)
        # an active consumer group: its subscribed topic is refused, another topic's offsets go
        assert delete_offsets(kp_admin, group, [(topic, 0), (other, 0)]) == {
            (topic, 0): "GroupSubscribedToTopicError", (other, 0): None}
        assert committed(admin, group) == {(topic, 0): 5, (topic, 1): 7}
        # the group lists as a consumer group (protocol type "consumer"), not a simple one
        listed = {g.group_id: g for g in admin.list_consumer_groups().result(timeout=20).valid}
        assert not listed[group].is_simple_consumer_group
        assert not admin.describe_consumer_groups([group])[group].result(timeout=20).is_simple_consumer_group
    finally:
        c.close()
    # Empty now (and forgotten by the coordinator's memory): still a consumer group, as in Kafka
    listed = {g.group_id: g for g in admin.list_consumer_groups().result(timeout=20).valid}
    assert listed[group].state.name == "EMPTY" and not listed[group].is_simple_consumer_group
    d = admin.describe_consumer_groups([group])[group].result(timeout=20)
    assert d.state.name == "EMPTY" and not d.is_simple_consumer_group
    # an Empty group: any partition goes; unknown partitions and topics are refused one by one
    assert delete_offsets(kp_admin, group, [(topic, 0), (topic, 9), (f"{topic}-nope", 0)]) == {
        (topic, 0): None, (topic, 9): "UnknownTopicOrPartitionError", (f"{topic}-nope", 0): "UnknownTopicOrPartitionError"}
    assert committed(admin, group) == {(topic, 1): 7}


def test_offset_delete_of_an_unknown_group_is_group_id_not_found(admin, kp_admin, shim, topic):
    create_topic(shim.bootstrap, topic, 1)
    assert group_error(kp_admin, f"nobody-{topic}", [(topic, 0)]) == "GroupIdNotFoundError"


def test_a_simple_group_committing_with_assign_lists_as_simple(admin, kp_admin, shim, topic):
    create_topic(shim.bootstrap, topic, 1)
    group = f"simple-{topic}"
    c = consumer(shim.bootstrap, group)
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        c.commit(offsets=[TopicPartition(topic, 0, 1)], asynchronous=False)
    finally:
        c.close()
    listed = {g.group_id: g for g in admin.list_consumer_groups().result(timeout=20).valid}
    assert listed[group].is_simple_consumer_group
    assert delete_offsets(kp_admin, group, [(topic, 0)]) == {(topic, 0): None}
    assert committed(admin, group) == {}
