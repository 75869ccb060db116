"""Client quotas and connection limits (compat_kafka/quotas.py, server.py): resolution and rates
without IO; DescribeClientQuotas/AlterClientQuotas over a socket (requests through our codec: no
installed client has a quota admin call); a producer bound by a client-id quota throttled beside an
unbound one (confluent-kafka, its throttle callback); the per-address connection limit; the CLI."""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from confluent_kafka import Producer
from kio.schema.errors import ErrorCode

from compat_kafka import quotas
from compat_kafka.quotas import QuotaConfig, QuotaManager, Rate
from compat_kafka.wire import codec
from streams.tools.localcluster import LocalCluster, free_port

from .conftest import ShimThread
from .test_bad_input import recv_frame

pytestmark = pytest.mark.process


# ---------------------------------------------------------------- without IO
def test_resolution_follows_kafkas_precedence():
    m = QuotaManager(store=None)
    d = None
    m.quotas = {
        (("client-id", "c"),): {"producer_byte_rate": 8},
        (("client-id", d),): {"producer_byte_rate": 9, "consumer_byte_rate": 90},
        (("user", d),): {"producer_byte_rate": 6},
        (("client-id", "c"), ("user", d)): {"producer_byte_rate": 4},
        (("user", "u"),): {"producer_byte_rate": 3},
        (("client-id", d), ("user", "u")): {"producer_byte_rate": 2},
        (("client-id", "c"), ("user", "u")): {"producer_byte_rate": 1},
    }
    p = "producer_byte_rate"
    assert m.resolve(p, "u", "c") == (1, (p, "u", "c"))
    assert m.resolve(p, "u", "x") == (2, (p, "u", "x"))
    assert m.resolve(p, "v", "c") == (4, (p, "v", "c"))
    assert m.resolve(p, "v", "x") == (6, (p, "v", None))  # the default user's quota: per user
    assert m.resolve("consumer_byte_rate", "u", "c") == (90, ("consumer_byte_rate", None, "c"))
    assert m.resolve("request_percentage", "u", "c") is None
    m.quotas = {(("client-id", "c"),): {p: 8}}
    m._resolved = {}
    assert m.resolve(p, "v", "c") == (8, (p, None, "c"))
    assert m.resolve(p, "v", "other") is None


def test_rate_and_throttle_time_as_kafka():
    r = Rate(11, 1.0)
    r.record(1000, 0.0)
    assert r.window(0.0) == 10.0 and r.rate(0.0) == 100.0  # at least num - 1 whole samples
    for t in range(1, 30):
        r.record(1000, float(t))
    assert r.rate(29.0) == pytest.approx(11000 / 10.0)
    m = QuotaManager(store=None, config=QuotaConfig(11, 1.0))
    m.quotas = {(("client-id", "c"),): {"producer_byte_rate": 100}}
    assert m.record("producer_byte_rate", "u", "c", 500, 0.0) == 0.0  # 500 / 10 s = 50 B/s
    # 2000 B over the 10 s window: 200 B/s, twice the quota: throttled for (200 - 100) / 100 * 10 s
    assert m.record("producer_byte_rate", "u", "c", 1500, 0.0) == pytest.approx(10.0)
    assert m.record("producer_byte_rate", "u", "c", 10**9, 0.0) > 1e6  # not capped (Kafka's is not)
    assert m.record("producer_byte_rate", "u", "other", 10**9, 0.0) == 0.0  # unbound


def test_describe_filters():
    d = None
    q = {(("user", "u"),): {"producer_byte_rate": 1.0}, (("user", d),): {"producer_byte_rate": 2.0},
         (("client-id", "c"), ("user", "u")): {"consumer_byte_rate": 3.0}, (("client-id", d),): {"request_percentage": 50.0}}
    names = lambda comps, strict=False: [quotas.show_entity(e) for e, _v in quotas.describe(q, comps, strict)]  # noqa: E731
    assert names([("user", 0, "u")]) == ["client-id=c,user=u", "user=u"]
    assert names([("user", 0, "u")], True) == ["user=u"]
    assert names([("user", 1, None)]) == ["user=<default>"]
    assert names([("user", 2, None)], True) == ["user=<default>", "user=u"]
    assert names([]) == sorted(names([]))
    assert len(names([])) == 4
    for bad in ([("group", 0, "x")], [("user", 0, None)], [("user", 2, None), ("user", 1, None)]):
        with pytest.raises(quotas.QuotaError) as info:
            quotas.describe(q, bad, False)
        assert info.value.code == ErrorCode.invalid_request


