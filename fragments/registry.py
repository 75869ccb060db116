"""Bookie registration: each live bookie holds ``/scroll/bookies/<bookie_id>`` under a lease.

A bookie registers at start-up and a background task refreshes the lease every ``ttl/3``. If the
process dies (no more refreshes) the lease expires and the key disappears by itself after its TTL;
a clean shutdown revokes the lease so the key disappears at once. Clients read the live set with
``live_bookies`` or follow it with ``watch_bookies``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fragments.ledgers import BOOKIES, bookie_key
from fragments.memstore import LeaseExpired
from fragments.store import Lease, MetadataError, MetadataStore

log = logging.getLogger(__name__)


class BookieAlreadyRegistered(MetadataError):
    """Another live registration holds this bookie id (or a stale one has not expired yet)."""

    retriable = True


@dataclass(frozen=True, slots=True)
class BookieRegistration:
    bookie_id: str
    address: str  # "127.0.0.1:port"
    rack: str = "/default-rack"
    free_bytes: int = 0
    used_bytes: int = 0
    read_only: bool = False
    started_at: float = 0.0  # wall-clock seconds (time.time()) when the bookie started

    def __post_init__(self) -> None:
        if not self.bookie_id or "/" in self.bookie_id:
            raise ValueError(f"a bookie id is non-empty and has no '/': {self.bookie_id!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a bookie address is host:port, got {self.address!r}")

    def with_(self, **changes) -> BookieRegistration:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> BookieRegistration:
        d = json.loads(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})  # tolerate fields added later


class Registrar:
    """A live registration: keeps the lease alive until ``close()`` (revoke) or ``abandon()``."""

    def __init__(self, store: MetadataStore, registration: BookieRegistration, lease: Lease, ttl_s: float) -> None:
        self.store = store
        self.key = bookie_key(registration.bookie_id)
        self.ttl_s = ttl_s
        self.refresh_count = 0  # successful keep-alives so far
        self.reregistrations = 0  # times the lease was lost and the key written again
        self._registration = registration
        self._lease = lease
        self._lock = asyncio.Lock()
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive(), name=f"bookie-registration-{registration.bookie_id}"
        )

    @property
    def registration(self) -> BookieRegistration:
        return self._registration

    @property
    def lease(self) -> Lease:
        return self._lease

    @property
    def interval_s(self) -> float:
        return self._lease.ttl_s / 3

    async def update(self, **changes) -> BookieRegistration:
        """Publish changed fields (``free_bytes=...``, ``read_only=True``) under the same lease."""
        if self._closed:
            raise MetadataError(f"registration of {self._registration.bookie_id} is closed")
        async with self._lock:
            new = self._registration.with_(**changes)
            try:
                await self.store.put(self.key, new.to_json().encode(), lease=self._lease)
                self._registration = new
            except LeaseExpired:
                self._registration = new
                await self._reregister()
        return new

    async def _reregister(self) -> None:
        """The lease is gone (we were paused or cut off longer than the TTL): register again."""
        self._lease = await self.store.grant_lease(self.ttl_s)
        await self.store.put(self.key, self._registration.to_json().encode(), lease=self._lease)
        self.reregistrations += 1
        log.warning("bookie %s: registration lease was lost; registered again", self._registration.bookie_id)

    async def _keepalive(self) -> None:
        failures = 0
        while True:
            # after a failure retry sooner, so that a short outage does not cost the lease
            await asyncio.sleep(self.interval_s if failures == 0 else min(self.interval_s, 0.5))
            try:
                async with self._lock:
                    try:
                        await self._lease.refresh()
                    except LeaseExpired:
                        await self._reregister()
                self.refresh_count += 1
                failures = 0
            except MetadataError as e:
                failures += 1
                log.warning("bookie %s: keeping the registration alive failed: %s",
                            self._registration.bookie_id, e)
            except Exception:
                failures += 1
                log.exception("bookie %s: registration keep-alive crashed", self._registration.bookie_id)

    async def _stop(self) -> None:
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def abandon(self) -> None:
        """Stop refreshing without revoking, as if the process had died: the key expires by TTL."""
        await self._stop()

    async def close(self) -> None:
        """Deregister now: stop refreshing and revoke the lease (the key disappears at once)."""
        if self._closed and self._task.done():
            return
        await self._stop()
        try:
            await self._lease.revoke()
        except MetadataError as e:  # unreachable store: the key expires by TTL anyway
            log.warning("bookie %s: revoking the registration failed (it will expire): %s",
                        self._registration.bookie_id, e)

    async def __aenter__(self) -> Registrar:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def register_bookie(
    store: MetadataStore,
    reg: BookieRegistration,
    ttl_s: float = 10.0,
    *,
    wait_s: float | None = None,
) -> Registrar:
    """Create ``/scroll/bookies/<id>`` under a fresh lease and keep it alive in the background.

    If the key exists (a previous incarnation whose lease has not expired yet, or another live
    process with the same id) wait up to ``wait_s`` (default: twice the TTL) for it to go away,
    then raise ``BookieAlreadyRegistered``.
    """
    key = bookie_key(reg.bookie_id)
    data = reg.to_json().encode()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (2 * ttl_s if wait_s is None else wait_s)
    lease = await store.grant_lease(ttl_s)
    waited = False
    try:
        while True:
            watch = store.watch_prefix(key)
            try:
                if waited:  # the wait took up to a TTL of the lease: give the key its whole TTL again
                    try:
                        await lease.refresh()
                    except LeaseExpired:
                        lease = await store.grant_lease(ttl_s)
                if await store.create(key, data, lease=lease) is not None:
                    break
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BookieAlreadyRegistered(f"bookie {reg.bookie_id} is already registered at {key}")
                try:
                    async with asyncio.timeout(remaining):
                        async for ev in watch:
                            if ev.key == key and ev.value is None:
                                break
                    waited = True
                except TimeoutError:
                    raise BookieAlreadyRegistered(
                        f"bookie {reg.bookie_id} is already registered at {key} (waited for it to expire)"
                    ) from None
            finally:
                await watch.aclose()
    except BaseException:
        with contextlib.suppress(MetadataError):
            await lease.revoke()
        raise
    return Registrar(store, reg, lease, ttl_s)


def _parse(key: str, raw: bytes) -> BookieRegistration | None:
    try:
        return BookieRegistration.from_json(raw)
    except (ValueError, TypeError) as e:
        log.warning("ignoring a malformed bookie registration at %s: %s", key, e)
        return None


async def live_bookies(store: MetadataStore) -> list[BookieRegistration]:
    """Every registered (live) bookie, by id."""
    regs = (_parse(k, v.value) for k, v in await store.list_prefix(BOOKIES))
    return [r for r in regs if r is not None]


async def watch_bookies(store: MetadataStore) -> AsyncIterator[list[BookieRegistration]]:
    """The live set now, then again every time it changes (joins, leaves, updates).

    Close it with ``aclose()`` (or ``contextlib.aclosing``) to stop the underlying watch.
    """
    watch = store.watch_prefix(BOOKIES)  # before the first read, so no change is missed
    try:
        last = await live_bookies(store)
        yield last
        async for _event in watch:
            current = await live_bookies(store)
            if current != last:
                last = current
                yield current
    finally:
        await watch.aclose()
