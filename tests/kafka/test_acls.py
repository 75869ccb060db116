"""Kafka ACLs: the decision and the filters without a network (Kafka's AclAuthorizer semantics), then
a real listener with SASL and `--acls` over real sockets: confluent-kafka's AdminClient creates,
describes and deletes ACLs; users without the right ACLs are refused producing (and nothing is
written), joining a group, and seeing topics; PREFIXED allows with a LITERAL deny; super users
bypass; aiokafka sees the same refusal; a change made through one listener applies on another."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from compat_kafka.security.acls import (
    AclBinding,
    AclFilter,
    AclSet,
    InvalidAcl,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    parse_super_users,
    principal_from_dn,
)

T, G, C, X = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER, ResourceType.TRANSACTIONAL_ID
LIT, PRE = PatternType.LITERAL, PatternType.PREFIXED
ALLOW, DENY = Permission.ALLOW, Permission.DENY


def _b(rt, name, pt, principal, op, perm=ALLOW, host="*"):
    return AclBinding.make(rt, name, pt, principal, host, op, perm)


# ---------------------------------------------------------------- no network
def test_deny_wins_and_operations_imply_describe():
    acls = AclSet([
        _b(T, "team-", PRE, "User:alice", Operation.WRITE),
        _b(T, "team-locked", LIT, "User:alice", Operation.WRITE, DENY),
        _b(T, "*", LIT, "User:*", Operation.DESCRIBE_CONFIGS),
        _b(T, "logs", LIT, "User:bob", Operation.ALTER_CONFIGS),
        _b(G, "g1", LIT, "User:alice", Operation.ALL),
        _b(T, "only-host", LIT, "User:carol", Operation.READ, host="10.0.0.1"),
    ], super_users=parse_super_users("User:admin; User:ops"))
    ok = acls.authorize
    assert ok("User:alice", "1.2.3.4", T, "team-a", Operation.WRITE)
    assert ok("User:alice", "1.2.3.4", T, "team-a", Operation.DESCRIBE)  # implied by WRITE
    assert not ok("User:alice", "1.2.3.4", T, "team-a", Operation.READ)
    assert not ok("User:alice", "1.2.3.4", T, "team-locked", Operation.WRITE)  # DENY wins
    assert ok("User:alice", "1.2.3.4", T, "team-locked", Operation.DESCRIBE)  # a DENY implies nothing
    assert not ok("User:alice", "1.2.3.4", T, "other", Operation.WRITE)  # no ACL: refused
    assert ok("User:bob", "h", T, "anything", Operation.DESCRIBE_CONFIGS)  # wildcard name and principal
    assert ok("User:bob", "h", T, "logs", Operation.DESCRIBE_CONFIGS)
    assert not ok("User:bob", "h", T, "logs", Operation.DESCRIBE)  # ALTER_CONFIGS implies DESCRIBE_CONFIGS only
    for op in (Operation.READ, Operation.DELETE, Operation.DESCRIBE):
        assert ok("User:alice", "h", G, "g1", op)  # ALL
    assert not ok("User:alice", "h", G, "g10", Operation.READ)  # LITERAL is not a prefix
    assert ok("User:carol", "10.0.0.1", T, "only-host", Operation.READ)
    assert not ok("User:carol", "10.0.0.2", T, "only-host", Operation.READ)
    assert ok("User:ops", "h", C, "kafka-cluster", Operation.ALTER)  # super user
    assert not ok("User:alice", "h", C, "kafka-cluster", Operation.ALTER)
    assert acls.any_allowed("User:alice", "h", T, Operation.WRITE)
    assert not acls.any_allowed("User:bob", "h", T, Operation.WRITE)


def test_bindings_are_checked_as_kafka_checks_them():
    for bad in [(ResourceType.ANY, "t", LIT), (T, "t", PatternType.MATCH), (T, "t", PatternType.ANY),
                (C, "other", LIT), (T, "*", PRE), (T, "", LIT)]:
        with pytest.raises(InvalidAcl):
            AclBinding.make(*bad, "User:a", "*", Operation.READ, ALLOW)
    for principal, op, perm in [("alice", Operation.READ, ALLOW), ("User:a", Operation.ANY, ALLOW),
                                ("User:a", Operation.READ, Permission.ANY), ("User:a", 99, ALLOW)]:
        with pytest.raises(InvalidAcl):
            AclBinding.make(T, "t", LIT, principal, "*", op, perm)
    b = _b(T, "t", LIT, "User:a", Operation.READ)
    assert AclBinding.from_bytes(b.to_bytes()) == b and b.key() == _b(T, "t", LIT, "User:a", Operation.READ).key()
    with pytest.raises(ValueError):
        parse_super_users("admin")


def test_filters_match_as_kafka_filters():
    bindings = [_b(T, "team-", PRE, "User:alice", Operation.WRITE), _b(T, "team-a", LIT, "User:bob", Operation.READ),
                _b(T, "*", LIT, "User:bob", Operation.DESCRIBE), _b(G, "g", LIT, "User:bob", Operation.READ, DENY)]
    acls = AclSet(bindings)

    def f(rt=ResourceType.ANY, name=None, pt=PatternType.ANY, principal=None, op=Operation.ANY, perm=Permission.ANY):
        return acls.matching(AclFilter.make(rt, name, pt, principal, None, op, perm))

    assert f() == bindings
    assert f(T, "team-a", PatternType.MATCH) == bindings[:3]  # every pattern that applies to team-a
    assert f(T, "team-a", LIT) == [bindings[1]]
    assert f(T, "team-", PatternType.ANY) == [bindings[0]]
    assert f(principal="User:bob", perm=DENY) == [bindings[3]]
    assert f(op=Operation.WRITE) == [bindings[0]]
    for bad in [(ResourceType.UNKNOWN, None, PatternType.ANY, None, None, Operation.ANY, Permission.ANY),
                (T, None, PatternType.UNKNOWN, None, None, Operation.ANY, Permission.ANY),
                (T, None, PatternType.ANY, None, None, 77, Permission.ANY)]:
        with pytest.raises(InvalidAcl):
            AclFilter.make(*bad)


def test_tls_principal_is_kafkas_dn_form():
    subject = ((("countryName", "US"),), (("organizationName", "Org, Inc"),), (("commonName", "client"),))
    assert principal_from_dn(subject) == "User:CN=client,O=Org\\, Inc,C=US"


def test_listener_cache_follows_the_store():
    """Two authorizers on one store (two listeners): a binding created through one is applied by the
    other at its next refresh, and decisions cached before are dropped."""
    from compat_kafka.security.authorizer import Authorizer
    from compat_kafka.wire import codec
    from fragments.memstore import MemoryStore

    async def main():
        store = MemoryStore()
        a, b = Authorizer(store, refresh_s=0.05), Authorizer(store, refresh_s=0.05)
        await a.start()
        await b.start()
        try:
            auth = codec.ConnectionAuth(principal="alice")
            codec.set_connection_auth(auth)
            codec.set_client_host(("10.1.2.3", 5555))
            assert not b.allowed(T, "orders", Operation.READ)  # cached: refused
            await a.create(_b(T, "orders", LIT, "User:alice", Operation.READ, host="10.1.2.3"))
            await a.reload()
            assert a.allowed(T, "orders", Operation.READ)
            deadline = asyncio.get_running_loop().time() + 5
            while not b.allowed(T, "orders", Operation.READ):
                assert asyncio.get_running_loop().time() < deadline, "the other listener never applied it"
                await asyncio.sleep(0.01)
            gone = await b.delete_matching(AclFilter.make(ResourceType.ANY, None, PatternType.ANY, "User:alice",
                                                          None, Operation.ANY, Permission.ANY))
            assert len(gone) == 1 and not b.allowed(T, "orders", Operation.READ)
            auth.principal = None  # not authenticated: User:ANONYMOUS
            assert not a.allowed(T, "orders", Operation.READ)
        finally:
            await a.close()
            await b.close()

    asyncio.run(main())


# ---------------------------------------------------------------- a real listener
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import (  # noqa: E402
    AclBinding as CkAclBinding,
)
from confluent_kafka.admin import (  # noqa: E402
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
)
from confluent_kafka.admin import ResourceType as CkResourceType  # noqa: E402

from streams.tools.localcluster import LocalCluster  # noqa: E402

from .shimproc import ShimProcess  # noqa: E402

SHIM_ARGS = ("--sasl-mechanisms", "PLAIN,SCRAM-SHA-256", "--acls", "--super-users", "User:admin;User:ops")


@pytest.fixture(scope="module")
def acl_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("acl-cluster"), bookies=3)
    c.start()
    for user in ("admin", "alice", "bob"):
        r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", "add", user, "--password",
                            f"{user}-pw", "--metadata", c.metadata_url], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    yield c
    c.stop()


@pytest.fixture(scope="module")
def acl_shim(acl_cluster, tmp_path_factory):
    shim = ShimProcess(acl_cluster.metadata_url, tmp_path_factory.mktemp("acl-shim"), *SHIM_ARGS)
    shim.start_and_wait()
    yield shim
    shim.stop()


def _conf(user: str) -> dict:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": user,
            "sasl.password": f"{user}-pw"}


def _admin(shim, user: str = "admin") -> AdminClient:
    return AdminClient({"bootstrap.servers": shim.bootstrap, **_conf(user)})


def _acl(rt, name, op, principal, pt=ResourcePatternType.LITERAL, perm=AclPermissionType.ALLOW):
    return CkAclBinding(rt, name, pt, principal, "*", op, perm)


def _create_acls(shim, *bindings, user: str = "admin") -> None:
    admin = _admin(shim, user)  # referenced until the answers are in (a destroyed client fails them)
    for f in admin.create_acls(list(bindings), request_timeout=30).values():
        f.result(30)


def _create_topic(shim, name: str) -> None:
    admin = _admin(shim)
    for f in admin.create_topics([NewTopic(name, 1)], request_timeout=30).values():
        f.result(30)


def _produce(shim, user: str, topic: str, n: int) -> list:
    """Produce ``n`` records as ``user``; the delivery errors' codes (empty: all acknowledged)."""
    errors: list = []
    p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "message.timeout.ms": 20000,
                  "enable.idempotence": False, **_conf(user)})
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, on_delivery=lambda err, _m: errors.append(err.code()) if err else None)
    assert p.flush(40) == 0
    return errors


