"""``scroll standalone --secure`` as a user runs it: the real command in the foreground, then its
"try it" lines: kcat with ``-F client.properties``, confluent-kafka with the same settings
(produce, a consumer group, admin ACL calls), the operators' group tool, the Python API through
``scroll-client.properties``; and what is refused: a plaintext Kafka client, a wrong password, a
user without ACLs, an unauthenticated bookie call, etcd without credentials. Then a restart on the
same directory keeps the credentials and the data."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from compat_kafka.security.client_security import read_properties
from tests.standalone_run import ROOT, Run, ports

PY = sys.executable

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = tmp_path_factory.mktemp("secure")
    run = Run(d / "data", ports(), "--secure")  # the README's `make run ARGS=--secure`
    try:
        run.wait_ready()
        yield run
    finally:
        _stop(run)


def _stop(run: Run) -> None:
    if run.p.poll() is None:
        try:
            run.ctrl_c()
        finally:
            run.kill()


def _kafka_conf(run: Run) -> dict:
    props = read_properties(run.data / "client.properties")
    return {k: v for k, v in props.items() if k != "bootstrap.servers"} | {"bootstrap.servers": props["bootstrap.servers"]}


def test_the_settings_files_and_the_banner(secure):
    banner = secure.wait_ready()
    kp, sp = secure.data / "client.properties", secure.data / "scroll-client.properties"
    for f in (kp, sp, secure.data / "pki" / "ca.key", secure.data / "pki" / "server.key"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    props = read_properties(kp)
    assert props["security.protocol"] == "SASL_SSL" and props["sasl.username"] == "admin"
    assert props["ssl.ca.location"] == str((secure.data / "pki" / "ca.pem").resolve())
    password = props["sasl.password"]
    etcd_password = (secure.data / "etcd" / "root.password").read_text().strip()
    token = (secure.data / "security" / "token").read_text().strip()
    everything = banner + "".join(p.read_text(errors="replace") for p in secure.data.glob("*/*.log"))
    for secret in (password, etcd_password, token):
        assert secret not in everything  # not in the banner, not in any log
    assert f"kcat -F {kp}" in banner and "scroll-client.properties" in banner


def test_kcat_with_the_client_properties(secure):
    kp = str(secure.data / "client.properties")
    r = subprocess.run(["kcat", "-F", kp, "-t", "greetings", "-P"], input=b"hello\nworld\n", capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["kcat", "-F", kp, "-t", "greetings", "-C", "-e", "-q"], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == [b"hello", b"world"], r


def test_confluent_kafka_produce_group_consume_and_acls(secure):
    from confluent_kafka import Consumer, KafkaException, Producer
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    conf = _kafka_conf(secure)
    p = Producer({**conf, "acks": "all"})
    for i in range(5):
        p.produce("orders", b"o%d" % i)
    assert p.flush(60) == 0
    c = Consumer({**conf, "group.id": "billing", "auto.offset.reset": "earliest"})
    try:
        c.subscribe(["orders"])
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < 5 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and m.error() is None:
                got.append(m.value())
        c.commit(asynchronous=False)
    finally:
        c.close()
    assert got == [b"o%d" % i for i in range(5)]
    admin = AdminClient(conf)
    binding = AclBinding(ResourceType.TOPIC, "orders", ResourcePatternType.LITERAL, "User:bob", "*",
                         AclOperation.READ, AclPermissionType.ALLOW)
    for f in admin.create_acls([binding]).values():
        f.result(30)
    found = admin.describe_acls(AclBindingFilter(ResourceType.TOPIC, "orders", ResourcePatternType.ANY, None, None,
                                                 AclOperation.ANY, AclPermissionType.ANY)).result(30)
    assert [b.principal for b in found] == ["User:bob"]
    for f in admin.delete_acls([AclBindingFilter(ResourceType.TOPIC, "orders", ResourcePatternType.ANY, None, None,
                                                 AclOperation.ANY, AclPermissionType.ANY)]).values():
        assert len(f.result(30)) == 1
    # the operators' tool with the same file
    r = subprocess.run([PY, "-m", "streams.tools.cli", "kafka", "groups", "describe", "billing", "--json",
                        "--bootstrap", conf["bootstrap.servers"], "--command-config",
                        str(secure.data / "client.properties")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert '"committed": 5' in r.stdout, r.stdout
    # the listener's lag metrics reach its own SASL_SSL listener (as the brokers' identity)
    import urllib.request

    url = f"http://127.0.0.1:{secure.ports['metrics'] + 4}/metrics"
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    assert 'scroll_kafka_group_lag_sum{group="billing"} 0.0' in text, text[-2000:]
    with pytest.raises(KafkaException):
        admin.create_acls([AclBinding(ResourceType.TOPIC, "x", ResourcePatternType.LITERAL, "bad-principal", "*",
                                      AclOperation.READ, AclPermissionType.ALLOW)])[
            AclBinding(ResourceType.TOPIC, "x", ResourcePatternType.LITERAL, "bad-principal", "*",
                       AclOperation.READ, AclPermissionType.ALLOW)].result(30)


def _refused(conf: dict) -> list[str]:
    from confluent_kafka import Producer

    errors: list[str] = []
    p = Producer({**conf, "message.timeout.ms": 15000, "error_cb": lambda e: errors.append(str(e))})
    p.produce("orders", b"should-not-land")
    deadline = time.monotonic() + 20
    while not errors and time.monotonic() < deadline:
        p.poll(0.1)
    p.purge()
    p.flush(5)
    return errors


def _end_offset(conf: dict, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**conf, "group.id": "peek"})
    try:
        return c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)[1]
    finally:
        c.close()


def test_the_rest_is_refused_and_nothing_is_written(secure):
    conf = _kafka_conf(secure)
    before = _end_offset(conf, "orders")
    assert _refused({"bootstrap.servers": conf["bootstrap.servers"]})  # plaintext against SASL_SSL
    assert any("Authentication failed" in e for e in _refused({**conf, "sasl.password": "wrong"}))
    # a user without ACLs: authenticated, but refused to write
    r = subprocess.run([PY, "-m", "streams.tools.cli", "kafka", "user", "add", "carol", "--password", "carol-pw"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "SCROLL_METADATA": read_properties(
                           secure.data / "scroll-client.properties")["metadata"]})
    assert r.returncode == 0, r.stderr
    from confluent_kafka import Producer

    delivered: list = []
    p = Producer({**conf, "sasl.username": "carol", "sasl.password": "carol-pw", "message.timeout.ms": 20000})
    p.produce("orders", b"carol", on_delivery=lambda err, _m: delivered.append(err))
    p.flush(30)
    assert delivered and delivered[0] is not None and "authoriz" in str(delivered[0]).lower()
    assert _end_offset(conf, "orders") == before


def test_the_python_api_with_scroll_client_properties_and_refusals(secure):
    from fragments.store import MetadataAuthError
    from streams import sync

    sp = secure.data / "scroll-client.properties"
    with sync.connect_properties(sp) as client:
        got = [r.value for r in client.consumer("orders").read(5)]
    assert got == [b"o%d" % i for i in range(5)]
    props = read_properties(sp)
    url = props["metadata"]
    # without the bookie token: the client is refused by the bookies, clearly
    from streams.errors import AuthenticationFailed

    with pytest.raises(AuthenticationFailed):
        sync.connect(url, security=_security(props, token=None))
    # etcd without credentials
    host_part = url.split("@", 1)[1]
    with pytest.raises(MetadataAuthError):
        sync.connect("etcds://" + host_part)


def _security(props: dict, **override):
    from fragments.security import ClientSecurity

    d = {"tls_ca": props["tls.ca"], "token": props["token"]} | override
    return ClientSecurity(**d)


def test_a_restart_keeps_the_credentials_and_the_data(secure):
    """Ctrl-C, start again on the same directory: the same CA, the same passwords and token (the
    settings files are unchanged), and the records are still there."""
    from streams import sync

    files = [secure.data / n for n in ("client.properties", "scroll-client.properties", "pki/ca.pem")]
    before = [f.read_bytes() for f in files]
    assert "stopped; data kept in" in secure.ctrl_c()
    again = Run(secure.data, secure.ports, "--secure")
    try:
        again.wait_ready()
        assert [f.read_bytes() for f in files] == before
        with sync.connect_properties(secure.data / "scroll-client.properties") as client:
            assert [r.value for r in client.consumer("orders").read(5)] == [b"o%d" % i for i in range(5)]
        assert _end_offset(_kafka_conf(again), "orders") == 5
    finally:
        _stop(again)
