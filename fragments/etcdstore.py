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
* High availability: ``etcd://h1:2379,h2:2379,h3:2379/ns`` lists the members of one cluster. The
  store talks to one member at a time (the first, until it fails) over its own gRPC channel, and
  moves to the next one when a request fails with ``MetadataUnavailable`` (connection refused or
  reset, deadline passed: a silent member, "no leader": a member cut off from the quorum). The
  request is then repeated there: reads, puts, lease keep-alives and revokes, blind txns and lease
  grants (with a client-chosen lease id) as they are; guarded writes (``create``, ``txn`` with
  compares, ``delete``) too, except that a lost compare after an attempt that may have been
  applied raises ``MetadataUnavailable`` (outcome unknown) rather than a false "lost". A call
  tries every member once and goes on (with short pauses) until ``timeout`` has passed. Watches
  whose stream broke are re-created on the next member from the revision after the last event
  they delivered. Requests carry etcd's require-leader flag, and gRPC keepalive (10 s, 5 s ping
  timeout) ends streams through a silent member. See docs/metadata.md, "Several etcd members".
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
import gc
import logging
import math
import secrets
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aetcd
import aetcd.rpc as rpc
import aetcd.watcher
import grpc
from aetcd.utils import prefix_range_end

from fragments.memstore import MAX_TXN_OPS, LeaseExpired, StoreClosed, check_txn
from fragments.security import ClientSecurity, redact_url
from fragments.store import (
    Lease,
    MetadataAuthError,
    MetadataError,
    MetadataStore,
    MetadataUnavailable,
    TxnResult,
    Versioned,
    WatchCompacted,
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
    # gRPC >= 1.5x waits this long for any ping's ack (default 60 s), keepalive pings included:
    # without it a silent server is noticed after ~70 s instead of ~15 s
    "grpc.http2.ping_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,  # keep pinging a watch stream that receives nothing
    # every store has its own connections: a member that was down and came back is tried afresh, not
    # refused from a connection-failure backoff shared through gRPC's process-wide subchannel pool
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.max_reconnect_backoff_ms": 5_000,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
    # no BDP probing: it sends an HTTP/2 ping after reads, which costs an idle process (a lease
    # keep-alive every few seconds) ~25% more CPU here and etcd a ping each; a fixed 4 MiB stream
    # window instead keeps large listings from waiting on window updates
    "grpc.http2.bdp_probe": 0,
    "grpc.http2.lookahead_bytes": 4 * 1024 * 1024,
}


# etcd's "require leader" metadata (clientv3.WithRequireLeader): a member without a leader refuses
# requests with "no leader" and ends watch streams, instead of serving a minority partition's view
_REQUIRE_LEADER = (("hasleader", "true"),)
_FAILOVER_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.5)  # pauses once every member has failed in a row
# failures that prove a request never reached etcd's state machine (it may be retried even if not idempotent)
_NOT_APPLIED_MARKERS = ("no leader", "failed to connect", "connection refused", "connect failed",
                        "not capable", "too many requests")

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
    # every member the URL lists, in order (host, port); the first is ``host``/``port``
    endpoints: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.endpoints:
            object.__setattr__(self, "endpoints", ((self.host, self.port),))

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


def _parse_endpoint(entry: str, shown: str) -> tuple[str, int]:
    """One ``host[:port]`` (or ``[v6addr][:port]``) of an endpoint list."""
    if not entry:
        raise ValueError(f"empty endpoint in the etcd URL's list (host:port,host:port,...): {shown!r}")
    parts = urllib.parse.urlsplit("//" + entry)
    if not parts.hostname or parts.netloc != entry:
        raise ValueError(f"bad endpoint {entry!r} in etcd URL {shown!r} (host:port expected)")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"bad port in endpoint {entry!r} of etcd URL {shown!r}") from None
    return parts.hostname, port


