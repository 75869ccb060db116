"""Kafka SASL on the listener (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512): the credential store and the
server side of the exchanges without a network, then a real listener process with users added by
the `scroll kafka user` CLI: confluent-kafka produces and consumes with each mechanism (and once
over TLS, SASL_SSL); a wrong password, an unknown user and a client without SASL are refused with
librdkafka's authentication error and write nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from scramp import ScramClient

from compat_kafka.security import sasl
from fragments.memstore import MemoryStore

# ---------------------------------------------------------------- no network


def test_credentials_are_salted_and_checked_without_the_password():
    async def main():
        store = MemoryStore()
        await sasl.add_user(store, "alice", "s3cret")
        await sasl.add_user(store, "bob", "pw", mechanisms=("SCRAM-SHA-512",), iterations=8192)
        assert await sasl.list_users(store) == {"alice": ["SCRAM-SHA-256", "SCRAM-SHA-512"], "bob": ["SCRAM-SHA-512"]}
        for _key, v in await store.list_prefix(sasl.PREFIX):
            assert b"s3cret" not in v.value and b"pw\"" not in v.value
        cred = await sasl.load_credential(store, "alice", "SCRAM-SHA-256")
        assert cred.iterations == 4096 and len(cred.salt) >= 16
        assert sasl.check_plain(cred, "s3cret") and not sasl.check_plain(cred, "s3cret!")
        assert (await sasl.load_credential(store, "bob", "SCRAM-SHA-512")).iterations == 8192
        assert await sasl.remove_user(store, "bob") and not await sasl.remove_user(store, "bob")
        assert await sasl.list_users(store) == {"alice": ["SCRAM-SHA-256", "SCRAM-SHA-512"]}
        with pytest.raises(ValueError):
            await sasl.add_user(store, "a/b", "x")

    asyncio.run(main())


async def _scram(store, mech: str, user: str, password: str) -> str | None:
    """Run a SCRAM exchange against the server side; the principal, or None if refused."""
    session = sasl.SaslSession(store, mech)
    client = ScramClient([mech], user, password)
    try:
        first = await session.step(client.get_client_first().encode())
        client.set_server_first(first.decode())
        final = await session.step(client.get_client_final().encode())
        client.set_server_final(final.decode())  # the client checks the server's signature too
    except sasl.AuthenticationFailed as exc:
        assert str(exc).startswith("Authentication failed") and mech in str(exc)
        return None
    return session.principal


async def _plain(store, user: str, password: str, authzid: str = "") -> str | None:
    session = sasl.SaslSession(store, "PLAIN")
    try:
        assert await session.step(f"{authzid}\0{user}\0{password}".encode()) == b""
    except sasl.AuthenticationFailed as exc:
        assert "PLAIN" in str(exc)
        return None
    return session.principal


def test_exchanges_accept_the_right_password_only():
    async def main():
        store = MemoryStore()
        await sasl.add_user(store, "alice", "s3cret")
        for mech in sasl.SCRAM_MECHANISMS:
            assert await _scram(store, mech, "alice", "s3cret") == "alice"
            assert await _scram(store, mech, "alice", "wrong") is None
            assert await _scram(store, mech, "nobody", "s3cret") is None  # same error as a wrong password
        assert await _plain(store, "alice", "s3cret") == "alice"
        assert await _plain(store, "alice", "s3cret", authzid="alice") == "alice"
        assert await _plain(store, "alice", "wrong") is None
        assert await _plain(store, "nobody", "s3cret") is None
        assert await _plain(store, "alice", "s3cret", authzid="root") is None
        with pytest.raises(sasl.AuthenticationFailed):
            await sasl.SaslSession(store, "PLAIN").step(b"no-separators")

    asyncio.run(main())


def test_an_unknown_user_costs_the_same_as_a_known_one():
    fake = sasl.fake_credential("nobody")
    assert fake.iterations == sasl.DEFAULT_ITERATIONS and fake.salt == sasl.fake_credential("nobody").salt
    assert not sasl.check_plain(fake, "anything")


def test_mechanism_option_is_checked():
    assert sasl.parse_mechanisms("plain, SCRAM-SHA-512") == ("PLAIN", "SCRAM-SHA-512")
    for bad in ("", "GSSAPI", "PLAIN,OAUTHBEARER"):
        with pytest.raises(ValueError):
            sasl.parse_mechanisms(bad)


# ---------------------------------------------------------------- a real listener
import trustme  # noqa: E402
from confluent_kafka import Consumer, KafkaException, Producer  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from streams.tools.localcluster import LocalCluster, free_port  # noqa: E402

from .shimproc import ShimProcess  # noqa: E402
from .test_tls import _end_offset, _read_all  # noqa: E402

ALL = "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"


@pytest.fixture(scope="module")
def sasl_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("sasl-cluster"), bookies=3)
    c.start()
    yield c
    c.stop()


def _cli(metadata_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", *args,
                           "--metadata", metadata_url], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def users(sasl_cluster):
    """alice (both SCRAM credentials) and a user added and removed again, through the CLI."""
    url = sasl_cluster.metadata_url
    for args in (("add", "alice", "--password", "alice-pw"),
                 ("add", "temp", "--password", "x", "--mechanism", "SCRAM-SHA-512", "--iterations", "5000")):
        r = _cli(url, *args)
        assert r.returncode == 0, r.stderr
    r = _cli(url, "list")
    assert r.returncode == 0 and r.stdout.splitlines() == ["alice\tSCRAM-SHA-256,SCRAM-SHA-512", "temp\tSCRAM-SHA-512"]
    assert "alice-pw" not in r.stdout
    assert _cli(url, "remove", "temp").returncode == 0
    r = _cli(url, "remove", "temp")
    assert r.returncode != 0 and "no user temp" in r.stderr
    assert _cli(url, "list").stdout.splitlines() == ["alice\tSCRAM-SHA-256,SCRAM-SHA-512"]


def _sasl(mech: str, user: str = "alice", password: str = "alice-pw", protocol: str = "SASL_PLAINTEXT") -> dict:
    return {"security.protocol": protocol, "sasl.mechanism": mech, "sasl.username": user, "sasl.password": password}


def _produce(bootstrap: str, topic: str, n: int, conf: dict, timeout_s: float = 30.0) -> tuple[list, list[str]]:
    """Produce ``n`` records: the delivery errors (empty: all acknowledged) and the client's errors."""
    errors: list = []
    client_errors: list[str] = []
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": int(timeout_s * 1000),
                  "error_cb": lambda e: client_errors.append(str(e)), **conf})
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, on_delivery=lambda err, _m: errors.append(err) if err else None)
    p.flush(timeout_s + 10)
    return errors, client_errors


