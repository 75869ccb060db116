"""The Kafka listener over TLS (Kafka's SSL security protocol), as a real process with certificates
from files (a test CA made with trustme): confluent-kafka produces and consumes over SSL; a
plaintext client, a client that does not trust the listener's CA, and (with mutual TLS) a client
without a certificate are each refused and write nothing."""

from __future__ import annotations

import time

import pytest
import trustme
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition  # noqa: E402

from streams.tools.localcluster import LocalCluster  # noqa: E402

from .shimproc import ShimProcess  # noqa: E402

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("tls-cluster"), bookies=3)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@scroll.test")
    other_ca = trustme.CA()
    stranger = other_ca.issue_cert("stranger@scroll.test")  # a client certificate from a CA nobody trusts
    stranger.private_key_pem.write_to_path(str(d / "stranger.key"))
    stranger.cert_chain_pems[0].write_to_path(str(d / "stranger.pem"))
    _expired_client_cert(ca, d)
    files = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key", "other_ca": d / "other-ca.pem",
             "client_cert": d / "client.pem", "client_key": d / "client.key",
             "stranger_cert": d / "stranger.pem", "stranger_key": d / "stranger.key",
             "expired_cert": d / "expired.pem", "expired_key": d / "expired.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other_ca.cert_pem.write_to_path(str(files["other_ca"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    with open(files["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client.private_key_pem.write_to_path(str(files["client_key"]))
    with open(files["client_cert"], "wb") as f:
        for blob in client.cert_chain_pems:
            f.write(blob.bytes())
    return {k: str(v) for k, v in files.items()}


def _expired_client_cert(ca: trustme.CA, d) -> None:
    """expired.pem/.key: a client certificate signed by ``ca`` whose validity ended yesterday."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    ca_key = serialization.load_pem_private_key(ca.private_key_pem.bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.bytes())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired-client")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=30)).not_valid_after(now - datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / "expired.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "expired.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))


def _ssl(pki, ca: str = "ca", client_cert: bool | str = False) -> dict:
    conf = {"security.protocol": "SSL", "ssl.ca.location": pki[ca]}
    if client_cert:
        who = "client" if client_cert is True else client_cert
        conf.update({"ssl.certificate.location": pki[f"{who}_cert"], "ssl.key.location": pki[f"{who}_key"]})
    return conf


def _produce(bootstrap: str, topic: str, n: int, conf: dict, timeout_s: float = 30.0) -> list:
    """Produce ``n`` records; the delivery errors (empty: all acknowledged)."""
    errors: list = []
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "message.timeout.ms": int(timeout_s * 1000), **conf})
    for i in range(n):
        p.produce(topic, value=b"v%d" % i, on_delivery=lambda err, _m: errors.append(err) if err else None)
    p.flush(timeout_s + 10)
    return errors


def _read_all(bootstrap: str, topic: str, conf: dict, want: int) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topic}-{time.monotonic()}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False, **conf})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < want and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())
        return got
    finally:
        c.close()


def _end_offset(bootstrap: str, topic: str, conf: dict) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks", **conf})
    try:
        return c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)[1]
    finally:
        c.close()


def test_ssl_listener_serves_ssl_clients_and_refuses_the_rest(tls_cluster, pki, tmp_path):
    shim = ShimProcess(tls_cluster.metadata_url, tmp_path, "--ssl-cert", pki["cert"], "--ssl-key", pki["key"])
    shim.start_and_wait()
    try:
        assert _produce(shim.bootstrap, "secure", 10, _ssl(pki)) == []
        assert _read_all(shim.bootstrap, "secure", _ssl(pki), 10) == [b"v%d" % i for i in range(10)]
        # a plaintext client: its requests never reach the listener (the TLS handshake fails)
        errors = _produce(shim.bootstrap, "secure", 3, {}, timeout_s=4)
        assert len(errors) == 3
        # a client that does not trust the listener's CA gives up in the handshake
        errors = _produce(shim.bootstrap, "secure", 3, _ssl(pki, ca="other_ca"), timeout_s=4)
        assert len(errors) == 3
        with pytest.raises(KafkaException):
            Consumer({"bootstrap.servers": shim.bootstrap, "group.id": "x", **_ssl(pki, ca="other_ca")}
                     ).list_topics(timeout=4)
        # nothing was written by the refused clients
        assert _end_offset(shim.bootstrap, "secure", _ssl(pki)) == 10
    finally:
        shim.stop()


def test_mutual_tls_refuses_a_client_without_a_trusted_valid_certificate(tls_cluster, pki, tmp_path):
    shim = ShimProcess(tls_cluster.metadata_url, tmp_path, "--ssl-cert", pki["cert"], "--ssl-key", pki["key"],
                       "--ssl-client-ca", pki["ca"], "--ssl-client-auth", "required")
    shim.start_and_wait()
    try:
        errors = _produce(shim.bootstrap, "mtls", 3, _ssl(pki), timeout_s=4)  # no client certificate
        assert len(errors) == 3
        for who in ("stranger", "expired"):  # untrusted, or trusted but expired: refused in the handshake
            assert len(_produce(shim.bootstrap, "mtls", 2, _ssl(pki, client_cert=who), timeout_s=4)) == 2
        assert _produce(shim.bootstrap, "mtls", 5, _ssl(pki, client_cert=True)) == []
        assert _read_all(shim.bootstrap, "mtls", _ssl(pki, client_cert=True), 5) == [b"v%d" % i for i in range(5)]
        assert _end_offset(shim.bootstrap, "mtls", _ssl(pki, client_cert=True)) == 5
    finally:
        shim.stop()


def test_bad_tls_options_are_refused_at_start(tls_cluster, pki, tmp_path):
    for args, says in ((("--ssl-cert", pki["cert"]), "go together"),
                       (("--ssl-cert", pki["cert"], "--ssl-key", str(tmp_path / "missing.key")), "cannot load"),
                       (("--ssl-client-auth", "required"), "need --ssl-cert")):
        shim = ShimProcess(tls_cluster.metadata_url, tmp_path, *args)
        shim.start()
        try:
            deadline = time.monotonic() + 30
            while shim.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not shim.alive
            assert says in shim.log_text()
        finally:
            shim.stop()