def parse_etcd_target(url: str) -> EtcdTarget:
    """``etcd[s]://[user:password@]host[:port][,host[:port]...][/namespace][?ca=&cert=&key=]``
    (also ``http``/``https``). Several comma-separated endpoints are members of one cluster."""
    parts = urllib.parse.urlsplit(url)
    shown = redact_url(url)
    if parts.scheme not in _PLAIN_SCHEMES + _TLS_SCHEMES:
        raise ValueError(f"not an etcd URL (etcd://host:port, or etcds://host:port for TLS): {shown!r}")
    hostport = parts.netloc.rpartition("@")[2]
    if "," in hostport:
        endpoints = tuple(_parse_endpoint(entry.strip(), shown) for entry in hostport.split(","))
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"an endpoint is listed twice in etcd URL {shown!r}")
        host, port = endpoints[0]
    else:
        host = parts.hostname or "127.0.0.1"
        try:
            port = parts.port or DEFAULT_PORT
        except ValueError as e:
            raise ValueError(f"bad port in etcd URL {shown!r}") from e
        endpoints = ((host, port),)
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
                      files.get("ca"), files.get("cert"), files.get("key"), endpoints)


def parse_etcd_url(url: str) -> tuple[str, int, str]:
    """``etcd://host:port[/namespace]`` (and the forms ``parse_etcd_target`` takes) -> (host, port, namespace).
    One endpoint only: use ``parse_etcd_target`` for a list of endpoints."""
    t = parse_etcd_target(url)
    if len(t.endpoints) > 1:
        raise ValueError(f"one etcd endpoint expected, not a list: {redact_url(url)!r}")
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
        if response.canceled and not response.created and response.compact_revision == 0:
            # etcd ended a watch by itself (e.g. "no leader"): tell its owner instead of going silent
            async with self._lock:
                callback = self._callbacks.pop(response.watch_id, None)
            if callback is not None:
                reason = response.cancel_reason or "watch canceled by etcd"
                await self._process_callback(callback, aetcd.ClientError(f"watch canceled: {reason}"))
            return
        await super()._handle_response(response)