def _refused(bootstrap: str, topic: str, conf: dict) -> list[str]:
    """Try to produce; once the client reports an error, give up: the client's errors."""
    client_errors: list[str] = []
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": 20000,
                  "error_cb": lambda e: client_errors.append(str(e)), **conf})
    for i in range(3):
        p.produce(topic, value=b"x%d" % i)
    deadline = time.monotonic() + 20
    while not client_errors and time.monotonic() < deadline:
        p.poll(0.1)
    p.purge()
    assert p.flush(5) == 0
    return client_errors


@pytest.fixture
def sasl_shim(sasl_cluster, users, tmp_path):
    # one per test: a listener left running would own partitions the next test's listener serves
    shim = ShimProcess(sasl_cluster.metadata_url, tmp_path, "--sasl-mechanisms", ALL)
    shim.start_and_wait()
    yield shim
    shim.stop()


def test_sasl_clients_produce_and_consume_and_the_rest_are_refused(sasl_shim):
    shim = sasl_shim
    for mech in ALL.split(","):
        topic = f"t-{mech.lower()}"
        assert _produce(shim.bootstrap, topic, 5, _sasl(mech))[0] == []
        assert _read_all(shim.bootstrap, topic, _sasl(mech), 5) == [b"v%d" % i for i in range(5)]
    # a wrong password, an unknown user: librdkafka reports the failed authentication
    for conf in (_sasl("SCRAM-SHA-256", password="nope"), _sasl("PLAIN", password="nope"),
                 _sasl("SCRAM-SHA-512", user="mallory")):
        client_errors = _refused(shim.bootstrap, "t-plain", conf)
        assert any("SASL authentication error: Authentication failed" in e for e in client_errors), client_errors
    # a client without SASL: the listener closes its connection at its first request
    client_errors = _refused(shim.bootstrap, "t-plain", {})
    assert any("Disconnected" in e or "brokers are down" in e for e in client_errors), client_errors
    with pytest.raises(KafkaException):
        Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "x"}).list_topics(timeout=2)
    # nothing was written by the refused clients
    assert _end_offset(shim.bootstrap, "t-plain", _sasl("PLAIN")) == 5
    assert "authenticated" in shim.log_text() and "SASL authentication failed" in shim.log_text()


