"""Helpers for the certificate rotation tests (``kill -HUP`` a listener after replacing its files):
a test CA with two server certificates, replacing the served files atomically, and reading the
certificate a TLS port presents to a new connection."""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509


@dataclass
class RotationPki:
    """``ca.pem``; server certificates ``one`` and ``two`` (same CA, CNs ``<name>-one``/``-two``),
    each as ``<n>.pem``/``<n>.key``; the served files ``server.pem``/``server.key`` start as ``one``."""

    dir: Path
    ca: trustme.CA
    serials: dict[str, int]

    @classmethod
    def make(cls, d: Path, name: str) -> RotationPki:
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(d / "ca.pem"))
        serials = {}
        for which in ("one", "two"):
            leaf = ca.issue_cert("127.0.0.1", "localhost", common_name=f"{name}-{which}")
            leaf.private_key_pem.write_to_path(str(d / f"{which}.key"))
            (d / f"{which}.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems))
            serials[which] = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes()).serial_number
        pki = cls(d, ca, serials)
        pki.serve("one")
        return pki

    @property
    def cert(self) -> str:
        return str(self.dir / "server.pem")

    @property
    def key(self) -> str:
        return str(self.dir / "server.key")

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    def serve(self, which: str) -> None:
        """Make ``which`` the served certificate and key (each file replaced atomically)."""
        self.put("server.pem", (self.dir / f"{which}.pem").read_bytes())
        self.put("server.key", (self.dir / f"{which}.key").read_bytes())

    def put(self, name: str, data: bytes) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / name)

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        return ctx


def served_serial(port: int, ctx: ssl.SSLContext, timeout_s: float = 10.0) -> int:
    """The serial number of the certificate a new TLS connection to 127.0.0.1:``port`` is shown."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
