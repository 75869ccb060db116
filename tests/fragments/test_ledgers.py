"""LedgerStore against every backend: creation, lookups, CAS, fragment range reads, deletion."""

from __future__ import annotations

import asyncio

import pytest

from fragments.ledgers import (
    ID_BLOCK,
    LEDGER_ID_COUNTER,
    LedgerExists,
    LedgerStore,
    NoSuchFragment,
    NoSuchLedger,
    by_name_key,
    fragment_key,
    meta_key,
)
from fragments.model import Fragment, InvalidConfig, LedgerConfig, LedgerMeta, LedgerStatus
from fragments.store import MetadataStore

pytestmark = pytest.mark.timeout(60)

CONFIG = LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2)
ENSEMBLE = ("b1", "b2", "b3")


async def append_fragments(ls: LedgerStore, meta: LedgerMeta, version: int, count: int, batch: int = 100):
    """Seal the tail and add ``count`` fragments of 10 entries each, ``batch`` per CAS."""
    tail = await ls.get_fragment(meta.ledger_id, meta.last_fragment_index)
    while count > 0:
        n = min(batch, count)
        frags = []
        for _ in range(n):
            sealed = Fragment(tail.index, tail.first_entry_id, tail.ensemble, tail.created_term,
                              last_entry_id=tail.first_entry_id + 9, size_bytes=1000)
            tail = Fragment(tail.index + 1, tail.first_entry_id + 10, tail.ensemble, meta.term)
            frags += [sealed, tail]
        frags = tuple({f.index: f for f in frags}.values())  # the last write of each index wins
        meta = meta.with_(last_fragment_index=tail.index)
        version = await ls.cas_ledger(meta, frags, version)
        assert version is not None
        count -= n
    return meta, version


