"""``BatchingStore`` (the Kafka listener's metadata store) and the batched calls it relies on
(``create_all``, ``get_many``), on both backends: what callers of one loop turn see is what each
would have seen alone, in fewer round trips."""

from __future__ import annotations

import asyncio

import pytest

from fragments.batching import BatchingStore
from fragments.memstore import LeaseExpired


def test_create_all_is_all_or_nothing_under_the_lease(store, run) -> None:
    async def go():
        lease = await store.grant_lease(5.0)
        assert await store.create_all({"c/1": b"1", "c/2": b"1"}, lease=lease) is not None
        assert await store.create_all({"c/2": b"2", "c/3": b"2"}, lease=lease) is None  # c/2 exists
        assert await store.get("c/3") is None  # nothing of the failed one written
        assert [v.value if v else None for v in await store.get_many(["c/1", "c/2", "c/3"])] == [b"1", b"1", None]
        await lease.revoke()  # the keys were created under it
        assert await store.get_many(["c/1", "c/2"]) == [None, None]
        with pytest.raises(LeaseExpired):
            await store.create_all({"c/4": b"x", "c/5": b"x"}, lease=lease)

    run(go())


def test_one_turn_is_one_request_and_each_caller_is_decided_alone(store, run) -> None:
    async def go():
        b = BatchingStore(store)
        for i in range(5):
            await store.put(f"k/{i}", str(i).encode())
        b.requests = 0
        got = await asyncio.gather(*(b.get(f"k/{i}") for i in range(6)))
        assert [g.value if g else None for g in got] == [b"0", b"1", b"2", b"3", b"4", None]
        assert b.requests == 1
        versions = {i: g.version for i, g in enumerate(got) if g}

        # five compare-and-sets at once, one of them stale: the four others are applied, the stale
        # one is refused, exactly as alone (one merged try, then each alone)
        b.requests = 0
        stale = {**versions, 2: versions[2] + 1000}
        res = await asyncio.gather(*(b.cas(f"k/{i}", b"new", stale[i]) for i in range(5)))
        assert [r is not None for r in res] == [True, True, False, True, True]
        assert [(await store.get(f"k/{i}")).value for i in range(5)] == [b"new", b"new", b"2", b"new", b"new"]
        assert b.requests == 1 + 5

        b.requests = 0  # all current: one request
        cur = await store.get_many([f"k/{i}" for i in range(5)])
        res = await asyncio.gather(*(b.cas(f"k/{i}", b"newer", cur[i].version) for i in range(5)))
        assert all(r is not None for r in res) and b.requests == 1
        assert [v.value for v in await store.get_many([f"k/{i}" for i in range(5)])] == [b"newer"] * 5

        # transactions on one key are not merged: both decided in order, the second sees the first
        v = (await store.get("k/0")).version
        first, second = await asyncio.gather(b.cas("k/0", b"a", v), b.cas("k/0", b"b", v))
        assert first is not None and second is None and (await store.get("k/0")).value == b"a"

        with pytest.raises(ValueError):  # a bad transaction fails its caller alone, at once
            await b.txn({"k/1": -1}, {})

    run(go())


def test_puts_under_one_lease_are_one_request_and_go_with_it(store, run) -> None:
    """A listener taking over many partitions writes each one's writer key under its lease: the
    puts of one turn are one request, each caller gets its key's version, a key written twice in
    the turn ends with the later value, and the keys go when the lease is revoked."""
    async def go():
        b = BatchingStore(store)
        lease = await b.grant_lease(30.0)
        b.requests = 0
        versions = await asyncio.gather(*(b.put(f"w/{i}", b"%d" % i, lease=lease) for i in range(40)))
        assert b.requests == 1
        got = await store.get_many([f"w/{i}" for i in range(40)])
        assert [g.value for g in got] == [b"%d" % i for i in range(40)]
        assert [g.version for g in got] == versions
        b.requests = 0
        await asyncio.gather(b.put("w/0", b"first", lease=lease), b.put("w/0", b"second", lease=lease))
        assert b.requests == 2 and (await store.get("w/0")).value == b"second"
        await lease.revoke()
        assert await store.get_many([f"w/{i}" for i in range(3)]) == [None, None, None]

    run(go())
