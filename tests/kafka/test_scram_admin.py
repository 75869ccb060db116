"""SCRAM credentials managed with the Kafka admin APIs (DescribeUserScramCredentials,
AlterUserScramCredentials) through confluent-kafka, then used to log in; and KIP-368
re-authentication: the session lifetime SaslAuthenticate answers, a connection that outlives it
without re-authenticating is closed, a re-authentication keeps it open (raw requests), and
librdkafka re-authenticates by itself while producing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import (
    AdminClient,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12 import MetadataRequest
from kio.schema.sasl_authenticate.v2 import SaslAuthenticateRequest
from kio.schema.sasl_handshake.v1 import SaslHandshakeRequest

from compat_kafka.security import sasl
from streams.tools.localcluster import LocalCluster

from .shimproc import RawConnection, ShimProcess

REAUTH_MS = 1500


@pytest.fixture(scope="module")
def scram_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("scram-admin-cluster"), bookies=3)
    c.start()
    for user in ("admin", "alice"):
        r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", "add", user, "--password",
                            f"{user}-pw", "--metadata", c.metadata_url], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    yield c
    c.stop()


def _conf(user: str, password: str | None = None, mech: str = "SCRAM-SHA-256") -> dict:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mech, "sasl.username": user,
            "sasl.password": password or f"{user}-pw"}


def _produce(bootstrap: str, conf: dict, topic: str, n: int, timeout_s: float = 20.0) -> tuple[list, list]:
    errors: list = []
    client_errors: list = []
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": int(timeout_s * 1000),
                  "error_cb": lambda e: client_errors.append(e), **conf})
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, on_delivery=lambda err, _m: errors.append(err) if err else None)
    deadline = time.monotonic() + timeout_s + 10
    while len(p) and time.monotonic() < deadline and not (client_errors and errors):
        p.poll(0.1)
    p.purge()
    p.flush(5)
    return errors, client_errors


def test_scram_credentials_through_the_admin_apis(scram_cluster, tmp_path):
    shim = ShimProcess(scram_cluster.metadata_url, tmp_path, "--sasl-mechanisms", "SCRAM-SHA-256,SCRAM-SHA-512",
                       "--acls", "--super-users", "User:admin")
    shim.start_and_wait()
    try:
        admin = AdminClient({"bootstrap.servers": shim.bootstrap, **_conf("admin")})
        # a new user, carol, with a SCRAM-SHA-512 credential of 8192 iterations
        up = UserScramCredentialUpsertion("carol", ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
                                          b"carol-pw")
        for f in admin.alter_user_scram_credentials([up], request_timeout=30).values():
            assert f.result(30) is None
        described = admin.describe_user_scram_credentials(request_timeout=30).result(30)
        assert set(described) == {"admin", "alice", "carol"}
        assert [(i.mechanism, i.iterations) for i in described["carol"].scram_credential_infos] == [
            (ScramMechanism.SCRAM_SHA_512, 8192)]
        # carol logs in with it (super user writes, carol is refused by the ACLs but authenticated)
        errors, client_errors = _produce(shim.bootstrap, _conf("carol", mech="SCRAM-SHA-512"), "scram-t", 1)
        assert [e.code() for e in errors] == [KafkaError.TOPIC_AUTHORIZATION_FAILED], (errors, client_errors)
        assert "SCRAM-SHA-512: carol authenticated" in shim.log_text()
        # a wrong password is still refused
        _errors, client_errors = _produce(shim.bootstrap, _conf("carol", "nope", mech="SCRAM-SHA-512"), "scram-t", 1,
                                          timeout_s=5)
        assert any("Authentication failed" in str(e) for e in client_errors), client_errors
        # describing one unknown user: RESOURCE_NOT_FOUND
        futs = admin.describe_user_scram_credentials(["nobody"], request_timeout=30)
        with pytest.raises(KafkaException) as exc:
            futs["nobody"].result(30)
        assert exc.value.args[0].code() == KafkaError.RESOURCE_NOT_FOUND
        # too few iterations: UNACCEPTABLE_CREDENTIAL; a non-admin: CLUSTER_AUTHORIZATION_FAILED
        bad = UserScramCredentialUpsertion("dave", ScramCredentialInfo(ScramMechanism.SCRAM_SHA_256, 100), b"pw")
        with pytest.raises(KafkaException) as exc:
            admin.alter_user_scram_credentials([bad], request_timeout=30)["dave"].result(30)
        assert exc.value.args[0].code() == KafkaError.UNACCEPTABLE_CREDENTIAL
        alice_admin = AdminClient({"bootstrap.servers": shim.bootstrap, **_conf("alice")})
        with pytest.raises(KafkaException) as exc:
            alice_admin.alter_user_scram_credentials([up], request_timeout=30)["carol"].result(30)
        assert exc.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED
        # deleted: carol can no longer log in
        dele = UserScramCredentialDeletion("carol", ScramMechanism.SCRAM_SHA_512)
        for f in admin.alter_user_scram_credentials([dele], request_timeout=30).values():
            assert f.result(30) is None
        assert "carol" not in admin.describe_user_scram_credentials(request_timeout=30).result(30)
        _errors, client_errors = _produce(shim.bootstrap, _conf("carol", mech="SCRAM-SHA-512"), "scram-t", 1,
                                          timeout_s=5)
        assert any("Authentication failed" in str(e) for e in client_errors), client_errors
    finally:
        shim.stop()


def test_a_credential_from_a_salted_password_checks_as_one_from_the_password():
    made = sasl.make_credential("SCRAM-SHA-256", "pw", 4096, b"0123456789abcdef")
    import hashlib

    salted = hashlib.pbkdf2_hmac("sha256", b"pw", b"0123456789abcdef", 4096)
    assert sasl.credential_from_salted("SCRAM-SHA-256", salted, b"0123456789abcdef", 4096) == made


# ---------------------------------------------------------------- KIP-368 re-authentication
@pytest.fixture(scope="module")
def reauth_shim(scram_cluster, tmp_path_factory):
    shim = ShimProcess(scram_cluster.metadata_url, tmp_path_factory.mktemp("reauth"), "--sasl-mechanisms",
                       "PLAIN,SCRAM-SHA-256", "--connections-max-reauth-ms", str(REAUTH_MS))
    shim.start_and_wait()
    yield shim
    shim.stop()


MD = MetadataRequest(topics=None, allow_auto_topic_creation=False, include_topic_authorized_operations=False)


def _login(c: RawConnection, user: str = "alice", password: str = "alice-pw"):
    assert c.call(SaslHandshakeRequest(mechanism="PLAIN")).error_code == ErrorCode.none
    return c.call(SaslAuthenticateRequest(auth_bytes=f"\0{user}\0{password}".encode()))


def test_a_session_not_renewed_ends_and_a_renewed_one_goes_on(reauth_shim):
    with RawConnection(reauth_shim.port) as c:
        started = time.monotonic()
        r = _login(c)
        assert r.error_code == ErrorCode.none and r.session_lifetime.total_seconds() * 1000 == REAUTH_MS
        closed_at = None
        deadline = started + 20
        while time.monotonic() < deadline:  # requests are served until the session ends, then closed
            try:
                assert c.call(MD).brokers
            except ConnectionError:
                closed_at = time.monotonic()
                break
            time.sleep(0.05)
        assert closed_at is not None and closed_at - started >= REAUTH_MS / 1000
    with RawConnection(reauth_shim.port) as c:  # re-authenticating before the end keeps the connection
        _login(c)
        renewals = 0
        end = time.monotonic() + 3 * REAUTH_MS / 1000
        while time.monotonic() < end:
            r = _login(c)
            assert r.error_code == ErrorCode.none and r.session_lifetime.total_seconds() > 0
            renewals += 1
            assert c.call(MD).brokers
            time.sleep(0.05)
        assert renewals > 3
        # re-authenticating as somebody else is refused, and closes the connection
        r = _login(c, "admin", "admin-pw")
        assert r.error_code == ErrorCode.sasl_authentication_failed and "principal" in r.error_message
        with pytest.raises(ConnectionError):
            c.call(MD)


def test_librdkafka_reauthenticates_while_producing(reauth_shim):
    seen = len(reauth_shim.log_text())  # the log from here on (the shim is shared with the raw test)

    def log() -> str:
        return reauth_shim.log_text()[seen:]

    errors: list = []
    client_errors: list = []
    p = Producer({"bootstrap.servers": reauth_shim.bootstrap, "acks": "all", "linger.ms": 5,
                  "error_cb": lambda e: client_errors.append(e), **_conf("alice")})
    sent = 0
    deadline = time.monotonic() + 30
    while log().count("alice re-authenticated") < 2 and time.monotonic() < deadline:
        p.produce("reauth-t", value=b"v%d" % sent, on_delivery=lambda err, _m: errors.append(err) if err else None)
        sent += 1
        p.poll(0.05)
    assert p.flush(30) == 0
    assert log().count("alice re-authenticated") >= 2
    assert errors == [] and not any("Disconnected" in str(e) for e in client_errors), (errors, client_errors)
    assert "expired" not in log()
