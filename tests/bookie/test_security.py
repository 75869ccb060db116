"""Secured bookies as real processes (``scroll bookie --tls-cert ... --auth-token-file ...``): every
gRPC method (enumerated from the proto, so a new one cannot be forgotten) and every data-plane
request (enumerated from ``wire.DATA_OPS``) is refused without credentials, with a wrong token,
in plaintext against TLS, or with a client certificate that is untrusted or expired; nothing is
written. With the right token or certificate the streams client produces and consumes end to end
over TLS, and ledger passwords are still needed."""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bookie import wire
from bookie.client import BookieClient
from bookie.errors import BookieAuthError, BookieError, CorruptEntryError, NoSuchLedgerError, Status
from bookie.proto import bookie_pb2 as pb
from fragments.security import AUTH_REQUIRED_MESSAGE, INVALID_TOKEN_MESSAGE, BookieSecurity, ClientSecurity
from terms.messages import AddOk, AddRequest, FenceOk

from .helpers import BookieProcess, run

pytestmark = pytest.mark.process

TOKEN = "s3cret-token-for-tests"
LEDGER = 7  # written by an authenticated client before any attack
FRESH = 8  # never written: attacks on it must not create it
SERVICE = pb.DESCRIPTOR.services_by_name["Bookie"]


# ------------------------------------------------------------------------------ certificates


