"""The MetadataStore contract, run against every backend (``store`` is parametrized).

Versions are only compared with each other (they grow on every write, a txn writes all its keys at
one version, 0 means absent), never against literal numbers: etcd's revisions are global.
"""

from __future__ import annotations

import asyncio

import pytest

from fragments.memstore import MAX_TXN_OPS, LeaseExpired
from fragments.store import MetadataStore, TxnResult, Versioned, WatchEvent

pytestmark = pytest.mark.timeout(60)


async def next_event(watch, timeout: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(anext(watch), timeout)


def test_get_put_and_versions(store: MetadataStore, run):
    async def body():
        assert await store.get("/a") is None
        v1 = await store.put("/a", b"one")
        assert v1 > 0
        assert await store.get("/a") == Versioned(b"one", v1)
        v2 = await store.put("/b", b"two")
        v3 = await store.put("/a", b"three")
        assert v1 < v2 < v3  # every write gets a new, larger version, whatever the key
        assert await store.get("/a") == Versioned(b"three", v3)
        assert await store.get("/b") == Versioned(b"two", v2)
        # binary and empty values round-trip
        v4 = await store.put("/bin", b"\x00\xff\x10")
        assert await store.get("/bin") == Versioned(b"\x00\xff\x10", v4)
        v5 = await store.put("/empty", b"")
        assert await store.get("/empty") == Versioned(b"", v5)

    run(body())


def test_create_only_if_absent(store: MetadataStore, run):
    async def body():
        v = await store.create("/c", b"first")
        assert v is not None
        assert await store.create("/c", b"second") is None
        assert await store.get("/c") == Versioned(b"first", v)
        assert await store.delete("/c")
        v2 = await store.create("/c", b"again")
        assert v2 is not None and v2 > v

    run(body())


def test_cas_semantics(store: MetadataStore, run):
    async def body():
        # version 0: "the key must not exist"
        assert await store.cas("/k", b"x", 5) is None  # absent key is not at any version > 0
        v1 = await store.cas("/k", b"a", 0)
        assert v1 is not None
        assert await store.cas("/k", b"b", 0) is None  # exists now
        v2 = await store.cas("/k", b"b", v1)
        assert v2 is not None and v2 > v1
        assert await store.cas("/k", b"c", v1) is None  # stale
        assert await store.get("/k") == Versioned(b"b", v2)
        # a write to another key does not change this key's version
        await store.put("/other", b"o")
        v3 = await store.cas("/k", b"c", v2)
        assert v3 is not None
        assert await store.get("/k") == Versioned(b"c", v3)

    run(body())


def test_delete_semantics(store: MetadataStore, run):
    async def body():
        assert await store.delete("/d") is False
        v = await store.put("/d", b"1")
        assert await store.delete("/d", expected_version=v + 1000) is False
        assert await store.delete("/d", expected_version=0) is False  # 0 means absent: nothing to delete
        assert await store.get("/d") == Versioned(b"1", v)
        assert await store.delete("/d", expected_version=v) is True
        assert await store.get("/d") is None
        assert await store.delete("/d") is False
        # after a delete the key is absent again: version-0 CAS recreates it at a new version
        v2 = await store.cas("/d", b"2", 0)
        assert v2 is not None and v2 > v
        assert await store.cas("/d", b"3", v) is None  # the pre-delete version never matches again
        assert await store.delete("/d") is True

    run(body())


def test_txn_all_or_nothing(store: MetadataStore, run):
    async def body():
        va = await store.put("/t/a", b"a")
        vb = await store.put("/t/b", b"b")
        # one compare fails: nothing is written or deleted
        r = await store.txn({"/t/a": va, "/t/b": vb + 1000}, {"/t/a": b"A", "/t/new": b"N"}, ("/t/b",))
        assert r == TxnResult(False, {})
        assert await store.get("/t/a") == Versioned(b"a", va)
        assert await store.get("/t/b") == Versioned(b"b", vb)
        assert await store.get("/t/new") is None
        # every compare holds (including "absent" for /t/new): all puts at one version, deletes applied
        r = await store.txn({"/t/a": va, "/t/b": vb, "/t/new": 0}, {"/t/a": b"A", "/t/new": b"N"}, ("/t/b",))
        assert r.succeeded
        assert set(r.versions) == {"/t/a", "/t/new"}
        v = r.versions["/t/a"]
        assert r.versions["/t/new"] == v and v > vb
        assert await store.get("/t/a") == Versioned(b"A", v)
        assert await store.get("/t/new") == Versioned(b"N", v)
        assert await store.get("/t/b") is None
        # no compares: unconditional
        r = await store.txn({}, {"/t/c": b"C"})
        assert r.succeeded and r.versions["/t/c"] > v
        # a txn that only compares succeeds and writes nothing
        r = await store.txn({"/t/c": r.versions["/t/c"]}, {})
        assert r == TxnResult(True, {})

    run(body())


def test_txn_rejects_invalid_requests(store: MetadataStore, run):
    async def body():
        with pytest.raises(ValueError):
            await store.txn({}, {"/x": b"1"}, ("/x",))
        too_many = {f"/many/{i}": b"v" for i in range(MAX_TXN_OPS + 1)}
        with pytest.raises(ValueError):
            await store.txn({}, too_many)
        assert await store.list_prefix("/") == []

    run(body())


def test_list_prefix(store: MetadataStore, run):
    async def body():
        versions = {}
        for key in ["/p/b", "/p/a", "/p/c/1", "/pq", "/p", "/q/a"]:
            versions[key] = await store.put(key, key.encode())
        got = await store.list_prefix("/p/")
        assert [k for k, _ in got] == ["/p/a", "/p/b", "/p/c/1"]
        assert all(v == Versioned(k.encode(), versions[k]) for k, v in got)
        assert [k for k, _ in await store.list_prefix("/p")] == ["/p", "/p/a", "/p/b", "/p/c/1", "/pq"]
        assert await store.list_prefix("/nothing/") == []

    run(body())


def test_watch_prefix_sees_changes_in_order(store: MetadataStore, run):
    async def body():
        await store.put("/w/before", b"old")  # before the watch: not reported
        watch = store.watch_prefix("/w/")
        try:
            v1 = await store.put("/w/a", b"1")
            await store.put("/elsewhere", b"x")  # outside the prefix
            r = await store.txn({"/w/a": v1}, {"/w/a": b"2", "/w/b": b"3"})
            v3 = r.versions["/w/a"]
            assert await store.delete("/w/a")
            events = [await next_event(watch) for _ in range(4)]
        finally:
            await watch.aclose()
        assert events[0] == WatchEvent("/w/a", b"1", v1)
        assert {events[1], events[2]} == {WatchEvent("/w/a", b"2", v3), WatchEvent("/w/b", b"3", v3)}
        assert events[3].key == "/w/a" and events[3].value is None and events[3].version > v3
        # a closed watch ends
        with pytest.raises(StopAsyncIteration):
            await next_event(watch)

    run(body())


def test_watch_close_while_waiting_ends_the_reader(store: MetadataStore, run):
    async def body():
        watch = store.watch_prefix("/idle/")
        await store.put("/idle/x", b"1")
        assert (await next_event(watch)).key == "/idle/x"
        reader = asyncio.ensure_future(next_event(watch))
        await asyncio.sleep(0)
        await watch.aclose()
        with pytest.raises(StopAsyncIteration):
            await reader

    run(body())


def test_lease_revoke_removes_keys(store: MetadataStore, run):
    async def body():
        lease = await store.grant_lease(30)
        assert lease.ttl_s >= 30
        watch = store.watch_prefix("/lease/")
        try:
            await store.put("/lease/a", b"a", lease=lease)
            assert await store.create("/lease/b", b"b", lease=lease) is not None
            await store.put("/lease/c", b"c", lease=lease)
            await store.put("/lease/c", b"c2")  # a plain put detaches the lease
            await lease.refresh()
            await lease.revoke()
            assert [k for k, _ in await store.list_prefix("/lease/")] == ["/lease/c"]
            events = [await next_event(watch) for _ in range(6)]
            deletes = [e for e in events[4:] if e.value is None]
            assert sorted(e.key for e in deletes) == ["/lease/a", "/lease/b"]
            with pytest.raises(LeaseExpired):
                await lease.refresh()
            with pytest.raises(LeaseExpired):
                await store.put("/lease/d", b"d", lease=lease)
            await lease.revoke()  # revoking twice is harmless
        finally:
            await watch.aclose()

    run(body())


def test_lease_expires_without_refresh(store: MetadataStore, run):
    async def body():
        lease = await store.grant_lease(1.0)
        watch = store.watch_prefix("/exp/")
        try:
            v = await store.put("/exp/k", b"v", lease=lease)
            assert await next_event(watch) == WatchEvent("/exp/k", b"v", v)
            gone = await next_event(watch, timeout=15)  # the TTL passes with no refresh
            assert gone.key == "/exp/k" and gone.value is None and gone.version > v
        finally:
            await watch.aclose()
        assert await store.get("/exp/k") is None
        with pytest.raises(LeaseExpired):
            await lease.refresh()

    run(body())


def test_next_id_is_unique_under_concurrency(store: MetadataStore, run):
    async def body():
        assert [await store.next_id("/ids/x") for _ in range(3)] == [1, 2, 3]
        ids = await asyncio.gather(*(store.next_id("/ids/y") for _ in range(20)))
        assert sorted(ids) == list(range(1, 21))
        assert (await store.get("/ids/y")).value == b"20"

    run(body())


def test_next_ids_allocates_disjoint_blocks(store: MetadataStore, run):
    """A block of ids in one allocation (a topic's partitions), disjoint from concurrent ones."""
    async def body():
        assert await store.next_ids("/ids/z", 5) == range(1, 6)
        blocks = await asyncio.gather(*(store.next_ids("/ids/z", 3) for _ in range(10)), store.next_id("/ids/z"))
        got = sorted(i for b in blocks for i in (b if isinstance(b, range) else [b]))
        assert got == list(range(6, 37))
        with pytest.raises(ValueError):
            await store.next_ids("/ids/z", 0)

    run(body())


def test_concurrent_cas_race(store: MetadataStore, run):
    """Many tasks increment one counter by CAS: every success is counted exactly once."""

    async def body():
        await store.put("/race", b"0")
        versions: list[int] = []

        async def incrementer(attempts: int) -> tuple[int, int]:
            won = lost = 0
            for _ in range(attempts):
                cur = await store.get("/race")
                v = await store.cas("/race", str(int(cur.value) + 1).encode(), cur.version)
                if v is None:
                    lost += 1
                else:
                    won += 1
                    versions.append(v)
            return won, lost

        results = await asyncio.gather(*(incrementer(15) for _ in range(8)))
        successes = sum(w for w, _ in results)
        conflicts = sum(lost for _, lost in results)
        assert successes + conflicts == 8 * 15
        assert successes >= 15  # someone always wins a round
        final = await store.get("/race")
        assert int(final.value) == successes
        assert len(set(versions)) == successes
        assert final.version == max(versions)

    run(body())