def _end_offset(shim, topic: str, user: str = "admin") -> int:
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "watermarks", **_conf(user)})
    try:
        return c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)[1]
    finally:
        c.close()


def _topics_seen(shim, user: str) -> set[str]:
    c = Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "meta", **_conf(user)})
    try:
        return set(c.list_topics(timeout=30).topics)
    finally:
        c.close()


def _wait(cond, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def test_admin_client_creates_describes_and_deletes_acls(acl_shim):
    admin = _admin(acl_shim)
    bindings = [_acl(CkResourceType.TOPIC, "orders", AclOperation.READ, "User:alice"),
                _acl(CkResourceType.TOPIC, "orders-", AclOperation.WRITE, "User:alice", ResourcePatternType.PREFIXED),
                _acl(CkResourceType.GROUP, "billing", AclOperation.READ, "User:bob"),
                _acl(CkResourceType.TOPIC, "orders", AclOperation.WRITE, "User:bob", perm=AclPermissionType.DENY)]
    for f in admin.create_acls(bindings, request_timeout=30).values():
        assert f.result(30) is None
    # describe: everything about User:alice; what applies to the topic orders-eu (MATCH)
    alice = admin.describe_acls(AclBindingFilter(CkResourceType.ANY, None, ResourcePatternType.ANY, "User:alice",
                                                 None, AclOperation.ANY, AclPermissionType.ANY),
                                request_timeout=30).result(30)
    assert sorted((b.name, b.operation, b.resource_pattern_type) for b in alice) == [
        ("orders", AclOperation.READ, ResourcePatternType.LITERAL),
        ("orders-", AclOperation.WRITE, ResourcePatternType.PREFIXED)]
    match = admin.describe_acls(AclBindingFilter(CkResourceType.TOPIC, "orders-eu", ResourcePatternType.MATCH, None,
                                                 None, AclOperation.ANY, AclPermissionType.ANY),
                                request_timeout=30).result(30)
    assert [(b.name, b.principal) for b in match] == [("orders-", "User:alice")]
    # a user without ALTER on the cluster cannot create ACLs, nor describe without DESCRIBE
    with pytest.raises(KafkaException) as exc:
        _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "x", AclOperation.ALL, "User:alice"), user="alice")
    assert exc.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED
    # nor describe them without DESCRIBE on the cluster: the answer is CLUSTER_AUTHORIZATION_FAILED, which
    # librdkafka (2.x) drops, handing back an empty listing: alice sees none of the bindings
    alice_admin = _admin(acl_shim, "alice")
    assert alice_admin.describe_acls(AclBindingFilter(
        CkResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY, AclPermissionType.ANY),
        request_timeout=30).result(30) == []
    # delete bob's, then nothing of bob's is left
    flt = AclBindingFilter(CkResourceType.ANY, None, ResourcePatternType.ANY, "User:bob", None, AclOperation.ANY,
                           AclPermissionType.ANY)
    deleted = admin.delete_acls([flt], request_timeout=30)[flt].result(30)
    assert sorted(b.name for b in deleted) == ["billing", "orders"]
    assert admin.describe_acls(flt, request_timeout=30).result(30) == []
    # an invalid binding is refused with Kafka's error (the cluster resource has one name)
    with pytest.raises(KafkaException) as exc:
        _create_acls(acl_shim, _acl(CkResourceType.BROKER, "not-the-cluster", AclOperation.ALTER, "User:alice"))
    assert exc.value.args[0].code() == KafkaError.INVALID_REQUEST


