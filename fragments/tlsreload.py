"""Server certificates that can be replaced while a listener runs (``kill -HUP``).

How this works. A listener's certificate, key and client CA are files. ``ReloadableServerContext``
wraps an ``ssl.SSLContext`` built from them: the listener is given ``.context`` once, at bind time,
and every TLS handshake on it passes through that context's SNI callback (OpenSSL runs it even
when the client sends no server name, as clients connecting to an IP address do), which switches
the handshake over to the newest context (``SSLObject.context = ...``). ``reload()`` builds a
whole new context from the files and, only if that succeeds, makes it the newest one: new
handshakes present the new certificate (and check client certificates against the new CA);
connections already made keep the session they negotiated. A file that is missing, unreadable,
not PEM, or a key that does not match the certificate fails the build; ``reload()`` logs why at
ERROR and the certificate in use stays in use.

``GrpcServerCertificates`` does the same for a gRPC server: gRPC fixes ``ssl_server_credentials``
at start, so the server is given ``grpc.dynamic_ssl_server_credentials`` whose fetcher gRPC calls
before each handshake; it hands gRPC a new certificate configuration once after each successful
``reload()`` (and None, "no change", otherwise). gRPC does not check the key against the
certificate before a handshake needs them, so ``reload()`` checks that here (``cryptography``).
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class CertificateReloadError(ValueError):
    """The new certificate files cannot be used (the ones in use stay)."""


def describe_certificate(pem: bytes) -> str:
    """``subject=... serial=... not_after=...`` of the first certificate of a PEM chain (for logs)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertificateReloadError(f"not a PEM certificate: {exc}") from None
    return (f"subject={cert.subject.rfc4514_string()} serial={cert.serial_number:x} "
            f"not_after={cert.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}")


def check_pem_pair(key_pem: bytes, chain_pem: bytes, ca_pem: bytes | None = None) -> str:
    """Check that ``chain_pem`` is a PEM certificate chain whose first certificate matches the
    private key ``key_pem`` (and that ``ca_pem``, if any, holds certificates); its description."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    desc = describe_certificate(chain_pem)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateReloadError(f"the private key cannot be read: {exc}") from None
    cert = x509.load_pem_x509_certificate(chain_pem)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise CertificateReloadError("the private key does not match the certificate")
    if ca_pem is not None:
        try:
            x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise CertificateReloadError(f"the client CA bundle cannot be read: {exc}") from None
    return desc


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise CertificateReloadError(f"cannot read the {what} {path}: {exc.strerror}") from None


def read_pem_files(cert: str | Path, key: str | Path, ca: str | Path | None = None) -> tuple[bytes, bytes, bytes | None, str]:
    """(key, chain, CA or None, description), checked by ``check_pem_pair``."""
    chain_pem, key_pem = _read(cert, "certificate"), _read(key, "private key")
    ca_pem = _read(ca, "client CA") if ca is not None else None
    return key_pem, chain_pem, ca_pem, check_pem_pair(key_pem, chain_pem, ca_pem)


class ReloadableServerContext:
    """An ``ssl.SSLContext`` for an asyncio listener whose certificate ``reload()`` replaces for new
    handshakes. ``build`` makes a complete server context from the files (raising on any problem);
    ``cert_file`` is read to say in the log which certificate is now in use; ``name`` names the
    listener in the log."""

    def __init__(self, build: Callable[[], ssl.SSLContext], name: str, cert_file: str | Path | None = None) -> None:
        self._build = build
        self.cert_file = cert_file
        self.name = name
        self.context = build()  # the listener's; its SNI callback moves each handshake to ``current``
        self.current = self.context
        self.context.sni_callback = self._switch

    def _switch(self, ssl_object: ssl.SSLObject, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        current = self.current
        if current is not self.context:
            try:
                ssl_object.context = current
            except Exception:  # noqa: BLE001 - never fail a handshake over this: the listener's stays
                log.exception("%s: cannot switch a TLS handshake to the reloaded certificate", self.name)
        return None

    def prepare(self) -> tuple[ssl.SSLContext, str]:
        """A new context from the files and a description of its certificate (raises on any problem)."""
        desc = describe_certificate(_read(self.cert_file, "certificate")) if self.cert_file is not None else ""
        return self._build(), desc

    def commit(self, ctx: ssl.SSLContext) -> None:
        self.current = ctx

    def reload(self) -> bool:
        """Build a new context from the files; use it for new handshakes if that worked. Whether it did."""
        try:
            ctx, desc = self.prepare()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the certificate in use
            log.error("%s: certificate reload failed, keeping the certificate in use: %s", self.name, exc)
            return False
        self.commit(ctx)
        log.info("%s: certificate reloaded; new TLS handshakes present %s", self.name, desc)
        return True


class GrpcServerCertificates:
    """Server credentials for ``grpc.aio.Server.add_secure_port`` whose certificate ``reload()``
    replaces for new handshakes (``.credentials`` go to ``add_secure_port``)."""

    def __init__(self, cert: str, key: str, client_ca: str | None, require_client_auth: bool, name: str) -> None:
        import grpc

        self._grpc = grpc
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.name = name
        key_pem, chain_pem, ca_pem, _desc = read_pem_files(cert, key, client_ca)
        initial = grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)], root_certificates=ca_pem)
        self._lock = threading.Lock()
        self._pending = None  # a configuration gRPC has not fetched yet
        self.credentials = grpc.dynamic_ssl_server_credentials(initial, self._fetch,
                                                               require_client_authentication=require_client_auth)

    def _fetch(self):
        """Called by gRPC (on one of its threads) before each handshake: a new configuration, or None."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def prepare(self) -> tuple[object, str]:
        """A new configuration from the files and its description (raises ``CertificateReloadError``)."""
        key_pem, chain_pem, ca_pem, desc = read_pem_files(self.cert, self.key, self.client_ca)
        return self._grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)], root_certificates=ca_pem), desc

    def commit(self, config) -> None:
        with self._lock:
            self._pending = config

    def reload(self) -> bool:
        try:
            config, desc = self.prepare()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the certificate in use
            log.error("%s: certificate reload failed, keeping the certificate in use: %s", self.name, exc)
            return False
        self.commit(config)
        log.info("%s: certificate reloaded; new TLS handshakes present %s", self.name, desc)
        return True
