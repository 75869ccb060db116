"""``scroll console --secure``: HTTPS, a login (a Kafka SCRAM user), the Kafka ACLs on every page and
action, CSRF tokens on POSTs, and SIGHUP re-reading the certificate for new handshakes."""

from __future__ import annotations

import asyncio
import signal
import ssl
import urllib.error
import urllib.parse
import urllib.request

import pytest
import trustme
from selenium.webdriver.common.by import By

from compat_kafka.security import sasl
from compat_kafka.security.acls import AclBinding, Operation, PatternType, Permission, ResourceType
from compat_kafka.security.authorizer import Authorizer
from fragments.stores import open_store
from streams.client import connect

from .conftest import ConsoleProc, screenshot, wait_for
from .test_console import submit, text

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


def _write_cert(ca: trustme.CA, d, name: str):
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = d / f"{name}.pem", d / f"{name}.key"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    return cert_file, key_file, cert.cert_chain_pems[0].bytes()


def _served_cert(port: int) -> bytes:
    pem = ssl.get_server_certificate(("127.0.0.1", port))
    return ssl.PEM_cert_to_DER_cert(pem)


def _login(browser, url: str, user: str, password: str) -> None:
    browser.get(url + "/")
    assert "/login" in browser.current_url  # every page needs a login
    form = browser.find_element(By.ID, "login")
    form.find_element(By.ID, "user").send_keys(user)
    form.find_element(By.ID, "password").send_keys(password)
    submit(browser, form)


async def _grant(metadata_url: str, binding: AclBinding) -> None:
    store = await open_store(metadata_url)
    try:
        await Authorizer(store).create(binding)
    finally:
        await store.close()


def test_login_acls_csrf_and_certificate_reload(console_cluster, browser, tmp_path):
    async def users():
        store = await open_store(console_cluster.metadata_url)
        try:
            await sasl.add_user(store, "admin", "admin-secret-1")
            await sasl.add_user(store, "alice", "alice-secret-1")
            client = await connect(console_cluster.metadata_url)
            try:
                await client.create_stream("secure-demo")
            finally:
                await client.close()
        finally:
            await store.close()

    asyncio.run(users())
    ca = trustme.CA()
    cert_file, key_file, _ = _write_cert(ca, tmp_path, "server")
    p = ConsoleProc(tmp_path, console_cluster.metadata_url,
                    ["--secure", "--ssl-cert", str(cert_file), "--ssl-key", str(key_file), "--super-users",
                     "User:admin", "--bootstrap", console_cluster.shim.bootstrap], scheme="https")
    try:
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        p.wait_ready(trusting)
        # a wrong password is refused
        _login(browser, p.url, "alice", "wrong")
        assert "wrong user name, password or token" in text(browser, "#error")
        screenshot(browser, "login")
        # alice has no ACL: every page says so
        _login(browser, p.url, "alice", "alice-secret-1")
        assert "User:alice is not authorized" in text(browser, "#error")
        browser.get(p.url + "/streams/chain-demo")
        assert "User:alice is not authorized" in text(browser, "#error")
        browser.get(p.url + "/streams")
        assert text(browser, "#streams").count("\n") == 0  # the list shows no topic she may not describe
        # granted DESCRIBE on the topic (as `scroll kafka acl add` stores it), she sees it and its page
        asyncio.run(_grant(console_cluster.metadata_url, AclBinding.make(
            ResourceType.TOPIC, "secure-demo", PatternType.LITERAL, "User:alice", "*", Operation.DESCRIBE,
            Permission.ALLOW)))
        wait_for(lambda: browser.get(p.url + "/streams/secure-demo") or browser.find_elements(By.ID, "chain"), 20,
                 "the granted stream page")
        browser.get(p.url + "/streams")
        assert [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR, "#streams tr")[1:]] == ["secure-demo"]
        browser.get(p.url + "/records?stream=secure-demo")  # reading records needs READ, not granted
        assert "User:alice is not authorized: READ on topic secure-demo" in text(browser, "#error")
        submit(browser, browser.find_element(By.CSS_SELECTOR, "nav form"))  # log out
        # admin, a super user, sees the cluster
        _login(browser, p.url, "admin", "admin-secret-1")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#bookies tr")) == 4
        # a POST without the session's CSRF token is refused, whatever the cookie
        cookie = browser.get_cookie("scroll_console")["value"]
        req = urllib.request.Request(p.url + "/groups/some-group/delete", method="POST",
                                     data=urllib.parse.urlencode({"confirm": "some-group"}).encode(),
                                     headers={"Cookie": f"scroll_console={cookie}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, context=trusting, timeout=10)
        assert e.value.code == 403 and b"CSRF" in e.value.read()
        # SIGHUP: new handshakes present the certificate now in the files
        before = _served_cert(p.port)
        new_cert, new_key, new_pem = _write_cert(ca, tmp_path, "server-2")
        new_cert.replace(cert_file)
        new_key.replace(key_file)
        p.popen.send_signal(signal.SIGHUP)
        expected = ssl.PEM_cert_to_DER_cert(new_pem.decode())
        assert expected != before
        wait_for(lambda: _served_cert(p.port) == expected, 20, "the reloaded certificate")
    finally:
        p.stop()