def test_produce_needs_write_and_refused_writes_store_nothing(acl_shim):
    _create_topic(acl_shim, "secret")
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "secret", AclOperation.READ, "User:alice"))
    assert _produce(acl_shim, "alice", "secret", 3) == [KafkaError.TOPIC_AUTHORIZATION_FAILED] * 3
    assert _end_offset(acl_shim, "secret") == 0  # the super user sees nothing written
    # the super user writes without any ACL; alice reads it (READ) once allowed
    assert _produce(acl_shim, "admin", "secret", 2) == []
    assert _end_offset(acl_shim, "secret", user="alice") == 2


def test_prefixed_allow_with_a_literal_deny(acl_shim):
    _create_acls(acl_shim,
                 _acl(CkResourceType.TOPIC, "team-", AclOperation.ALL, "User:bob", ResourcePatternType.PREFIXED),
                 _acl(CkResourceType.TOPIC, "team-locked", AclOperation.WRITE, "User:bob",
                      perm=AclPermissionType.DENY),
                 _acl(CkResourceType.BROKER, "kafka-cluster", AclOperation.CREATE, "User:bob"))
    assert _produce(acl_shim, "bob", "team-a", 2) == []
    assert _produce(acl_shim, "bob", "team-locked", 1) == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    assert _end_offset(acl_shim, "team-a") == 2 and _end_offset(acl_shim, "team-locked") == 0


