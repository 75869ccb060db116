"""``ReloadableServerContext`` in one process: after ``reload()`` new handshakes get the new
certificate and are checked against the new client CA; a reload whose files cannot be used changes
nothing; ``check_pem_pair`` (what the gRPC side checks) refuses a key of another certificate."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest
import trustme

from fragments.tlsreload import CertificateReloadError, ReloadableServerContext, check_pem_pair


def test_reload_switches_the_client_ca_for_new_handshakes_and_a_failed_build_changes_nothing() -> None:
    server_ca, ca_a, ca_b = trustme.CA(), trustme.CA(), trustme.CA()
    leaf = server_ca.issue_cert("127.0.0.1")
    client_a, client_b = ca_a.issue_cert("a"), ca_b.issue_cert("b")
    trusted = [ca_a]

    def build() -> ssl.SSLContext:
        if trusted[0] is None:
            raise ssl.SSLError("no such file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        leaf.configure_cert(ctx)
        trusted[0].configure_trust(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    reloadable = ReloadableServerContext(build, "test listener")
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with reloadable.context.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (OSError, ssl.SSLError):
                conn.close()

    threading.Thread(target=serve, daemon=True).start()

    def accepted(client) -> bool:
        ctx = ssl.create_default_context()
        server_ca.configure_trust(ctx)
        client.configure_cert(ctx)
        try:
            with ctx.wrap_socket(socket.create_connection(listener.getsockname(), timeout=10),
                                 server_hostname="127.0.0.1") as tls:
                return tls.recv(2) == b"ok"
        except (OSError, ssl.SSLError):
            return False

    try:
        assert (accepted(client_a), accepted(client_b)) == (True, False)
        trusted[0] = ca_b
        assert reloadable.reload()
        assert (accepted(client_a), accepted(client_b)) == (False, True)
        trusted[0] = None
        assert not reloadable.reload()
        assert (accepted(client_a), accepted(client_b)) == (False, True)
    finally:
        listener.close()


def test_check_pem_pair_refuses_a_key_of_another_certificate() -> None:
    ca = trustme.CA()
    one, two = ca.issue_cert("one.test"), ca.issue_cert("two.test")
    chain = one.cert_chain_pems[0].bytes()
    assert "serial=" in check_pem_pair(one.private_key_pem.bytes(), chain, ca.cert_pem.bytes())
    with pytest.raises(CertificateReloadError, match="does not match"):
        check_pem_pair(two.private_key_pem.bytes(), chain)
    with pytest.raises(CertificateReloadError, match="not a PEM certificate"):
        check_pem_pair(one.private_key_pem.bytes(), b"garbage")