# ---------------------------------------------------------------- a listener of their own
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A cluster of its own: every partition is this module's listener's (with its short windows)."""
    c = LocalCluster(tmp_path_factory.mktemp("quotas"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def qshim(cluster):
    # 11 samples of 0.2 s: a rate settles within ~2 s (Kafka's 11 x 1 s would need ~10 s)
    s = ShimThread(cluster.metadata_url, free_port(), quotas=QuotaConfig(11, 0.2))
    s.start()
    yield s
    s.stop()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def call(s, body, corr=1):
    s.sendall(codec.encode_request(body, corr))
    got, resp = codec.decode_response(recv_frame(s), body.__api_key__, body.__version__)
    assert got == corr
    return resp


def alter_req(version: int, entries, validate_only=False):
    cls = codec.request_schema(codec.API_ALTER_CLIENT_QUOTAS, version)
    ec, oc, rc = (codec.nested(cls, n) for n in ("EntityData", "OpData", "EntryData"))
    return cls(validate_only=validate_only, entries=tuple(
        rc(entity=tuple(ec(entity_type=t, entity_name=n) for t, n in entity),
           ops=tuple(oc(key=k, value=float(v or 0), remove=v is None) for k, v in ops)) for entity, ops in entries))


def describe_req(version: int, components, strict=False):
    cls = codec.request_schema(codec.API_DESCRIBE_CLIENT_QUOTAS, version)
    cc = codec.nested(cls, "ComponentData")
    return cls(strict=strict, components=tuple(cc(entity_type=t, match_type=m, match=x) for t, m, x in components))


def described(resp) -> dict:
    assert resp.error_code == ErrorCode.none, resp.error_message
    return {tuple((e.entity_type, e.entity_name) for e in entry.entity): {v.key: v.value for v in entry.values}
            for entry in resp.entries}


@pytest.mark.parametrize("version", [0, 1])
def test_alter_describe_round_trip_defaults_and_deletion(qshim, version):
    cid = f"rt-{version}"
    with connect(qshim.port) as s:
        resp = call(s, alter_req(version, [
            ([("client-id", cid)], [("producer_byte_rate", 1024), ("consumer_byte_rate", 2048)]),
            ([("user", f"alice{version}"), ("client-id", None)], [("request_percentage", 25.5)]),
            ([("client-id", None)], [("producer_byte_rate", 10**9)]),
            ([("group", "x")], [("producer_byte_rate", 1)]),  # not a quota entity
            ([("client-id", "bad")], [("producer_bytes", 1)]),  # not a quota key
            ([("client-id", "neg")], [("producer_byte_rate", -1)]),
        ]))
        codes = [e.error_code for e in resp.entries]
        assert codes == [ErrorCode.none] * 3 + [ErrorCode.invalid_request] * 3
        assert [(x.entity_type, x.entity_name) for x in resp.entries[1].entity] == [("user", f"alice{version}"),
                                                                                      ("client-id", None)]
        got = described(call(s, describe_req(version, [("client-id", 0, cid)]), 2))
        assert got == {(("client-id", cid),): {"producer_byte_rate": 1024.0, "consumer_byte_rate": 2048.0}}
        got = described(call(s, describe_req(version, [("user", 0, f"alice{version}")], strict=False), 3))
        assert got == {(("client-id", None), ("user", f"alice{version}")): {"request_percentage": 25.5}}
        assert described(call(s, describe_req(version, [("user", 0, f"alice{version}")], strict=True), 4)) == {}
        got = described(call(s, describe_req(version, [("client-id", 1, None)], strict=True), 5))
        assert got == {(("client-id", None),): {"producer_byte_rate": 1e9}}
        # validate_only changes nothing; a removal of the last key removes the entity
        call(s, alter_req(version, [([("client-id", cid)], [("producer_byte_rate", 5)])], validate_only=True), 6)
        assert described(call(s, describe_req(version, [("client-id", 0, cid)]), 7))[(("client-id", cid),)][
            "producer_byte_rate"] == 1024.0
        resp = call(s, alter_req(version, [([("client-id", cid)], [("producer_byte_rate", None)]),
                                           ([("client-id", None)], [("producer_byte_rate", None)]),
                                           ([("user", f"alice{version}"), ("client-id", None)],
                                            [("request_percentage", None)])]), 8)
        assert [e.error_code for e in resp.entries] == [ErrorCode.none] * 3
        assert described(call(s, describe_req(version, [("client-id", 0, cid)]), 9)) == {
            (("client-id", cid),): {"consumer_byte_rate": 2048.0}}
        call(s, alter_req(version, [([("client-id", cid)], [("consumer_byte_rate", None)])]), 10)
        assert described(call(s, describe_req(version, [("client-id", 2, None)]), 11)) == {}
        bad = call(s, describe_req(version, [("client-id", 0, None)]), 12)
        assert bad.error_code == ErrorCode.invalid_request and bad.entries is None


def test_quota_bound_producer_is_throttled_beside_an_unbound_one(qshim):
    quota = 100_000  # bytes/s
    slow_id, fast_id, topic = "slow-producer", "fast-producer", "quota-topic"
    with connect(qshim.port) as s:
        resp = call(s, alter_req(1, [([("client-id", slow_id)], [("producer_byte_rate", quota)])]))
        assert resp.entries[0].error_code == ErrorCode.none
    value = b"x" * 10_000
    results: dict[str, dict] = {}

    def run(client_id: str, seconds: float) -> None:
        delivered: list[tuple[float, int]] = []
        throttles: list[int] = []
        p = Producer({"bootstrap.servers": qshim.bootstrap, "client.id": client_id, "acks": "all", "linger.ms": 5,
                      "batch.size": 50_000,  # requests of ~50 KB: the slow one's rate is measured finely
                      "throttle_cb": lambda ev: throttles.append(int(ev.throttle_time * 1000))})

        def report(err, msg):
            if err is None:
                delivered.append((time.monotonic(), len(msg.value())))

        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if len(p) < 20:  # at most ~200 KB queued in the client
                p.produce(topic, value, on_delivery=report)
            p.poll(0.001 if len(p) < 20 else 0.05)
        end = time.monotonic()
        p.flush(30)
        results[client_id] = {"delivered": delivered, "throttles": throttles, "start": start, "end": end}

    threads = [threading.Thread(target=run, args=(cid, 10.0)) for cid in (slow_id, fast_id)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    def rate(cid: str, after: float) -> float:
        r = results[cid]
        t0 = r["start"] + after
        return sum(n for t, n in r["delivered"] if t0 <= t <= r["end"]) / (r["end"] - t0)  # acknowledged bytes/s

    slow, fast = rate(slow_id, 3.0), rate(fast_id, 3.0)  # after the first windows filled
    print(f"slow {slow / 1e3:.0f} KB/s (quota {quota / 1e3:.0f}), fast {fast / 1e3:.0f} KB/s, "
          f"slow throttles {len(results[slow_id]['throttles'])} max {max(results[slow_id]['throttles'], default=0)} ms")
    assert results[slow_id]["throttles"] and max(results[slow_id]["throttles"]) > 0
    assert 0 < slow <= 2 * quota
    assert fast > 3 * quota and fast > 2 * slow
    assert qshim.server.stats["throttled_responses"] > 0
    with connect(qshim.port) as s:
        call(s, alter_req(1, [([("client-id", slow_id)], [("producer_byte_rate", None)])]))


def api_versions_ok(s: socket.socket) -> bool:
    try:
        resp = call(s, codec.build(codec.request_schema(18, 3), client_software_name="t", client_software_version="1"))
        return resp.error_code == ErrorCode.none
    except (OSError, AssertionError, TypeError, struct_error):
        return False


struct_error = __import__("struct").error


def test_connection_limit_per_address_refuses_the_next_one(cluster):
    shim = ShimThread(cluster.metadata_url, free_port(), node_id=None,
                      server_options={"max_connections_per_ip": 3})
    shim.start()
    try:
        held = [connect(shim.port) for _ in range(3)]
        assert all(api_versions_ok(s) for s in held)
        extra = connect(shim.port)  # accepted by TCP, closed by the listener
        extra.settimeout(10)
        assert extra.recv(1) == b""
        extra.close()
        assert shim.server.stats["refused_max_connections_per_ip"] == 1
        assert all(api_versions_ok(s) for s in held)  # the others unaffected
        held.pop().close()
        deadline = time.monotonic() + 30
        while True:  # the closed one's slot is freed once the listener has seen it close
            s = connect(shim.port)
            if api_versions_ok(s):
                held.append(s)
                break
            s.close()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for s in held:
            s.close()
    finally:
        shim.stop()


def test_quotas_cli_alters_and_describes(cluster, qshim):
    url = cluster.metadata_url

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "quotas", *args, "--metadata", url],
                              capture_output=True, text=True, timeout=60)

    r = cli("alter", "--entity-type", "users", "--entity-name", "bob", "--entity-type", "clients", "--entity-default",
            "--add-config", "producer_byte_rate=1024,request_percentage=50")
    assert r.returncode == 0, r.stderr
    r = cli("describe", "--entity-type", "users", "--entity-name", "bob")
    assert r.stdout.splitlines() == ["client-id=<default>,user=bob\tproducer_byte_rate=1024,request_percentage=50.0"]
    with connect(qshim.port) as s:  # the API sees what the CLI stored
        got = described(call(s, describe_req(1, [("user", 0, "bob")])))
        assert got == {(("client-id", None), ("user", "bob")): {"producer_byte_rate": 1024.0,
                                                                 "request_percentage": 50.0}}
    r = cli("alter", "--entity-type", "users", "--entity-name", "bob", "--entity-type", "clients", "--entity-default",
            "--add-config", "producer_byte_rate=0")
    assert r.returncode != 0 and "INVALID_REQUEST" in r.stderr
    r = cli("alter", "--entity-type", "users", "--entity-name", "bob", "--entity-type", "clients", "--entity-default",
            "--delete-config", "producer_byte_rate,request_percentage")
    assert r.returncode == 0, r.stderr
    assert cli("describe").stdout == ""


def test_inflight_produce_bytes_budget_is_first_come_first_served():
    import asyncio

    from compat_kafka.server import ByteBudget

    async def main():
        b = ByteBudget(100)
        assert b.try_acquire(60) and not b.try_acquire(50)
        order = []

        async def take(name, n):
            await b.acquire(n)
            order.append(name)

        big = asyncio.create_task(take("big", b.clamp(500)))  # over the whole budget: waits for all of it
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 10))  # fits, but queued behind the big one
        gone = asyncio.create_task(take("cancelled", 10))
        await asyncio.sleep(0)
        assert order == [] and b.used == 60
        gone.cancel()
        b.release(60)
        await big
        assert order == ["big"] and b.used == 100
        b.release(100)
        await small
        assert order == ["big", "small"] and b.used == 10 and b.peak == 100
        b.release(10)
        assert b.used == 0

    asyncio.run(main())


# ---------------------------------------------------------------- fetch quota (Kafka's throttled fetch)
FETCH_QUOTA = 200_000  # bytes/s: qshim's window (10 x 0.2 s) lets 400 KB through at once
FETCH_RECORDS = 1000  # of ~1 KB: ~1 MB to read, ~3 s at the quota


@pytest.fixture(scope="module")
def fetch_topic(qshim):
    """A one-partition topic of FETCH_RECORDS numbered ~1 KB records, and consumer_byte_rate set for
    the client ids starting ``fq-``."""
    topic = "fetch-quota"
    cids = ["fq-raw-4", "fq-raw-12", "fq-kafka-python"]
    with connect(qshim.port) as s:
        resp = call(s, alter_req(1, [([("client-id", c)], [("consumer_byte_rate", FETCH_QUOTA)]) for c in cids]))
        assert [e.error_code for e in resp.entries] == [ErrorCode.none] * len(cids)
    p = Producer({"bootstrap.servers": qshim.bootstrap, "acks": "all", "linger.ms": 5, "batch.size": 16_000})
    for i in range(FETCH_RECORDS):
        p.produce(topic, b"%06d" % i + b"v" * 994)
    assert p.flush(60) == 0
    yield topic
    with connect(qshim.port) as s:
        call(s, alter_req(1, [([("client-id", c)], [("consumer_byte_rate", None)]) for c in cids]))


def fetch_req(version: int, topic: str, offset: int, session_id: int = 0, epoch: int = -1, named: bool = True):
    cls = codec.request_schema(codec.API_FETCH, version)
    tc, pc = codec.nested(cls, "FetchTopic"), codec.nested(cls, "FetchPartition")
    parts = (codec.build(pc, partition=0, current_leader_epoch=-1, fetch_offset=offset, last_fetched_epoch=-1,
                         log_start_offset=-1, partition_max_bytes=64_000),) if named else ()
    return codec.build(cls, replica_id=-1, max_wait=datetime.timedelta(milliseconds=100), min_bytes=1,
                       max_bytes=10 << 20, isolation_level=0, session_id=session_id, session_epoch=epoch, rack_id="",
                       topics=(codec.build(tc, topic=topic, partitions=parts),) if named else (),
                       forgotten_topics_data=())


def batches_of(records: bytes) -> list[tuple[int, int]]:
    """(base offset, offset count) of each record batch in a fetch answer's records."""
    out, pos = [], 0
    while pos + 12 <= len(records):
        base, length = struct.unpack_from(">qi", records, pos)
        if pos + 12 + length > len(records):
            break  # a partial batch at the end (Kafka may send one; the client drops it)
        (last_delta,) = struct.unpack_from(">i", records, pos + 23)
        out.append((base, last_delta + 1))
        pos += 12 + length
    return out