def test_metadata_hides_topics_the_user_cannot_describe(acl_shim):
    for t in ("visible-1", "hidden-1"):
        _create_topic(acl_shim, t)
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "visible-", AclOperation.DESCRIBE, "User:alice",
                                ResourcePatternType.PREFIXED))
    seen = _topics_seen(acl_shim, "alice")
    assert "visible-1" in seen and "hidden-1" not in seen
    assert {"visible-1", "hidden-1"} <= _topics_seen(acl_shim, "admin")
    # asked for by name: TOPIC_AUTHORIZATION_FAILED
    c = Consumer({"bootstrap.servers": acl_shim.bootstrap, "group.id": "meta", **_conf("alice")})
    try:
        md = c.list_topics("hidden-1", timeout=30)
        assert md.topics["hidden-1"].error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    finally:
        c.close()


def test_consumer_group_needs_read_on_the_group(acl_shim):
    _create_topic(acl_shim, "events")
    assert _produce(acl_shim, "admin", "events", 1) == []
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "events", AclOperation.READ, "User:alice"),
                 _acl(CkResourceType.GROUP, "allowed-group", AclOperation.READ, "User:alice"))

    def consume(group: str):
        errors: list = []
        c = Consumer({"bootstrap.servers": acl_shim.bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                      "error_cb": lambda e: errors.append(e.code()), **_conf("alice")})
        c.subscribe(["events"])
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = c.poll(0.2)
                if m is not None:
                    return m.error().code() if m.error() else m.value()
                if errors:
                    return errors[0]
            raise AssertionError("neither a record nor an error")
        finally:
            c.close()

    assert consume("allowed-group") == b"v0"
    assert consume("other-group") == KafkaError.GROUP_AUTHORIZATION_FAILED


