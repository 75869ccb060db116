"""The production ``MetadataStore``: etcd v3 through aetcd (asyncio gRPC).

* Versions are etcd ``mod_revision``s. A comparison with version 0 is ``create_revision == 0``
  (the key is absent); any other is ``mod_revision == version``.
* ``create``/``cas``/``txn``/``delete(expected_version=...)`` are single etcd transactions.
* Leases are etcd leases: TTLs are whole seconds (``ttl_s`` is rounded up, at least 1 s; etcd may
  raise it to its minimum TTL); ``Lease.ttl_s`` is what etcd granted.
* ``watch_prefix`` starts at the revision after the last one this client has observed, so a
  change made after the call is never missed even though the etcd watch is created lazily on the
  first read (it may also report a change made by another client shortly before the call).
* Every request has a deadline (``timeout``, default 5 s). Connection failures, deadlines and
  transient etcd errors (no leader, leader changed) raise ``MetadataUnavailable`` naming the
  endpoint; nothing hangs when etcd is down or killed.
* An optional key namespace (``namespace=`` or the URL's path: ``etcd://host:2379/ns``) is
  prepended to every key and stripped from every result, so several tenants or tests can share
  one etcd.
"""

from __future__ import annotations

import asyncio
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aetcd
import aetcd.rpc as rpc
from aetcd.utils import prefix_range_end

