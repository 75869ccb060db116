"""A real ``scroll kafka --ssl-cert ... --ssl-key ...`` listener gets its certificate rotated under
connected clients: the files are replaced with a second certificate (same CA, another serial and
CN) and the listener gets SIGHUP. New connections are then shown the new certificate; a raw TLS
connection opened before keeps its session (old certificate) and is still answered, and a
confluent-kafka producer connected before keeps producing. A certificate file that cannot be
used and SIGHUP leave the certificate in use (logged) and the listener keeps serving."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from cryptography import x509
from kio.schema.api_versions.v0 import ApiVersionsRequest

from streams.tools.localcluster import LocalCluster
from tests.certrotation import RotationPki, served_serial, wait_for

from .shimproc import RawConnection, ShimProcess

pytestmark = pytest.mark.process


class TlsRawConnection(RawConnection):
    def __init__(self, port: int, ctx, timeout_s: float = 15.0):
        self.sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=timeout_s),
                                    server_hostname="127.0.0.1")
        self._corr = 0

    def peer_serial(self) -> int:
        return x509.load_der_x509_certificate(self.sock.getpeercert(binary_form=True)).serial_number


def _produce(p: Producer, topic: str, values: list[bytes]) -> None:
    errors: list = []
    for v in values:
        p.produce(topic, value=v, on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert p.flush(40) == 0 and errors == []


def _read_all(bootstrap: str, topic: str, conf: dict, want: int) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{time.monotonic()}", "enable.auto.commit": False,
                  **conf})
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


def test_sighup_rotates_the_listener_certificate_under_connected_clients(tmp_path) -> None:
    (tmp_path / "pki").mkdir()
    pki = RotationPki.make(tmp_path / "pki", "kafka")
    one, two = pki.serials["one"], pki.serials["two"]
    cluster = LocalCluster(tmp_path / "cluster", bookies=3)
    cluster.start()
    shim = ShimProcess(cluster.metadata_url, tmp_path, "--ssl-cert", pki.cert, "--ssl-key", pki.key)
    producer = None
    try:
        shim.start_and_wait()
        ctx = pki.client_context()
        conf = {"security.protocol": "SSL", "ssl.ca.location": pki.ca_file}
        producer = Producer({"bootstrap.servers": shim.bootstrap, "acks": "all", "message.timeout.ms": 40000, **conf})
        _produce(producer, "rotate", [b"a0", b"a1"])
        raw = TlsRawConnection(shim.port, ctx)
        assert raw.call(ApiVersionsRequest()).error_code == 0 and raw.peer_serial() == one
        assert served_serial(shim.port, ctx) == one

        pki.serve("two")
        shim.signal(signal.SIGHUP)
        wait_for("the new certificate", lambda: served_serial(shim.port, ctx) == two)

        # connected before: still answered, on the session made with the old certificate
        assert raw.call(ApiVersionsRequest()).error_code == 0 and raw.peer_serial() == one
        _produce(producer, "rotate", [b"b0", b"b1"])
        # a new client verifies the new certificate (same CA) and reads everything
        assert _read_all(shim.bootstrap, "rotate", conf, 4) == [b"a0", b"a1", b"b0", b"b1"]

        # a certificate file that is not a certificate: logged, the one in use stays
        pki.put("server.pem", b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
        shim.signal(signal.SIGHUP)
        wait_for("the failed reload in the log", lambda: "certificate reload failed" in shim.log_text())
        assert served_serial(shim.port, ctx) == two
        assert raw.call(ApiVersionsRequest()).error_code == 0
        _produce(producer, "rotate", [b"c0"])
        assert _read_all(shim.bootstrap, "rotate", conf, 5) == [b"a0", b"a1", b"b0", b"b1", b"c0"]
        assert shim.alive
        raw.close()
    finally:
        if producer is not None:
            producer.flush(5)
        shim.stop()
        cluster.stop()
