"""etcd credentials and TLS: the metadata URL's user:password, etcds:// with a CA, re-authentication
after etcd's auth token expires, clear non-retriable errors, and no password in messages or logs.

Real etcd servers started by ``LocalCluster`` (auth on through etcd's gRPC Auth API; a 2 s
``--auth-token-ttl`` so the token expires during the tests) with certificates from trustme.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from pathlib import Path

import pytest
import trustme

from fragments.etcdstore import EtcdStore, parse_etcd_target
from fragments.security import ClientSecurity, redact_url
from fragments.store import MetadataAuthError, MetadataError
from fragments.stores import open_store
from streams.tools.localcluster import EtcdTLSFiles, LocalCluster

from .conftest import ETCD, NO_ETCD, namespace

pytestmark = pytest.mark.timeout(120)

PASSWORD = "s3cr:t/p@ss%w"  # every character that needs percent-encoding in a URL's user info
QUOTED = urllib.parse.quote(PASSWORD, safe="")
TOKEN_TTL_S = 2


def _no_password(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text and QUOTED not in text, text


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    if ETCD is None:
        pytest.skip(NO_ETCD)
    c = LocalCluster(tmp_path_factory.mktemp("etcd-auth"), bookies=0, etcd_password=PASSWORD,
                     etcd_auth_token_ttl=TOKEN_TTL_S)
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("certs")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("root")
    files = {
        "ca": d / "ca.pem", "other_ca": d / "other-ca.pem", "cert": d / "server.pem", "key": d / "server.key",
        "client_cert": d / "client.pem", "client_key": d / "client.key",
    }
    ca.cert_pem.write_to_path(files["ca"])
    other_ca.cert_pem.write_to_path(files["other_ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    client.cert_chain_pems[0].write_to_path(files["client_cert"])
    client.private_key_pem.write_to_path(files["client_key"])
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory, certs):
    """etcd serving TLS (server certificate only) with auth on."""
    if ETCD is None:
        pytest.skip(NO_ETCD)
    c = LocalCluster(tmp_path_factory.mktemp("etcd-tls"), bookies=0, etcd_password=PASSWORD,
                     etcd_tls=EtcdTLSFiles(certs["cert"], certs["key"], certs["ca"]))
    c.start()
    yield c
    c.stop()


def _plain(cluster: LocalCluster, creds: str = "", scheme: str = "etcd") -> str:
    return f"{scheme}://{creds}127.0.0.1:{cluster.etcd_port}{namespace()}"


# ------------------------------------------------------------------------------------------ URLs
def test_url_forms():
    t = parse_etcd_target(f"etcd://root:{QUOTED}@db.example:2380/tenant")
    assert (t.host, t.port, t.namespace, t.tls, t.user, t.password) == ("db.example", 2380, "/tenant", False, "root",
                                                                          PASSWORD)
    t = parse_etcd_target("etcds://u%40corp:pw@127.0.0.1/ns?ca=/c.pem&cert=/u.pem&key=/u.key")
    assert (t.tls, t.user, t.password, t.port, t.ca, t.cert, t.key) == (True, "u@corp", "pw", 2379, "/c.pem",
                                                                         "/u.pem", "/u.key")
    assert parse_etcd_target("https://127.0.0.1:1").tls
    _no_password(repr(parse_etcd_target(f"etcd://root:{QUOTED}@h:1")))
    for bad in ["etcd://h:1?ca=/c.pem", "etcds://h:1?cert=/u.pem", "etcds://h:1?bogus=1", "etcd://user@h:1",
                f"ftp://root:{QUOTED}@h:1"]:
        with pytest.raises(ValueError) as info:
            parse_etcd_target(bad)
        _no_password(str(info.value))
    assert redact_url(f"etcds://root:{QUOTED}@h:1/ns?ca=/c") == "etcds://root:***@h:1/ns?ca=/c"
    assert redact_url("etcd://h:1/ns") == "etcd://h:1/ns"


def test_security_overrides_the_url():
    sec = ClientSecurity(user="alice", password="pw2")
    t = parse_etcd_target("etcd://bob:pw1@h:1").with_security(sec)
    assert (t.user, t.password) == ("alice", "pw2")
    t = parse_etcd_target("etcd://bob:pw1@h:1").with_security(ClientSecurity())
    assert (t.user, t.password) == ("bob", "pw1")


# ------------------------------------------------------------------------------------------ auth
def test_right_credentials_put_get_watch_lease(auth_etcd, run):
    async def body():
        store = await open_store(_plain(auth_etcd, f"root:{QUOTED}@"))
        try:
            lease = await store.grant_lease(5)
            await store.put("/k", b"v", lease=lease)
            assert (await store.get("/k")).value == b"v"
            watch = store.watch_prefix("/w/")
            await store.put("/w/a", b"1")
            assert (await asyncio.wait_for(anext(watch), 5)).key == "/w/a"
            await lease.refresh()
            await lease.revoke()
            assert await store.get("/k") is None
            await watch.aclose()
        finally:
            await store.close()
        _no_password(str(store), repr(store))

    run(body())


def test_credentials_for_an_etcd_without_auth_are_unused(etcd_server, run):
    async def body():
        store = await open_store(f"etcd://root:{QUOTED}@127.0.0.1:{etcd_server.client_port}{namespace()}")
        await store.put("/k", b"v")
        assert (await store.get("/k")).value == b"v"
        await store.close()

    run(body())


def test_security_credentials_win_over_the_url(auth_etcd, run):
    async def body():
        for url in (_plain(auth_etcd), _plain(auth_etcd, "root:wrong@")):
            store = await open_store(url, security=ClientSecurity(user="root", password=PASSWORD))
            await store.put("/k", b"v")
            await store.close()

    run(body())


@pytest.mark.parametrize("creds,expect", [
    ("root:wrong@", "refused the credentials for user 'root'"),
    (f"nobody:{QUOTED}@", "refused the credentials for user 'nobody'"),
    ("", "requires authentication: put user:password in the metadata URL"),
])
def test_bad_or_missing_credentials_fail_clearly_and_quickly(auth_etcd, run, caplog, creds, expect):
    caplog.set_level(logging.DEBUG)

    async def body():
        started = time.monotonic()
        with pytest.raises(MetadataAuthError) as info:
            await open_store(_plain(auth_etcd, creds), timeout=5.0)
        assert time.monotonic() - started < 3.0  # not a retry loop nor a timeout
        assert expect in str(info.value).replace(" (ping)", "").replace(" (connect)", "")
        assert not info.value.retriable
        _no_password(str(info.value), repr(info.value), caplog.text)

    run(body())


def test_token_expiry_reauthenticates_and_watches_and_leases_survive(auth_etcd, run, caplog):
    """etcd's simple tokens expire after ``--auth-token-ttl`` seconds *without use* (every call
    resets the clock), so the test leaves the store idle for longer and longer gaps until a call
    finds its token expired, rather than sleeping a guessed time."""
    caplog.set_level(logging.DEBUG)

    async def idle_until_reauth(store: EtcdStore, call) -> None:
        before, gap = store.reauths, float(TOKEN_TTL_S)  # a shorter idle cannot expire it
        deadline = time.monotonic() + 30
        while store.reauths == before:
            assert time.monotonic() < deadline, "the token never expired"
            await asyncio.sleep(gap)
            await call()
            gap += 0.5

    async def body():
        store = await EtcdStore.connect(_plain(auth_etcd, f"root:{QUOTED}@"))
        try:
            lease = await store.grant_lease(30)
            await store.put("/leased", b"x", lease=lease)
            old_watch = store.watch_prefix("/w/")
            await store.put("/w/1", b"1")
            assert (await asyncio.wait_for(anext(old_watch), 5)).key == "/w/1"

            await idle_until_reauth(store, lambda: store.get("/k"))  # a read re-authenticates
            assert store.reauths >= 1
            await store.put("/w/2", b"2")  # the watch made with the first token still reports
            assert (await asyncio.wait_for(anext(old_watch), 5)).key == "/w/2"

            async def refresh_then_read():  # etcd 3.4 does not check the token of lease keep-alives,
                await lease.refresh()  # so the read after each refresh tells when it had expired
                assert (await store.get("/leased")).value == b"x"

            await idle_until_reauth(store, refresh_then_read)  # lease keep-alives keep working
            await idle_until_reauth(store, lambda: store.put("/w/3", b"3"))  # writes too
            assert (await asyncio.wait_for(anext(old_watch), 5)).key == "/w/3"

            # a watch created after the token expired (etcd checks the token of the watch stream)
            async def new_watch():
                w = store.watch_prefix("/w/")
                pending = asyncio.ensure_future(anext(w))
                await asyncio.sleep(0.3)  # the watch is created on the first read
                await store.put("/w/4", b"4")
                assert (await asyncio.wait_for(pending, 5)).key == "/w/4"
                await w.aclose()

            before = store.reauths
            await asyncio.sleep(TOKEN_TTL_S + 1.5)
            await new_watch()
            assert store.reauths > before
            assert (await store.get("/leased")).value == b"x"
            await old_watch.aclose()
        finally:
            await store.close()
        assert "re-authenticated" in caplog.text
        _no_password(caplog.text)

    run(body(), timeout=90)


# ------------------------------------------------------------------------------------------- TLS
def test_tls_with_the_right_ca(tls_etcd, certs, run):
    async def body():
        q = "?" + urllib.parse.urlencode({"ca": certs["ca"]})
        for url, security in [
            (f"etcds://root:{QUOTED}@127.0.0.1:{tls_etcd.etcd_port}/ns{q}", None),
            (tls_etcd.metadata_url, None),
            (f"https://127.0.0.1:{tls_etcd.etcd_port}/ns", ClientSecurity(tls_ca=certs["ca"], user="root",
                                                                          password=PASSWORD)),
        ]:
            store = await open_store(url, security=security)
            await store.put("/k", b"v")
            assert (await store.get("/k")).value == b"v"
            watch = store.watch_prefix("/w/")
            await store.put("/w/a", b"1")
            assert (await asyncio.wait_for(anext(watch), 5)).key == "/w/a"
            await watch.aclose()
            await store.close()

    run(body())


def test_tls_with_an_untrusted_ca_or_plaintext_fails_clearly(tls_etcd, certs, run, caplog):
    caplog.set_level(logging.DEBUG)

    async def body():
        port = tls_etcd.etcd_port
        started = time.monotonic()
        q = "?" + urllib.parse.urlencode({"ca": certs["other_ca"]})
        with pytest.raises(MetadataAuthError) as info:
            await open_store(f"etcds://root:{QUOTED}@127.0.0.1:{port}{q}", timeout=3.0)
        assert "TLS with etcd at" in str(info.value)
        assert not info.value.retriable
        _no_password(str(info.value), repr(info.value))
        # plaintext towards a TLS server: refused, not a hang
        with pytest.raises(MetadataError) as info:
            await open_store(f"etcd://root:{QUOTED}@127.0.0.1:{port}", timeout=3.0)
        _no_password(str(info.value), repr(info.value))
        assert "etcds://" in str(info.value)  # the hint
        assert time.monotonic() - started < 15
        # a CA file that does not exist
        with pytest.raises(MetadataAuthError, match="cannot read the etcd TLS file"):
            await open_store(f"etcds://127.0.0.1:{port}?ca=/nonexistent/ca.pem")
        _no_password(caplog.text)

    run(body(), timeout=60)


def test_mutual_tls(tmp_path, certs, run):
    if ETCD is None:
        pytest.skip(NO_ETCD)
    files = EtcdTLSFiles(certs["cert"], certs["key"], certs["ca"], certs["client_cert"], certs["client_key"])
    with LocalCluster(tmp_path, bookies=0, etcd_password=PASSWORD, etcd_tls=files) as c:
        assert "cert=" in c.metadata_url

        async def body():
            store = await open_store(c.metadata_url)
            await store.put("/k", b"v")
            await store.close()
            started = time.monotonic()
            q = "?" + urllib.parse.urlencode({"ca": certs["ca"]})
            with pytest.raises(MetadataError):  # no client certificate
                await open_store(f"etcds://root:{QUOTED}@127.0.0.1:{c.etcd_port}{q}", timeout=3.0)
            assert time.monotonic() - started < 15

        run(body(), timeout=60)


def test_localcluster_restart_keeps_auth(tmp_path, run):
    if ETCD is None:
        pytest.skip(NO_ETCD)
    c = LocalCluster(tmp_path, bookies=0, etcd_password=PASSWORD)
    with c:
        run(_put(c.metadata_url))
    with LocalCluster(tmp_path, bookies=0, etcd_password=PASSWORD, etcd_port=c.etcd_port,
                      etcd_peer_port=c.etcd_peer_port) as again:
        run(_put(again.metadata_url))
        with pytest.raises(MetadataAuthError):
            run(_put(f"etcd://127.0.0.1:{again.etcd_port}"))


async def _put(url: str) -> None:
    store = await open_store(url)
    try:
        await store.put("/k", b"v")
    finally:
        await store.close()


def test_docs_mention_what_we_built():
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert "Metadata store (etcd)" in text and "etcds://" in text and "--auth-token-ttl" in text
