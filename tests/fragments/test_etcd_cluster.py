"""EtcdStore against a real 3-member etcd cluster: a URL listing every member, and fail-over when the
member a store talks to is killed (SIGKILL), stopped silently (SIGSTOP: no RST, like a cut link) or
restarted."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from fragments.etcdstore import EtcdStore, parse_etcd_target, parse_etcd_url
from fragments.registry import BookieRegistration, register_bookie
from fragments.security import redact_url
from fragments.store import MetadataAuthError, MetadataUnavailable
from streams.tools.localcluster import EtcdTLSFiles, LocalCluster, Proc
from tests.ports import port_block

from .conftest import ETCD, NO_ETCD, free_port, namespace

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------------ URLs
def test_endpoint_lists_parse():
    t = parse_etcd_target("etcd://h1:2379,h2:2380,h3/ns")
    assert t.endpoints == (("h1", 2379), ("h2", 2380), ("h3", 2379))
    assert (t.host, t.port, t.namespace, t.tls) == ("h1", 2379, "/ns", False)
    t = parse_etcd_target("etcds://u%40corp:s3cret@10.0.0.1:2379,10.0.0.2:2379,[::1]:2379?ca=/c.pem")
    assert t.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379), ("::1", 2379))
    assert (t.tls, t.user, t.password, t.ca, t.namespace) == (True, "u@corp", "s3cret", "/c.pem", "")
    assert parse_etcd_target("etcd://127.0.0.1:2379").endpoints == (("127.0.0.1", 2379),)
    url = "etcd://root:s3cret@h1:1,h2:2,h3:3/ns"
    assert redact_url(url) == "etcd://root:***@h1:1,h2:2,h3:3/ns"
    for bad, why in [("etcd://h1:1,,h3:3", "empty endpoint"), ("etcd://h1:1,", "empty endpoint"),
                     ("etcd://h1:1,h2:x", "bad port"), ("etcd://h1:1,h2:70000", "bad port"),
                     ("etcd://h1:1,:2", "bad endpoint"), ("etcd://h1:1,h1:1", "listed twice"),
                     ("etcd://root:s3cret@h1:1,h2:nope", "bad port")]:
        with pytest.raises(ValueError, match=why) as info:
            parse_etcd_target(bad)
        assert "s3cret" not in str(info.value)
    with pytest.raises(ValueError, match="one etcd endpoint"):
        parse_etcd_url("etcd://h1:1,h2:2")  # the (host, port, namespace) form has room for one


# ------------------------------------------------------------------------------------- cluster
class Member:
    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"m{index}"
        self.client_port = cluster.base + index
        self.peer_port = cluster.base + 3 + index
        self.data_dir = cluster.dir / self.name
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        assert ETCD is not None
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        self.starts += 1
        log = open(self.cluster.dir / f"{self.name}-{self.starts}.log", "wb")
        try:
            self.proc = subprocess.Popen(
                [ETCD, "--name", self.name, "--data-dir", str(self.data_dir),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", self.cluster.initial_cluster, "--initial-cluster-state", "new",
                 "--initial-cluster-token", self.cluster.token,
                 # 50 ms heartbeats / 500 ms elections: quick fail-over, yet steady on a loaded machine
                 "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        finally:
            log.close()

    def status(self) -> dict | None:
        try:
            req = urllib.request.Request(f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=1) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


class Cluster:
    def __init__(self, base_dir: Path) -> None:
        self.dir = base_dir
        self.base = port_block(6)  # client ports base..base+2, peer ports base+3..base+5
        self.token = f"scroll-{self.base}"
        self.members = [Member(self, i) for i in range(3)]
        self.initial_cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)

    def url(self, first: Member | None = None) -> str:
        """``etcd://a,b,c`` with ``first`` first (the member a new store talks to)."""
        order = sorted(self.members, key=lambda m: m is not first)
        return "etcd://" + ",".join(m.endpoint for m in order)

    def wait_healthy(self, members: list[Member] | None = None, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for m in members or self.members:
            while not m.healthy():
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited:\n{self.log_tail(m)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} did not become healthy:\n{self.log_tail(m)}")
                time.sleep(0.05)

    def leader(self) -> Member:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for m in self.members:
                st = m.status()
                if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                    return m
            time.sleep(0.05)
        raise RuntimeError("no etcd leader")

    def log_tail(self, m: Member) -> str:
        logs = sorted(self.dir.glob(f"{m.name}-*.log"))
        return logs[-1].read_text(errors="replace")[-1500:] if logs else ""

    def kill(self) -> None:
        for m in self.members:
            m.kill()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if ETCD is None:
        pytest.skip(NO_ETCD)
    c = Cluster(tmp_path)
    try:
        for m in c.members:
            m.start()
        c.wait_healthy()
        yield c
    finally:
        c.kill()


@pytest.fixture
def run():
    with asyncio.Runner() as runner:
        yield lambda coro, timeout=90.0: runner.run(asyncio.wait_for(coro, timeout))


async def _timed(aw, bound: float, what: str, timings: dict[str, float]):
    t0 = time.monotonic()
    result = await asyncio.wait_for(aw, bound)
    timings[what] = round(time.monotonic() - t0, 2)
    return result


# ------------------------------------------------------------------------------------- fail-over
@pytest.mark.process
def test_killed_member_fail_over_keeps_requests_leases_and_watches(cluster, run):
    """(1) get/put/txn keep working after the member the store talks to (the leader: an election
    too) is SIGKILLed; (2) a 3 s lease kept alive through it survives, never re-created; (3) a
    watch opened through it delivers every later put once, in order; (4) the member restarted on
    its data dir rejoins, and the store survives losing another member."""
    leader = cluster.leader()
    ns = namespace()
    timings: dict[str, float] = {}

    async def body():
        store = await EtcdStore.connect(cluster.url(first=leader), namespace=ns, timeout=3.0)
        other = next(m for m in cluster.members if m is not leader)
        writer = await EtcdStore.connect(cluster.url(first=other), namespace=ns, timeout=3.0)
        try:
            assert store.endpoint == leader.endpoint and store.fails_over
            assert all(m.endpoint in store.url for m in cluster.members)
            registrar = await register_bookie(store, BookieRegistration("b1", "127.0.0.1:1"), ttl_s=3)
            lease_id, key = registrar.lease.id, registrar.key
            reg_version = (await store.get(key)).version
            v = await store.put("/k", b"0")
            own = store.watch_prefix("/w/")  # through the leader, on the store that fails over itself
            theirs = writer.watch_prefix("/w/")  # through another member: it must not notice anything
            await writer.put("/w/0", b"before")
            for w in (own, theirs):
                assert (await asyncio.wait_for(anext(w), 5)).value == b"before"

            leader.kill()
            killed_at = time.monotonic()
            # (1) reads, writes and a guarded txn through the remaining members
            assert (await _timed(store.get("/k"), 15, "first get after SIGKILL", timings)).value == b"0"
            assert store.endpoint != leader.endpoint
            v2 = await _timed(store.put("/k", b"1"), 15, "put", timings)
            assert (await store.txn({"/k": v2}, {"/k": b"2", "/t": b"x"})).succeeded
            assert not (await store.txn({"/k": v}, {"/k": b"stale"})).succeeded
            assert (await store.get("/k")).value == b"2"
            # (3) every put after the kill arrives once, in order, on both watches
            expected = [f"v{i}".encode() for i in range(20)]
            for i, value in enumerate(expected):
                await (store if i % 2 else writer).put(f"/w/{i:02d}", value)
            for w in (own, theirs):
                got = [(await asyncio.wait_for(anext(w), 15)).value for _ in expected]
                assert got == expected
            assert store.watch_resumes >= 1  # the store's own watch was re-created on another member
            # (2) the lease outlives > 2 TTLs since the kill, kept alive through another member
            while time.monotonic() - killed_at < 2.5 * registrar.ttl_s:
                assert (await store.get(key)).version == reg_version
                await asyncio.sleep(0.5)
            assert registrar.reregistrations == 0 and registrar.lease.id == lease_id
            assert registrar.refresh_count >= 3

            # (4) the killed member rejoins from its data dir and catches up
            leader.start()
            await asyncio.to_thread(cluster.wait_healthy, [leader])
            alone = await EtcdStore.connect(f"etcd://{leader.endpoint}", namespace=ns, timeout=3.0)
            try:
                assert (await alone.get("/k")).value == b"2"
            finally:
                await alone.close()
            current = next(m for m in cluster.members if m.endpoint == store.endpoint)
            assert current is not leader
            current.kill()
            v3 = await _timed(store.put("/k", b"3"), 15, "put after killing a 2nd member", timings)
            assert (await store.get("/k")).version == v3
            assert store.endpoint not in (current.endpoint,)
            await store.put("/w/after", b"after")
            assert (await asyncio.wait_for(anext(own), 15)).key == "/w/after"
            await asyncio.sleep(registrar.ttl_s)
            assert (await store.get(key)).version == reg_version and registrar.reregistrations == 0
            await registrar.close()
            assert await store.get(key) is None
            await own.aclose()
            await theirs.aclose()
        finally:
            await store.close()
            await writer.close()
        print("fail-over timings (s):", timings)

    run(body())


@pytest.mark.process
def test_silent_member_is_left_within_a_deadline(cluster, run):
    """(5) SIGSTOP of the member the store talks to (no RST, like a cut network link): requests time
    out there and complete through another member within a bounded time; a watch through the
    stopped member is re-created on the new one; nothing is missed after SIGCONT either."""
    leader = cluster.leader()
    ns = namespace()
    timeout = 2.0
    timings: dict[str, float] = {}

    async def body():
        store = await EtcdStore.connect(cluster.url(first=leader), namespace=ns, timeout=timeout)
        watcher = None
        try:
            registrar = await register_bookie(store, BookieRegistration("b1", "127.0.0.1:1"), ttl_s=3)
            reg_version = (await store.get(registrar.key)).version
            await store.put("/k", b"0")
            watch = store.watch_prefix("/w/")
            # a store that only watches: gRPC keepalive (10 s + 5 s) notices the silence
            watcher = await EtcdStore.connect(cluster.url(first=leader), namespace=ns, timeout=timeout)
            only = watcher.watch_prefix("/w/")
            await store.put("/w/0", b"before")
            assert (await asyncio.wait_for(anext(watch), 5)).value == b"before"
            assert (await asyncio.wait_for(anext(only), 5)).value == b"before"
            leader.stop()
            stopped_at = time.monotonic()
            try:
                # a deadline at the silent member, then the next member: about one timeout
                v = await _timed(store.put("/k", b"1"), 3 * timeout + 5, "put with a stopped member", timings)
                assert timings["put with a stopped member"] < 2 * timeout + 3
                assert store.endpoint != leader.endpoint
                assert (await _timed(store.get("/k"), timeout + 2, "next get", timings)).version == v
                await store.put("/w/1", b"during")
                got = await _timed(anext(watch), 15, "watch event", timings)
                assert (got.key, got.value) == ("/w/1", b"during")
                # the 3 s lease was kept alive through another member all along
                while time.monotonic() - stopped_at < 2.5 * registrar.ttl_s:
                    assert (await store.get(registrar.key)).version == reg_version
                    await asyncio.sleep(0.5)
                assert registrar.reregistrations == 0
                got = await asyncio.wait_for(anext(only), 25)
                timings["watch-only store's event, since SIGSTOP"] = round(time.monotonic() - stopped_at, 2)
                assert (got.key, got.value, watcher.watch_resumes) == ("/w/1", b"during", 1)
                assert time.monotonic() - stopped_at < 10 + 5 + 5
            finally:
                leader.cont()
            await store.put("/w/2", b"after")
            assert (await asyncio.wait_for(anext(watch), 10)).value == b"after"
            assert (await asyncio.wait_for(anext(only), 10)).value == b"after"
            await watch.aclose()
            await only.aclose()
            await registrar.close()
        finally:
            await store.close()
            if watcher is not None:
                await watcher.close()
        print("silent member timings (s):", timings)

    run(body())


@pytest.mark.process
def test_every_member_down_is_unavailable_naming_all(cluster, run):
    """Losing every member (first quorum, then all) ends in MetadataUnavailable naming every
    endpoint, within the bounded retry time; nothing hangs."""
    ns = namespace()

    async def body():
        store = await EtcdStore.connect(cluster.url(), namespace=ns, timeout=1.0)
        try:
            await store.put("/k", b"0")
            cluster.members[1].kill()
            cluster.members[2].kill()  # no quorum: member 0 answers "no leader" (or times out)
            t0 = time.monotonic()
            with pytest.raises(MetadataUnavailable) as info:
                await asyncio.wait_for(store.put("/k", b"1"), 20)
            took = time.monotonic() - t0
            print(f"quorum lost: MetadataUnavailable after {took:.2f}s")
            assert took < 3 * (1.0 + 1.0) + 2
            assert all(m.endpoint in str(info.value) for m in cluster.members)
            assert info.value.retriable
        finally:
            await store.close()

    run(body())


def _lease_of(member: Member, key: str) -> int | None:
    """The lease id attached to ``key``, read through etcd's JSON gateway (None: no such key)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    deadline = time.monotonic() + 10
    while True:
        req = urllib.request.Request(f"http://{member.endpoint}/v3/kv/range", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                kvs = json.loads(r.read()).get("kvs") or []
            return int(kvs[0].get("lease", 0)) if kvs else None
        except urllib.error.HTTPError as e:  # 503 while the cluster elects a new leader
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.process
def test_bookie_process_keeps_its_registration_while_a_member_dies(cluster, tmp_path):
    """A bookie process (``scroll bookie``, as LocalCluster starts it) registered through the leader
    keeps its registration, under the same lease, while the leader is SIGKILLed."""
    leader = cluster.leader()
    others = [m for m in cluster.members if m is not leader]
    ns = namespace()
    key = f"{ns}/scroll/bookies/bookie-ha"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    env["SCROLL_METADATA"] = cluster.url(first=leader) + ns
    bookie = Proc("bookie-ha", [sys.executable, "-m", "streams.tools.cli", "bookie", "--data-dir",
                                str(tmp_path / "bookie"), "--port", str(free_port()), "--bookie-id", "bookie-ha",
                                "--registration-ttl", "3", "--log-level", "WARNING"], 0, tmp_path / "bookie.log")
    try:
        bookie.start(env)
        deadline = time.monotonic() + 30
        while "registered" not in bookie.output():
            assert bookie.alive and time.monotonic() < deadline, bookie.output()
            time.sleep(0.05)
        lease = _lease_of(others[0], key)
        assert lease
        leader.kill()
        killed_at = time.monotonic()
        while time.monotonic() - killed_at < 3 * 3:  # three TTLs
            assert _lease_of(others[0], key) == lease, bookie.output()
            time.sleep(0.5)
        assert bookie.alive
        assert "registered again" not in bookie.output()
    finally:
        bookie.stop()
    assert "bookie stopped" in bookie.output()
    assert _lease_of(others[1], key) is None  # it deregistered through the surviving members


@pytest.mark.process
def test_tls_and_credentials_with_several_endpoints(tmp_path, run):
    """etcds:// with several endpoints: each member is verified against the CA under its own host
    name (here ``localhost``), and the credentials authenticate on whichever member is used."""
    if ETCD is None:
        pytest.skip(NO_ETCD)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(files["ca"])
    server.cert_chain_pems[0].write_to_path(files["cert"])
    server.private_key_pem.write_to_path(files["key"])
    password = "s3cr:t"
    with LocalCluster(tmp_path / "c", bookies=0, etcd_password=password,
                      etcd_tls=EtcdTLSFiles(files["cert"], files["key"], files["ca"])) as c:
        dead = free_port()
        url = (f"etcds://root:{urllib.parse.quote(password, safe='')}@127.0.0.1:{dead},localhost:{c.etcd_port}/ns"
               f"?ca={files['ca']}")

        async def body():
            store = await EtcdStore.connect(url, timeout=3.0)
            try:
                assert store.endpoint == f"localhost:{c.etcd_port}"
                assert password not in store.url and f"127.0.0.1:{dead},localhost:{c.etcd_port}" in store.url
                await store.put("/k", b"v")
                assert (await store.get("/k")).value == b"v"
            finally:
                await store.close()
            # the other member name, with a CA that did not sign it: a clear TLS error, not a retry loop
            other = tmp_path / "other-ca.pem"
            trustme.CA().cert_pem.write_to_path(other)
            with pytest.raises(MetadataAuthError, match="TLS") as info:
                await EtcdStore.connect(url.replace(files["ca"], str(other)), timeout=3.0)
            assert password not in str(info.value)

        run(body(), timeout=60)