def test_create_and_get(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        meta, version = await ls.create_ledger("orders", CONFIG, ENSEMBLE, retention={"max_age_s": 60})
        assert meta.name == "orders" and meta.ledger_id >= 1
        assert meta.status is LedgerStatus.OPEN and meta.term == 0
        assert meta.first_fragment_index == meta.last_fragment_index == 0
        assert meta.retention == {"max_age_s": 60} and meta.config == CONFIG
        assert await ls.get_ledger("orders") == (meta, version)
        assert await ls.get_ledger(meta.ledger_id) == (meta, version)
        frag0 = await ls.get_fragment(meta.ledger_id, 0)
        assert frag0 == Fragment(index=0, first_entry_id=0, ensemble=ENSEMBLE, created_term=0, first_offset=0)
        # the documented key layout
        assert (await store.get(by_name_key("orders"))).value == str(meta.ledger_id).encode()
        assert (await store.get(f"/scroll/ledgers/{meta.ledger_id:012d}/meta")).version == version
        assert await store.get(f"/scroll/ledgers/{meta.ledger_id:012d}/fragments/000000000000") is not None
        assert int((await store.get("/scroll/ids/ledger")).value) >= meta.ledger_id  # a block was taken
        other, _ = await ls.create_ledger("payments", CONFIG, ENSEMBLE)
        assert other.ledger_id > meta.ledger_id and other.retention == {}

    run(body())


def test_duplicate_name_and_create_race(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        await ls.create_ledger("dup", CONFIG, ENSEMBLE)
        with pytest.raises(LedgerExists, match="dup") as info:
            await ls.create_ledger("dup", CONFIG, ENSEMBLE)
        assert not info.value.retriable
        results = await asyncio.gather(
            *(ls.create_ledger("raced", CONFIG, ENSEMBLE) for _ in range(6)), return_exceptions=True
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1
        assert all(isinstance(r, LedgerExists) for r in results if isinstance(r, BaseException))
        assert (await ls.get_ledger("raced"))[0] == winners[0][0]

    run(body())


def test_bad_requests_and_missing_ledgers(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        with pytest.raises(InvalidConfig):
            await ls.create_ledger("short", CONFIG, ("b1", "b2"))
        with pytest.raises(InvalidConfig):
            await ls.create_ledger("repeated", CONFIG, ("b1", "b1", "b2"))
        with pytest.raises(ValueError):
            await ls.create_ledger("", CONFIG, ENSEMBLE)
        with pytest.raises(NoSuchLedger, match="ghost") as info:
            await ls.get_ledger("ghost")
        assert not info.value.retriable
        with pytest.raises(NoSuchLedger):
            await ls.get_ledger(424242)
        meta, _ = await ls.create_ledger("real", CONFIG, ENSEMBLE)
        with pytest.raises(NoSuchFragment):
            await ls.get_fragment(meta.ledger_id, 7)
        assert await ls.list_ledgers() == [meta]

    run(body())


def test_cas_ledger_conflict_writes_nothing(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        meta, v0 = await ls.create_ledger("s", CONFIG, ENSEMBLE)
        frag0 = await ls.get_fragment(meta.ledger_id, 0)
        # writer A takes over: term 1, seals fragment 0 at entry 99, opens fragment 1
        a_meta = meta.with_(term=1, last_fragment_index=1)
        sealed = Fragment(0, 0, ENSEMBLE, 0, last_entry_id=99, size_bytes=12345)
        f1 = Fragment(1, 100, ("b2", "b3", "b4"), created_term=1)
        v1 = await ls.cas_ledger(a_meta, (sealed, f1), v0)
        assert v1 is not None and v1 > v0
        # writer B still holds v0: its CAS fails and writes none of its records
        b_meta = meta.with_(term=2, last_fragment_index=2)
        f2 = Fragment(2, 50, ENSEMBLE, created_term=2)
        assert await ls.cas_ledger(b_meta, (frag0, f2), v0) is None
        assert await ls.get_ledger("s") == (a_meta, v1)
        assert await ls.get_fragment(meta.ledger_id, 0) == sealed
        assert await ls.fragments(meta.ledger_id) == [sealed, f1]
        # retention: drop fragment 0 in the same CAS that moves first_fragment_index
        r_meta = a_meta.with_(first_fragment_index=1)
        v2 = await ls.cas_ledger(r_meta, (), v1, drop_fragments=(0,))
        assert v2 is not None
        assert await ls.fragments(meta.ledger_id) == [f1]
        with pytest.raises(ValueError):
            await ls.cas_ledger(r_meta, tuple(Fragment(i, i, ENSEMBLE, 1) for i in range(200)), v2)

    run(body())


def test_fragment_range_reads(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        meta, version = await ls.create_ledger("ranged", CONFIG, ENSEMBLE)
        other, _ = await ls.create_ledger("other", CONFIG, ENSEMBLE)
        meta, version = await append_fragments(ls, meta, version, 30, batch=7)
        lid = meta.ledger_id
        assert [f.index for f in await ls.fragments(lid)] == list(range(31))
        assert [f.index for f in await ls.fragments(lid, 5, 12)] == list(range(5, 13))
        assert [f.index for f in await ls.fragments(lid, 9, 10)] == [9, 10]  # read by key, not ".../0000000000*"
        assert [f.index for f in await ls.fragments(lid, 28, 40)] == [28, 29, 30]  # absent keys are no fragments
        assert [f.index for f in await ls.fragments(lid, first_index=25)] == list(range(25, 31))
        assert [f.index for f in await ls.fragments(lid, last_index=3)] == [0, 1, 2, 3]
        assert await ls.fragments(lid, 12, 5) == []
        assert [f.index for f in await ls.fragments(other.ledger_id)] == [0]
        frags = await ls.fragments(lid)
        assert all(f.sealed for f in frags[:-1]) and not frags[-1].sealed
        assert [f.first_entry_id for f in frags] == [10 * i for i in range(31)]

    run(body())


def test_metadata_does_not_grow_with_the_stream(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        meta, version = await ls.create_ledger("long", CONFIG, ENSEMBLE)
        before = (await store.get(meta_key(meta.ledger_id))).value
        meta, version = await append_fragments(ls, meta, version, 1000)
        after = (await store.get(meta_key(meta.ledger_id))).value
        # the only difference is the digits of last_fragment_index (0 -> 1000): nothing per fragment
        assert meta.last_fragment_index == 1000
        assert len(after) == len(before) + len("1000") - len("0")
        assert after == meta.to_json().encode()
        assert len(after) < 1024
        # ... while every fragment is its own small key
        assert len(await ls.fragments(meta.ledger_id)) == 1001
        last = await store.get(fragment_key(meta.ledger_id, 1000))
        assert len(last.value) < 512

    run(body(), timeout=60)


def test_list_reads_the_meta_records_a_chunk_at_a_time(store: MetadataStore, run):
    """More ledgers than one request reads (128): every one listed, in id order, none twice."""
    async def body():
        ls = LedgerStore(store)
        ids = await store.next_ids(LEDGER_ID_COUNTER, 300)
        made = list(await asyncio.gather(*(ls.create_ledger(f"many-{i}", CONFIG, ENSEMBLE, ledger_id=lid)
                                           for i, lid in enumerate(ids))))
        await ls.delete_ledger("many-7")
        want = sorted((m for m, _v in made if m.name != "many-7"), key=lambda m: m.ledger_id)
        assert await ls.list_ledgers() == want

    run(body())

def test_concurrent_creates_share_blocks_of_ids(store: MetadataStore, run):
    """Two clients creating 40 ledgers each, all at once: every ledger gets an id no other has,
    and the id counter is written once per block of ids, not once per ledger (each of those
    writes is a compare-and-set every concurrent create used to retry)."""
    async def body():
        a, b = LedgerStore(store), LedgerStore(store)
        before = await store.get(LEDGER_ID_COUNTER)
        made = await asyncio.gather(*(ls.create_ledger(f"blk-{n}-{i}", CONFIG, ENSEMBLE)
                                      for n, ls in enumerate((a, b)) for i in range(40)))
        ids = [m.ledger_id for m, _v in made]
        assert len(set(ids)) == 80
        counter = await store.get(LEDGER_ID_COUNTER)
        blocks = (int(counter.value) - (int(before.value) if before else 0)) / ID_BLOCK
        assert blocks == 2 * -(-40 // ID_BLOCK)  # the counter moved by whole blocks, one write each
        assert max(ids) <= int(counter.value)
        assert sorted(m.ledger_id for m in await a.list_ledgers()) == sorted(ids)

    run(body())


def test_list_and_delete(store: MetadataStore, run):
    async def body():
        ls = LedgerStore(store)
        a, _ = await ls.create_ledger("a", CONFIG, ENSEMBLE)
        b, bv = await ls.create_ledger("b", CONFIG, ENSEMBLE)
        c, _ = await ls.create_ledger("c", CONFIG, ENSEMBLE)
        assert await ls.list_ledgers() == [a, b, c]
        b2, bv2 = await append_fragments(ls, b, bv, 300)
        await ls.delete_ledger("b")
        with pytest.raises(NoSuchLedger):
            await ls.get_ledger("b")
        with pytest.raises(NoSuchLedger):
            await ls.get_ledger(b.ledger_id)
        assert await ls.fragments(b.ledger_id) == []
        assert await store.list_prefix(f"/scroll/ledgers/{b.ledger_id:012d}/") == []
        assert await ls.list_ledgers() == [a, c]
        # a writer that still holds the old version cannot resurrect it
        assert await ls.cas_ledger(b2.with_(term=5), (), bv2) is None
        with pytest.raises(NoSuchLedger):
            await ls.delete_ledger("b")
        # the name can be reused; the new ledger gets a new id
        b_new, _ = await ls.create_ledger("b", CONFIG, ENSEMBLE)
        assert b_new.ledger_id > c.ledger_id
        assert [m.name for m in await ls.list_ledgers()] == ["a", "c", "b"]

    run(body())
