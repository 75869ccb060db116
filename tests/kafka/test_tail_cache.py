"""A writable partition answers tailing fetches from the entries it just wrote (``tailcache.py``):
byte for byte what the bookies answer, no bookie read, and bounded per partition and per process."""

from __future__ import annotations

import asyncio
import time

from kio.schema.errors import ErrorCode

from compat_kafka.partitions.tailcache import TailBudget, TailCache
from streams.batches import COMPRESSION, BatchBuilder

from .shimproc import RawConnection
from .test_produce_merge import _batch, _create, _produce, _read


def _built(base: int, n: int, size: int = 100) -> bytearray:
    b = BatchBuilder(COMPRESSION["none"], 1 << 20)
    for i in range(n):
        assert b.raw_append(i, 1000, None, b"v" * size, []) is not None
    b.count = n
    return b.build(base)


def test_runs_are_contiguous_and_bounded_by_entries_bytes_and_the_process_budget():
    budget = TailBudget(10_000)
    c = TailCache(entries=3, max_bytes=5_000, budget=budget)
    for eid in range(5):  # entry i holds offsets 10i..10i+9
        c.add(eid, _built(10 * eid, 10, 30))
    assert [b.entry_id for b in c.run(2, 10)] == [2, 3, 4] and c.run(0, 10) == []  # the last three: 0, 1 dropped
    assert c.run(1, 10) == [] and c.run(7, 9) == []
    assert [b.entry_id for b in c.run(3, 3)] == [3]
    assert [(b.base_offset, b.end_offset) for b in c.run(2, 4)] == [(20, 30), (30, 40), (40, 50)]
    assert (c.locate(35), c.locate(49), c.locate(50), c.locate(19)) == (3, 4, None, None)
    # entries of sealed fragments (before the writer's current one) are not served: compaction may rewrite them
    assert [b.entry_id for b in c.run(3, 4, min_entry=3)] == [3, 4] and c.run(2, 4, min_entry=3) == []
    assert (c.locate(35, min_entry=4), c.locate(45, min_entry=4)) == (None, 4)
    c.add(9, _built(100, 10, 300))  # ~3.3 KB  # not the next entry (a no-op between): the run starts again
    assert [b.entry_id for b in c.run(9, 9)] == [9] and c.run(4, 9) == []
    assert budget.used == c.bytes
    other = TailCache(entries=100, max_bytes=1 << 20, budget=budget)
    big = _built(0, 25, 300)  # ~8 KB: more than the process budget has left, less than all of it
    other.add(0, big)
    assert other.run(0, 0) == [] and budget.used == c.bytes  # not kept, nothing else lost
    c.clear()
    other.add(0, big)
    assert [b.entry_id for b in other.run(0, 0)] == [0] and budget.used == len(big)
    budget.shed()  # a produce waits for memory: every cache gives its bytes back
    assert budget.used == 0 and other.run(0, 0) == []


def test_a_tailing_fetch_is_served_from_the_cache_byte_for_byte_as_the_bookies_hold_it(shim, topic):
    _create(shim, topic)
    t0 = int(time.time() * 1000)
    batches = [_batch([(b"k%d" % i, b"v" * (i * 37 % 300), [("h", b"x")], t0 + i)]) for i in range(6)]
    batches.insert(3, _batch([(None, b"z" * 2000, [], t0)], compression=1))  # stored as it came
    with RawConnection(shim.port) as conn:
        for b in batches:
            assert _produce(conn, topic, b).error_code == ErrorCode.none

    async def both_ways():
        plog = shim.server.broker._logs[(topic, 0)]
        hits, misses = plog._tail.hits, plog._tail.misses
        cached = await plog.read(0, 1 << 20)
        assert plog._tail.hits > hits and plog._tail.misses == misses  # no bookie read
        plog._tail.clear()  # now the same offsets from the bookies
        plog._cursors.clear()
        stored = await plog.read(0, 1 << 20)
        assert plog._tail.misses > misses
        return cached, stored

    cached, stored = asyncio.run_coroutine_threadsafe(both_ways(), shim.loop).result(60)
    assert cached and cached == stored
    assert [v for _o, _k, v, _h, _t in _read(shim.bootstrap, topic, 7)] == [
        b"v" * (i * 37 % 300) for i in range(3)] + [b"z" * 2000] + [b"v" * (i * 37 % 300) for i in range(3, 6)]