def test_aiokafka_and_kafka_python_authenticate(sasl_shim):
    import aiokafka
    import kafka

    async def aio():
        conf = dict(bootstrap_servers=sasl_shim.bootstrap, security_protocol="SASL_PLAINTEXT",
                    sasl_mechanism="SCRAM-SHA-256", sasl_plain_username="alice", sasl_plain_password="alice-pw")
        producer = aiokafka.AIOKafkaProducer(acks="all", **conf)
        await producer.start()
        try:
            for i in range(3):
                await producer.send_and_wait("t-aio", b"a%d" % i)
        finally:
            await producer.stop()
        consumer = aiokafka.AIOKafkaConsumer("t-aio", auto_offset_reset="earliest", **conf)
        await consumer.start()
        try:
            got = []
            while len(got) < 3:
                batch = await asyncio.wait_for(consumer.getmany(timeout_ms=500), 30)
                got += [m.value for ms in batch.values() for m in ms]
            return got
        finally:
            await consumer.stop()

    assert asyncio.run(aio()) == [b"a0", b"a1", b"a2"]
    producer = kafka.KafkaProducer(bootstrap_servers=sasl_shim.bootstrap, acks="all", security_protocol="SASL_PLAINTEXT",
                                   sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="alice",
                                   sasl_plain_password="alice-pw")
    try:
        assert producer.send("t-kp", b"k0").get(timeout=30).offset == 0
    finally:
        producer.close()
    assert _end_offset(sasl_shim.bootstrap, "t-kp", _sasl("PLAIN")) == 1