def test_aiokafka_sees_topic_authorization_failed(acl_shim):
    import aiokafka
    from aiokafka.errors import TopicAuthorizationFailedError

    async def main():
        p = aiokafka.AIOKafkaProducer(bootstrap_servers=acl_shim.bootstrap, security_protocol="SASL_PLAINTEXT",
                                      sasl_mechanism="PLAIN", sasl_plain_username="bob", sasl_plain_password="bob-pw",
                                      request_timeout_ms=20000)
        await p.start()
        try:
            await p.send_and_wait("not-bobs", b"x")
        finally:
            await p.stop()

    _create_topic(acl_shim, "not-bobs")
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(main())
    assert _end_offset(acl_shim, "not-bobs") == 0


def test_a_change_through_one_listener_applies_on_another(acl_cluster, acl_shim, tmp_path):
    other = ShimProcess(acl_cluster.metadata_url, tmp_path, *SHIM_ARGS)
    other.start_and_wait()
    try:
        _create_topic(acl_shim, "shared-1")
        assert "shared-1" not in _topics_seen(other, "bob")
        _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "shared-1", AclOperation.DESCRIBE, "User:bob"))
        _wait(lambda: "shared-1" in _topics_seen(other, "bob"), "bob sees shared-1 through the other listener")
    finally:
        other.stop()


def test_transactional_producer_needs_write_on_its_transactional_id(acl_shim):
    _create_topic(acl_shim, "txn-t")
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "txn-t", AclOperation.WRITE, "User:alice"))

    def producer(txn_id: str) -> Producer:
        return Producer({"bootstrap.servers": acl_shim.bootstrap, "transactional.id": txn_id, **_conf("alice")})

    with pytest.raises(KafkaException) as exc:
        producer("tx-alice-1").init_transactions(30)
    assert exc.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    _create_acls(acl_shim, _acl(CkResourceType.TRANSACTIONAL_ID, "tx-alice-", AclOperation.WRITE, "User:alice",
                                ResourcePatternType.PREFIXED))
    p = producer("tx-alice-2")
    p.init_transactions(30)
    p.begin_transaction()
    p.produce("txn-t", value=b"t0")
    p.commit_transaction(30)
    assert _end_offset(acl_shim, "txn-t") == 2  # the record and the commit marker


