"""A real ``scroll bookie --tls-cert ... --tls-key ...`` process gets its certificate rotated under a
connected client: the files are replaced with a second certificate (same CA, another serial and
CN) and the bookie gets SIGHUP. New connections to both ports (gRPC and data) are then shown the
new certificate, while the client connected before carries on on its existing data connection
(whose TLS session still holds the old certificate). Files that cannot be used (a key that does
not match, a missing key) and SIGHUP leave the certificate in use, logged at ERROR, and the bookie
keeps serving; fixed files and SIGHUP are taken again."""

from __future__ import annotations

import asyncio
import signal
import ssl

import pytest
from cryptography import x509

from bookie.client import BookieClient
from fragments.security import ClientSecurity
from terms.messages import AddOk, AddRequest, FenceOk
from tests.certrotation import RotationPki, served_serial, wait_for

from .helpers import BookieProcess

pytestmark = pytest.mark.process

LEDGER = 11


def _data_peer_serial(client: BookieClient) -> int:
    ssl_object: ssl.SSLObject = client._conn.transport.get_extra_info("ssl_object")
    return x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True)).serial_number


def test_sighup_rotates_the_certificate_under_a_connected_client(tmp_path) -> None:
    (tmp_path / "pki").mkdir()
    pki = RotationPki.make(tmp_path / "pki", "bookie")
    one, two = pki.serials["one"], pki.serials["two"]
    bp = BookieProcess(tmp_path / "data", extra=["--tls-cert", pki.cert, "--tls-key", pki.key])
    bp.start()
    ctx = pki.client_context()
    security = ClientSecurity(tls_ca=pki.ca_file)

    def served() -> tuple[int, int]:
        return served_serial(bp.port, ctx), served_serial(bp.data_port, ctx)

    def errors_logged() -> int:
        return sum("certificate reload failed" in line for line in bp.stderr_lines)

    async def scenario() -> None:
        async with BookieClient(bp.address, security=security) as c:
            assert isinstance(await c.fence(LEDGER, 1), FenceOk)
            assert isinstance(await c.add(AddRequest(LEDGER, 0, 1, -1, -1, b"e0", truncate=True)), AddOk)
            conn = c._conn
            assert _data_peer_serial(c) == one
            assert await asyncio.to_thread(served) == (one, one)

            # rotate: new files, SIGHUP; wait until new connections see the new certificate on both ports
            pki.serve("two")
            bp.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_for, "the new certificate on both ports", lambda: served() == (two, two))

            # the client connected before carries on, on the same data connection (old session)
            res = await c.submit([AddRequest(LEDGER, i, 1, 0, 0, b"e%d" % i) for i in range(1, 4)])
            assert res.all_ok
            assert c._conn is conn and not conn.dead and _data_peer_serial(c) == one
            assert [e.data for e in (await c.read(LEDGER, 0, 3)).entries] == [b"e0", b"e1", b"e2", b"e3"]
            assert (await c.info()).ledgers >= 1  # gRPC, on the channel opened before

            # a new client connects (and verifies the new certificate against the same CA)
            async with BookieClient(bp.address, security=security) as fresh:
                assert [e.data for e in (await fresh.read(LEDGER, 0, 3)).entries] == [b"e0", b"e1", b"e2", b"e3"]
                assert _data_peer_serial(fresh) == two

            # a key that does not match the certificate: logged, the certificate in use stays
            pki.put("server.key", (pki.dir / "one.key").read_bytes())
            bp.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_for, "the failed reload in the log", lambda: errors_logged() >= 1)
            assert await asyncio.to_thread(served) == (two, two)
            # the key file gone: the same
            (pki.dir / "server.key").unlink()
            bp.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_for, "the second failed reload in the log", lambda: errors_logged() >= 2)
            assert await asyncio.to_thread(served) == (two, two)
            res = await c.submit([AddRequest(LEDGER, 4, 1, 0, 0, b"e4")])
            assert res.all_ok
            async with BookieClient(bp.address, security=security) as fresh:
                assert len((await fresh.read(LEDGER, 0, 4)).entries) == 5
                assert (await fresh.info()).ledgers >= 1

            # fixed files are taken on the next SIGHUP
            pki.serve("one")
            bp.proc.send_signal(signal.SIGHUP)
            await asyncio.to_thread(wait_for, "the first certificate again", lambda: served() == (one, one))

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        failures = [line for line in bp.stderr_lines if "certificate reload failed" in line]
        assert "mismatch" in failures[0].lower() and "no such file" in failures[1].lower(), failures
        assert bp.proc.poll() is None
    finally:
        bp.kill()
