"""Several shims on one cluster: broker registration, partition ownership and fail-over.

Key layout in the metadata store (every key below is attached to its shim's lease, so it vanishes
by itself when the shim dies; a clean shutdown revokes the lease so they vanish at once):

* ``kafka/brokers/<node id>`` -> JSON ``{"node_id", "host", "port"}``: one per live shim. Node ids
  are unique among live shims (registration is create-if-absent, waiting up to twice the TTL for
  a previous incarnation's key to expire); without ``--node-id`` a shim allocates one from the
  counter ``kafka/node-ids`` (1, 2, ...: never reused).
* ``kafka/owners/<topic>/<partition>`` -> the owner's node id: the one shim serving that
  partition (its stream's writer).
* ``kafka/coordinators/<group>`` (``kafka/coordinators-txn/<id>`` for key type 1) -> the node
  coordinating a consumer group. Group state itself lives in the metadata store, so any shim can
  take a group over.

Who owns what. The owner of a resource (partition or group) is the node named in its key if that
node is live, else the *preferred* node: rendezvous hashing (highest blake2b of resource and node
id) over the live shims — deterministic, spreads resources evenly, and when a shim dies only its
resources move. Metadata and FindCoordinator answer with that owner. A shim serves a resource only
when it holds the key: on first use it claims it (create-if-absent under its lease) if it is the
preferred node; otherwise the request gets NOT_LEADER_OR_FOLLOWER / NOT_COORDINATOR and the client
refreshes metadata. Ownership is sticky while the live shims stay the same.

Rebalancing (``Broker._rebalance_loop``, on unless ``--no-rebalance``). Each shim lists the live
shims every ``rebalance_check_s`` (one small read); once a changed set has been stable for
``rebalance_delay_s``, it hands over, ``rebalance_batch`` at a time, every partition it holds whose
preferred node is now another live shim: it stops admitting appends to it, lets the queued ones be
acknowledged, closes the writer (writing the producer-state snapshot), then ``release``s the key.
Metadata then names the preferred node, which claims the partition on the next request for it and
takes the stream over with a new term, as in a fail-over. Rendezvous hashing moves only what the
new shim is now preferred for: about 1/n of the partitions when the n-th shim joins, none between
the others. Group and transaction coordinator keys are not moved: they stay sticky.

Fail-over. A killed shim stops refreshing its lease; after the TTL its keys vanish and the
preferred survivor claims each partition on the next request for it, opening the stream — a
take-over with a new term, which fences the old writer at the bookies. A shim that was paused
(SIGSTOP, a long GC-like stall) and comes back is a zombie: it stops serving as soon as its last
successful lease refresh is older than the TTL (``valid``, checked on every request, from the local
monotonic clock — conservative, since the store's TTL counts from when it received the refresh),
and its keep-alive then finds the lease gone, drops every resource (``on_lost``) and registers
again with a new lease. Even a zombie that appended before noticing would fail: its term is stale.

Claims are batched: the claims made in one event-loop turn (a first produce to a new topic, or a
survivor taking over a dead shim's partitions, claims hundreds at once) go to the store as one
create-all-if-absent transaction per 128 keys (``MetadataStore.create_all``). Such a transaction
writes nothing if any of its keys exists (another shim's, or ours from a previous lease); its
claims are then made one by one, so each key is decided on its own, as a lone claim is.

A ``Broker`` used as a library without being started (no registration) does not take part: it
serves every partition it is asked for, as the single shim of phase 1 did.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fragments.memstore import MAX_TXN_OPS, LeaseExpired
from fragments.store import Lease, MetadataError, MetadataStore

log = logging.getLogger(__name__)

BROKERS = "kafka/brokers/"
OWNERS = "kafka/owners/"
COORDINATORS = "kafka/coordinators/"
TXN_COORDINATORS = "kafka/coordinators-txn/"
NODE_ID_COUNTER = "kafka/node-ids"
CLAIM_LIVE_MAX_AGE_S = 0.5  # how old the listing of live shims a claim decides from may be


class NodeIdInUse(MetadataError):
    """Another live shim is registered with this node id."""


def partition_key(topic: str, partition: int) -> str:
    return f"{OWNERS}{topic}/{partition}"


def parse_partition_key(resource: str) -> tuple[str, int]:
    """(topic, partition) of a ``partition_key`` (topic names have no '/')."""
    topic, _, index = resource[len(OWNERS):].rpartition("/")
    return topic, int(index)


def coordinator_key(key_type: int, key: str) -> str:
    return f"{TXN_COORDINATORS if key_type == 1 else COORDINATORS}{key}"


@dataclass(frozen=True, order=True)
class BrokerInfo:
    """A live listener process: its node id, its primary (first) endpoint, and every endpoint as
    (listener name, host, port) - a client is told the address of the listener it came in on, as
    Kafka's ``advertised.listeners`` do."""

    node_id: int
    host: str
    port: int
    endpoints: tuple[tuple[str, str, int], ...] = ()

    def at(self, listener: str | None) -> tuple[str, int]:
        """(host, port) of the named listener (the primary endpoint if it has none by that name)."""
        for name, host, port in self.endpoints:
            if name == listener:
                return host, port
        return self.host, self.port

    def encode(self) -> bytes:
        d = {"node_id": self.node_id, "host": self.host, "port": self.port}
        if self.endpoints:
            d["endpoints"] = [list(e) for e in self.endpoints]
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BrokerInfo:
        d = json.loads(raw)
        endpoints = tuple((str(n), str(h), int(p)) for n, h, p in d.get("endpoints", ()))
        return cls(int(d["node_id"]), str(d["host"]), int(d["port"]), endpoints)