def _expired_cert(ca: trustme.CA, d: Path) -> tuple[str, str]:
    """A client certificate signed by ``ca`` whose validity ended yesterday (trustme cannot)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired-client")]))
        .issuer_name(ca._certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now - datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca._private_key, hashes.SHA256())
    )
    (d / "expired.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "expired.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return str(d / "expired.pem"), str(d / "expired.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = trustme.CA(), trustme.CA()
    paths = {}

    def write(name: str, blob) -> str:
        blob.write_to_path(str(d / name))
        paths[name] = str(d / name)
        return paths[name]

    write("ca.pem", ca.cert_pem)
    server = ca.issue_cert("127.0.0.1", "localhost")
    write("server.pem", server.private_key_and_cert_chain_pem)
    write("server.key", server.private_key_pem)
    client = ca.issue_cert("good-client")
    write("client.pem", client.cert_chain_pems[0])
    write("client.key", client.private_key_pem)
    bad = rogue.issue_cert("rogue-client")
    write("rogue.pem", bad.cert_chain_pems[0])
    write("rogue.key", bad.private_key_pem)
    write("rogue-ca.pem", rogue.cert_pem)
    paths["expired.pem"], paths["expired.key"] = _expired_cert(ca, d)
    tokens = d / "tokens"
    tokens.write_text(f"# bookie tokens\nanother-token\n{TOKEN}\n")
    os.chmod(tokens, 0o600)
    paths["tokens"] = str(tokens)
    return paths


def _start(tmp_path_factory, name: str, extra: list[str]) -> BookieProcess:
    bp = BookieProcess(tmp_path_factory.mktemp(name), extra=extra)
    try:
        bp.start()
    except BaseException:
        bp.kill()
        raise
    return bp


@pytest.fixture(scope="module")
def token_bookie(tmp_path_factory, pki):
    """TLS on both ports; a token required."""
    bp = _start(tmp_path_factory, "token-bookie",
                ["--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--auth-token-file", pki["tokens"]])
    try:
        run(_seed(bp.address, ClientSecurity(tls_ca=pki["ca.pem"], token=TOKEN)))
        yield bp
    finally:
        bp.kill()


@pytest.fixture(scope="module")
def mtls_bookie(tmp_path_factory, pki):
    """TLS on both ports; a client certificate from our CA required."""
    bp = _start(tmp_path_factory, "mtls-bookie",
                ["--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--tls-client-ca", pki["ca.pem"],
                 "--tls-client-auth", "required"])
    try:
        run(_seed(bp.address, ClientSecurity(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])))
        yield bp
    finally:
        bp.kill()


def good(pki, bookie: BookieProcess) -> ClientSecurity:
    if "--tls-client-ca" in bookie.extra:
        return ClientSecurity(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
    return ClientSecurity(tls_ca=pki["ca.pem"], token=TOKEN)


async def _seed(address: str, security: ClientSecurity) -> None:
    async with BookieClient(address, security=security) as c:
        assert isinstance(await c.fence(LEDGER, 1), FenceOk)
        assert isinstance(await c.add(AddRequest(LEDGER, 0, 1, -1, -1, b"noop", truncate=True)), AddOk)
        res = await c.submit([AddRequest(LEDGER, i, 1, 0, 0, b"entry-%d" % i) for i in range(1, 6)])
        assert res.all_ok


async def _snapshot(address: str, security: ClientSecurity):
    """What the bookie holds, as an authenticated client sees it."""
    async with BookieClient(address, security=security) as c:
        r = await c.read(LEDGER, 0, 100)
        lac = await c.read_lac(LEDGER)
        with pytest.raises(NoSuchLedgerError):
            await c.read(FRESH, 0)
        info = await c.info()
        return [(e.entry_id, e.entry_term, e.data) for e in r.entries], r.term, lac.lac, info.ledgers


# ------------------------------------------------------------------------------ gRPC, raw


def _raw_rpc(address: str, security: ClientSecurity, metadata, ledger: int = LEDGER) -> dict[str, tuple[grpc.StatusCode, str]]:
    """Call every method of the Bookie service with a valid request; (code, details) per method."""

    async def go():
        root, key, chain = security.pem()
        out = {}
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root, key, chain)) as ch:
            for m in SERVICE.methods:
                req_cls = getattr(pb, m.input_type.name)
                req = req_cls()
                for field, value in (("ledger_id", ledger), ("term", 99), ("first_entry_id", 0), ("last_entry_id", 5),
                                     ("whole_ledger", True), ("entry_id", 1)):
                    if field in req_cls.DESCRIPTOR.fields_by_name:
                        setattr(req, field, value)
                path = f"/{SERVICE.full_name}/{m.name}"
                ser, de = req_cls.SerializeToString, (lambda b: b)
                try:
                    if m.client_streaming or m.server_streaming:  # none today; refused all the same
                        async for _ in ch.stream_stream(path, request_serializer=ser, response_deserializer=de)(
                                iter([req]), metadata=metadata, timeout=10):
                            pass
                    else:
                        await ch.unary_unary(path, request_serializer=ser, response_deserializer=de)(
                            req, metadata=metadata, timeout=10)
                    out[m.name] = (grpc.StatusCode.OK, "")
                except grpc.aio.AioRpcError as exc:
                    out[m.name] = (exc.code(), exc.details() or "")
        return out

    return run(go())


@pytest.mark.parametrize("metadata, message", [
    (None, AUTH_REQUIRED_MESSAGE),
    ((("authorization", "Bearer wrong-token"),), INVALID_TOKEN_MESSAGE),
    ((("authorization", f"Basic {TOKEN}"),), INVALID_TOKEN_MESSAGE),
    ((("authorization", "Bearer " + TOKEN[:-1]),), INVALID_TOKEN_MESSAGE),
], ids=["no-token", "wrong-token", "not-bearer", "token-prefix"])
def test_every_rpc_without_a_valid_token_is_unauthenticated(token_bookie, pki, metadata, message) -> None:
    before = run(_snapshot(token_bookie.address, good(pki, token_bookie)))
    got = _raw_rpc(token_bookie.address, ClientSecurity(tls_ca=pki["ca.pem"]), metadata)
    assert set(got) == {m.name for m in SERVICE.methods} and {"Fence", "Trim", "Info", "RecoveryRead"} <= set(got)
    for name, (code, details) in got.items():
        assert code == grpc.StatusCode.UNAUTHENTICATED, (name, code, details)
        assert details == message, (name, details)
    assert run(_snapshot(token_bookie.address, good(pki, token_bookie))) == before


def test_every_rpc_with_the_token_passes(token_bookie, pki) -> None:
    got = _raw_rpc(token_bookie.address, ClientSecurity(tls_ca=pki["ca.pem"]), (("authorization", f"Bearer {TOKEN}"),),
                   ledger=30)  # a ledger of its own: these calls fence and delete it
    assert all(code == grpc.StatusCode.OK for code, _ in got.values()), got


# ------------------------------------------------------------------------------ data plane, raw


def _data_requests() -> dict[str, tuple[int, object]]:
    """One valid request per data-plane use, by name: (op, frame of rid)."""
    add = lambda rid: b"".join(wire.add_frame(rid, 1, *_add_parts()))  # noqa: E731
    return {
        "add": (wire.ADD, add),
        "range read": (wire.READ, lambda rid: wire.encode_read(rid, LEDGER, 0, 5, 0, 0, 0)),
        "long-poll read": (wire.READ, lambda rid: wire.encode_read(rid, LEDGER, 6, 10, 0, 0, 2000)),
        "tail read": (wire.READ, lambda rid: wire.encode_read(rid, LEDGER, 0, 10, 0, 0, -1)),
        "LAC read": (wire.READ_LAC, lambda rid: wire.encode_read_lac(rid, LEDGER, -1, 0)),
        "long-poll LAC read": (wire.READ_LAC, lambda rid: wire.encode_read_lac(rid, LEDGER, 100, 2000)),
        "LAC write": (wire.WRITE_LAC, lambda rid: wire.encode_write_lac(rid, LEDGER, 1, 5, 5)),
        "fence": (wire.FENCE, lambda rid: wire.encode_fence(rid, LEDGER, 99)),
        "recovery read": (wire.RECOVERY_READ, lambda rid: wire.encode_recovery_read(rid, LEDGER, 1, 99)),
    }


def _add_parts():
    parts, size = wire.add_entry(FRESH, 0, 1, -1, -1, True, False, 0, b"\0\0\0\0", b"intruder")
    return size, parts


def test_the_data_requests_cover_every_data_op() -> None:
    assert {op for op, _ in _data_requests().values()} == set(wire.DATA_OPS)
    assert set(wire.OPS) == set(wire.DATA_OPS) | {wire.AUTH}


def _data_exchange(port: int, payload: bytes, context: ssl.SSLContext | None) -> tuple[list, bool]:
    """Send raw bytes to the data port; (answer frames, whether the bookie closed the connection)."""
    reader = wire.FrameReader()
    frames: list = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        s = context.wrap_socket(raw, server_hostname="127.0.0.1") if context is not None else raw
        try:
            s.sendall(payload)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return frames, True
                frames.extend(reader.feed(chunk))
        except (ConnectionError, ssl.SSLError):
            return frames, True
        except TimeoutError:
            return frames, False


def _refusal(frames: list) -> tuple[int, int, str]:
    assert len(frames) == 1, frames
    op, rid, body = frames[0]
    assert op == wire.ERROR
    status, message = wire.decode_error(body)
    return rid, status, message


@pytest.mark.parametrize("name", list(_data_requests()))
def test_every_data_request_without_a_token_is_refused_and_closed(token_bookie, pki, name) -> None:
    before = run(_snapshot(token_bookie.address, good(pki, token_bookie)))
    ctx = ClientSecurity(tls_ca=pki["ca.pem"]).ssl_context()
    _op, frame_of = _data_requests()[name]
    # nothing but the request
    frames, closed = _data_exchange(token_bookie.data_port, frame_of(11), ctx)
    assert closed and _refusal(frames) == (11, Status.UNAUTHENTICATED, AUTH_REQUIRED_MESSAGE)
    # a wrong token first: refused on the AUTH frame, the request never handled
    frames, closed = _data_exchange(token_bookie.data_port, wire.encode_auth(1, "wrong") + frame_of(12), ctx)
    assert closed and _refusal(frames) == (1, Status.UNAUTHENTICATED, INVALID_TOKEN_MESSAGE)
    # plaintext against the TLS port: the handshake fails, nothing is answered
    frames, closed = _data_exchange(token_bookie.data_port, wire.encode_auth(1, TOKEN) + frame_of(13), None)
    assert closed and frames == []
    assert run(_snapshot(token_bookie.address, good(pki, token_bookie))) == before


def test_a_large_frame_before_authentication_is_refused_unread(token_bookie, pki) -> None:
    ctx = ClientSecurity(tls_ca=pki["ca.pem"]).ssl_context()
    head = wire.frame_head(wire.AUTH, 3, 1 << 20)  # claims 1 MiB: refused on the header alone
    frames, closed = _data_exchange(token_bookie.data_port, head + b"x" * 1000, ctx)
    assert closed and _refusal(frames) == (0, Status.UNAUTHENTICATED, AUTH_REQUIRED_MESSAGE)


def test_the_right_token_opens_the_data_plane(token_bookie, pki) -> None:
    ctx = ClientSecurity(tls_ca=pki["ca.pem"]).ssl_context()
    payload = wire.encode_auth(1, TOKEN) + wire.encode_read_lac(2, LEDGER, -1, 0)
    reader = wire.FrameReader()
    frames: list = []
    with socket.create_connection(("127.0.0.1", token_bookie.data_port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(payload)
            while len(frames) < 2:
                frames.extend(reader.feed(s.recv(65536)))
    assert [(op, rid) for op, rid, _ in frames] == [(wire.AUTH | wire.ANSWER, 1), (wire.READ_LAC | wire.ANSWER, 2)]
    assert wire.decode_read_lac_answer(frames[1][2])[0] == Status.OK


# ------------------------------------------------------------------------------ through the client


async def _try_everything(address: str, security: ClientSecurity) -> dict[str, object]:
    """Every operation of the bookie client; what each gave (an exception or a result)."""
    out: dict[str, object] = {}
    async with BookieClient(address, security=security, call_timeout_s=5, add_timeout_s=5) as c:
        ops = {
            "info": lambda: c.info(),
            "fence": lambda: c.fence(LEDGER, 99),
            "recovery_read": lambda: c.recovery_read(LEDGER, 1, 99),
            "trim": lambda: c.trim(LEDGER, 0, 5),
            "delete_ledger": lambda: c.delete_ledger(LEDGER),
            "add": lambda: c.add(AddRequest(FRESH, 0, 1, -1, -1, b"intruder", truncate=True)),
            "add_many": lambda: c.add_many([AddRequest(LEDGER, 6 + i, 1, 5, 5, b"more") for i in range(3)]),
            "read": lambda: c.read(LEDGER, 0, 5),
            "read_tail": lambda: c.read_tail(LEDGER, 6, 10, wait_s=1.0),
            "read_lac": lambda: c.read_lac(LEDGER),
            "read_lac_long_poll": lambda: c.read_lac(LEDGER, after_lac=100, timeout_s=1.0),
            "write_lac": lambda: c.write_lac(LEDGER, 1, 5, 5),
        }
        for name, op in ops.items():
            try:
                out[name] = await op()
            except BookieError as exc:
                out[name] = exc
    return out


REFUSED_EVENTS = ("FenceFailed", "ReadFailed", "WriteFailed")


def _assert_all_refused(got: dict[str, object], auth_errors: bool) -> None:
    for name, result in got.items():
        if isinstance(result, BaseException):
            assert isinstance(result, BookieAuthError if auth_errors else BookieError), (name, result)
        else:
            for r in result if isinstance(result, list) else [result]:
                assert type(r).__name__ in REFUSED_EVENTS, (name, result)


@pytest.mark.parametrize("case", ["no-token", "wrong-token", "plaintext"])
def test_client_without_valid_credentials_does_nothing_on_a_token_bookie(token_bookie, pki, case) -> None:
    security = {
        "no-token": ClientSecurity(tls_ca=pki["ca.pem"]),
        "wrong-token": ClientSecurity(tls_ca=pki["ca.pem"], token="wrong"),
        "plaintext": ClientSecurity(token=TOKEN),
    }[case]
    before = run(_snapshot(token_bookie.address, good(pki, token_bookie)))
    got = run(_try_everything(token_bookie.address, security))
    _assert_all_refused(got, auth_errors=True)
    expected = {"no-token": AUTH_REQUIRED_MESSAGE, "wrong-token": INVALID_TOKEN_MESSAGE,
                "plaintext": "the bookie speaks TLS and this client does not"}[case]
    for name in ("info", "read", "trim", "read_lac"):
        assert expected in str(got[name]) and f"bookie {token_bookie.address} refused this client" in str(got[name])
    # the bookie said so (consumers stop) vs inferred from TLS (retried like an unavailable bookie)
    assert got["read"].definite is (case != "plaintext")
    assert run(_snapshot(token_bookie.address, good(pki, token_bookie))) == before


@pytest.mark.parametrize("case", ["no-cert", "untrusted-ca", "expired", "plaintext", "token-only"])
def test_client_without_a_valid_certificate_does_nothing_on_an_mtls_bookie(mtls_bookie, pki, case) -> None:
    security = {
        "no-cert": ClientSecurity(tls_ca=pki["ca.pem"]),
        "untrusted-ca": ClientSecurity(tls_ca=pki["ca.pem"], tls_cert=pki["rogue.pem"], tls_key=pki["rogue.key"]),
        "expired": ClientSecurity(tls_ca=pki["ca.pem"], tls_cert=pki["expired.pem"], tls_key=pki["expired.key"]),
        "plaintext": ClientSecurity(),
        "token-only": ClientSecurity(tls_ca=pki["ca.pem"], token=TOKEN),
    }[case]
    before = run(_snapshot(mtls_bookie.address, good(pki, mtls_bookie)))
    got = run(_try_everything(mtls_bookie.address, security))
    _assert_all_refused(got, auth_errors=True)
    expected = "speaks TLS and this client does not" if case == "plaintext" else "requires a client certificate it trusts"
    for name in ("info", "read", "trim", "read_lac"):
        assert expected in str(got[name]), (name, got[name])
    assert got["read"].definite is False
    assert run(_snapshot(mtls_bookie.address, good(pki, mtls_bookie))) == before


def test_server_certificate_from_another_ca_is_refused_by_the_client(token_bookie, pki) -> None:
    got = run(_try_everything(token_bookie.address, ClientSecurity(tls_ca=pki["rogue-ca.pem"], token=TOKEN)))
    _assert_all_refused(got, auth_errors=True)
    assert "CERTIFICATE_VERIFY_FAILED" in str(got["info"])


def test_good_credentials_work_and_ledger_passwords_are_still_needed(token_bookie, mtls_bookie, pki) -> None:
    async def scenario(bp: BookieProcess, ledger: int) -> None:
        sec = good(pki, bp)
        async with BookieClient(bp.address, security=sec) as c, BookieClient(bp.address, security=sec) as wrong:
            c.set_password(ledger, b"ledger-password")
            assert isinstance(await c.add(AddRequest(ledger, 0, 1, -1, -1, b"secret data", truncate=True)), AddOk)
            assert (await c.read(ledger, 0)).entries[0].data == b"secret data"
            wrong.set_password(ledger, b"guess")
            with pytest.raises(CorruptEntryError):
                await wrong.read(ledger, 0)
            assert type(await wrong.recovery_read(ledger, 0, 1)).__name__ == "ReadFailed"

    run(scenario(token_bookie, 21))
    run(scenario(mtls_bookie, 22))


def test_bad_security_flags_stop_the_bookie_with_a_clear_message(tmp_path, pki) -> None:
    for extra, needle in [
        (["--tls-cert", pki["server.pem"]], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", pki["ca.pem"]], "needs --tls-cert"),
        (["--auth-token-file", str(tmp_path / "missing")], "no such file"),
    ]:
        bp = BookieProcess(tmp_path / "b", extra=extra)
        with pytest.raises(RuntimeError):
            bp.start(timeout=20)
        assert bp.proc.wait(20) == 2
        assert any(needle in line for line in bp.stderr_lines), (extra, bp.stderr_lines)


def test_token_comparison_and_token_file_parsing(tmp_path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# comment\n\n  alpha  \nbeta\n")
    os.chmod(f, 0o600)
    sec = BookieSecurity(token_file=str(f))
    assert sec.auth_required and sec.tokens == (b"alpha", b"beta")
    assert sec.token_ok("alpha") and sec.token_ok(b"beta")
    assert not sec.token_ok("alph") and not sec.token_ok("") and not sec.token_ok(None)
    assert "alpha" not in repr(sec)  # tokens never show in logs


# ------------------------------------------------------------------------------ streams, end to end


@pytest.mark.parametrize("mode", ["token", "mtls"])
def test_streams_end_to_end_on_a_secured_cluster(tmp_path, mode) -> None:
    from streams.client import connect
    from streams.errors import AuthenticationFailed
    from streams.sync import connect as sync_connect
    from streams.tools.localcluster import LocalCluster

    with LocalCluster(tmp_path / "cluster", bookies=3, secure_bookies=mode) as cluster:
        sec = cluster.client_security
        if mode == "mtls":
            sec = sec.with_(token=None)  # the certificate alone authenticates

        async def scenario() -> None:
            with pytest.raises(AuthenticationFailed, match="requires authentication|refused"):
                await connect(cluster.metadata_url)
            if mode == "token":
                with pytest.raises(AuthenticationFailed, match="invalid token"):
                    await connect(cluster.metadata_url, security=sec.with_(token="wrong"))
            async with await connect(cluster.metadata_url, security=sec) as client:
                await client.create_stream("secure", ensemble=3, write_quorum=3, ack_quorum=2)
                async with await client.producer("secure") as p:
                    offsets = [await p.append(b"v%d" % i, key=b"k") for i in range(50)]
                assert offsets == list(range(50))
                c = await client.consumer("secure", start="earliest")
                got = []
                while len(got) < 50:
                    got += await c.read(100, timeout_s=5)
                assert [r.value for r in got] == [b"v%d" % i for i in range(50)]

        run(scenario(), timeout=120)
        with sync_connect(cluster.metadata_url, security=sec) as client:
            assert client.consumer("secure", start="earliest").read(10, timeout_s=5)
        if mode == "token":  # the scroll CLI's global options
            from click.testing import CliRunner

            from streams.tools.cli import main

            token_file = str(cluster.dir / "security" / "token")
            ok = CliRunner().invoke(main, ["--tls-ca", sec.tls_ca, "--token-file", token_file, "stream", "list",
                                           "--metadata", cluster.metadata_url, "--json"])
            assert ok.exit_code == 0 and "secure" in ok.output, ok.output
            env = {"SCROLL_TLS_CA": sec.tls_ca, "SCROLL_TOKEN_FILE": token_file}
            ok = CliRunner(env=env).invoke(main, ["stream", "list", "--metadata", cluster.metadata_url, "--json"])
            assert ok.exit_code == 0 and "secure" in ok.output, ok.output
            refused = CliRunner().invoke(main, ["--tls-ca", sec.tls_ca, "stream", "list", "--metadata",
                                                cluster.metadata_url])
            assert refused.exit_code != 0 and "requires authentication" in refused.output, refused.output



def test_requested_client_certificates_authenticate_the_data_port(tmp_path, pki) -> None:
    """``--tls-client-auth requested``: a verified certificate authenticates a data connection
    without a token; without either the connection is refused (gRPC needs the token: grpc-python
    cannot ask for a certificate without requiring one)."""
    from bookie.server import BookieServer

    from .helpers import small_config

    async def scenario() -> None:
        sec = BookieSecurity(tls_cert=pki["server.pem"], tls_key=pki["server.key"], client_ca=pki["ca.pem"],
                             client_auth="requested", token_file=pki["tokens"])
        server = BookieServer(small_config(tmp_path / "b"), security=sec)
        await server.start()
        try:
            data = f"127.0.0.1:{server.data_port}"
            with_token = ClientSecurity(tls_ca=pki["ca.pem"], token=TOKEN)
            cert = ClientSecurity(tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"], tls_key=pki["client.key"])
            async with BookieClient(server.address, security=with_token) as c:
                assert isinstance(await c.fence(5, 1), FenceOk)
                assert isinstance(await c.add(AddRequest(5, 0, 1, -1, -1, b"x", truncate=True)), AddOk)
            async with BookieClient(server.address, security=cert, data_address=data) as c:
                assert (await c.read(5, 0)).entries[0].data == b"x"
                with pytest.raises(BookieAuthError, match="requires authentication"):
                    await c.info()
            async with BookieClient(server.address, security=ClientSecurity(tls_ca=pki["ca.pem"]),
                                    data_address=data) as c:
                with pytest.raises(BookieAuthError, match="requires authentication"):
                    await c.read(5, 0)
        finally:
            await server.stop()

    run(scenario())


def test_a_silent_unauthenticated_connection_is_closed(tmp_path, pki, monkeypatch) -> None:
    """A connection that never authenticates is refused after PREAUTH_TIMEOUT_S (here shortened)."""
    from bookie import dataplane
    from bookie.server import BookieServer

    from .helpers import small_config

    monkeypatch.setattr(dataplane, "PREAUTH_TIMEOUT_S", 0.2)

    async def scenario() -> None:
        sec = BookieSecurity(tls_cert=pki["server.pem"], tls_key=pki["server.key"], token_file=pki["tokens"])
        server = BookieServer(small_config(tmp_path / "b"), security=sec)
        await server.start()
        try:
            ctx = ClientSecurity(tls_ca=pki["ca.pem"]).ssl_context()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.data_port, ssl=ctx,
                                                           server_hostname="127.0.0.1")
            got = await asyncio.wait_for(reader.read(), 10)  # until the bookie closes
            writer.transport.abort()
            frames = wire.FrameReader().feed(got)
            assert _refusal(frames) == (0, Status.UNAUTHENTICATED, AUTH_REQUIRED_MESSAGE)
            assert all(c.closed for c in server.data.connections)  # refused (connection_lost may lag)
        finally:
            await server.stop()

    run(scenario())
