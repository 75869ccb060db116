"""``scroll standalone`` forwards SIGHUP (reload the TLS certificates) to the bookies and the Kafka
listener that are running, not to etcd (it reads its certificate files at every handshake) nor to
a child that is down; under ``--secure`` it first issues again the certificates about to expire."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from streams.tools.pki import LocalPki
from streams.tools.standalone import Standalone, StandaloneConfig


@dataclass
class FakeProc:
    name: str
    alive: bool = True
    got: list = field(default_factory=list)

    def signal(self, sig: int) -> None:
        self.got.append(sig)


def test_sighup_is_forwarded_to_the_running_bookies_and_the_kafka_listener(tmp_path) -> None:
    sa = Standalone(StandaloneConfig(data_dir=tmp_path, object_store=False))
    bookies = [FakeProc("bookie-0"), FakeProc("bookie-1", alive=False), FakeProc("bookie-2")]
    sa.cluster.bookies, sa.kafka, sa.cluster.etcd = bookies, FakeProc("kafka"), FakeProc("etcd")
    assert sa.reload_certificates() == ["bookie-0", "bookie-2", "kafka"]
    assert [b.got for b in bookies] == [[signal.SIGHUP], [], [signal.SIGHUP]]
    assert sa.kafka.got == [signal.SIGHUP] and sa.cluster.etcd.got == []


def test_secure_sighup_renews_a_missing_server_certificate_first(tmp_path) -> None:
    sa = Standalone(StandaloneConfig(data_dir=tmp_path, object_store=False, secure=True))
    pki: LocalPki = sa.secure.pki
    before = pki.server_cert.read_bytes()
    pki.server_cert.unlink()  # as if it had expired: ensure() issues it again, from the same CA
    sa.kafka = FakeProc("kafka")
    assert sa.reload_certificates() == ["kafka"]
    assert pki.server_cert.read_bytes() != before and pki.server_cert.read_bytes().startswith(b"-----BEGIN CERTIFICATE")
