"""A metadata store that sends the reads and transactions of one event-loop turn as one request.

Why. A Kafka listener opening hundreds of partitions at once (a first produce to a new topic, a
survivor taking over a dead listener's partitions) makes several metadata calls per partition:
the stream's name and ledger record, its last fragment, the take-over's two compare-and-sets, the
producer-state snapshot. Each one is an etcd round trip and a gRPC call (~300 µs of the caller's
CPU, and etcd's). Calls made concurrently usually land in the same event-loop turn, so
``BatchingStore`` collects them there and sends them together:

- ``get``: the keys asked for in one turn are read in one transaction of range reads
  (``MetadataStore.get_many``, at most 128 keys each), all at one revision. Each caller gets what a
  ``get`` of its own would have returned at that revision.
- ``put``: the unconditional writes of one turn under the same lease are sent as one transaction
  of puts (``MetadataStore.put_many``, at most 128 keys; a key written twice in one turn starts a
  new transaction, so the later write lands last). Each caller gets its key's new version. (A
  listener taking over many partitions writes each one's writer key under its ownership lease.)
- ``txn`` (and ``cas``, which is a ``txn``): transactions of one turn whose keys do not overlap are
  merged into one (at most 128 compares and 128 writes). If it succeeds, every one of them
  succeeded (each one's compares held, each one's writes applied atomically). If it fails, some
  compare failed, nothing was written, and each one is sent again on its own, so each is decided
  exactly as if it had been sent alone (a moment later). Transactions on the same key are never
  merged: they go in the order they were made. An error (the store unreachable, an
  outcome unknown) is every merged caller's error, as it would have been for each alone.

Everything else (single creates under a lease, deletes, listings, leases, watches) passes straight through.
A single call in a turn is sent as it is, so a lone caller pays one loop turn and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from .memstore import MAX_TXN_OPS, check_txn
from .store import Lease, MetadataStore, TxnResult, Versioned, WatchEvent

log = logging.getLogger(__name__)


class BatchingStore(MetadataStore):
    def __init__(self, inner: MetadataStore) -> None:
        self.inner = inner
        self._gets: dict[str, list[asyncio.Future]] = {}
        self._txns: list[tuple[dict, dict, tuple, asyncio.Future]] = []
        self._puts: list[tuple[str, bytes, Lease | None, asyncio.Future]] = []
        self._scheduled = False
        self.requests = 0  # gets and transactions sent to the inner store (batched ones count once)

    def __getattr__(self, name: str):  # the inner store's own extras (ping, ...)
        return getattr(self.inner, name)

    # ---------------------------------------------------------------- batched
    async def get(self, key: str) -> Versioned | None:
        fut = asyncio.get_running_loop().create_future()
        self._gets.setdefault(key, []).append(fut)
        self._schedule()
        return await fut

    async def txn(self, compares: dict[str, int], puts: dict[str, bytes], deletes: tuple[str, ...] = ()) -> TxnResult:
        deletes = check_txn(compares, puts, deletes)  # a bad one fails its caller alone, before merging
        fut = asyncio.get_running_loop().create_future()
        self._txns.append((dict(compares), dict(puts), deletes, fut))
        self._schedule()
        return await fut

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        gets, self._gets = self._gets, {}
        txns, self._txns = self._txns, []
        puts, self._puts = self._puts, []
        if puts:
            asyncio.ensure_future(self._send_puts(puts))
        keys = list(gets)
        for i in range(0, len(keys), MAX_TXN_OPS):
            asyncio.ensure_future(self._send_gets({k: gets[k] for k in keys[i:i + MAX_TXN_OPS]}))
        if txns:
            asyncio.ensure_future(self._send_groups(_groups(txns)))

    async def _send_gets(self, waiting: dict[str, list[asyncio.Future]]) -> None:
        keys = list(waiting)
        self.requests += 1
        try:
            values = [await self.inner.get(keys[0])] if len(keys) == 1 else await self.inner.get_many(keys)
        except BaseException as exc:  # noqa: BLE001 - every waiter gets it
            for futs in waiting.values():
                for f in futs:
                    if not f.done():
                        f.set_exception(exc) if isinstance(exc, Exception) else f.cancel()
            return
        for k, v in zip(keys, values):
            for f in waiting[k]:
                if not f.done():
                    f.set_result(v)

    async def _send_puts(self, puts: list[tuple[str, bytes, Lease | None, asyncio.Future]]) -> None:
        """In order: chunks of distinct keys under one lease, each one request."""
        chunks: list[tuple[Lease | None, dict[str, bytes], dict[str, asyncio.Future]]] = []
        for key, value, lease, fut in puts:
            last = chunks[-1] if chunks else None
            if last is None or last[0] is not lease or key in last[1] or len(last[1]) >= MAX_TXN_OPS:
                last = (lease, {}, {})
                chunks.append(last)
            last[1][key] = value
            last[2][key] = fut
        for lease, items, futs in chunks:
            self.requests += 1
            try:
                if len(items) == 1:
                    (key, value), = items.items()
                    versions = {key: await self.inner.put(key, value, lease=lease)}
                else:
                    versions = await self.inner.put_many(items, lease=lease)
            except BaseException as exc:  # noqa: BLE001 - every caller of the chunk gets it
                for f in futs.values():
                    if not f.done():
                        f.set_exception(exc) if isinstance(exc, Exception) else f.cancel()
                continue
            for k, f in futs.items():
                if not f.done():
                    f.set_result(versions[k])

    async def _send_groups(self, groups: list[list]) -> None:
        """In order: a transaction on a key another one of the turn wrote first sees that write."""
        for group in groups:
            await self._send_txns(group)

    async def _send_txns(self, group: list[tuple[dict, dict, tuple, asyncio.Future]]) -> None:
        if len(group) == 1:
            await self._one(*group[0])
            return
        compares: dict[str, int] = {}
        puts: dict[str, bytes] = {}
        deletes: list[str] = []
        for c, p, d, _ in group:
            compares.update(c)
            puts.update(p)
            deletes.extend(d)
        self.requests += 1
        try:
            result = await self.inner.txn(compares, puts, tuple(deletes))
        except BaseException as exc:  # noqa: BLE001 - every merged caller gets it
            for *_, f in group:
                if not f.done():
                    f.set_exception(exc) if isinstance(exc, Exception) else f.cancel()
            return
        if result.succeeded:
            for _, p, _, f in group:
                if not f.done():
                    f.set_result(TxnResult(True, {k: result.versions[k] for k in p}))
            return
        await asyncio.gather(*(self._one(*t) for t in group))  # some compare failed: each on its own

    async def _one(self, compares: dict, puts: dict, deletes: tuple, fut: asyncio.Future) -> None:
        self.requests += 1
        try:
            result = await self.inner.txn(compares, puts, deletes)
        except BaseException as exc:  # noqa: BLE001 - the caller's
            if not fut.done():
                fut.set_exception(exc) if isinstance(exc, Exception) else fut.cancel()
            return
        if not fut.done():
            fut.set_result(result)

    # ---------------------------------------------------------------- passed through
    async def get_many(self, keys: list[str]) -> list[Versioned | None]:
        return await self.inner.get_many(keys)

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        check_txn({}, {key: value}, ())  # a bad one fails its caller alone, before merging
        fut = asyncio.get_running_loop().create_future()
        self._puts.append((key, value, lease, fut))
        self._schedule()
        return await fut

    async def put_many(self, items: dict[str, bytes], lease: Lease | None = None) -> dict[str, int]:
        return await self.inner.put_many(items, lease=lease)

    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> int | None:
        return await self.inner.create(key, value, lease=lease)

    async def create_all(self, items: dict[str, bytes], lease: Lease | None = None) -> int | None:
        return await self.inner.create_all(items, lease=lease)

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        return await self.inner.delete(key, expected_version)

    async def list_prefix(self, prefix: str) -> list[tuple[str, Versioned]]:
        return await self.inner.list_prefix(prefix)

    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        return self.inner.watch_prefix(prefix)

    async def grant_lease(self, ttl_s: float) -> Lease:
        return await self.inner.grant_lease(ttl_s)

    async def close(self) -> None:
        await self.inner.close()


def _groups(txns: list) -> list[list]:
    """Transactions in merge groups: keys disjoint within a group, within etcd's limits; each
    transaction that is too big to share, or the only one, alone."""
    groups: list[list] = []
    cur: list = []
    keys: set[str] = set()
    n_cmp = n_wr = 0
    for t in txns:
        c, p, d, _ = t
        tkeys = set(c) | set(p) | set(d)
        w = len(p) + len(d)
        if cur and (tkeys & keys or n_cmp + len(c) > MAX_TXN_OPS or n_wr + w > MAX_TXN_OPS):
            groups.append(cur)
            cur, keys, n_cmp, n_wr = [], set(), 0, 0
        cur.append(t)
        keys |= tkeys
        n_cmp += len(c)
        n_wr += w
    if cur:
        groups.append(cur)
    return groups
