"""The metadata store interface: a small versioned key-value store with compare-and-set.

Every write in Scroll's metadata is a compare-and-set on a version, so the interface is built
around versions: a key's version changes on every write (etcd's ``mod_revision``; the in-process
store keeps a global revision counter with the same meaning). A version of ``0`` in a comparison
means "the key must not exist".

Backends: ``fragments.memstore.MemoryStore`` (in-process, for the simulator-style unit tests and
``scroll standalone`` experiments) and ``fragments.etcdstore.EtcdStore`` (production, via aetcd).
One contract test suite runs against both.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass


class MetadataError(Exception):
    retriable = False


class MetadataUnavailable(MetadataError):
    """The store cannot be reached (connection refused, timeout). Safe to retry."""

    retriable = True


class MetadataAuthError(MetadataError):
    """The store refused our credentials, requires some, or its TLS handshake failed. Retrying
    with the same settings cannot help, so this is not retriable (and never names the password)."""

    retriable = False


class WatchCompacted(MetadataError):
    """A watch asked for changes from a revision the store no longer keeps (etcd compacted it): the
    watcher must list again and watch from the new listing."""

    retriable = True


@dataclass(frozen=True, slots=True)
class Versioned:
    value: bytes
    version: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    key: str
    value: bytes | None  # None: deleted
    version: int


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    versions: dict[str, int]  # key -> new version, for every key put (empty when not succeeded)


class Lease(abc.ABC):
    id: int
    ttl_s: float

    @abc.abstractmethod
    async def refresh(self) -> None:
        """Keep the lease alive once (callers run this on a timer, about ttl/3)."""

    @abc.abstractmethod
    async def revoke(self) -> None:
        """End the lease now: every key attached to it disappears."""


class MetadataStore(abc.ABC):
    @abc.abstractmethod
    async def get(self, key: str) -> Versioned | None: ...

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Unconditional write; returns the new version."""

    @abc.abstractmethod
    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> int | None:
        """Create-if-absent: the new version, or None if the key exists."""

    async def create_all(self, items: dict[str, bytes], lease: Lease | None = None) -> int | None:
        """Create every key of ``items`` if none of them exists, in one transaction (at most
        etcd's ``--max-txn-ops``, 128, keys): the new revision, or None if any exists (then
        nothing is written). Many create-if-absent claims in one round trip."""
        raise NotImplementedError

    async def put_many(self, items: dict[str, bytes], lease: Lease | None = None) -> dict[str, int]:
        """Unconditional writes of ``items`` (at most 128 keys) under ``lease``, in one transaction
        where the store has them: each key's new version."""
        return {k: await self.put(k, v, lease=lease) for k, v in items.items()}

    async def get_many(self, keys: list[str]) -> list[Versioned | None]:
        """The values of ``keys`` (at most 128) read at one revision, in one round trip."""
        return [await self.get(k) for k in keys]

    async def cas(self, key: str, value: bytes, expected_version: int) -> int | None:
        """Write if the key is at ``expected_version`` (0: absent): new version, or None."""
        result = await self.txn({key: expected_version}, {key: value})
        return result.versions[key] if result.succeeded else None

    @abc.abstractmethod
    async def txn(
        self,
        compares: dict[str, int],
        puts: dict[str, bytes],
        deletes: tuple[str, ...] = (),
    ) -> TxnResult:
        """Atomically: if every key in ``compares`` is at its version (0: absent), apply every put
        and delete."""

    @abc.abstractmethod
    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        """Delete (only at ``expected_version`` when given). True if something was deleted."""

    @abc.abstractmethod
    async def list_prefix(self, prefix: str) -> list[tuple[str, Versioned]]:
        """Every key under ``prefix``, sorted by key."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from now on, in order, until the iterator is closed."""

    async def list_and_watch(self, prefix: str) -> tuple[list[tuple[str, Versioned]], AsyncIterator[WatchEvent]]:
        """Every key under ``prefix`` and a watch reporting every change made after that listing.
        The watch may also report changes the listing already holds (a key's version tells them
        apart: skip an event whose version is not above the version known for its key). It may end
        with ``WatchCompacted`` or another ``MetadataError``: list and watch again then."""
        watch = self.watch_prefix(prefix)  # registered before the listing: nothing falls in between
        try:
            items = await self.list_prefix(prefix)
        except BaseException:
            await watch.aclose()
            raise
        return items, watch

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: float) -> Lease: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def next_id(self, counter_key: str) -> int:
        """Allocate the next integer from a counter key (1, 2, ...), by a CAS loop."""
        return (await self.next_ids(counter_key, 1)).start

    async def next_ids(self, counter_key: str, n: int) -> range:
        """Allocate ``n`` consecutive integers from a counter key with one CAS (retried on conflict):
        callers that create many things at once take a block instead of racing for each id."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        while True:
            cur = await self.get(counter_key)
            last = int(cur.value) if cur else 0
            if await self.cas(counter_key, str(last + n).encode(), cur.version if cur else 0) is not None:
                return range(last + 1, last + n + 1)
