"""Bookie registration against every backend, plus a real killed process against etcd."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fragments.etcdstore import EtcdStore
from fragments.ledgers import bookie_key
from fragments.registry import (
    BookieAlreadyRegistered,
    BookieRegistration,
    live_bookies,
    register_bookie,
    watch_bookies,
)
from fragments.store import MetadataStore

from .conftest import namespace

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def reg(bookie_id: str, port: int = 3181, **kw) -> BookieRegistration:
    return BookieRegistration(bookie_id=bookie_id, address=f"127.0.0.1:{port}", started_at=1.5, **kw)


async def until(predicate, what: str, timeout: float = 15.0, step: float = 0.05):
    """Poll ``predicate`` (sync or async) until true, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(step)


async def next_set(sets, timeout: float = 15.0) -> list[str]:
    return [r.bookie_id for r in await asyncio.wait_for(anext(sets), timeout)]


async def set_becomes(sets, expected: list[str], timeout: float = 15.0) -> None:
    """Read live sets until ``expected`` shows up (several changes may come as one set)."""

    async def wait():
        while await next_set(sets) != expected:
            pass

    await asyncio.wait_for(wait(), timeout)


def test_registration_json_and_validation():
    r = reg("bk-1", rack="/r1", free_bytes=10, used_bytes=5, read_only=True)
    assert BookieRegistration.from_json(r.to_json()) == r
    assert BookieRegistration.from_json(r.to_json().replace("{", '{"future_field": 1, ', 1)) == r
    for bad in [dict(bookie_id="", address="127.0.0.1:1"), dict(bookie_id="a/b", address="127.0.0.1:1"),
                dict(bookie_id="a", address="127.0.0.1"), dict(bookie_id="a", address="127.0.0.1:x")]:
        with pytest.raises(ValueError):
            BookieRegistration(**bad)


def test_register_update_close(store: MetadataStore, run):
    async def body():
        r = await register_bookie(store, reg("bk-1"), ttl_s=5)
        assert await live_bookies(store) == [reg("bk-1")]
        updated = await r.update(free_bytes=123, read_only=True)
        assert updated == reg("bk-1", free_bytes=123, read_only=True)
        assert await live_bookies(store) == [updated]
        await r.close()
        assert await live_bookies(store) == []
        await r.close()  # idempotent

    run(body())


def test_refreshed_registration_outlives_its_ttl(store: MetadataStore, run):
    async def body():
        async with await register_bookie(store, reg("bk-1"), ttl_s=1.0) as r:
            version = (await store.get(bookie_key("bk-1"))).version
            await until(lambda: r.refresh_count >= 4, "four keep-alives (more than one TTL)")
            assert (await store.get(bookie_key("bk-1"))).version == version  # never expired and rewritten
            assert r.reregistrations == 0

    run(body())


def test_abandoned_registration_disappears_after_ttl(store: MetadataStore, run):
    async def body():
        sets = watch_bookies(store)
        async with contextlib.aclosing(sets):
            assert await next_set(sets) == []
            dead = await register_bookie(store, reg("dead", 3181), ttl_s=1.0)
            alive = await register_bookie(store, reg("alive", 3182), ttl_s=5.0)
            await set_becomes(sets, ["alive", "dead"])
            await dead.abandon()  # as if the process had died: no refresh, no revoke
            assert await next_set(sets) == ["alive"]
            await alive.close()
            assert await next_set(sets) == []

    run(body())


def test_lost_lease_is_registered_again(store: MetadataStore, run):
    async def body():
        async with await register_bookie(store, reg("bk-1"), ttl_s=1.0) as r:
            watch = store.watch_prefix(bookie_key("bk-1"))
            await r.lease.revoke()  # e.g. the process was paused for longer than the TTL
            assert (await asyncio.wait_for(anext(watch), 10)).value is None
            back = await asyncio.wait_for(anext(watch), 10)
            assert back.value == reg("bk-1").to_json().encode()
            await watch.aclose()
            for _ in range(500):  # the watch can deliver the put before the registrar's put returns
                if r.reregistrations:
                    break
                await asyncio.sleep(0.01)
            assert r.reregistrations == 1
            assert await live_bookies(store) == [reg("bk-1")]

    run(body())


def test_same_id_waits_for_the_previous_registration(store: MetadataStore, run):
    async def body():
        first = await register_bookie(store, reg("bk-1", 3181), ttl_s=5)
        with pytest.raises(BookieAlreadyRegistered) as info:
            await register_bookie(store, reg("bk-1", 4181), ttl_s=5, wait_s=0.2)
        assert info.value.retriable
        second = asyncio.ensure_future(register_bookie(store, reg("bk-1", 4181), ttl_s=5, wait_s=20))
        await asyncio.sleep(0.1)
        assert not second.done()
        await first.close()
        r = await asyncio.wait_for(second, 10)
        assert await live_bookies(store) == [reg("bk-1", 4181)]
        await r.close()

    run(body())


def test_a_registration_that_waited_for_its_predecessor_keeps_its_whole_ttl(run):
    """A restarted bookie waits for its previous incarnation's key to expire (up to a TTL). The
    lease it registers with then gets its whole TTL again, instead of lapsing at once and making the
    bookie leave and rejoin the registry (writers replace it: found as a CI flake)."""
    from fragments.memstore import MemoryStore

    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])

    async def body():
        old = await register_bookie(store, reg("bk-1", 3181), ttl_s=10)
        await old.abandon()  # SIGKILLed: its key lives until t=10
        now[0] = 5.0
        new = asyncio.ensure_future(register_bookie(store, reg("bk-1", 4181), ttl_s=10, wait_s=60))
        await asyncio.sleep(0.05)
        assert not new.done()
        now[0] = 14.0
        assert store.expire_leases() == 1  # the old key goes; the new incarnation registers
        r = await asyncio.wait_for(new, 10)
        now[0] = 20.0  # past the TTL of a lease granted at t=5, within one renewed at t=14
        store.expire_leases()
        assert await live_bookies(store) == [reg("bk-1", 4181)]
        await r.close()

    run(body())


CHILD = """
import asyncio, sys
from fragments.etcdstore import EtcdStore
from fragments.registry import BookieRegistration, register_bookie

async def main():
    store = await EtcdStore.connect(sys.argv[1], namespace=sys.argv[2])
    await register_bookie(store, BookieRegistration("child", "127.0.0.1:3999"), ttl_s=1.0)
    print("registered", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_killed_bookie_process_disappears_after_ttl(etcd_server, run):
    ns = namespace()
    child = subprocess.Popen([sys.executable, "-c", CHILD, etcd_server.url, ns], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "registered", child.stderr.read()

        async def body():
            store = await EtcdStore.connect(etcd_server.url, namespace=ns)
            try:
                sets = watch_bookies(store)
                async with contextlib.aclosing(sets):
                    assert await next_set(sets) == ["child"]
                    child.kill()
                    assert await next_set(sets) == []
            finally:
                await store.close()

        run(body())
    finally:
        child.kill()
        child.wait(10)