def preferred(resource: str, node_ids: list[int]) -> int | None:
    """Rendezvous hashing: the node with the highest hash of (resource, node)."""
    best, best_h = None, b""
    for n in node_ids:
        h = hashlib.blake2b(f"{resource}\x00{n}".encode(), digest_size=8).digest()
        if best is None or h > best_h:
            best, best_h = n, h
    return best


class Ownership:
    def __init__(self, store: MetadataStore, host: str, port: int, node_id: int | None = None,
                 ttl_s: float = 10.0, on_lost: Callable[[set[str]], None] = lambda _r: None):
        if ttl_s < 1.0:
            raise ValueError("the lease TTL must be at least 1 s")
        self.store = store
        self.host = host
        self.port = port
        self.endpoints: tuple[tuple[str, str, int], ...] = ()  # (listener name, host, port); set before start
        self.node_id = node_id
        self.ttl_s = ttl_s
        self.on_lost = on_lost
        self.held: set[str] = set()
        self._lease: Lease | None = None
        self._valid_until = 0.0
        self._task: asyncio.Task | None = None
        self._claiming: dict[str, asyncio.Future] = {}  # resource -> the claim in flight
        self._brokers_cache: tuple[float, list[BrokerInfo]] = (0.0, [])
        self._listing: asyncio.Future | None = None  # the listing of the live shims in flight
        self._claim_batch: list[tuple[str, Lease, asyncio.Future]] = []  # creates of this loop turn
        self.claim_transactions = 0  # store round trips claims took (batched), for tests and metrics
        self.started = False

    @property
    def me(self) -> BrokerInfo:
        return BrokerInfo(self.node_id, self.host, self.port, self.endpoints)

    # ---------------------------------------------------------------- registration
    async def start(self) -> None:
        if self.node_id is None:
            self.node_id = await self.store.next_id(NODE_ID_COUNTER)
        await self._register(wait_s=2 * self.ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._keepalive(), name=f"kafka-node-{self.node_id}")
        self.started = True
        log.info("Kafka shim registered as node %d (%s:%d), lease TTL %.1fs", self.node_id, self.host, self.port,
                 self.ttl_s)

    async def _register(self, wait_s: float) -> None:
        key = BROKERS + str(self.node_id)
        lease = await self.store.grant_lease(self.ttl_s)
        started = time.monotonic()
        deadline = started + wait_s
        try:
            while await self.store.create(key, self.me.encode(), lease=lease) is None:
                if time.monotonic() > deadline:
                    raise NodeIdInUse(f"node id {self.node_id} is registered by another live shim ({key})")
                await asyncio.sleep(min(0.5, self.ttl_s / 4))
        except BaseException:
            with contextlib.suppress(MetadataError):
                await lease.revoke()
            raise
        self._lease = lease
        self._valid_until = started + self.ttl_s

    async def _keepalive(self) -> None:
        failed = False
        while True:
            # after a failed refresh (a timeout while the store or this process is busy) retry soon:
            # waiting the usual third of the TTL again could let the lease run out
            await asyncio.sleep(self.ttl_s / 3 if self.valid and not failed else min(0.25, self.ttl_s / 4))
            sent = time.monotonic()
            failed = False
            try:
                await self._lease.refresh()
                self._valid_until = sent + self.ttl_s
            except LeaseExpired:
                self._lost("the lease expired")
                try:
                    await self._register(wait_s=2 * self.ttl_s)
                    log.warning("node %d: registered again with a new lease", self.node_id)
                except Exception as exc:
                    log.warning("node %d: registering again failed: %r", self.node_id, exc)
            except Exception as exc:
                failed = True
                log.warning("node %d: refreshing the lease failed: %r", self.node_id, exc)

    def _lost(self, why: str) -> None:
        lost, self.held = self.held, set()
        self._valid_until = 0.0
        log.warning("node %d: %s; dropping %d partitions/groups", self.node_id, why, len(lost))
        self.on_lost(lost)

    @property
    def lease(self) -> Lease | None:
        """The lease our keys live under (None unless started)."""
        return self._lease if self.started else None

    @property
    def valid(self) -> bool:
        return time.monotonic() < self._valid_until

    async def close(self) -> None:
        """Deregister now: every key of ours vanishes and the survivors can claim at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.held = set()
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()

    # ---------------------------------------------------------------- who owns what
    async def brokers(self, max_age_s: float = 0.0) -> list[BrokerInfo]:
        """The live shims, by node id (``max_age_s``: a cached answer that recent will do)."""
        if not self.started:
            return [self.me]
        at, cached = self._brokers_cache
        if max_age_s > 0 and time.monotonic() - at < max_age_s:
            return cached
        if max_age_s > 0 and self._listing is not None:  # many callers at once share one listing
            return await asyncio.shield(self._listing)
        listing = asyncio.ensure_future(self._list_brokers())
        if max_age_s > 0:
            self._listing = listing
            listing.add_done_callback(lambda f: setattr(self, "_listing", None) if self._listing is f else None)
        return await asyncio.shield(listing)

    async def _list_brokers(self) -> list[BrokerInfo]:
        out = []
        for k, v in await self.store.list_prefix(BROKERS):
            try:
                out.append(BrokerInfo.decode(v.value))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed broker registration at %s", k)
        if all(b.node_id != self.me.node_id for b in out):
            if self.valid:
                out.append(self.me)  # our own registration may not be listed yet (just started or renewed)
            else:
                log.warning("node %d: not registered (lease not refreshed for %.1f s); not listing itself",
                            self.node_id, time.monotonic() - self._valid_until + self.ttl_s)
        out.sort()
        self._brokers_cache = (time.monotonic(), out)
        return out

    def owns(self, resource: str) -> bool:
        if not self.started:  # a Broker used as a library without start(): single-shim behaviour
            return True
        return resource in self.held and self.valid

    async def owners(self, prefix: str) -> dict[str, int]:
        """Resource key -> node id of every held key under ``prefix``."""
        out = {}
        for k, v in await self.store.list_prefix(prefix):
            with contextlib.suppress(ValueError):
                out[k] = int(v.value)
        return out

    def owner_among(self, resource: str, holder: int | None, live: list[BrokerInfo]) -> BrokerInfo | None:
        ids = [b.node_id for b in live]
        node = holder if holder in ids else preferred(resource, ids)
        return next((b for b in live if b.node_id == node), None)

    async def owner(self, resource: str) -> BrokerInfo | None:
        live = await self.brokers(max_age_s=0.5)
        v = await self.store.get(resource)
        holder = None
        if v is not None:
            with contextlib.suppress(ValueError):
                holder = int(v.value)
        return self.owner_among(resource, holder, live)

    async def claim(self, resource: str) -> bool:
        """Whether this shim owns ``resource`` now, claiming it if it is unowned and we are preferred.

        One store round trip when the live shims are known (a listing at most ``CLAIM_LIVE_MAX_AGE_S``
        old: a shim that joined since may lose a resource it would have been preferred for, which
        the rebalancing pass after ``rebalance_delay_s`` hands over); one that died since is still listed, so we may decline for
        that long and the client retries). Claims of different resources run concurrently (a
        first produce to a new topic claims all its partitions at once); claims of one resource
        share one attempt."""
        if self.owns(resource):
            return True
        if not self.valid:
            return False
        pending = self._claiming.get(resource)
        if pending is None:
            pending = asyncio.ensure_future(self._claim(resource))
            self._claiming[resource] = pending
            pending.add_done_callback(lambda _f: self._claiming.pop(resource, None))
        return await asyncio.shield(pending)

    async def _claim(self, resource: str) -> bool:
        live = [b.node_id for b in await self.brokers(max_age_s=CLAIM_LIVE_MAX_AGE_S)]
        if self.node_id not in live or preferred(resource, live) != self.node_id:
            return False
        lease = self._lease
        try:
            # create-if-absent: a key held by another live shim (or by our own previous lease,
            # until it expires) is left alone
            created = await self._create_batched(resource, lease)
        except LeaseExpired:
            return False
        if created is None or lease is not self._lease or not self.valid:
            return False
        self.held.add(resource)
        log.info("node %d: claimed %s", self.node_id, resource)
        return True

    def _create_batched(self, resource: str, lease: Lease) -> asyncio.Future:
        """``store.create(resource, our node id, lease)``, sent with the other claims of this
        loop turn (``_flush_claims``)."""
        fut = asyncio.get_running_loop().create_future()
        if not self._claim_batch:
            asyncio.get_running_loop().call_soon(self._flush_claims)
        self._claim_batch.append((resource, lease, fut))
        return fut

    def _flush_claims(self) -> None:
        batch, self._claim_batch = self._claim_batch, []
        by_lease: dict[int, list[tuple[str, Lease, asyncio.Future]]] = {}
        for item in batch:
            by_lease.setdefault(id(item[1]), []).append(item)
        for items in by_lease.values():
            for i in range(0, len(items), MAX_TXN_OPS):
                asyncio.ensure_future(self._create_chunk(items[i:i + MAX_TXN_OPS]))

    async def _create_chunk(self, items: list[tuple[str, Lease, asyncio.Future]]) -> None:
        value = str(self.node_id).encode()
        lease = items[0][1]
        try:
            self.claim_transactions += 1
            if len(items) == 1:
                results = [await self.store.create(items[0][0], value, lease=lease)]
            else:
                rev = await self.store.create_all({r: value for r, _, _ in items}, lease=lease)
                if rev is not None:
                    results = [rev] * len(items)
                else:  # some key exists: decide each on its own
                    self.claim_transactions += len(items)
                    results = await asyncio.gather(*(self.store.create(r, value, lease=lease) for r, _, _ in items),
                                                   return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - every claim of the chunk fails with it
            results = [exc] * len(items)
        except BaseException:  # cancelled (shutdown): so are the claims
            for _, _, fut in items:
                fut.cancel()
            raise
        for (_, _, fut), res in zip(items, results):
            if fut.done():
                continue
            if isinstance(res, BaseException):
                fut.set_exception(res)
            else:
                fut.set_result(res)

    async def release(self, resource: str) -> None:
        """Give ``resource`` up (its key is deleted so the preferred shim can claim it). If the
        store fails, the resource is still held (and served) here, and the error raised."""
        if resource in self.held:
            self.held.discard(resource)
            lease = self._lease
            try:
                v = await self.store.get(resource)
                if v is not None and v.value == str(self.node_id).encode():
                    await self.store.delete(resource, expected_version=v.version)
            except BaseException:
                if lease is self._lease and self.valid:
                    self.held.add(resource)
                raise
