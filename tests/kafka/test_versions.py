"""Every version Kafka 3.9 serves, against a real listener: the oldest ones (which kio 0.6.5 lacks and
``codec`` derives), the newest, a few between, and versions outside the range (Kafka's answers)."""

from __future__ import annotations

import datetime
import time

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from kio.schema.errors import ErrorCode

from compat_kafka.wire import codec

from .test_bad_input import assert_closed, assert_serving, connect, recv_frame

pytestmark = pytest.mark.process

# Kafka 3.9.0's validVersions for the APIs the listener implements (clients/src/main/resources/
# common/message/*Request.json); we serve at least these.
KAFKA_39 = {0: (0, 11), 1: (0, 17), 2: (0, 9), 3: (0, 12), 8: (0, 9), 9: (0, 9), 10: (0, 6), 11: (0, 9),
            12: (0, 4), 13: (0, 5), 14: (0, 5), 15: (0, 5), 16: (0, 5), 17: (0, 1), 18: (0, 4), 19: (0, 7),
            20: (0, 6), 21: (0, 2), 22: (0, 5), 24: (0, 5), 25: (0, 4), 26: (0, 4), 27: (0, 1), 28: (0, 4),
            29: (0, 3), 30: (0, 3), 31: (0, 3), 32: (0, 4), 33: (0, 2), 36: (0, 2), 37: (0, 3), 42: (0, 2),
            44: (0, 1), 47: (0, 0), 48: (0, 1), 49: (0, 1), 50: (0, 0), 51: (0, 0), 60: (0, 1), 65: (0, 0), 66: (0, 1), 68: (0, 0),
            69: (0, 0)}


def req(api_key: int, version: int, /, **values):
    cls = codec.request_schema(api_key, version)
    return codec.build(cls, **values)


def sub(api_key: int, version: int, cls_name: str, /, **values):
    return codec.build(codec.nested(codec.request_schema(api_key, version), cls_name), **values)


def call(s, body, corr=1):
    s.sendall(codec.encode_request(body, corr))
    got, resp = codec.decode_response(recv_frame(s), body.__api_key__, body.__version__)
    assert got == corr
    return resp


def test_served_ranges_cover_kafka_39():
    for key, (lo, hi) in KAFKA_39.items():
        ours = codec.SUPPORTED[key]
        assert ours[0] <= lo and ours[1] >= hi, (key, ours, (lo, hi))
    for key, (lo, hi) in codec.SUPPORTED.items():  # every served version has a schema
        for v in range(lo, hi + 1):
            assert codec.request_schema(key, v).__version__ == v
            assert codec.response_schema(key, v).__version__ == v


def test_api_versions_advertises_exactly_the_served_ranges(shim):
    with connect(shim) as s:
        for v in (0, 3, 4):
            resp = call(s, req(18, v, client_software_name="t", client_software_version="1"), v + 1)
            assert resp.error_code == ErrorCode.none
            assert {(k.api_key, k.min_version, k.max_version) for k in resp.api_keys} == set(codec.our_api_ranges())


def test_api_versions_out_of_range_gets_v0_unsupported_version(shim):
    with connect(shim) as s:
        s.sendall(codec.frame(bytes.fromhex("0012" "0005" "00000007" "ffff" "00")))  # ApiVersions v5
        corr, body = codec.decode_response(recv_frame(s), 18, 0)
        assert corr == 7 and body.error_code == ErrorCode.unsupported_version
        assert [(k.api_key, k.min_version, k.max_version) for k in body.api_keys] == [(18, 0, 4)]
        assert call(s, req(18, 4, client_software_name="t", client_software_version="1"), 8).error_code == 0


@pytest.mark.parametrize("key_version", ["0001" "0012", "0003" "000e", "0013" "0008"])  # Fetch 18, Metadata 14, CreateTopics 8
def test_other_api_out_of_range_closes_the_connection(shim, key_version):
    with connect(shim) as s:
        s.sendall(codec.frame(bytes.fromhex(key_version + "00000001" "ffff" "00")))
        assert_closed(s)
    assert_serving(shim)


def _create(s, version: int, name: str, partitions: int = 1):
    topic = sub(19, version, "CreatableTopic", name=name, num_partitions=partitions, replication_factor=1,
                assignments=(), configs=())
    return call(s, req(19, version, topics=(topic,), timeout=datetime.timedelta(seconds=30), validate_only=False))