def assert_held_near(quota: float, window_s: float, total: int, elapsed: float) -> None:
    # Kafka's rate lets one window's worth through at once, then holds the quota
    assert total <= quota * (elapsed + window_s) * 1.3 + 64_000, (total, elapsed)


@pytest.mark.parametrize("version", [4, 12])  # sessionless; a KIP-227 session (full, then incremental)
def test_a_fetch_over_its_byte_rate_is_answered_empty_and_nothing_is_lost(qshim, fetch_topic, version):
    cid = f"fq-raw-{version}"
    throttled0 = qshim.server.broker.quotas.throttled["consumer_byte_rate"]
    offset, total, throttled, corr, sessions = 0, 0, 0, 0, set()
    session_id, epoch = 0, (0 if version >= 7 else -1)
    start = time.monotonic()
    with connect(qshim.port) as s:
        while offset < FETCH_RECORDS:
            corr += 1
            # within a session, the partition is named again only when its fetch offset changed
            req = fetch_req(version, fetch_topic, offset, session_id, epoch)
            s.sendall(codec.encode_request(req, corr, client_id=cid))
            got, resp = codec.decode_response(recv_frame(s), codec.API_FETCH, version)
            assert got == corr and getattr(resp, "error_code", ErrorCode.none) == ErrorCode.none
            if version >= 7:
                if epoch == 0 or resp.session_id == 0:
                    session_id, epoch = resp.session_id, (1 if resp.session_id else 0)
                else:
                    assert resp.session_id == session_id
                    epoch += 1
                sessions.add(session_id)
            parts = [p for t in resp.responses for p in t.partitions]
            if resp.throttle_time.total_seconds() > 0:
                throttled += 1
                assert parts == [], "a throttled fetch carries no partitions (Kafka's empty answer)"
                continue
            for p in parts:
                assert p.error_code == ErrorCode.none
                for base, count in batches_of(p.records or b""):
                    assert base == offset, f"a gap or a duplicate: batch at {base}, expected {offset}"
                    offset += count
                total += len(p.records or b"")
    elapsed = time.monotonic() - start
    print(f"v{version}: {total} B in {elapsed:.2f} s ({total / elapsed / 1e3:.0f} KB/s, quota "
          f"{FETCH_QUOTA / 1e3:.0f}), {throttled} throttled answers")
    assert offset == FETCH_RECORDS
    assert version < 7 or sessions - {0}, "the fetches went through a session"
    assert throttled > 0 and qshim.server.broker.quotas.throttled["consumer_byte_rate"] > throttled0
    assert_held_near(FETCH_QUOTA, 2.0, total, elapsed)