class _Client(aetcd.Client):
    """``aetcd.Client`` with TLS, re-authentication and fail-over between the members of a cluster.

    aetcd 1.0's ``connect`` always opens ``grpc.aio.insecure_channel`` to one host; this override
    opens one channel (a ``secure_channel`` when ``credentials`` are given) to the *current*
    endpoint of ``endpoints``, with our ``_Watcher``, and closes it again when authenticating
    fails. ``fail_over`` drops that channel (every watch on it gets a ``ConnectionFailedError``)
    and moves to the next endpoint; the next ``connect`` opens it. ``epoch`` counts the switches,
    so that of several callers that saw the same member fail only the first one switches.
    ``reauthenticate`` fetches a fresh token (etcd's simple tokens expire when unused for
    ``--auth-token-ttl``) and starts a new watcher carrying it for new watches: etcd checks the
    token given when a watch stream opens on every watch it creates.

    Every request carries etcd's "require leader" metadata, so a member that lost its leader
    (a minority partition) refuses at once ("no leader") instead of answering stale or not at
    all, and ends its watch streams.
    """

    def __init__(self, *, endpoints: tuple[tuple[str, int], ...],
                 credentials: grpc.ChannelCredentials | None = None, **kwargs: Any) -> None:
        host, port = endpoints[0]
        super().__init__(host=host, port=port, **kwargs)
        self.endpoints = tuple(endpoints)
        self._index = 0
        self.epoch = 0  # bumped by every switch to another endpoint
        self._credentials = credentials
        self.generation = 0  # bumped by every (re)authentication
        self._old_watchers: list[aetcd.watcher.Watcher] = []
        self._switch_lock = asyncio.Lock()
        self._keepalive_lock = asyncio.Lock()
        self._keepalive_call: Any = None  # the open LeaseKeepAlive stream (see refresh_lease)
        self._keepalive_of: tuple = ()  # the stub and metadata it was opened with

    @property
    def authenticates(self) -> bool:
        return self._username is not None

    @property
    def endpoint(self) -> str:
        """The member this client talks to now (``host:port``)."""
        host, port = self.endpoints[self._index]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _authenticate(self) -> None:
        req = rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            resp = await self.auth_stub.Authenticate(req, timeout=self._timeout, metadata=_REQUIRE_LEADER)
        except rpc.AioRpcError as e:
            if "authentication is not enabled" not in (e.details() or ""):
                raise
            self.metadata = _REQUIRE_LEADER  # credentials for an etcd without auth: nothing to send
        else:
            self.metadata = (("token", resp.token), *_REQUIRE_LEADER)
        self.generation += 1

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        async with self._switch_lock:  # one connect at a time, never during a switch
            if self._connected.is_set():
                return
            target = self.endpoint
            if self._credentials is None:
                self.channel = rpc.insecure_channel(target, options=self._options.items())
            else:
                self.channel = rpc.secure_channel(target, self._credentials, options=self._options.items())
            self.metadata = _REQUIRE_LEADER
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

    async def fail_over(self, epoch: int, reason: str) -> bool:
        """Leave the current member for the next one, unless someone already did since ``epoch``."""
        async with self._switch_lock:
            if epoch != self.epoch or len(self.endpoints) < 2:
                return False
            old = self.endpoint
            self.epoch += 1
            self._index = (self._index + 1) % len(self.endpoints)
            log.warning("etcd member %s failed (%s): switching to %s", old, reason, self.endpoint)
            await self._drop(aetcd.ConnectionFailedError(f"etcd member {old} failed ({reason})"))
            return True

    async def _drop(self, error: BaseException) -> None:
        """Close the current channel; its watches end with ``error`` (their owners re-create them)."""
        watchers, self._old_watchers = [*self._old_watchers, self._watcher], []
        channel = self.channel
        self._init_channel_attrs()
        self._connected.clear()
        for w in watchers:
            if w is None:
                continue
            try:
                await asyncio.wait_for(w._terminate_stream(error), 2.0)
            except Exception as e:
                log.debug("ending the watch stream of a failed etcd member: %r", e)
        if channel is not None:
            try:
                await asyncio.wait_for(channel.close(), 2.0)
            except Exception as e:
                log.debug("closing the channel to a failed etcd member: %r", e)

    async def reauthenticate(self) -> None:
        await self.connect()
        async with self._switch_lock:
            if not self._connected.is_set():  # another request switched members meanwhile (and authenticated)
                return
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

    async def refresh_lease(self, lease_id: int) -> Any:
        """One keep-alive, over a LeaseKeepAlive stream kept open between keep-alives (aetcd opens a
        stream for every one: about twice the CPU, in etcd and here, for what a process does every
        third of its lease TTL while idle). The stream belongs to the current channel and token;
        any error or cancellation (a timeout) drops it, and the next keep-alive opens another."""
        await self.connect()
        async with self._keepalive_lock:
            call = self._keepalive_call
            if call is None or call.done() or self._keepalive_of != (self.leasestub, self.metadata):
                if call is not None:
                    call.cancel()
                call = self.leasestub.LeaseKeepAlive(metadata=self.metadata)
                self._keepalive_call, self._keepalive_of = call, (self.leasestub, self.metadata)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise aetcd.ConnectionFailedError("the lease keep-alive stream ended")
                if reply.ID != lease_id:  # (one request at a time: cannot happen)
                    raise aetcd.ClientError(f"keep-alive answer for lease {reply.ID:x}, not {lease_id:x}")
                return reply
            except BaseException as e:
                self._keepalive_call = None
                call.cancel()
                if isinstance(e, rpc.AioRpcError):
                    aetcd.exceptions._handle_exception(e)
                raise

    async def close(self) -> None:
        """Cancel the keep-alive and watch streams, close the channel, and wait (bounded) until gRPC
        has delivered each stream's status: its status task otherwise outlives the client, and an
        owner that stops its loop at once is told "Task was destroyed but it is pending"."""
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
            self._keepalive_call = None
        old, self._old_watchers = self._old_watchers, []
        for w in old:
            try:
                await w.shutdown()
            except Exception as e:
                log.debug("shutting down an etcd watcher: %r", e)
        settling = _status_tasks(self.channel)
        await super().close()
        if settling:
            await asyncio.wait(settling, timeout=2.0)


def _status_tasks(channel: Any) -> list[asyncio.Task]:
    """The pending status tasks of ``channel``'s streaming calls. gRPC starts one per stream and
    keeps no list of them, so they are found through their coroutine's scope, which holds the
    call (whose ``_channel`` is the channel's). Only at close: it looks at every task of the loop."""
    cy = getattr(channel, "_channel", None)
    if cy is None:
        return []
    found = []
    for t in asyncio.all_tasks():
        co = t.get_coro()
        if t.done() or not getattr(co, "__qualname__", "").endswith("_handle_status_once_received"):
            continue
        if any(getattr(r, "_channel", None) is cy for scope in gc.get_referents(co) for r in gc.get_referents(scope)):
            found.append(t)
    return found


def _detail(e: BaseException) -> str:
    if isinstance(e, rpc.AioRpcError):
        return e.details() or ""
    return str(e)