@pytest.mark.parametrize("version", [0, 1, 2, 5, 7])
def test_create_topics_every_era(shim, topic, version):
    with connect(shim) as s:
        resp = _create(s, version, topic)
        assert [t.error_code for t in resp.topics] == [ErrorCode.none]
        again = _create(s, version, topic)
        assert again.topics[0].error_code == ErrorCode.topic_already_exists
        if version >= 1:
            assert again.topics[0].error_message
        if version >= 2:
            assert again.throttle_time == datetime.timedelta(0)


@pytest.mark.parametrize("version", [0, 1, 4, 9, 12])
def test_metadata_versions(shim, topic, version):
    with connect(shim) as s:
        _create(s, 7, topic)
        t = sub(3, version, "MetadataRequestTopic", name=topic, topic_id=None)
        resp = call(s, req(3, version, topics=(t,), allow_auto_topic_creation=False,
                           include_topic_authorized_operations=False,
                           include_cluster_authorized_operations=False))
        assert [x.error_code for x in resp.topics] == [ErrorCode.none]
        assert resp.brokers and resp.topics[0].partitions[0].leader_id == resp.brokers[0].node_id


def _legacy(magic: int, values: list[bytes], compression: int = 0) -> bytes:
    b = LegacyRecordBatchBuilder(magic, compression, 1 << 20)
    for i, v in enumerate(values):
        b.append(i, 1_700_000_000_000 + i, b"k", v)
    return bytes(b.build())


def _batch(values: list[bytes]) -> bytes:
    b = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 20)
    for i, v in enumerate(values):
        b.append(i, 1_700_000_000_000 + i, b"k", v, [])
    return bytes(b.build())


def _produce(s, version: int, topic: str, records: bytes):
    pd = sub(0, version, "PartitionProduceData", index=0, records=records)
    td = sub(0, version, "TopicProduceData", name=topic, partition_data=(pd,))
    resp = call(s, req(0, version, acks=-1, timeout=datetime.timedelta(seconds=10), topic_data=(td,),
                       transactional_id=None))
    return resp.responses[0].partition_responses[0]


def _fetch(s, version: int, topic: str, offset: int, topic_id=None):
    fp = sub(1, version, "FetchPartition", partition=0, fetch_offset=offset, partition_max_bytes=1 << 20)
    ft = sub(1, version, "FetchTopic", topic=topic, topic_id=topic_id, partitions=(fp,))
    resp = call(s, req(1, version, replica_id=-1, max_wait=datetime.timedelta(milliseconds=100), min_bytes=1,
                       max_bytes=1 << 20, topics=(ft,), forgotten_topics_data=(), rack_id=""))
    p = resp.responses[0].partitions[0]
    out, magics = [], set()
    mr = MemoryRecords(bytes(p.records or b""))
    while (b := mr.next_batch()) is not None:
        magics.add(getattr(b, "magic", None) if not hasattr(b, "validate_crc") or b.validate_crc() else "bad crc")
        out += [(r.offset, r.value) for r in b]
    return p, out, magics


def test_old_produce_and_fetch_convert_message_formats(shim, topic):
    with connect(shim) as s:
        _create(s, 7, topic)
        r0 = _produce(s, 0, topic, _legacy(0, [b"a", b"b"]))
        assert (r0.error_code, r0.base_offset) == (ErrorCode.none, 0)
        r1 = _produce(s, 1, topic, _legacy(0, [b"c"], compression=1))  # gzip wrapper
        assert (r1.error_code, r1.base_offset) == (ErrorCode.none, 2)
        r2 = _produce(s, 2, topic, _legacy(1, [b"d", b"e"]))
        assert (r2.error_code, r2.base_offset) == (ErrorCode.none, 3)
        r3 = _produce(s, 3, topic, _batch([b"f"]))
        assert (r3.error_code, r3.base_offset) == (ErrorCode.none, 5)
        bad = _produce(s, 2, topic, _batch([b"x"]))  # a magic-2 batch needs Produce v3+
        assert bad.error_code == ErrorCode.unsupported_for_message_format
        corrupt = _produce(s, 0, topic, _legacy(0, [b"z"])[:-3])
        assert corrupt.error_code == ErrorCode.corrupt_message
        everything = [(i, v) for i, v in enumerate([b"a", b"b", b"c", b"d", b"e", b"f"])]
        for version, magic in ((0, 0), (1, 0), (2, 1), (3, 1)):
            p, recs, magics = _fetch(s, version, topic, 0)
            assert p.error_code == ErrorCode.none and p.high_watermark == 6
            assert recs == everything and magics <= {magic, None}, (version, recs, magics)
        p, recs, _ = _fetch(s, 0, topic, 4)
        assert recs == everything[4:]
        p, recs, _ = _fetch(s, 4, topic, 0)  # v4+: the stored batches as they are
        assert recs == everything