def _server_certificate(d) -> None:
    """ca.pem, and server.pem/server.key for 127.0.0.1 and localhost, in ``d`` (a test CA)."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    with open(d / "server.pem", "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())


def test_sasl_over_tls(sasl_cluster, users, tmp_path):
    _server_certificate(tmp_path)
    shim = ShimProcess(sasl_cluster.metadata_url, tmp_path, "--sasl-mechanisms", "SCRAM-SHA-512",
                       "--ssl-cert", str(tmp_path / "server.pem"), "--ssl-key", str(tmp_path / "server.key"))
    shim.start_and_wait()
    try:
        conf = {**_sasl("SCRAM-SHA-512", protocol="SASL_SSL"), "ssl.ca.location": str(tmp_path / "ca.pem")}
        assert _produce(shim.bootstrap, "t-ssl", 4, conf)[0] == []
        assert _read_all(shim.bootstrap, "t-ssl", conf, 4) == [b"v%d" % i for i in range(4)]
        client_errors = _refused(shim.bootstrap, "t-ssl", {**conf, "sasl.password": "nope"})
        assert any("Authentication failed" in e for e in client_errors), client_errors
        assert _end_offset(shim.bootstrap, "t-ssl", conf) == 4
    finally:
        shim.stop()


def test_the_protocol_before_authentication(sasl_shim):
    """Raw requests: what an unauthenticated connection may send, and what closes it."""
    from kio.schema.api_versions.v0 import ApiVersionsRequest
    from kio.schema.errors import ErrorCode
    from kio.schema.metadata.v12 import MetadataRequest
    from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

    from .shimproc import RawConnection

    md = MetadataRequest(topics=None, allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    with RawConnection(sasl_shim.port) as c:  # ApiVersions is answered (and lists the SASL APIs); Metadata closes
        keys = {k.api_key: (k.min_version, k.max_version) for k in c.call(ApiVersionsRequest()).api_keys}
        assert keys[17] == (0, 1) and keys[36] == (0, 2)
        with pytest.raises(ConnectionError):
            c.call(md)
    with RawConnection(sasl_shim.port) as c:  # an unknown mechanism: the enabled ones, then closed
        r = c.call(SaslHandshakeRequest(mechanism="GSSAPI"))
        assert r.error_code == ErrorCode.unsupported_sasl_mechanism and r.mechanisms == tuple(ALL.split(","))
        with pytest.raises(ConnectionError):
            c.call(ApiVersionsRequest())
    with RawConnection(sasl_shim.port) as c:  # SaslAuthenticate without a handshake
        r = c.call(SaslAuthenticateRequest(auth_bytes=b"\0alice\0alice-pw"))
        assert r.error_code == ErrorCode.illegal_sasl_state
    with RawConnection(sasl_shim.port) as c:  # PLAIN by hand: a principal, then any request
        assert c.call(SaslHandshakeRequest(mechanism="PLAIN")).error_code == ErrorCode.none
        r = c.call(SaslAuthenticateRequest(auth_bytes=b"\0alice\0alice-pw"))
        assert r.error_code == ErrorCode.none and r.session_lifetime.total_seconds() == 0
        assert c.call(md).brokers
        assert c.call(SaslHandshakeRequest(mechanism="PLAIN")).error_code == ErrorCode.illegal_sasl_state
    with RawConnection(sasl_shim.port) as c:  # a wrong password: the error and its message, then closed
        c.call(SaslHandshakeRequest(mechanism="PLAIN"))
        r = c.call(SaslAuthenticateRequest(auth_bytes=b"\0alice\0nope"))
        assert r.error_code == ErrorCode.sasl_authentication_failed and "Authentication failed" in r.error_message
        with pytest.raises(ConnectionError):
            c.call(md)


def test_plaintext_listener_beside_sasl_ssl(sasl_cluster, users, tmp_path):
    """Two listeners in one process (Kafka's ``listeners``): each answers Metadata with the brokers'
    addresses on the listener the client came in on, so a SASL_SSL client stays on SASL_SSL and a
    PLAINTEXT client on PLAINTEXT; both read the same log."""
    _server_certificate(tmp_path)
    secure_port = free_port()
    shim = ShimProcess(sasl_cluster.metadata_url, tmp_path, "--sasl-mechanisms", "SCRAM-SHA-256",
                       "--ssl-cert", str(tmp_path / "server.pem"), "--ssl-key", str(tmp_path / "server.key"))
    plain_port = shim.port
    shim.args += ["--listener", f"PLAINTEXT://127.0.0.1:{plain_port}",
                  "--listener", f"SASL_SSL://127.0.0.1:{secure_port}"]
    shim.start_and_wait()
    try:
        secure = f"127.0.0.1:{secure_port}"
        conf = {**_sasl("SCRAM-SHA-256", protocol="SASL_SSL"), "ssl.ca.location": str(tmp_path / "ca.pem")}
        seen = AdminClient({"bootstrap.servers": secure, **conf}).list_topics(timeout=20)
        assert {b.port for b in seen.brokers.values()} == {secure_port}
        seen = AdminClient({"bootstrap.servers": shim.bootstrap}).list_topics(timeout=20)
        assert {b.port for b in seen.brokers.values()} == {plain_port}
        assert _produce(secure, "t-two", 3, conf)[0] == []
        assert _produce(shim.bootstrap, "t-two", 2, {})[0] == []
        assert _read_all(secure, "t-two", conf, 5) == [b"v0", b"v1", b"v2", b"v0", b"v1"]
        # a plaintext client on the SASL_SSL port gets nowhere and writes nothing
        assert _refused(secure, "t-two", {})
        assert _end_offset(shim.bootstrap, "t-two", {}) == 5
    finally:
        shim.stop()


def test_transaction_markers_cross_sasl_ssl_listeners(sasl_cluster, users, tmp_path):
    """Two listener processes that serve only SASL_SSL: a transaction over partitions owned by both
    commits, so the coordinator's WriteTxnMarkers reached the other listener through TLS (checked
    against --inter-broker-ca) and SASL (the brokers' own identity from the metadata store)."""
    from confluent_kafka.admin import NewTopic

    _server_certificate(tmp_path)
    shims = []
    for _ in range(2):
        s = ShimProcess(sasl_cluster.metadata_url, tmp_path, "--sasl-mechanisms", "SCRAM-SHA-512",
                        "--ssl-cert", str(tmp_path / "server.pem"), "--ssl-key", str(tmp_path / "server.key"),
                        "--inter-broker-ca", str(tmp_path / "ca.pem"))
        shims.append(s)
        s.start()
    try:
        for s in shims:
            s.wait_listening()
        bootstrap = ",".join(s.bootstrap for s in shims)
        conf = {**_sasl("SCRAM-SHA-512", protocol="SASL_SSL"), "ssl.ca.location": str(tmp_path / "ca.pem")}
        admin = AdminClient({"bootstrap.servers": bootstrap, **conf})
        deadline = time.monotonic() + 30
        while len(admin.list_topics(timeout=10).brokers) != 2:  # both registered, as each other sees
            assert time.monotonic() < deadline, "the two listeners did not both register"
            time.sleep(0.1)
        admin.create_topics([NewTopic("t-txn-ssl", 6, 1)])["t-txn-ssl"].result(30)
        deadline = time.monotonic() + 30
        while True:
            md = admin.list_topics("t-txn-ssl", timeout=10).topics["t-txn-ssl"]
            if len({p.leader for p in md.partitions.values()}) == 2:
                break
            assert time.monotonic() < deadline, "the partitions are not spread over both listeners"
            time.sleep(0.1)
        p = Producer({"bootstrap.servers": bootstrap, "transactional.id": "ssl-txn", **conf})
        p.init_transactions(30)
        p.begin_transaction()
        for part in range(6):
            p.produce("t-txn-ssl", b"c%d" % part, partition=part)
        p.commit_transaction(30)
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ssl-txn-reader", "auto.offset.reset": "earliest",
                      "isolation.level": "read_committed", "enable.auto.commit": False, **conf})
        try:
            c.subscribe(["t-txn-ssl"])
            got: list[bytes] = []
            deadline = time.monotonic() + 60
            while len(got) < 6 and time.monotonic() < deadline:
                m = c.poll(0.2)
                if m is not None and m.error() is None:
                    got.append(m.value())
        finally:
            c.close()
        assert sorted(got) == [b"c%d" % i for i in range(6)]
        assert any("markers for" in s.log_text() for s in shims)  # a WriteTxnMarkers between the listeners
    finally:
        for s in shims:
            s.stop()