@pytest.fixture(scope="module")
def other_cluster(tmp_path_factory):
    """A cluster of its own for listeners configured otherwise: admin requests go to the controller
    (the lowest live node id), which must be the listener under test."""
    c = LocalCluster(tmp_path_factory.mktemp("acl-other-cluster"), bookies=3)
    c.start()
    r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", "add", "alice", "--password",
                        "alice-pw", "--metadata", c.metadata_url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    yield c
    c.stop()


def test_acl_apis_without_acls_answer_security_disabled(other_cluster, tmp_path):
    shim = ShimProcess(other_cluster.metadata_url, tmp_path, "--sasl-mechanisms", "SCRAM-SHA-256")
    shim.start_and_wait()
    try:
        with pytest.raises(KafkaException) as exc:
            _create_acls(shim, _acl(CkResourceType.TOPIC, "t", AclOperation.READ, "User:alice"), user="alice")
        assert exc.value.args[0].code() == KafkaError.SECURITY_DISABLED
        assert _produce(shim, "alice", "no-acls", 2) == []  # everything allowed, as before
    finally:
        shim.stop()


def test_a_tls_client_certificate_names_the_principal(other_cluster, tmp_path):
    import trustme

    ca = trustme.CA()
    files = {"ca": tmp_path / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for name, cert in (("server", ca.issue_cert("127.0.0.1", "localhost")),
                       ("admin", ca.issue_cert("admin.test", common_name="admin", organization_name="scroll",
                                            organization_unit_name="ops")),
                       ("client", ca.issue_cert("client.test", common_name="client", organization_name="Org, Inc",
                                             organization_unit_name="eng"))):
        cert.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
        with open(tmp_path / f"{name}.pem", "wb") as f:
            for blob in cert.cert_chain_pems:
                f.write(blob.bytes())
    shim = ShimProcess(other_cluster.metadata_url, tmp_path, "--ssl-cert", str(tmp_path / "server.pem"), "--ssl-key",
                       str(tmp_path / "server.key"), "--ssl-client-ca", str(files["ca"]), "--ssl-client-auth",
                       "required", "--acls", "--super-users", "User:CN=admin,OU=ops,O=scroll")
    shim.start_and_wait()

    def conf(who: str) -> dict:
        return {"security.protocol": "SSL", "ssl.ca.location": str(files["ca"]),
                "ssl.certificate.location": str(tmp_path / f"{who}.pem"),
                "ssl.key.location": str(tmp_path / f"{who}.key")}

    def produce(who: str, topic: str) -> list:
        errors: list = []
        p = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "message.timeout.ms": 20000, **conf(who)})
        p.produce(topic, value=b"x", on_delivery=lambda err, _m: errors.append(err.code()) if err else None)
        assert p.flush(40) == 0
        return errors

    try:
        admin = AdminClient({"bootstrap.servers": shim.bootstrap, **conf("admin")})
        for f in admin.create_topics([NewTopic("tls-ok", 1), NewTopic("tls-no", 1)], request_timeout=30).values():
            f.result(30)
        for f in admin.create_acls([_acl(CkResourceType.TOPIC, "tls-ok", AclOperation.WRITE,
                                         "User:CN=client,OU=eng,O=Org\\, Inc")], request_timeout=30).values():
            f.result(30)
        assert produce("client", "tls-ok") == []
        assert produce("client", "tls-no") == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
        assert produce("admin", "tls-no") == []  # the super user, by its certificate
    finally:
        shim.stop()


def test_refusals_encode_for_every_api_and_version():
    """A request refused as a whole is answered with the error in an otherwise empty response of its
    own version: every such response, and every blank nested entry, encodes."""
    import dataclasses
    import sys as _sys

    from kio.schema.errors import ErrorCode

    from compat_kafka.security.authorizer import blank, refused
    from compat_kafka.wire import codec

    for key, (lo, hi) in codec.SUPPORTED.items():
        for v in range(lo, hi + 1):
            resp_cls = codec.response_schema(key, v)
            frame = codec.encode_response(7, refused(resp_cls, ErrorCode.cluster_authorization_failed))
            corr, body = codec.decode_response(frame[4:], key, v)
            assert corr == 7
            if hasattr(body, "error_code"):
                assert body.error_code == ErrorCode.cluster_authorization_failed
            mod = _sys.modules[resp_cls.__module__]
            for obj in vars(mod).values():
                if dataclasses.is_dataclass(obj) and obj.__module__ == mod.__name__:
                    blank(obj)