def test_a_fetch_quota_bound_kafka_python_consumer_reads_everything_in_order(qshim, fetch_topic):
    from kafka import KafkaConsumer

    throttled0 = qshim.server.broker.quotas.throttled["consumer_byte_rate"]
    c = KafkaConsumer(fetch_topic, bootstrap_servers=qshim.bootstrap, client_id="fq-kafka-python",
                      auto_offset_reset="earliest", enable_auto_commit=False, fetch_max_wait_ms=100,
                      max_partition_fetch_bytes=64_000, consumer_timeout_ms=200)
    try:
        got: list[tuple[int, bytes]] = []
        start = time.monotonic()
        deadline = start + 60
        while len(got) < FETCH_RECORDS and time.monotonic() < deadline:
            got.extend((m.offset, m.value[:6]) for m in c)
        elapsed = time.monotonic() - start
    finally:
        c.close()
    assert [o for o, _v in got] == list(range(FETCH_RECORDS))  # in order, no gap, no duplicate
    assert [v for _o, v in got] == [b"%06d" % i for i in range(FETCH_RECORDS)]
    assert qshim.server.broker.quotas.throttled["consumer_byte_rate"] > throttled0
    assert_held_near(FETCH_QUOTA, 2.0, FETCH_RECORDS * 1000, elapsed)


