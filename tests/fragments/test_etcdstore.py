"""EtcdStore specifics: URLs, namespaces, paging, and what happens when etcd is down or dies."""

from __future__ import annotations

import asyncio

import pytest

from fragments import etcdstore
from fragments.etcdstore import EtcdStore, parse_etcd_url
from fragments.memstore import MemoryStore
from fragments.store import MetadataUnavailable
from fragments.stores import open_store

from .conftest import free_port, namespace

pytestmark = pytest.mark.timeout(60)


def test_parse_etcd_url():
    assert parse_etcd_url("etcd://127.0.0.1:2380") == ("127.0.0.1", 2380, "")
    assert parse_etcd_url("http://localhost:1234/") == ("localhost", 1234, "")
    assert parse_etcd_url("etcd://10.0.0.1") == ("10.0.0.1", 2379, "")
    assert parse_etcd_url("etcd://127.0.0.1:2379/tenant-a") == ("127.0.0.1", 2379, "/tenant-a")
    for bad in ["ftp://127.0.0.1:2379", "etcd://127.0.0.1:2379?ca=/x", "127.0.0.1:2379", "etcd://a:1,b:2", "etcd://h:notaport"]:
        with pytest.raises(ValueError):
            parse_etcd_url(bad)


def test_open_store_by_url(etcd_server, run):
    async def body():
        mem = await open_store("memory://")
        assert isinstance(mem, MemoryStore)
        await mem.close()
        port = etcd_server.client_port
        for url in (f"etcd://127.0.0.1:{port}", f"http://127.0.0.1:{port}{namespace()}"):
            s = await open_store(url)
            assert isinstance(s, EtcdStore)
            await s.put("/k", b"v")
            assert (await s.get("/k")).value == b"v"
            await s.delete("/k")
            await s.close()
        with pytest.raises(ValueError):
            await open_store("zookeeper://127.0.0.1:2181")

    run(body())


def test_nothing_listening_is_unavailable_quickly(run):
    url = f"etcd://127.0.0.1:{free_port()}"

    async def body():
        with pytest.raises(MetadataUnavailable) as info:
            await asyncio.wait_for(EtcdStore.connect(url, timeout=2.0), 10)
        assert url in str(info.value)
        assert info.value.retriable

    run(body(), timeout=20)


def test_killing_etcd_mid_use_gives_unavailable_not_a_hang(etcd_servers, run):
    server = etcd_servers()

    async def body():
        store = await EtcdStore.connect(server.url, timeout=2.0)
        lease = await store.grant_lease(30)
        await store.put("/k", b"v", lease=lease)
        watch = store.watch_prefix("/w/")
        await store.put("/w/a", b"1")
        assert (await asyncio.wait_for(anext(watch), 5)).key == "/w/a"
        waiting = asyncio.ensure_future(anext(watch))

        server.kill()

        async def fails(aw):
            with pytest.raises(MetadataUnavailable) as info:
                await asyncio.wait_for(aw, 10)  # bounded: a hang fails the test instead of blocking it
            assert server.url in str(info.value)

        await fails(waiting)
        await fails(store.put("/k", b"v2"))
        await fails(store.get("/k"))
        await fails(store.cas("/k", b"v3", 1))
        await fails(store.list_prefix("/"))
        await fails(lease.refresh())
        await fails(store.grant_lease(5))
        await fails(anext(store.watch_prefix("/w/")))
        await asyncio.wait_for(store.close(), 10)

    run(body(), timeout=60)


def test_namespaces_isolate_tenants(etcd_server, run):
    async def body():
        a = await EtcdStore.connect(etcd_server.url, namespace=namespace())
        b = await EtcdStore.connect(etcd_server.url, namespace=namespace())
        try:
            watch = b.watch_prefix("")
            await a.put("/k", b"a")
            assert await b.get("/k") is None
            await b.put("/k", b"b")
            assert (await a.get("/k")).value == b"a"
            assert [k for k, _ in await a.list_prefix("")] == ["/k"]
            event = await asyncio.wait_for(anext(watch), 5)
            assert (event.key, event.value) == ("/k", b"b")  # b's own write, not a's
            await watch.aclose()
        finally:
            await a.close()
            await b.close()

    run(body())


def test_list_prefix_pages_through_one_snapshot(etcd_server, run, monkeypatch):
    monkeypatch.setattr(etcdstore, "LIST_PAGE", 3)

    async def body():
        s = await EtcdStore.connect(etcd_server.url, namespace=namespace())
        try:
            keys = [f"/p/{i:03d}" for i in range(10)]
            for k in reversed(keys):
                await s.put(k, k.encode())
            await s.put("/q", b"outside")
            got = await s.list_prefix("/p/")
            assert [k for k, _ in got] == keys
            assert all(v.value == k.encode() for k, v in got)
        finally:
            await s.close()

    run(body())


def test_lease_ttl_is_whole_seconds(etcd_server, run):
    async def body():
        s = await EtcdStore.connect(etcd_server.url, namespace=namespace())
        try:
            lease = await s.grant_lease(0.3)
            assert lease.ttl_s == 1.0
            await lease.revoke()
        finally:
            await s.close()

    run(body())
