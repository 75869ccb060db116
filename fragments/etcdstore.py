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
* Credentials and TLS (see docs/security.md, "Metadata store (etcd)"):
  ``etcd://user:password@host:port/ns`` (user and password percent-decoded) authenticates with
  etcd's user/password auth; ``etcds://`` (or ``https://``) speaks TLS, with optional
  ``?ca=/path&cert=/path&key=/path`` (PEM files: the CA to verify etcd with, and a client
  certificate for ``--client-cert-auth``). A ``ClientSecurity`` given to ``connect`` overrides the
  URL's user/password and files. aetcd 1.x opens only insecure channels, so ``_Client`` overrides
  its ``connect`` (and nothing else) to open a TLS channel.
* etcd's simple auth tokens expire after ``--auth-token-ttl`` seconds of disuse (300 s by default)
  and aetcd never re-authenticates: a call refused with "invalid auth token" re-authenticates once
  and is retried (``EtcdStore.reauths`` counts them). New watches after a re-authentication open a
  new watch stream with the new token (watches already running keep streaming).
* Refused or missing credentials and failed TLS handshakes raise ``MetadataAuthError`` (not
  retriable). Passwords never appear in messages, logs or ``repr``s: ``EtcdStore.url`` is redacted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aetcd
import aetcd.rpc as rpc
import aetcd.watcher
import grpc
from aetcd.utils import prefix_range_end

