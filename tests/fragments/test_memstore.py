"""MemoryStore specifics: leases on an injected clock (exact expiry, refresh extends), close."""

from __future__ import annotations

import asyncio

import pytest

from fragments.memstore import LeaseExpired, MemoryStore, StoreClosed
from fragments.store import MetadataError

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lease_expiry_follows_the_injected_clock(run):
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    async def body():
        lease = await store.grant_lease(2.0)
        await store.put("/k", b"v", lease=lease)
        clock.now += 1.5
        await lease.refresh()  # deadline moves to now + 2
        clock.now += 1.9
        assert await store.get("/k") is not None
        clock.now += 0.2  # 2.1 s since the refresh
        assert await store.get("/k") is None
        with pytest.raises(LeaseExpired):
            await lease.refresh()
        with pytest.raises(LeaseExpired):
            await store.create("/k2", b"v", lease=lease)
        await store.close()

    run(body())


def test_expiry_is_one_revision_and_reaches_watchers(run):
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    async def body():
        lease = await store.grant_lease(1.0)
        watch = store.watch_prefix("/")
        await store.put("/a", b"1", lease=lease)
        await store.put("/b", b"2", lease=lease)
        rev = store.revision
        clock.now += 5
        assert store.expire_leases() == 1
        assert store.revision == rev + 1
        events = [await asyncio.wait_for(anext(watch), 5) for _ in range(4)]
        assert [(e.key, e.value) for e in events[2:]] == [("/a", None), ("/b", None)]
        assert events[2].version == events[3].version == rev + 1
        await store.close()

    run(body())


def test_reaper_expires_without_any_operation(run):
    """A watcher sees a dead lease's keys go even if nobody touches the store."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    async def body():
        lease = await store.grant_lease(1.0)
        await store.put("/r", b"1", lease=lease)
        watch = store.watch_prefix("/r")
        clock.now += 2
        event = await asyncio.wait_for(anext(watch), 5)
        assert (event.key, event.value) == ("/r", None)
        await store.close()

    run(body())


def test_closed_store_refuses_and_ends_watches(run):
    store = MemoryStore()

    async def body():
        watch = store.watch_prefix("/")
        reader = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0)
        await store.close()
        with pytest.raises(StopAsyncIteration):
            await reader
        with pytest.raises(StoreClosed):
            await store.get("/x")
        assert issubclass(StoreClosed, MetadataError) and not StoreClosed.retriable

    run(body())


def test_foreign_lease_is_rejected(run):
    async def body():
        a, b = MemoryStore(), MemoryStore()
        lease = await a.grant_lease(5)
        with pytest.raises(TypeError):
            await b.put("/k", b"v", lease=lease)
        await a.close()
        await b.close()

    run(body())