def _acl_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "acl", *args, "--metadata", url],
                          capture_output=True, text=True, timeout=60)


def test_acl_cli_adds_lists_and_removes(acl_cluster, acl_shim):
    url = acl_cluster.metadata_url
    _create_topic(acl_shim, "cli-t")
    r = _acl_cli(url, "add", "--resource-type", "topic", "--name", "cli-", "--prefixed", "--principal", "User:bob",
                 "--operation", "write", "--operation", "describe")
    assert r.returncode == 0, r.stderr
    r = _acl_cli(url, "list", "--principal", "User:bob", "--name", "cli-t", "--pattern", "match")
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == [
        "TOPIC\tPREFIXED\tcli-\tUser:bob\t*\tDESCRIBE\tALLOW", "TOPIC\tPREFIXED\tcli-\tUser:bob\t*\tWRITE\tALLOW"]
    # the running listener applies it within about a second
    _wait(lambda: _produce(acl_shim, "bob", "cli-t", 1) == [], "bob may write to cli-t")
    r = _acl_cli(url, "remove", "--name", "cli-", "--principal", "User:bob")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    _wait(lambda: _produce(acl_shim, "bob", "cli-t", 1) == [KafkaError.TOPIC_AUTHORIZATION_FAILED],
          "bob is refused again")
    assert _acl_cli(url, "remove", "--name", "cli-").returncode != 0  # nothing left to remove
    r = _acl_cli(url, "add", "--resource-type", "cluster", "--name", "other", "--principal", "User:bob",
                 "--operation", "alter")
    assert r.returncode != 0 and "kafka-cluster" in r.stderr


def test_read_revoked_during_a_fetch_session_stops_the_records(acl_shim):
    """kafka-python's consumer keeps an incremental fetch session (KIP-227): once READ is revoked, its
    next fetch is refused with TOPIC_AUTHORIZATION_FAILED and the records after are not served."""
    import kafka
    from kafka.errors import TopicAuthorizationFailedError

    _create_topic(acl_shim, "revoked-t")
    assert _produce(acl_shim, "admin", "revoked-t", 1) == []
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "revoked-t", AclOperation.READ, "User:alice"))
    c = kafka.KafkaConsumer(bootstrap_servers=acl_shim.bootstrap, security_protocol="SASL_PLAINTEXT",
                            sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice",
                            sasl_plain_password="alice-pw", enable_auto_commit=False, group_id=None)
    tp = kafka.TopicPartition("revoked-t", 0)
    records: list[bytes] = []
    refused: list = []

    def poll() -> None:
        try:
            for msgs in c.poll(timeout_ms=200).values():
                records.extend(m.value for m in msgs)
        except TopicAuthorizationFailedError as exc:
            refused.append(exc)

    try:
        c.assign([tp])
        c.seek(tp, 0)
        _wait(lambda: poll() or records, "the first record")
        admin = _admin(acl_shim)
        flt = AclBindingFilter(CkResourceType.TOPIC, "revoked-t", ResourcePatternType.LITERAL, "User:alice", None,
                               AclOperation.ANY, AclPermissionType.ANY)
        assert len(admin.delete_acls([flt], request_timeout=30)[flt].result(30)) == 1
        assert _produce(acl_shim, "admin", "revoked-t", 1) == []
        _wait(lambda: poll() or refused, "alice's fetch refused")
        assert records == [b"v0"]  # nothing after the revocation
    finally:
        c.close()