from fragments.memstore import LeaseExpired, StoreClosed, check_txn
from fragments.security import ClientSecurity, redact_url
from fragments.store import (
    Lease,
    MetadataAuthError,
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


_PLAIN_SCHEMES = ("etcd", "http")
_TLS_SCHEMES = ("etcds", "https")
# etcd's answers when a token is no longer valid: re-authenticate once and retry
_TOKEN_MARKERS = ("invalid auth token", "auth token is expired", "token is expired", "revision of auth store is old")
_TLS_MARKERS = ("handshake", "certificate", "ssl", "tls")


@dataclass(frozen=True)
class EtcdTarget:
    """What an etcd URL names: where, which key namespace, and how to authenticate."""

    host: str
    port: int
    namespace: str = ""
    tls: bool = False
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def with_security(self, security: ClientSecurity | None) -> EtcdTarget:
        """Explicit credentials win over the URL's: ``user``/``password`` always, ``tls_*`` when
        the URL asks for TLS (``etcds://``)."""
        if security is None:
            return self
        changes: dict[str, Any] = {}
        if security.user is not None:
            changes.update(user=security.user, password=security.password)
        if self.tls:
            for mine, theirs in (("ca", "tls_ca"), ("cert", "tls_cert"), ("key", "tls_key")):
                if getattr(security, theirs) is not None:
                    changes[mine] = getattr(security, theirs)
        return replace(self, **changes)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise MetadataAuthError(f"cannot read the etcd TLS file {path}: {e.strerror}") from None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def parse_etcd_target(url: str) -> EtcdTarget:
    """``etcd[s]://[user:password@]host[:port][/namespace][?ca=&cert=&key=]`` (also ``http``/``https``)."""
    parts = urllib.parse.urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in _PLAIN_SCHEMES + _TLS_SCHEMES:
        raise ValueError(f"not an etcd URL (etcd://host:port, or etcds://host:port for TLS): {shown!r}")
    hostport = parts.netloc.rpartition("@")[2]
    if "," in hostport:
        raise ValueError(f"one etcd endpoint per URL is supported: {shown!r}")
    host = parts.hostname or "127.0.0.1"
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as e:
        raise ValueError(f"bad port in etcd URL {shown!r}") from e
    tls = parts.scheme in _TLS_SCHEMES
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - {"ca", "cert", "key"}
    if unknown:
        raise ValueError(f"unknown etcd URL parameter(s) {sorted(unknown)} (ca, cert, key are known): {shown!r}")
    files = {k: v[-1] for k, v in query.items()}
    if files and not tls:
        raise ValueError(f"ca/cert/key need TLS: use etcds://... ({shown!r})")
    if ("cert" in files) != ("key" in files):
        raise ValueError(f"cert and key go together in an etcd URL: {shown!r}")
    user = password = None
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        if ":" not in userinfo:
            raise ValueError(f"an etcd URL's user needs a password (user:password@host): {shown!r}")
        raw_user, raw_password = userinfo.split(":", 1)
        user, password = urllib.parse.unquote(raw_user), urllib.parse.unquote(raw_password)
        if not user:
            raise ValueError(f"empty user name in etcd URL {shown!r}")
    return EtcdTarget(host, port, parts.path.rstrip("/"), tls, user, password,
                      files.get("ca"), files.get("cert"), files.get("key"))


def parse_etcd_url(url: str) -> tuple[str, int, str]:
    """``etcd://host:port[/namespace]`` (and the forms ``parse_etcd_target`` takes) -> (host, port, namespace)."""
    t = parse_etcd_target(url)
    return t.host, t.port, t.namespace


class _Watcher(aetcd.watcher.Watcher):
    """aetcd's watcher, except that a watch the server refuses to create (etcd answers
    ``created`` and ``canceled`` together, e.g. "invalid auth token" or "permission denied") fails
    its ``add_callback`` instead of becoming a watch that never reports anything."""

    async def _handle_response(self, response: Any) -> None:
        if response.created and response.canceled:
            async with self._lock:
                if self._new_callback is not None:
                    self._new_callback.error = aetcd.ClientError(f"watch refused: {response.cancel_reason}")
                    self._new_callback_ready.notify_all()
            return
        await super()._handle_response(response)


class _Client(aetcd.Client):
    """``aetcd.Client`` with TLS and re-authentication.

    aetcd 1.0's ``connect`` always opens ``grpc.aio.insecure_channel``; this override is the same
    code with a ``secure_channel`` when ``credentials`` are given, our ``_Watcher``, and the channel
    closed again when authenticating fails. ``reauthenticate`` fetches a fresh token (etcd's simple
    tokens expire when unused for ``--auth-token-ttl``) and starts a new watcher carrying it for
    new watches: etcd checks the token given when a watch stream opens on every watch it creates.
    """

    def __init__(self, *, credentials: grpc.ChannelCredentials | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials
        self.generation = 0  # bumped by every (re)authentication
        self._old_watchers: list[aetcd.watcher.Watcher] = []

    @property
    def authenticates(self) -> bool:
        return self._username is not None

    async def _authenticate(self) -> None:
        req = rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            resp = await self.auth_stub.Authenticate(req, timeout=self._timeout)
        except rpc.AioRpcError as e:
            if "authentication is not enabled" not in (e.details() or ""):
                raise
            self.metadata = None  # credentials for an etcd without auth: nothing to send
        else:
            self.metadata = (("token", resp.token),)
        self.generation += 1

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            if self._credentials is None:
                self.channel = rpc.insecure_channel(target, options=self._options.items())
            else:
                self.channel = rpc.secure_channel(target, self._credentials, options=self._options.items())
            try:
                if self.authenticates:
                    self.auth_stub = rpc.AuthStub(self.channel)
                    await self._authenticate()
            except BaseException:
                channel, self.channel = self.channel, None
                await channel.close()
                raise
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def reauthenticate(self) -> None:
        await self.connect()
        await self._authenticate()
        old, self._watcher = self._watcher, _Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        keep = []
        for w in [*self._old_watchers, old]:
            if w is not None and w._callbacks:  # still streaming someone's watch
                keep.append(w)
            elif w is not None:
                await w.shutdown()
        self._old_watchers = keep

    async def close(self) -> None:
        old, self._old_watchers = self._old_watchers, []
        for w in old:
            try:
                await w.shutdown()
            except Exception as e:
                log.debug("shutting down an etcd watcher: %r", e)
        await super().close()


def _detail(e: BaseException) -> str:
    if isinstance(e, rpc.AioRpcError):
        return e.details() or ""
    return str(e)


def _is_token_error(e: BaseException) -> bool:
    for err in (e, e.__cause__):
        if err is not None and any(m in _detail(err).lower() for m in _TOKEN_MARKERS):
            return True
    return False


class EtcdLease(Lease):
    def __init__(self, store: EtcdStore, lease_id: int, ttl_s: float) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self._store = store

    async def refresh(self) -> None:
        reply = await self._store._call(lambda: self._store._client.refresh_lease(self.id), "lease keep-alive")
        if reply is None or reply.TTL <= 0:
            raise LeaseExpired(f"lease {self.id:x} has expired or was revoked")

    async def revoke(self) -> None:
        try:
            await self._store._call(lambda: self._store._client.revoke_lease(self.id), "lease revoke")
        except LeaseExpired:
            pass  # already gone: the keys are gone too

    def __repr__(self) -> str:
        return f"EtcdLease(id={self.id:x}, ttl_s={self.ttl_s})"


class _WatchStream:
    """One watch on the watcher (watch stream) that created it: ``aetcd.Client.watch`` cancels on
    the client's current watcher, which is a newer one after a re-authentication."""

    def __init__(self, watcher: aetcd.watcher.Watcher, callback: aetcd.watcher.WatcherCallback,
                 events: asyncio.Queue) -> None:
        self._watcher = watcher
        self._callback = callback
        self._events = events

    async def _iterate(self) -> AsyncIterator[aetcd.Event]:
        while True:
            event = await self._events.get()
            if event is None:  # cancelled, or the watcher shut down
                return
            if isinstance(event, BaseException):
                raise event
            yield event

    def __aiter__(self) -> AsyncIterator[aetcd.Event]:
        return self._iterate()

    async def cancel(self) -> None:
        self._events.put_nowait(None)
        await self._watcher.cancel(self._callback.watch_id)


class _EtcdWatch:
    """An async iterator over an etcd watch, created on the first read from a known revision."""

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int | None) -> None:
        self.prefix = prefix
        self._store = store
        self._start_revision = start_revision
        self._watch: _WatchStream | None = None
        self._iter: AsyncIterator[aetcd.Event] | None = None
        self._closed = False

    async def _start(self) -> None:
        store = self._store
        key, end = store._range(self.prefix)
        try:
            self._watch = await store._call(lambda: store._open_watch(key, end, self._start_revision), "watch")
        except MetadataError as e:
            if not isinstance(e.__cause__, aetcd.RevisionCompactedError):
                raise
            # the history since our last observed revision is gone: the best we can do is "now"
            log.warning("etcd watch on %r: revision %s compacted, watching from now", self.prefix, self._start_revision)
            self._watch = await store._call(lambda: store._open_watch(key, end, None), "watch")
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
    def __init__(self, client: aetcd.Client, url: str, namespace: str = "", timeout: float = 5.0,
                 user: str | None = None) -> None:
        self._client = client
        self.url = redact_url(url)  # never the password: it goes into messages and logs
        self.namespace = namespace
        self.timeout = timeout
        self.user = user
        self.reauths = 0  # re-authentications after etcd's token expired (see _call)
        self._ns = namespace.encode()
        self._last_revision = 0
        self._closed = False
        self._auth_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r}, namespace={self.namespace!r})"

    @classmethod
    async def connect(cls, url: str, *, namespace: str | None = None, timeout: float = 5.0,
                      security: ClientSecurity | None = None) -> EtcdStore:
        """Connect and check that etcd answers (``MetadataUnavailable`` within ``timeout`` if not;
        ``MetadataAuthError`` if it refuses the credentials or the TLS handshake fails).
        ``security`` overrides the URL's user/password (and, for ``etcds://``, its CA/cert/key)."""
        target = parse_etcd_target(url).with_security(security)
        ns = target.namespace if namespace is None else namespace
        client = _Client(host=target.host, port=target.port, username=target.user, password=target.password,
                         timeout=timeout, options=dict(_GRPC_OPTIONS), credentials=target.channel_credentials())
        store = cls(client, url, ns, timeout, user=target.user)
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

    async def _open_watch(self, key: bytes, end: bytes, start_revision: int | None) -> _WatchStream:
        await self._client.connect()
        watcher = self._client._watcher
        events: asyncio.Queue = asyncio.Queue()
        callback = await watcher.add_callback(key, events.put, range_end=end, start_revision=start_revision)
        return _WatchStream(watcher, callback, events)

    def _unavailable(self, detail: str, what: str) -> MetadataUnavailable:
        hint = ""
        if "socket closed" in detail.lower() and not self.url.startswith(("etcds:", "https:")):
            hint = " (if etcd serves TLS, use an etcds:// URL)"
        return MetadataUnavailable(f"metadata store {self.url} is unavailable ({what}): {detail}{hint}")

    def _auth_error(self, e: BaseException, what: str) -> MetadataAuthError | None:
        """The non-retriable credential and TLS failures, with what to do about them."""
        detail = _detail(e)
        low = detail.lower()
        if "authentication failed" in low or "invalid user id or password" in low:
            return MetadataAuthError(f"etcd at {self.url} refused the credentials for user {self.user!r} ({what})")
        unauthenticated = isinstance(e, aetcd.exceptions.UnauthenticatedError) or (
            isinstance(e, rpc.AioRpcError) and e.code() == rpc.StatusCode.UNAUTHENTICATED
        )
        if self.user is None and (unauthenticated or "user name is empty" in low or "invalid auth token" in low
                                  or "permission denied" in low):
            return MetadataAuthError(
                f"etcd at {self.url} requires authentication ({what}): put user:password in the metadata URL "
                "(etcd://user:password@host:port) or pass the user and password options"
            )
        if "permission denied" in low:
            return MetadataAuthError(f"etcd at {self.url} denied user {self.user!r} ({what}): {detail}")
        if self.url.startswith(("etcds:", "https:")) and any(m in low for m in _TLS_MARKERS):
            return MetadataAuthError(
                f"TLS with etcd at {self.url} failed ({what}): {detail} (is the CA the one that signed etcd's "
                "certificate, its name 127.0.0.1/the host of the URL, and does etcd serve TLS?)"
            )
        return None

    def _map_error(self, e: BaseException, what: str) -> BaseException:
        if isinstance(e, MetadataError):
            return e
        if isinstance(e, aetcd.ClientError | rpc.AioRpcError):
            auth = self._auth_error(e, what)
            if auth is None and e.__cause__ is not None:
                auth = self._auth_error(e.__cause__, what)
            if auth is not None:
                return auth
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

    async def _reauthenticate(self, generation: int, what: str) -> None:
        """A fresh token, once for every caller that saw the old one expire."""
        async with self._auth_lock:
            if self._client.generation != generation:
                return  # someone else already did
            await self._client.reauthenticate()
            self.reauths += 1
            log.info("etcd at %s: auth token expired (%s); re-authenticated as %r", self.url, what, self.user)

    async def _call(self, make: Callable[[], Awaitable[T]], what: str) -> T:
        """``await make()`` with a hard deadline, errors mapped to ``MetadataError``s; when etcd says
        the token is no longer valid, re-authenticate and call ``make`` once more."""
        expired: int | None = None  # the token generation etcd refused
        while True:
            if self._closed:
                raise StoreClosed(f"the metadata store {self.url} is closed")
            generation = getattr(self._client, "generation", 0)
            try:
                async with asyncio.timeout(self.timeout + 1.0):  # a hard bound over aetcd's own deadline
                    if expired is not None:
                        await self._reauthenticate(expired, what)
                    return await make()
            except Exception as e:
                if expired is None and self.user is not None and _is_token_error(e):
                    expired = generation
                    continue
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
        await self._call(lambda: self._client.connect(), "connect")
        client = self._client
        resp = await self._call(
            lambda: client.kvstub.Range(
                rpc.RangeRequest(key=self._k("/"), count_only=True), timeout=self.timeout, metadata=client.metadata
            ),
            "ping",
        )
        self._observe(resp.header.revision)
        return resp.header.revision

    async def get(self, key: str) -> Versioned | None:
        got = await self._call(lambda: self._client.get(self._k(key)), f"get {key}")
        if got is None:
            return None
        self._observe(got.header.revision)
        return Versioned(got.value, got.mod_revision)

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        check_txn({}, {key: value}, ())
        resp = await self._call(lambda: self._client.put(self._k(key), bytes(value), lease=self._lease_id(lease)), f"put {key}")
        self._observe(resp.header.revision)
        return resp.header.revision

    async def create(self, key: str, value: bytes, lease: Lease | None = None) -> int | None:
        check_txn({}, {key: value}, ())
        t = self._client.transactions
        ok, responses = await self._call(
            lambda: self._client.transaction(
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
            lambda: self._client.transaction(
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
            resp = await self._call(lambda: self._client.delete(self._k(key)), f"delete {key}")
            if resp is None:
                return False
            self._observe(resp.header.revision)
            return resp.deleted > 0
        if expected_version == 0:
            return False  # "delete if absent" never deletes anything
        t = self._client.transactions
        ok, responses = await self._call(
            lambda: self._client.transaction(
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
        await self._call(lambda: self._client.connect(), "connect")
        client = self._client
        out: list[tuple[str, Versioned]] = []
        revision = 0  # 0: the first page reads the latest revision; later pages read that same one
        while True:
            req = rpc.RangeRequest(key=start, range_end=end, limit=LIST_PAGE, revision=revision)
            resp = await self._call(
                lambda req=req: client.kvstub.Range(req, timeout=self.timeout, metadata=client.metadata), f"list {prefix}"
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
        granted = await self._call(lambda: self._client.lease(ttl), "lease grant")
        return EtcdLease(self, granted.id, float(granted.ttl))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._client.close(), self.timeout)
        except Exception as e:  # closing a connection to a dead server must not fail
            log.debug("closing etcd client for %s: %r", self.url, e)