# ---------------------------------------------------------------- a produce flood under a memory bound
def test_a_produce_flood_keeps_the_listeners_memory_under_its_inflight_bound(cluster):
    """Five producers send 1 MB produce requests as fast as they can to a listener whose
    ``max_inflight_produce_bytes`` is 4 MiB: the Python memory the listener allocates meanwhile
    (tracemalloc: the listener runs in this process; librdkafka's memory is not Python's) stays
    under the bound plus a small fixed overhead, the clients wait (backpressure), and every
    acknowledged record is stored. Before the bound counted each request's copies and the bytes the
    partitions' writers keep, the same flood took ~9x the bound."""
    import tracemalloc

    from confluent_kafka.admin import AdminClient, NewTopic

    bound, overhead = 4 << 20, 2 << 20
    shim = ShimThread(cluster.metadata_url, free_port(), node_id=None,
                      server_options={"max_inflight_produce_bytes": bound})
    shim.start()
    prods = []
    try:
        admin = AdminClient({"bootstrap.servers": shim.bootstrap})
        admin.create_topics([NewTopic("flood", 4, 1)])["flood"].result(30)
        prods = [Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "linger.ms": 50,
                           "batch.size": 1_000_000, "message.max.bytes": 1_000_000,
                           "queue.buffering.max.kbytes": 4096}) for _ in range(5)]
        pad = b"z" * 99_000
        acked, errors = [0], []

        def report(err, _msg):
            if err is None:
                acked[0] += 1
            else:
                errors.append(err)

        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            stop = time.monotonic() + 3.0
            while time.monotonic() < stop:
                for p in prods:
                    with contextlib.suppress(BufferError):
                        p.produce("flood", pad, on_delivery=report)
                    p.poll(0)
                time.sleep(0.001)
            for p in prods:
                assert p.flush(60) == 0
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        budget = shim.server.produce_budget
        print(f"flood: {acked[0]} records acked, listener allocations peak +{peak / 2**20:.1f} MiB (bound "
              f"{bound / 2**20:.0f} MiB), budget peak {budget.peak / 2**20:.1f} MiB, with the writers' "
              f"{budget.peak_total / 2**20:.1f} MiB, waits {shim.server.stats['produce_bytes_waits']}")
        assert not errors and acked[0] > 20
        assert shim.server.stats["produce_bytes_waits"] > 0  # the bound held clients back
        assert budget.peak <= bound
        assert peak <= bound + overhead
        # every acknowledged record is stored: the high watermarks count them
        assert sum(high_watermarks(shim.bootstrap, "flood", 4)) == acked[0]
    finally:
        prods.clear()
        shim.stop()


def high_watermarks(bootstrap: str, topic: str, partitions: int) -> list[int]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks"})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)]
    finally:
        c.close()


def test_a_fetch_over_its_request_percentage_is_answered_empty(qshim, fetch_topic):
    """As Kafka: a fetch over the request quota (a tiny share of a handler: any fetch is over it)
    gets the empty, throttled answer although records are there."""
    cid = "fq-request-share"
    with connect(qshim.port) as s:
        call(s, alter_req(1, [([("client-id", cid)], [("request_percentage", 0.0001)])]))
        try:
            with connect(qshim.port) as c:  # its own connection: this one is muted after the answer
                c.sendall(codec.encode_request(fetch_req(12, fetch_topic, 0), 1, client_id=cid))
                _corr, resp = codec.decode_response(recv_frame(c), codec.API_FETCH, 12)
            assert resp.throttle_time.total_seconds() > 0 and resp.responses == ()
        finally:
            call(s, alter_req(1, [([("client-id", cid)], [("request_percentage", None)])]), 2)