def _scram_login(port: int, user: str, password: str) -> None:
    """A fresh connection, SCRAM-SHA-256 by hand, then one Metadata request (raises if refused)."""
    from kio.schema.errors import ErrorCode
    from kio.schema.metadata.v12 import MetadataRequest
    from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

    from .shimproc import RawConnection

    with RawConnection(port, timeout_s=60) as c:
        assert c.call(SaslHandshakeRequest(mechanism="SCRAM-SHA-256")).error_code == ErrorCode.none
        client = ScramClient(["SCRAM-SHA-256"], user, password)
        r = c.call(SaslAuthenticateRequest(auth_bytes=client.get_client_first().encode()))
        client.set_server_first(r.auth_bytes.decode())
        r = c.call(SaslAuthenticateRequest(auth_bytes=client.get_client_final().encode()))
        assert r.error_code == ErrorCode.none, r.error_message
        client.set_server_final(r.auth_bytes.decode())
        assert c.call(MetadataRequest(topics=None, allow_auto_topic_creation=False,
                                      include_topic_authorized_operations=False)).brokers


def test_a_brute_force_loop_does_not_slow_other_clients(sasl_shim):
    """Eight connections at a time try wrong PLAIN passwords as fast as the listener answers, while
    alice logs in (SCRAM) and asks for metadata, over and over on fresh connections: her logins
    keep pace (within a few times the time they take with no attack, measured in the same test),
    every wrong password is refused, and the listener never accepts one."""
    import threading

    from kio.schema.errors import ErrorCode
    from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

    from .shimproc import RawConnection

    def logins(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            _scram_login(sasl_shim.port, "alice", "alice-pw")
        return time.perf_counter() - t0

    logins(3)  # warm up (credential cache, connections to etcd)
    quiet = logins(20)
    stop = threading.Event()
    tried, accepted = [0], [0]

    def attack(i: int) -> None:
        while not stop.is_set():
            try:
                with RawConnection(sasl_shim.port, timeout_s=60) as c:
                    c.call(SaslHandshakeRequest(mechanism="PLAIN"))
                    r = c.call(SaslAuthenticateRequest(auth_bytes=b"\0alice\0guess-%d-%d" % (i, tried[0])))
                    tried[0] += 1
                    if r.error_code == ErrorCode.none:
                        accepted[0] += 1
            except OSError:
                tried[0] += 1  # refused and closed: also a failed attempt
    attackers = [threading.Thread(target=attack, args=(i,), daemon=True) for i in range(8)]
    for t in attackers:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while tried[0] < 50:  # the attack is under way
            assert time.monotonic() < deadline, "the attackers made no attempts"
            time.sleep(0.05)
        before = tried[0]
        attacked = logins(20)
        during = tried[0] - before
    finally:
        stop.set()
        for t in attackers:
            t.join(60)
    assert accepted[0] == 0
    assert during >= 20, f"only {during} wrong passwords were tried while alice logged in 20 times"
    print(f"20 logins: {quiet:.2f}s quiet, {attacked:.2f}s under attack ({during} wrong passwords meanwhile)")
    assert attacked < 5 * quiet, f"20 logins took {attacked:.2f}s under attack, {quiet:.2f}s without"
