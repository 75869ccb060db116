"""An in-process ``MetadataStore`` with the same semantics as the etcd backend.

Used by unit tests, the simulator-style tests and ``scroll standalone`` experiments. Everything
lives in one process and one event loop: the store is asyncio-safe (every operation is atomic with
respect to other tasks, and yields once to the loop first so that concurrent tasks really
interleave), but it is not thread-safe.

Semantics shared with ``fragments.etcdstore.EtcdStore`` (one contract test suite runs against
both):

* A global revision counter starts at 0 and grows by one on every write transaction (a put, a
  delete, a successful txn that writes, a lease expiry or revoke that removes keys). A key's
  version is the revision of its last write, so versions are unique, increase, and a version 0
  means "absent".
* ``txn`` compares every key in ``compares`` against its version (0: must be absent), then applies
  all puts and deletes at one new revision. A key may not be both put and deleted; at most
  ``MAX_TXN_OPS`` compares and ``MAX_TXN_OPS`` writes per transaction (etcd's default limit).
* A plain ``put``/``cas``/``txn`` write detaches any lease from the key (as etcd does); ``put`` and
  ``create`` with a lease attach it. Writing with a lease that has expired raises ``LeaseExpired``.
* Leases expire by the clock given to the store (``time.monotonic`` by default). Expiry is checked
  before every operation and by a background reaper task, so watchers see keys of a dead lease
  disappear without anyone touching the store. Unlike etcd (whole seconds, rounded up), fractional
  TTLs are honoured; ``Lease.ttl_s`` is the granted TTL in both backends.
* Watches see every change under their prefix after the ``watch_prefix`` call, in revision order;
  a delete event has ``value=None`` and ``version`` = the revision of the delete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from fragments.store import Lease, MetadataError, MetadataStore, TxnResult, Versioned, WatchEvent

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops; both backends enforce it


class LeaseExpired(MetadataError):
    """The lease has expired or was revoked: every key attached to it is gone. Grant a new one."""

    retriable = False


class StoreClosed(MetadataError):
    """The store was closed by its owner."""

    retriable = False


def check_txn(compares: dict[str, int], puts: dict[str, bytes], deletes: Iterable[str]) -> tuple[str, ...]:
    """Validate a transaction the way etcd would; returns the deletes as a tuple."""
    deletes = tuple(deletes)
    both = set(puts) & set(deletes)
    if both:
        raise ValueError(f"a transaction cannot both put and delete {sorted(both)!r}")
    if len(set(deletes)) != len(deletes):
        raise ValueError("a transaction deletes the same key twice")
    if len(compares) > MAX_TXN_OPS or len(puts) + len(deletes) > MAX_TXN_OPS:
        raise ValueError(f"a transaction is limited to {MAX_TXN_OPS} compares and {MAX_TXN_OPS} writes")
    for version in compares.values():
        if version < 0:
            raise ValueError("versions are >= 0")
    for value in puts.values():
        if not isinstance(value, bytes | bytearray):
            raise TypeError("values are bytes")
    return deletes


@dataclass(slots=True)
class _Entry:
    value: bytes
    version: int
    lease_id: int = 0


@dataclass(slots=True)
class _LeaseState:
    ttl_s: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryLease(Lease):
    def __init__(self, store: MemoryStore, lease_id: int, ttl_s: float) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store

    async def refresh(self) -> None:
        await self._store._refresh_lease(self.id)

    async def revoke(self) -> None:
        await self._store._revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"MemoryLease(id={self.id}, ttl_s={self.ttl_s})"


class _MemoryWatch:
    """A watch registered at creation time (so nothing between the call and the first read is lost)."""

    def __init__(self, store: MemoryStore, prefix: str) -> None:
        self.prefix = prefix
        self._store = store
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._closed = False
        store._watchers.append(self)

    def _push(self, event: WatchEvent | None) -> None:
        if not self._closed:
            self._queue.put_nowait(event)

    def __aiter__(self) -> _MemoryWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._closed:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None or self._closed:
            self._closed = True
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self in self._store._watchers:
            self._store._watchers.remove(self)
        self._queue.put_nowait(None)


class MemoryStore(MetadataStore):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._revision = 0
        self._leases: dict[int, _LeaseState] = {}
        self._next_lease_id = 0x5C0_0000
        self._watchers: list[_MemoryWatch] = []
        self._reaper: asyncio.Task | None = None
        self._reaper_wake: asyncio.Event | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"MemoryStore(keys={len(self._data)}, revision={self._revision})"

    @property
    def revision(self) -> int:
        """The store's current revision (the version of the latest write)."""
        return self._revision

    # -- internals -------------------------------------------------------------------------------

    async def _enter(self) -> None:
        """Common prologue: yield once (real interleaving), refuse after close, expire leases."""
        if self._closed:
            raise StoreClosed("the memory store is closed")
        await asyncio.sleep(0)
        if self._closed:
            raise StoreClosed("the memory store is closed")
        self.expire_leases()

    def _emit(self, key: str, value: bytes | None, version: int) -> None:
        if not self._watchers:
            return
        event = WatchEvent(key, value, version)
        for w in list(self._watchers):
            if key.startswith(w.prefix):
                w._push(event)

    def _write(self, key: str, value: bytes, revision: int, lease_id: int = 0) -> None:
        old = self._data.get(key)
        if old is not None and old.lease_id and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        if lease_id:
            self._leases[lease_id].keys.add(key)
        self._data[key] = _Entry(bytes(value), revision, lease_id)
        self._emit(key, bytes(value), revision)

    def _remove(self, key: str, revision: int) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        if old.lease_id and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        self._emit(key, None, revision)
        return True

    def _live_lease_id(self, lease: Lease | None) -> int:
        if lease is None:
            return 0
        if not isinstance(lease, MemoryLease) or lease._store is not self:
            raise TypeError(f"{lease!r} does not belong to this store")
        if lease.id not in self._leases:
            raise LeaseExpired(f"lease {lease.id:x} has expired or was revoked")
        return lease.id

    def _version_of(self, key: str) -> int:
        e = self._data.get(key)
        return e.version if e else 0

    def _drop_lease(self, lease_id: int) -> None:
        state = self._leases.pop(lease_id, None)
        if state is None or not state.keys:
            return
        self._revision += 1
        for key in sorted(state.keys):
            e = self._data.get(key)
            if e is not None and e.lease_id == lease_id:
                self._remove(key, self._revision)

    def expire_leases(self) -> int:
        """Drop every lease whose deadline has passed (and its keys); the number dropped.

        Runs before every operation and from the reaper task; call it directly after moving an
        injected clock to see expiry without any other operation.
        """
        if not self._leases:
            return 0
        now = self._clock()
        dead = sorted(i for i, s in self._leases.items() if s.deadline <= now)
        for lease_id in dead:
            self._drop_lease(lease_id)
        return len(dead)

    def _ensure_reaper(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reaper is not None and not self._reaper.done() and self._reaper.get_loop() is loop:
            if self._reaper_wake is not None:
                self._reaper_wake.set()
            return
        self._reaper_wake = asyncio.Event()
        self._reaper = loop.create_task(self._reap(self._reaper_wake), name="memstore-lease-reaper")

    async def _reap(self, wake: asyncio.Event) -> None:
        while self._leases and not self._closed:
            wake.clear()
            self.expire_leases()
            if not self._leases:
                break
            delay = min(s.deadline for s in self._leases.values()) - self._clock()
            # bounded so that an injected clock that jumps is noticed within a fraction of a second
            delay = min(max(delay, 0.001), 0.25)
            try:
                await asyncio.wait_for(wake.wait(), delay)
            except TimeoutError:
                pass

    # -- MetadataStore -----------------------------------------------------------------------------

    async def get(self, key: str) -> Versioned | None:
        await self._enter()
        e = self._data.get(key)
        return Versioned(e.value, e.version) if e else None

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        await self._enter()
        check_txn({}, {key: value}, ())
        lease_id = self._live_lease_id(lease)
        self._revision += 1
        self._write(key, value, self._revision, lease_id)
        return self._revision

    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> int | None:
        await self._enter()
        check_txn({}, {key: value}, ())
        if key in self._data:
            return None  # (etcd checks the lease only on the branch it takes)
        lease_id = self._live_lease_id(lease)
        self._revision += 1
        self._write(key, value, self._revision, lease_id)
        return self._revision

    async def create_all(self, items: dict[str, bytes], lease: Lease | None = None) -> int | None:
        await self._enter()
        check_txn(dict.fromkeys(items, 0), items, ())
        if any(k in self._data for k in items):
            return None
        lease_id = self._live_lease_id(lease)
        self._revision += 1
        for k, v in items.items():
            self._write(k, v, self._revision, lease_id)
        return self._revision

    async def put_many(self, items: dict[str, bytes], lease: Lease | None = None) -> dict[str, int]:
        await self._enter()
        check_txn({}, items, ())
        if not items:
            return {}
        lease_id = self._live_lease_id(lease)
        self._revision += 1
        for k, v in items.items():
            self._write(k, v, self._revision, lease_id)
        return dict.fromkeys(items, self._revision)

    async def get_many(self, keys: list[str]) -> list[Versioned | None]:
        await self._enter()
        if len(keys) > MAX_TXN_OPS:
            raise ValueError(f"a transaction is limited to {MAX_TXN_OPS} reads")
        return [Versioned(e.value, e.version) if (e := self._data.get(k)) else None for k in keys]

    async def txn(
        self,
        compares: dict[str, int],
        puts: dict[str, bytes],
        deletes: tuple[str, ...] = (),
    ) -> TxnResult:
        deletes = check_txn(compares, puts, deletes)
        await self._enter()
        if any(self._version_of(k) != v for k, v in compares.items()):
            return TxnResult(False, {})
        if not puts and not any(k in self._data for k in deletes):
            return TxnResult(True, {})  # nothing written: no new revision (as in etcd)
        self._revision += 1
        for k, v in puts.items():
            self._write(k, v, self._revision)
        for k in deletes:
            self._remove(k, self._revision)
        return TxnResult(True, {k: self._revision for k in puts})

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        await self._enter()
        if key not in self._data:
            return False
        if expected_version is not None and self._version_of(key) != expected_version:
            return False
        self._revision += 1
        return self._remove(key, self._revision)

    async def list_prefix(self, prefix: str) -> list[tuple[str, Versioned]]:
        await self._enter()
        return [(k, Versioned(e.value, e.version)) for k, e in sorted(self._data.items()) if k.startswith(prefix)]

    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        if self._closed:
            raise StoreClosed("the memory store is closed")
        return _MemoryWatch(self, prefix)

    async def grant_lease(self, ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise ValueError("a lease TTL must be positive")
        await self._enter()
        self._next_lease_id += 1
        lease_id = self._next_lease_id
        self._leases[lease_id] = _LeaseState(float(ttl_s), self._clock() + ttl_s)
        self._ensure_reaper()
        return MemoryLease(self, lease_id, float(ttl_s))

    async def _refresh_lease(self, lease_id: int) -> None:
        await self._enter()
        state = self._leases.get(lease_id)
        if state is None:
            raise LeaseExpired(f"lease {lease_id:x} has expired or was revoked")
        state.deadline = self._clock() + state.ttl_s
        self._ensure_reaper()

    async def _revoke_lease(self, lease_id: int) -> None:
        await self._enter()
        self._drop_lease(lease_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._watchers):
            await w.aclose()
        reaper, self._reaper = self._reaper, None
        if reaper is not None and not reaper.done():
            if reaper.get_loop() is asyncio.get_running_loop():
                reaper.cancel()
                try:
                    await reaper
                except asyncio.CancelledError:
                    pass
            else:
                reaper.cancel()