def test_list_offsets_v0_old_style_offsets(shim, topic):
    with connect(shim) as s:
        _create(s, 7, topic)
        _produce(s, 3, topic, _batch([b"a", b"b", b"c"]))
        for ts, want in ((-1, 3), (-2, 0)):
            p = sub(2, 0, "ListOffsetsPartition", partition_index=0, timestamp=ts, max_num_offsets=1)
            t = sub(2, 0, "ListOffsetsTopic", name=topic, partitions=(p,))
            resp = call(s, req(2, 0, replica_id=-1, topics=(t,)))
            got = resp.topics[0].partitions[0]
            assert got.error_code == ErrorCode.none and tuple(got.old_style_offsets) == (want,)


@pytest.mark.parametrize("commit_version,fetch_version", [(0, 0), (1, 1), (2, 1), (1, 0)])
def test_offset_commit_and_fetch_old_versions(shim, topic, commit_version, fetch_version):
    group = f"g-{topic}"
    with connect(shim) as s:
        _create(s, 7, topic)
        cp = sub(8, commit_version, "OffsetCommitRequestPartition", partition_index=0, committed_offset=42,
                 commit_timestamp=-1, committed_metadata="m")
        ct = sub(8, commit_version, "OffsetCommitRequestTopic", name=topic, partitions=(cp,))
        resp = call(s, req(8, commit_version, group_id=group, generation_id_or_member_epoch=-1, member_id="",
                           topics=(ct,)))
        assert resp.topics[0].partitions[0].error_code == ErrorCode.none
        ft = sub(9, fetch_version, "OffsetFetchRequestTopic", name=topic, partition_indexes=(0,))
        got = call(s, req(9, fetch_version, group_id=group, topics=(ft,))).topics[0].partitions[0]
        assert (got.error_code, got.committed_offset, got.metadata) == (ErrorCode.none, 42, "m")


def test_delete_topics_v0_and_describe_configs_v0(shim, topic):
    with connect(shim) as s:
        _create(s, 0, topic)
        r = sub(32, 0, "DescribeConfigsResource", resource_type=2, resource_name=topic, configuration_keys=None)
        resp = call(s, req(32, 0, resources=(r,)))
        res = resp.results[0]
        assert res.error_code == ErrorCode.none and res.configs
        assert any(c.is_default for c in res.configs)
        resp = call(s, req(20, 0, topic_names=(topic,), timeout=datetime.timedelta(seconds=30)))
        assert [(x.name, x.error_code) for x in resp.responses] == [(topic, ErrorCode.none)]


def test_acls_v0_and_transactions_newest(shim):
    with connect(shim) as s:
        resp = call(s, req(29, 0, resource_type_filter=1, resource_name_filter=None, principal_filter=None,
                           host_filter=None, operation=1, permission_type=1))
        assert isinstance(resp.error_code, ErrorCode)  # ACLs off here: a well-formed answer either way
        resp = call(s, req(26, 4, transactional_id="nope", producer_id=1, producer_epoch=0, committed=True))
        assert resp.error_code != ErrorCode.none
        resp = call(s, req(25, 4, transactional_id="nope", producer_id=1, producer_epoch=0, group_id="g"))
        assert resp.error_code != ErrorCode.none


@pytest.mark.parametrize("version", [0, 3, 4, 6])
def test_find_coordinator_versions(shim, version):
    with connect(shim) as s:
        resp = call(s, req(10, version, key="grp", key_type=0, coordinator_keys=("grp",)))
        codes = [c.error_code for c in resp.coordinators] if version >= 4 else [resp.error_code]
        assert codes == [ErrorCode.none]


