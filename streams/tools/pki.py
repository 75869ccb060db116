"""A local certificate authority for ``scroll standalone --secure`` (and anyone who wants one).

How this works. ``LocalPki(directory).ensure()`` makes, once, a CA (``ca.pem``/``ca.key``) and
with it a server certificate (``server.pem``/``server.key``, valid for 127.0.0.1, ::1, localhost
and this host's name) that every listener of the standalone platform presents (etcd, bookies, the
Kafka listener), and a client certificate (``client.pem``/``client.key``, CN ``scroll-client``)
the platform's own processes present where mutual TLS is asked for. Keys are written 0600 and the
directory is 0700. A later start reuses the files while they are valid for more than
``RENEW_BEFORE``; an expiring or missing leaf is issued again from the same CA (so clients that
trust ``ca.pem`` keep working); an expiring CA starts everything anew. Built on ``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_BEFORE = dt.timedelta(days=30)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_key(path: Path, key) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _valid(path: Path) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    return cert.not_valid_after_utc - _now() > RENEW_BEFORE


@dataclass(frozen=True)
class LocalPki:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.directory / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.directory / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.directory / "client.key"

    def ensure(self) -> LocalPki:
        """Create what is missing or about to expire; returns self."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        if not (_valid(self.ca) and self.ca_key.is_file()):
            self._make_ca()
            for p in (self.server_cert, self.client_cert):
                p.unlink(missing_ok=True)
        ca_cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), None)
        if not (_valid(self.server_cert) and self.server_key.is_file()):
            names = ["localhost", socket.gethostname()]
            ips = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
            self._issue(ca_cert, ca_key, self.server_cert, self.server_key, "scroll-server", names, ips,
                        ExtendedKeyUsageOID.SERVER_AUTH)
        if not (_valid(self.client_cert) and self.client_key.is_file()):
            self._issue(ca_cert, ca_key, self.client_cert, self.client_key, "scroll-client", [], [],
                        ExtendedKeyUsageOID.CLIENT_AUTH)
        return self

    def _make_ca(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Scroll standalone"),
                          x509.NameAttribute(NameOID.COMMON_NAME, "Scroll local CA")])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=CA_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        _write_key(self.ca_key, key)
        self.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _issue(ca_cert, ca_key, cert_path: Path, key_path: Path, cn: str, names: list[str], ips: list,
               usage) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Scroll standalone"),
                                      x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
        if names or ips:
            b = b.add_extension(x509.SubjectAlternativeName([*(x509.DNSName(n) for n in dict.fromkeys(names)),
                                                             *(x509.IPAddress(i) for i in ips)]), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        _write_key(key_path, key)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