from fragments.memstore import LeaseExpired, StoreClosed, check_txn
from fragments.store import (
    Lease,
    MetadataError,
    MetadataStore,
    MetadataUnavailable,
    TxnResult,
    Versioned,
    WatchEvent,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 2379
LIST_PAGE = 1000  # keys per range request when listing a prefix
_TRANSIENT_MARKERS = (
    "no leader",
    "leader changed",
    "request timed out",
    "timed out",
    "too many requests",
    "not capable",
    "connection reset",
    "socket closed",
    "stream removed",
    "unavailable",
)
_GRPC_OPTIONS = {
    "grpc.keepalive_time_ms": 10_000,  # detect a silent (partitioned) server on long watches
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}


def parse_etcd_url(url: str) -> tuple[str, int, str]:
    """``etcd://host:port[/namespace]`` or ``http://host:port[/namespace]`` -> (host, port, namespace)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("etcd", "http"):
        raise ValueError(f"not an etcd URL (etcd://host:port or http://host:port): {url!r}")
    if "," in parts.netloc:
        raise ValueError(f"one etcd endpoint per URL is supported: {url!r}")
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as e:
        raise ValueError(f"bad port in etcd URL {url!r}") from e
    path = parts.path.rstrip("/")
    return host, port, path


class EtcdLease(Lease):
    def __init__(self, store: EtcdStore, lease_id: int, ttl_s: float) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store

    async def refresh(self) -> None:
        reply = await self._store._call(self._store._client.refresh_lease(self.id), "lease keep-alive")
        if reply is None or reply.TTL <= 0:
            raise LeaseExpired(f"lease {self.id:x} has expired or was revoked")

    async def revoke(self) -> None:
        try:
            await self._store._call(self._store._client.revoke_lease(self.id), "lease revoke")
        except LeaseExpired:
            pass  # already gone: the keys are gone too

    def __repr__(self) -> str:
        return f"EtcdLease(id={self.id:x}, ttl_s={self.ttl_s})"


class _EtcdWatch:
    """An async iterator over an etcd watch, created on the first read from a known revision."""

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int | None) -> None:
        self.prefix = prefix
        self._store = store
        self._start_revision = start_revision
        self._watch: aetcd.Watch | None = None
        self._iter: AsyncIterator[aetcd.Event] | None = None
        self._closed = False

    async def _start(self) -> None:
        store = self._store
        key, end = store._range(self.prefix)
        try:
            self._watch = await store._call(
                store._client.watch(key, range_end=end, start_revision=self._start_revision), "watch"
            )
        except MetadataError as e:
            if not isinstance(e.__cause__, aetcd.RevisionCompactedError):
                raise
            # the history since our last observed revision is gone: the best we can do is "now"
            log.warning("etcd watch on %r: revision %s compacted, watching from now", self.prefix, self._start_revision)
            self._watch = await store._call(store._client.watch(key, range_end=end), "watch")
        self._iter = self._watch.__aiter__()

    def __aiter__(self) -> _EtcdWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._closed:
            raise StopAsyncIteration
        if self._iter is None:
            await self._start()
            if self._closed:  # closed while starting
                await self._cancel()
                raise StopAsyncIteration
        assert self._iter is not None
        try:
            event = await self._iter.__anext__()
        except StopAsyncIteration:
            self._closed = True
            raise
        except Exception as e:
            self._closed = True
            raise self._store._map_error(e, "watch") from e
        kv = event.kv
        self._store._observe(kv.mod_revision)
        key = self._store._strip(kv.key)
        if event.kind == "DELETE":
            return WatchEvent(key, None, kv.mod_revision)
        return WatchEvent(key, kv.value, kv.mod_revision)

    async def _cancel(self) -> None:
        watch, self._watch = self._watch, None
        if watch is None:
            return
        try:
            await asyncio.wait_for(watch.cancel(), 2.0)
        except Exception as e:  # the connection may be gone; the server drops the watch with it
            log.debug("cancelling etcd watch on %r: %r", self.prefix, e)

    async def aclose(self) -> None:
        if self._closed and self._watch is None:
            return
        self._closed = True
        await self._cancel()


class EtcdStore(MetadataStore):
    def __init__(self, client: aetcd.Client, url: str, namespace: str = "", timeout: float = 5.0) -> None:
        self._client = client
        self.url = url
        self.namespace = namespace
        self.timeout = timeout
        self._ns = namespace.encode()
        self._last_revision = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r}, namespace={self.namespace!r})"

    @classmethod
    async def connect(cls, url: str, *, namespace: str | None = None, timeout: float = 5.0) -> EtcdStore:
        """Connect and check that etcd answers (``MetadataUnavailable`` within ``timeout`` if not)."""
        host, port, path_ns = parse_etcd_url(url)
        ns = path_ns if namespace is None else namespace
        client = aetcd.Client(host=host, port=port, timeout=timeout, options=dict(_GRPC_OPTIONS))
        store = cls(client, url, ns, timeout)
        try:
            await store.ping()
        except BaseException:
            await store.close()
            raise
        return store

    # -- internals -------------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        return self._ns + key.encode()

    def _strip(self, key: bytes) -> str:
        return key[len(self._ns):].decode()

    def _range(self, prefix: str) -> tuple[bytes, bytes]:
        start = self._k(prefix)
        if not start:
            return b"\0", b"\0"  # every key
        return start, prefix_range_end(start)

    def _observe(self, revision: int) -> None:
        if revision > self._last_revision:
            self._last_revision = revision

    def _unavailable(self, detail: str, what: str) -> MetadataUnavailable:
        return MetadataUnavailable(f"metadata store {self.url} is unavailable ({what}): {detail}")

    def _map_error(self, e: BaseException, what: str) -> BaseException:
        if isinstance(e, MetadataError):
            return e
        if isinstance(e, aetcd.ConnectionFailedError | aetcd.ConnectionTimeoutError | aetcd.WatchTimeoutError):
            return self._unavailable(str(e) or type(e).__name__, what)
        if isinstance(e, TimeoutError):
            return self._unavailable(f"no answer within {self.timeout:g}s", what)
        if isinstance(e, rpc.AioRpcError):
            code, detail = e.code(), e.details() or ""
            if "lease not found" in detail:
                return LeaseExpired(f"{what}: {detail}")
            if code in (rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED, rpc.StatusCode.CANCELLED):
                return self._unavailable(f"{code.name}: {detail}", what)
            return MetadataError(f"metadata store {self.url} ({what}): {code.name}: {detail}")
        if isinstance(e, aetcd.RevisionCompactedError):
            return MetadataError(f"metadata store {self.url} ({what}): {e}")
        if isinstance(e, aetcd.ClientError):
            detail = str(e)
            if "lease not found" in detail:
                return LeaseExpired(f"{what}: {detail}")
            if any(m in detail.lower() for m in _TRANSIENT_MARKERS):
                return self._unavailable(detail, what)
            return MetadataError(f"metadata store {self.url} ({what}): {detail}")
        if isinstance(e, rpc.BaseError):  # grpc.aio usage errors (e.g. the channel was closed)
            return self._unavailable(f"{type(e).__name__}: {e}", what)
        return e

    async def _call(self, aw: Awaitable[T], what: str) -> T:
        if self._closed:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise StoreClosed(f"the metadata store {self.url} is closed")
        try:
            async with asyncio.timeout(self.timeout + 1.0):  # a hard bound over aetcd's own deadline
                return await aw
        except Exception as e:
            mapped = self._map_error(e, what)
            if mapped is e:
                raise
            raise mapped from e

    def _lease_id(self, lease: Lease | None) -> int:
        if lease is None:
            return 0
        if not isinstance(lease, EtcdLease):
            raise TypeError(f"{lease!r} is not an etcd lease")
        return lease.id

    def _compare(self, key: str, version: int) -> Any:
        t = self._client.transactions
        if version == 0:
            return t.create(self._k(key)) == 0
        return t.mod(self._k(key)) == version

    # -- MetadataStore -----------------------------------------------------------------------------

    async def ping(self) -> int:
        """One cheap linearizable read; the current revision of the store."""
        await self._call(self._client.connect(), "connect")
        client = self._client
        resp = await self._call(
            client.kvstub.Range(
                rpc.RangeRequest(key=self._k("/"), count_only=True), timeout=self.timeout, metadata=client.metadata
            ),
            "ping",
        )
        self._observe(resp.header.revision)
        return resp.header.revision

    async def get(self, key: str) -> Versioned | None:
        got = await self._call(self._client.get(self._k(key)), f"get {key}")
        if got is None:
            return None
        self._observe(got.header.revision)
        return Versioned(got.value, got.mod_revision)

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        check_txn({}, {key: value}, ())
        resp = await self._call(self._client.put(self._k(key), bytes(value), lease=self._lease_id(lease)), f"put {key}")
        self._observe(resp.header.revision)
        return resp.header.revision

    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> int | None:
        check_txn({}, {key: value}, ())
        t = self._client.transactions
        ok, responses = await self._call(
            self._client.transaction(
                compare=[t.create(self._k(key)) == 0],
                success=[t.put(self._k(key), bytes(value), lease=self._lease_id(lease))],
                failure=[],
            ),
            f"create {key}",
        )
        if not ok:
            return None
        revision = responses[0].response_put.header.revision
        self._observe(revision)
        return revision

    async def txn(
        self,
        compares: dict[str, int],
        puts: dict[str, bytes],
        deletes: tuple[str, ...] = (),
    ) -> TxnResult:
        deletes = check_txn(compares, puts, deletes)
        t = self._client.transactions
        success = [t.put(self._k(k), bytes(v)) for k, v in puts.items()]
        success += [t.delete(self._k(k)) for k in deletes]
        ok, responses = await self._call(
            self._client.transaction(
                compare=[self._compare(k, v) for k, v in compares.items()], success=success, failure=[]
            ),
            "txn",
        )
        if not ok:
            return TxnResult(False, {})
        if not puts:
            for r in responses:
                self._observe(r.response_delete_range.header.revision)
            return TxnResult(True, {})
        revision = responses[0].response_put.header.revision
        self._observe(revision)
        return TxnResult(True, dict.fromkeys(puts, revision))

    async def delete(self, key: str, expected_version: int | None = None) -> bool:
        if expected_version is None:
            resp = await self._call(self._client.delete(self._k(key)), f"delete {key}")
            if resp is None:
                return False
            self._observe(resp.header.revision)
            return resp.deleted > 0
        if expected_version == 0:
            return False  # "delete if absent" never deletes anything
        t = self._client.transactions
        ok, responses = await self._call(
            self._client.transaction(
                compare=[self._compare(key, expected_version)], success=[t.delete(self._k(key))], failure=[]
            ),
            f"delete {key}",
        )
        if not ok:
            return False
        dr = responses[0].response_delete_range
        self._observe(dr.header.revision)
        return dr.deleted > 0

    async def list_prefix(self, prefix: str) -> list[tuple[str, Versioned]]:
        """One consistent snapshot of the prefix, read in pages of ``LIST_PAGE`` keys."""
        start, end = self._range(prefix)
        await self._call(self._client.connect(), "connect")
        client = self._client
        out: list[tuple[str, Versioned]] = []
        revision = 0  # 0: the first page reads the latest revision; later pages read that same one
        while True:
            req = rpc.RangeRequest(key=start, range_end=end, limit=LIST_PAGE, revision=revision)
            resp = await self._call(
                client.kvstub.Range(req, timeout=self.timeout, metadata=client.metadata), f"list {prefix}"
            )
            revision = revision or resp.header.revision
            self._observe(revision)
            out.extend((self._strip(kv.key), Versioned(kv.value, kv.mod_revision)) for kv in resp.kvs)
            if not resp.more or not resp.kvs:
                return out
            start = resp.kvs[-1].key + b"\0"

    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        if self._closed:
            raise StoreClosed(f"the metadata store {self.url} is closed")
        start = self._last_revision + 1 if self._last_revision else None
        return _EtcdWatch(self, prefix, start)

    async def grant_lease(self, ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise ValueError("a lease TTL must be positive")
        ttl = max(1, math.ceil(ttl_s))
        granted = await self._call(self._client.lease(ttl), "lease grant")
        return EtcdLease(self, granted.id, float(granted.ttl))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._client.close(), self.timeout)
        except Exception as e:  # closing a connection to a dead server must not fail
            log.debug("closing etcd client for %s: %r", self.url, e)