def _compare_failed(result: tuple[bool, Any]) -> bool:
    return not result[0]


def _maybe_applied(e: BaseException) -> bool:
    """Whether a failed request may still have been applied (deadline, connection lost mid-request)."""
    detail = " ".join(_detail(err) for err in (e, e.__cause__) if err is not None).lower()
    return not any(m in detail for m in _NOT_APPLIED_MARKERS)


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
        # a keep-alive that takes a third of the TTL is left for another member (several endpoints)
        reply = await self._store._call(lambda: self._store._client.refresh_lease(self.id), "lease keep-alive",
                                        attempt_timeout=max(1.0, min(self._store.timeout, self.ttl_s / 3)))
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
                 events: asyncio.Queue, epoch: int = 0) -> None:
        self._watcher = watcher
        self._callback = callback
        self._events = events
        self.epoch = epoch  # the client's endpoint epoch the watch was created in

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

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int | None, *, strict: bool = False) -> None:
        self.prefix = prefix
        self._strict = strict  # a compacted start revision raises WatchCompacted (the owner lists again)
        self._store = store
        self._start_revision = start_revision
        self._last_revision = 0  # of the last event delivered: a re-created watch starts after it
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
            if self._strict:
                raise WatchCompacted(f"etcd watch on {self.prefix!r}: revision {self._start_revision} compacted") \
                    from e
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
        while True:
            assert self._iter is not None
            try:
                event = await self._iter.__anext__()
                break
            except StopAsyncIteration:
                self._closed = True
                raise
            except Exception as e:
                mapped = self._store._map_error(e, "watch")
                if not (isinstance(mapped, MetadataUnavailable) and self._store.fails_over) or self._closed:
                    self._closed = True
                    raise mapped from e
            await self._resume(mapped)
        kv = event.kv
        self._last_revision = kv.mod_revision
        self._store._observe(kv.mod_revision)
        key = self._store._strip(kv.key)
        if event.kind == "DELETE":
            return WatchEvent(key, None, kv.mod_revision)
        return WatchEvent(key, kv.value, kv.mod_revision)

    async def _resume(self, error: MetadataUnavailable) -> None:
        """The watch stream broke (its member died, went silent or lost its leader): create the watch
        again through another member, from the revision after the last event delivered."""
        store = self._store
        broken, self._watch, self._iter = self._watch, None, None
        if broken is not None:
            await store._client.fail_over(broken.epoch, str(error.__cause__ or error))
        if self._last_revision:
            self._start_revision = self._last_revision + 1
        try:
            await self._start()
        except BaseException:
            self._closed = True
            raise
        store.watch_resumes += 1
        log.info("etcd watch on %r re-created through %s from revision %s", self.prefix, store.endpoint,
                 self._start_revision)
        if self._closed:  # closed while resuming
            await self._cancel()
            raise StopAsyncIteration

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
        self.failovers = 0  # requests that succeeded through another member after one failed
        self.watch_resumes = 0  # watches re-created through another member after their stream broke
        self._ns = namespace.encode()
        self._last_revision = 0
        self._closed = False
        self._auth_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"EtcdStore({self.url!r}, namespace={self.namespace!r})"

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every member of the URL, ``host:port``."""
        return tuple(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in getattr(self._client, "endpoints", ()))

    @property
    def endpoint(self) -> str | None:
        """The member requests go to now (the first of the URL until it fails)."""
        return getattr(self._client, "endpoint", None)

    @property
    def fails_over(self) -> bool:
        """True when the URL lists several members: failed requests and watches move to the next one."""
        return len(getattr(self._client, "endpoints", ())) > 1

    @classmethod
    async def connect(cls, url: str, *, namespace: str | None = None, timeout: float = 5.0,
                      security: ClientSecurity | None = None) -> EtcdStore:
        """Connect and check that etcd answers (``MetadataUnavailable`` within ``timeout`` if not;
        ``MetadataAuthError`` if it refuses the credentials or the TLS handshake fails).
        ``security`` overrides the URL's user/password (and, for ``etcds://``, its CA/cert/key)."""
        target = parse_etcd_target(url).with_security(security)
        ns = target.namespace if namespace is None else namespace
        client = _Client(endpoints=target.endpoints, username=target.user, password=target.password,
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
        epoch = getattr(self._client, "epoch", 0)
        events: asyncio.Queue = asyncio.Queue()
        callback = await watcher.add_callback(key, events.put, range_end=end, start_revision=start_revision)
        return _WatchStream(watcher, callback, events, epoch)

    def _unavailable(self, detail: str, what: str) -> MetadataUnavailable:
        hint = ""
        if "socket closed" in detail.lower() and not self.url.startswith(("etcds:", "https:")):
            hint = " (if etcd serves TLS, use an etcds:// URL)"
        if self.fails_over:
            hint += f" (last tried member {self.endpoint})"
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

    async def _call(self, make: Callable[[], Awaitable[T]], what: str, *,
                    lost: Callable[[T], bool] | None = None, attempt_timeout: float | None = None) -> T:
        """``await make()`` with a hard deadline, errors mapped to ``MetadataError``s; when etcd says
        the token is no longer valid, re-authenticate and call ``make`` once more.

        With several endpoints, a ``MetadataUnavailable`` failure moves the client to the next member
        and calls ``make`` again: at least once on every member, and on until ``timeout`` has passed
        since the first attempt (pausing briefly after each round in which every member failed, e.g.
        during an election). ``make`` must be safe to repeat. A guarded write passes ``lost``, which
        says whether its result is a lost compare: after an attempt that may have been applied
        (deadline, connection lost mid-request), a lost compare may be our own earlier write, so
        the call raises ``MetadataUnavailable`` (outcome unknown) instead of returning it.
        ``attempt_timeout`` (several endpoints only) bounds each attempt more tightly than
        ``timeout``, so that a silent member is left sooner (lease keep-alives)."""
        client = self._client
        members = len(getattr(client, "endpoints", ())) or 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempts = 0
        maybe_applied = False
        expired: int | None = None  # the token generation etcd refused
        bound = attempt_timeout if attempt_timeout and members > 1 else self.timeout + 1.0
        while True:
            if self._closed:
                raise StoreClosed(f"the metadata store {self.url} is closed")
            generation = getattr(client, "generation", 0)
            epoch = getattr(client, "epoch", 0)
            attempts += 1
            try:
                async with asyncio.timeout(bound):  # a hard bound over aetcd's own deadline
                    if expired is not None:
                        await self._reauthenticate(expired, what)
                    await client.connect()  # after a switch: open the next member's channel first
                    result = await make()
            except (Exception, asyncio.CancelledError) as caught:
                e = caught
                if isinstance(e, asyncio.CancelledError):
                    task = asyncio.current_task()
                    if (task is not None and task.cancelling()) or getattr(client, "epoch", 0) == epoch:
                        raise  # we were cancelled
                    # grpc.aio reports a call on a channel that another caller closed (switching
                    # members) as a cancellation: that call failed, it was not ours to cancel
                    e = aetcd.ConnectionFailedError("the channel closed: another request switched members")
                    e.__cause__ = caught
                if expired is None and self.user is not None and _is_token_error(e):
                    expired = generation
                    continue
                mapped = self._map_error(e, what)
                if isinstance(e, TimeoutError) and attempt_timeout:
                    mapped = self._unavailable(f"no answer within {bound:g}s", what)
                if (members > 1 and isinstance(mapped, MetadataUnavailable) and not self._closed
                        and (attempts < members or loop.time() - started < self.timeout)):
                    maybe_applied = maybe_applied or _maybe_applied(e)
                    await client.fail_over(epoch, f"{what}: {_detail(e) or type(e).__name__}")
                    if attempts >= members:  # every member failed in a row: let an election finish
                        await asyncio.sleep(_FAILOVER_BACKOFF_S[min(attempts - members, len(_FAILOVER_BACKOFF_S) - 1)])
                    continue
                if mapped is e:
                    raise
                raise mapped from e
            if attempts > 1:
                self.failovers += 1
                if lost is not None and maybe_applied and lost(result):
                    raise self._unavailable(
                        "the member failed while the write was in flight and the retry's compare failed: "
                        "the write may or may not have been applied", what)
            return result

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
        return await self.create_all({key: value}, lease=lease)

    async def create_all(self, items: dict[str, bytes], lease: Lease | None = None) -> int | None:
        check_txn(dict.fromkeys(items, 0), items, ())
        if not items:
            return None
        t = self._client.transactions
        lease_id = self._lease_id(lease)
        ok, responses = await self._call(
            lambda: self._client.transaction(
                compare=[t.create(self._k(k)) == 0 for k in items],
                success=[t.put(self._k(k), bytes(v), lease=lease_id) for k, v in items.items()],
                failure=[],
            ),
            f"create {next(iter(items))}" if len(items) == 1 else f"create {len(items)} keys",
            lost=_compare_failed,
        )
        if not ok:
            return None
        revision = responses[0].response_put.header.revision
        self._observe(revision)
        return revision

    async def put_many(self, items: dict[str, bytes], lease: Lease | None = None) -> dict[str, int]:
        check_txn({}, items, ())
        if not items:
            return {}
        t = self._client.transactions
        lease_id = self._lease_id(lease)
        _ok, responses = await self._call(
            lambda: self._client.transaction(
                compare=[], success=[t.put(self._k(k), bytes(v), lease=lease_id) for k, v in items.items()],
                failure=[]),
            f"put {len(items)} keys",
        )
        revision = responses[0].response_put.header.revision
        self._observe(revision)
        return dict.fromkeys(items, revision)

    async def get_many(self, keys: list[str]) -> list[Versioned | None]:
        if len(keys) > MAX_TXN_OPS:
            raise ValueError(f"a transaction is limited to {MAX_TXN_OPS} reads")
        if not keys:
            return []
        t = self._client.transactions
        ok, responses = await self._call(
            lambda: self._client.transaction(compare=[], success=[t.get(self._k(k)) for k in keys], failure=[]),
            f"get {len(keys)} keys",
        )
        out: list[Versioned | None] = []
        for kvs in responses:  # aetcd: a range answer is a list of (value, Get)
            if kvs:
                value, got = kvs[0]
                out.append(Versioned(value, got.mod_revision))
                self._observe(got.header.revision)
            else:
                out.append(None)
        return out

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
            lost=_compare_failed if compares else None,
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
            resp = await self._call(lambda: self._client.delete(self._k(key)), f"delete {key}",
                                    lost=lambda r: r is None)
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
            lost=_compare_failed,
        )
        if not ok:
            return False
        dr = responses[0].response_delete_range
        self._observe(dr.header.revision)
        return dr.deleted > 0

    async def list_prefix(self, prefix: str) -> list[tuple[str, Versioned]]:
        """One consistent snapshot of the prefix, read in pages of ``LIST_PAGE`` keys."""
        return (await self._list(prefix))[0]

    async def _list(self, prefix: str) -> tuple[list[tuple[str, Versioned]], int]:
        """The snapshot and the revision it was read at."""
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
                return out, revision
            start = resp.kvs[-1].key + b"\0"

    async def list_and_watch(self, prefix: str) -> tuple[list[tuple[str, Versioned]], AsyncIterator[WatchEvent]]:
        """The listing, and a watch from exactly the revision after it (a compacted one raises
        ``WatchCompacted`` rather than silently watching from now)."""
        if self._closed:
            raise StoreClosed(f"the metadata store {self.url} is closed")
        items, revision = await self._list(prefix)
        return items, _EtcdWatch(self, prefix, revision + 1, strict=True)

    def watch_prefix(self, prefix: str) -> AsyncIterator[WatchEvent]:
        if self._closed:
            raise StoreClosed(f"the metadata store {self.url} is closed")
        start = self._last_revision + 1 if self._last_revision else None
        return _EtcdWatch(self, prefix, start)

    async def grant_lease(self, ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise ValueError("a lease TTL must be positive")
        ttl = max(1, math.ceil(ttl_s))
        if not self.fails_over:
            granted = await self._call(lambda: self._client.lease(ttl), "lease grant")
            return EtcdLease(self, granted.id, float(granted.ttl))
        # several members: the client picks the lease id, so that a grant repeated on another member
        # after an interrupted one finds its own lease ("lease already exists") instead of leaking one
        lease_id = secrets.randbits(62) + 1
        attempts = 0

        async def grant() -> float:
            nonlocal attempts
            attempts += 1
            try:
                return float((await self._client.lease(ttl, lease_id)).ttl)
            except aetcd.DuplicateLeaseError:
                if attempts == 1:
                    raise
                info = await self._client.get_lease_info(lease_id, keys=False)
                return float(info.grantedTTL)

        return EtcdLease(self, lease_id, await self._call(grant, "lease grant"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._client.close(), self.timeout)
        except Exception as e:  # closing a connection to a dead server must not fail
            log.debug("closing etcd client for %s: %r", self.url, e)