def test_raw_requests_refused_whole_or_in_part(acl_shim):
    """Metadata v1 asking only for refused topics still names the brokers; an acks=0 produce refused
    gets no answer and stores nothing; a produce to an allowed and a refused topic is answered for both."""
    import datetime

    from kio.schema.errors import ErrorCode
    from kio.schema.metadata.v1 import MetadataRequest
    from kio.schema.metadata.v1.request import MetadataRequestTopic
    from kio.schema.produce.v9 import ProduceRequest
    from kio.schema.produce.v9.request import PartitionProduceData, TopicProduceData
    from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

    from .shimproc import RawConnection, record_batch

    for t in ("raw-denied", "raw-ok"):
        _create_topic(acl_shim, t)
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "raw-ok", AclOperation.WRITE, "User:bob"))

    def produce(acks: int, *topics: str) -> ProduceRequest:
        return ProduceRequest(transactional_id=None, acks=acks, timeout=datetime.timedelta(seconds=10), topic_data=tuple(
            TopicProduceData(name=t, partition_data=(PartitionProduceData(index=0, records=record_batch([b"r"])),))
            for t in topics))

    with RawConnection(acl_shim.port) as c:
        assert c.call(SaslHandshakeRequest(mechanism="PLAIN")).error_code == ErrorCode.none
        assert c.call(SaslAuthenticateRequest(auth_bytes=b"\0bob\0bob-pw")).error_code == ErrorCode.none
        md = c.call(MetadataRequest(topics=(MetadataRequestTopic(name="raw-denied"),)))
        assert md.brokers and [(t.name, t.error_code) for t in md.topics] == [
            ("raw-denied", ErrorCode.topic_authorization_failed)]
        c.send(produce(0, "raw-denied"))  # no answer: the next answer is the next request's
        r = c.call(produce(-1, "raw-ok", "raw-denied"))
        assert {t.name: t.partition_responses[0].error_code for t in r.responses} == {
            "raw-ok": ErrorCode.none, "raw-denied": ErrorCode.topic_authorization_failed}
    assert _end_offset(acl_shim, "raw-denied") == 0 and _end_offset(acl_shim, "raw-ok") == 1


def test_delete_topics_by_id_needs_delete_on_the_named_topic(acl_shim):
    import datetime

    from kio.schema.delete_topics.v6 import DeleteTopicsRequest
    from kio.schema.delete_topics.v6.request import DeleteTopicState
    from kio.schema.errors import ErrorCode
    from kio.schema.metadata.v12 import MetadataRequest
    from kio.schema.metadata.v12.request import MetadataRequestTopic
    from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

    from .shimproc import RawConnection

    _create_topic(acl_shim, "raw-del")
    _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "raw-del", AclOperation.DESCRIBE, "User:bob"))
    with RawConnection(acl_shim.port) as c:
        assert c.call(SaslHandshakeRequest(mechanism="PLAIN")).error_code == ErrorCode.none
        assert c.call(SaslAuthenticateRequest(auth_bytes=b"\0bob\0bob-pw")).error_code == ErrorCode.none
        md = c.call(MetadataRequest(topics=(MetadataRequestTopic(name="raw-del", topic_id=None),),
                                    allow_auto_topic_creation=False, include_topic_authorized_operations=False))
        topic_id = md.topics[0].topic_id
        delete = DeleteTopicsRequest(topics=(DeleteTopicState(name=None, topic_id=topic_id),),
                                     timeout=datetime.timedelta(seconds=10))
        r = c.call(delete)
        assert [(t.name, t.error_code) for t in r.responses] == [("raw-del", ErrorCode.topic_authorization_failed)]
        _create_acls(acl_shim, _acl(CkResourceType.TOPIC, "raw-del", AclOperation.DELETE, "User:bob"))
        r = c.call(delete)
        assert [(t.name, t.error_code) for t in r.responses] == [("raw-del", ErrorCode.none)]
    assert "raw-del" not in _topics_seen(acl_shim, "admin")