@pytest.mark.parametrize("api_version", [(0, 10, 2), (2, 0)])
def test_kafka_python_pinned_to_an_old_broker_version(shim, topic, api_version):
    kafka = pytest.importorskip("kafka")
    boot = f"127.0.0.1:{shim.port}"
    admin = kafka.KafkaAdminClient(bootstrap_servers=boot, api_version=api_version)
    try:
        admin.create_topics([kafka.admin.NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    producer = kafka.KafkaProducer(bootstrap_servers=boot, api_version=api_version)
    try:
        for i in range(5):
            producer.send(topic, key=b"k", value=b"v%d" % i)
        producer.flush(30)
    finally:
        producer.close()
    consumer = kafka.KafkaConsumer(topic, bootstrap_servers=boot, api_version=api_version,
                                   auto_offset_reset="earliest", group_id=f"g-{topic}", consumer_timeout_ms=15000)
    try:
        got, deadline = [], time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            for msgs in consumer.poll(1000).values():
                got += [m.value for m in msgs]
        assert got == [b"v%d" % i for i in range(5)]
        consumer.commit()
    finally:
        consumer.close()


def test_fetch_13_to_17_name_topics_by_id(shim, topic):
    """Fetch v13+ (KIP-516) names topics by the id Metadata gives; an unknown id is UNKNOWN_TOPIC_ID."""
    import uuid

    with connect(shim) as s:
        _create(s, 7, topic)
        assert _produce(s, 9, topic, _batch([b"a", b"b", b"c"])).error_code == ErrorCode.none
        t = sub(3, 12, "MetadataRequestTopic", name=topic, topic_id=None)
        meta = call(s, req(3, 12, topics=(t,), allow_auto_topic_creation=False,
                           include_topic_authorized_operations=False))
        topic_id = meta.topics[0].topic_id
        for version in (13, 15, 17):
            p, recs, _ = _fetch(s, version, topic, 1, topic_id=topic_id)
            assert p.error_code == ErrorCode.none and p.high_watermark == 3, (version, p)
            assert recs == [(0, b"a"), (1, b"b"), (2, b"c")]  # the batch holding offset 1, whole
        fp = sub(1, 13, "FetchPartition", partition=0, fetch_offset=0, partition_max_bytes=1 << 20)
        ft = sub(1, 13, "FetchTopic", topic_id=uuid.uuid4(), partitions=(fp,))
        resp = call(s, req(1, 13, max_wait=datetime.timedelta(milliseconds=10), min_bytes=1, max_bytes=1 << 20,
                           topics=(ft,), forgotten_topics_data=(), rack_id=""))
        assert [x.partitions[0].error_code for x in resp.responses] == [ErrorCode.unknown_topic_id]
        assert resp.responses[0].topic_id == ft.topic_id


def test_fetch_by_the_id_of_a_topic_deleted_elsewhere_is_unknown_topic_id(shim, kafka_cluster, topic, monkeypatch):
    """An id the listener learnt, of a topic then deleted and created again by another client (a new
    id, the same name), is not served from the new topic: its entry is confirmed once stale."""
    import asyncio

    import compat_kafka.broker as broker_mod
    from streams.client import connect as aconnect

    def topic_id(s):
        t = sub(3, 12, "MetadataRequestTopic", name=topic, topic_id=None)
        return call(s, req(3, 12, topics=(t,), allow_auto_topic_creation=False,
                           include_topic_authorized_operations=False)).topics[0].topic_id

    async def recreate():
        c = await aconnect(kafka_cluster.metadata_url)
        try:
            await c.delete_topic(topic)
            await c.create_topic(topic, 1)
        finally:
            await c.close()

    with connect(shim) as s:
        _create(s, 7, topic)
        old = topic_id(s)
        p, _, _ = _fetch(s, 13, topic, 0, topic_id=old)
        assert p.error_code == ErrorCode.none
        asyncio.run(recreate())
        monkeypatch.setattr(broker_mod, "TOPIC_IDS_TTL_S", 0.0)  # every entry stale at once
        p, _, _ = _fetch(s, 13, topic, 0, topic_id=old)
        assert p.error_code == ErrorCode.unknown_topic_id
        new = topic_id(s)
        assert new != old
        deadline = time.monotonic() + 20  # a new id is listed at most once a second: clients retry
        while (got := _fetch(s, 13, topic, 0, topic_id=new)[0]).error_code != ErrorCode.none:
            assert time.monotonic() < deadline, got
