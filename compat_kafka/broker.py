"""The request handlers: Kafka APIs answered from Scroll streams.

How this works. ``Broker.handle`` takes a decoded request and returns the kio response body (or
None for an acks=0 produce, which gets no answer). Topics are the streams API's topics
(``streams/topics.py``): one record per topic at ``/scroll/topics/<name>`` (partitions, topic id,
configs), shared with ``ScrollClient.create_topic`` and ``scroll topic``; partition ``p`` of topic
``t`` is the stream ``partition_stream(t, p)`` (``t`` itself for partition 0, ``t:p`` after), and a
stream created alone with the Python API is a one-partition topic of its own name, listed in
Metadata like any other. Partitions are opened on first use (``PartitionLog.open``) and kept open:
read-only for Fetch/ListOffsets (no take-over: another writer, a Python producer say, keeps the
stream), writable for Produce (the stream's one writer, a take-over), and opened again after their
writer fails or another writer took the stream over. Fetch long-polls on this shim's own
acknowledged appends, and on the bookies' LAC for read-only partitions.

Several shims (``compat_kafka.ownership``): each registers as a broker under a lease and serves only
the partitions it owns (claimed under its lease on first use when it is the preferred node), and
hands over those another live shim is now preferred for (``_rebalance_loop``, ``_hand_over``);
Metadata names every live shim and each partition's owner as its leader, the lowest live node id
as controller; Produce/Fetch/ListOffsets for a partition owned elsewhere answer
NOT_LEADER_OR_FOLLOWER. Group coordinators are placed the same way (``coordinator_node``,
``is_coordinator``). InitProducerId hands out producer ids (``compat_kafka.producer_ids``); with a
transactional id it is the transaction coordinator's (``compat_kafka.transactions``), which also
serves AddPartitionsToTxn, AddOffsetsToTxn, EndTxn, TxnOffsetCommit and WriteTxnMarkers. Fetch and
ListOffsets with read_committed stop at the partition's last stable offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime
import functools
import itertools
import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kio.schema.errors import ErrorCode

from fragments.ledgers import NoSuchLedger
from streams.errors import NoSuchTopic, StaleTermError, TopicExists
from streams.topics import InvalidTopicName, TopicMeta, check_topic_name, partition_stream

from .admin import REPLICATION_FACTOR, SEGMENT_KEYS, Admin, check_topic_configs, retention_policy, rollover_caps
from .cluster.interbroker import BROKER_PRINCIPAL, InterBrokerClient, ensure_identity
from .cluster.ownership import BROKERS as OWNERSHIP_BROKERS
from .cluster.ownership import OWNERS, Ownership, coordinator_key, parse_partition_key, partition_key, preferred
from .groups.coordinator import GroupConfig, GroupCoordinator
from .partitions.fetch_sessions import FetchSession, FetchSessionCache, SessionError
from .partitions.partition import PartitionConfig, PartitionLog
from .quotas import FETCH, PRODUCE, REQUEST, QuotaApis, QuotaConfig, QuotaManager
from .security import authorizer
from .transactions.coordinator import TransactionCoordinator, TxnConfig
from .transactions.coordinator import error_code as txn_error_code
from .transactions.producer_ids import PRODUCER_STATE_PREFIX, ProducerIdAllocator
from .wire import codec
from .wire.batches import downconvert, keyless_records, split_batches, upconvert
from .wire.codec import ZERO_MS, build, nested
from .wire.errors import (
    CorruptMessage,
    DropConnection,
    InvalidPartitions,
    InvalidRecord,
    InvalidRequest,
    InvalidRequiredAcks,
    InvalidTopic,
    KafkaError,
    NotLeaderOrFollower,
    RequestTimedOut,
    TopicAlreadyExists,
    UnknownTopicOrPartition,
    code_for,
)

log = logging.getLogger(__name__)

_REFRESH_SOME = "some"  # see Broker._caught_up_now
SNAPSHOT_CONCURRENCY = 32  # producer-state snapshot writes in flight at once
TOPIC_IDS_TTL_S = 30.0  # how long a topic id -> name entry is trusted (Fetch v13+ names topics by id)
TOPIC_FOR_OPEN_S = 1.0  # partitions opened within this long of each other share one read of their topic
# How old this listener's knowledge of a topic's cleanup.policy may get (a produce to a compacted topic
# decodes its batches to refuse records without a key; an alter on this listener applies at once)
CLEANUP_POLICY_TTL_S = 2.0

# kio resolves a schema through importlib on every call (~3% of the shim's CPU under produce load)
_response_schema = functools.lru_cache(maxsize=None)(codec.response_schema)


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"  # advertised in Metadata (IPv4: some clients resolve localhost to ::1)
    port: int = 9092  # 0: the port the server listens on
    node_id: int | None = 0  # None: allocate one from the metadata store
    lease_ttl_s: float = 10.0  # broker registration and ownership lease
    producer_id_block: int = 1000
    # test-only fault injection: close the connection instead of answering every Nth produce request
    # that carries idempotent batches (after storing them), so that clients retry for real
    drop_produce_response_every: int = 0
    cluster_id: str = "scroll"
    default_partitions: int = 1
    auto_create_topics: bool = True
    max_partitions: int = 1000
    inter_broker_ca: str | None = None  # CA of the other listeners' certificates (calls over SSL)
    ensemble: int = 3
    write_quorum: int = 3
    ack_quorum: int = 2
    max_fetch_bytes: int = 64 << 20
    max_fetch_wait_ms: int = 30_000
    max_produce_timeout_ms: int = 60_000
    fetch_sessions: bool = True  # KIP-227 incremental fetch sessions (False: every fetch is a full one)
    # a caught-up partition's state (high watermark, another writer's take-over) is learnt from the
    # bookies on a fetch at most this often (see Broker._caught_up_now); 0: on every fetch
    partition_refresh_s: float = 0.5
    max_fetch_sessions: int = 1000
    # partitions being opened (claimed and taken over) at once: a first produce to a new topic
    # opens all its partitions concurrently, up to this many in flight
    max_concurrent_opens: int = 128
    # rebalancing onto listeners that join later (see Broker._rebalance_loop): off keeps ownership
    # sticky until a listener dies or stops
    rebalance: bool = True
    rebalance_batch: int = 8  # partitions in hand-over at once, per listener
    rebalance_delay_s: float = 3.0  # the live listeners must be unchanged this long before partitions move
    # while a change of the live listeners is pending (or a pass failed), they are listed this often
    # (one small read of kafka/brokers/); otherwise a watch on kafka/brokers/ wakes the check, and
    # they are listed again after rebalance_recheck_s without any change seen (a lost watch)
    rebalance_check_s: float = 1.0
    rebalance_recheck_s: float = 60.0
    hand_over_timeout_s: float = 10.0  # a hand-over waits at most this long for queued appends
    # Kafka ACLs (authorizer.py): with acls off every principal may do anything (as before)
    acls: bool = False
    super_users: frozenset[str] = frozenset()  # e.g. {"User:admin"}: bypass the ACLs
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    groups: GroupConfig = field(default_factory=GroupConfig)
    transactions: TxnConfig = field(default_factory=TxnConfig)
    quotas: QuotaConfig = field(default_factory=QuotaConfig)  # client quotas' rate windows (quotas.py)

    def __post_init__(self):
        if not 1 <= self.default_partitions <= self.max_partitions:
            raise ValueError(f"default_partitions must be 1..{self.max_partitions}")
        if not 1 <= self.ack_quorum <= self.write_quorum <= self.ensemble:
            raise ValueError("need 1 <= ack_quorum <= write_quorum <= ensemble")
        if self.max_fetch_bytes < 1024 or self.max_fetch_wait_ms < 0:
            raise ValueError("invalid fetch limits")
        if self.lease_ttl_s < 1.0:
            raise ValueError("lease_ttl_s must be at least 1 s")
        if self.max_concurrent_opens < 1:
            raise ValueError("max_concurrent_opens must be at least 1")
        if self.rebalance_batch < 1 or self.rebalance_delay_s < 0 or self.rebalance_check_s <= 0:
            raise ValueError("rebalance_batch must be at least 1, rebalance_delay_s >= 0, rebalance_check_s > 0")
        if self.hand_over_timeout_s <= 0:
            raise ValueError("hand_over_timeout_s must be positive")
        if self.node_id is not None and not 0 <= self.node_id < 2**31:
            raise ValueError(f"node_id must be 0..2**31-1, not {self.node_id}")


@functools.cache
def _batch_error_cls(resp_cls: type) -> type | None:
    """Produce v8+'s ``BatchIndexAndErrorMessage`` of the answer's schema (None before v8)."""
    return getattr(sys.modules[resp_cls.__module__], "BatchIndexAndErrorMessage", None)


async def _all_done(futs: list[asyncio.Future], timeout_s: float) -> bool:
    """Wait until every one of ``futs`` is done, or one has failed (as ``gather``), for at most
    ``timeout_s``; whether that happened in time. The futures are not cancelled on a timeout
    (``shield``). One waiter and one timer per produce partition instead of the tasks and futures
    of ``wait_for(shield(gather(...)))``, and one loop turn from the last acknowledgement to the
    handler instead of three: every produce pays it."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    left = [len(futs)]

    def one(f: asyncio.Future) -> None:
        left[0] -= 1
        if not waiter.done() and (left[0] == 0 or f.cancelled() or f.exception() is not None):
            waiter.set_result(True)

    def expired() -> None:
        if not waiter.done():
            waiter.set_result(False)

    for f in futs:
        f.add_done_callback(one)
    timer = loop.call_later(timeout_s, expired)
    try:
        return await waiter
    finally:
        timer.cancel()
        for f in futs:
            f.remove_done_callback(one)


def _ignore_outcome(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: the request's handler meets (and answers) the same error


# not bound by the request quota (Kafka: ApiVersions, SASL and the brokers' own requests)
_QUOTA_EXEMPT = frozenset({codec.API_API_VERSIONS, codec.API_WRITE_TXN_MARKERS})
# a fetch that recorded its own quotas (Broker.fetch): its throttle time, for Broker.throttle
_FETCH_THROTTLE_S: contextvars.ContextVar[float | None] = contextvars.ContextVar("fetch_throttle_s", default=None)


class Broker:
    def __init__(self, client, config: BrokerConfig | None = None):
        self.client = client
        self.store = client.cluster.store
        self.config = config or BrokerConfig()
        self._logs: dict[tuple[str, int], PartitionLog] = {}
        self._opening: dict[tuple[str, int], asyncio.Future] = {}
        self._open_slots = asyncio.Semaphore(self.config.max_concurrent_opens)
        self._topic_reads: dict[str, tuple[float, asyncio.Future]] = {}  # see _topic_for_open
        self._compacted: dict[str, tuple[float, bool]] = {}  # topic -> (loop time read, compact?)
        self._topic_ids: dict[uuid.UUID, tuple[float, str]] = {}  # topic id -> (loop time listed, name)
        self._topic_ids_listed_at = -1e9
        self._snapshotter: asyncio.Task | None = None  # one for all partitions (see _snapshot_loop)
        self._snapshot_candidates: set[PartitionLog] = set()  # appended to (or opened) since its last round
        self._snapshot_wanted = asyncio.Event()
        self._rebalancer: asyncio.Task | None = None  # see _rebalance_loop
        self._handing_over: dict[tuple[str, int], int] = {}  # partition -> node it is being handed over to
        self.handed_over = 0  # partitions handed over to other listeners since start
        self._appended = asyncio.Event()
        c = self.config
        self.ownership = Ownership(self.store, c.host, c.port, c.node_id, c.lease_ttl_s, on_lost=self._on_lost)
        self.producer_ids = ProducerIdAllocator(self.store, c.producer_id_block)
        self._idempotent_produces = itertools.count(1)
        self.fetch_sessions = FetchSessionCache(c.max_fetch_sessions)
        self._handlers = {
            codec.API_API_VERSIONS: self.api_versions,
            codec.API_METADATA: self.metadata,
            codec.API_PRODUCE: self.produce,
            codec.API_FETCH: self.fetch,
            codec.API_LIST_OFFSETS: self.list_offsets,
            codec.API_CREATE_TOPICS: self.create_topics,
            codec.API_DELETE_TOPICS: self.delete_topics,
            codec.API_INIT_PRODUCER_ID: self.init_producer_id,
        }
        self.groups = GroupCoordinator(self, self.config.groups)  # consumer groups (groups.py)
        self.admin = Admin(self)  # configs, partitions, cluster (admin.py)
        self.bound_listeners: tuple[tuple[str, str, int], ...] = ()  # (name, bind host, port): set by the server
        self.txn = TransactionCoordinator(self, self.config.transactions)  # transactions (transactions.py)
        self.inter_broker = InterBrokerClient(self.store, self.config.inter_broker_ca)  # WriteTxnMarkers
        self._handlers.update(self.groups.handlers())
        self._handlers.update(self.admin.handlers())
        self._handlers.update(self.txn.handlers())
        self.authorizer = (authorizer.Authorizer(self.store, self.config.super_users | {BROKER_PRINCIPAL}) if self.config.acls
                           else None)  # ACLs (authorizer.py)
        self._handlers.update(authorizer.AclApis(self).handlers())
        self._handlers.update(authorizer.ScramApis(self).handlers())
        self.quotas = QuotaManager(self.store, self.config.quotas)  # client quotas (quotas.py)
        self._handlers.update(QuotaApis(self).handlers())

    def prepare(self, req: codec.Request) -> None:
        """Called as a request is read, before it is handled (requests of one connection may be
        handled one at a time, in order): a produce starts opening its partitions now, so that a
        client sending one partition per request (librdkafka) still has its partitions opened
        concurrently (bounded by ``max_concurrent_opens``). Opening is no effect a client can see;
        the appends still happen when the request is handled, in order. Errors are left for the
        handler (it opens again and answers them)."""
        if req.api_key != codec.API_PRODUCE or getattr(req.body, "acks", None) not in (-1, 0, 1):
            return
        for t in req.body.topic_data:
            if not authorizer.may_write(self.authorizer, t.name):  # refused: opened for nobody
                continue
            for p in t.partition_data:
                plog = self._logs.get((t.name, p.index))
                if plog is not None and plog.usable and plog.writable:
                    continue
                fut = asyncio.ensure_future(self.partition(t.name, p.index, write=True))
                fut.add_done_callback(_ignore_outcome)

    async def handle(self, req: codec.Request) -> Any:
        resp_cls = _response_schema(req.api_key, req.api_version)
        codec.set_client_id(req.client_id)
        if self.authorizer is not None:
            return await authorizer.check(self.authorizer, self, req, resp_cls, self._handlers[req.api_key])
        return await self._handlers[req.api_key](req.body, resp_cls)

    def throttle(self, req: codec.Request, body: Any, handled_s: float) -> tuple[Any, float]:
        """Client quotas (quotas.py): the request's bytes and handling time recorded against the
        quotas of its user and client id; the answer with ``throttle_time`` set, and the throttle
        time in seconds (the server mutes the connection that long; 0: within every quota)."""
        q = self.quotas
        if not q.quotas or req.api_key in _QUOTA_EXEMPT:
            return body, 0.0
        fetch_throttle_s = _FETCH_THROTTLE_S.get()
        if req.api_key == codec.API_FETCH and fetch_throttle_s is not None:  # recorded by the fetch itself
            return body, fetch_throttle_s
        user = authorizer.principal().partition(":")[2]
        now = asyncio.get_running_loop().time()
        throttle = q.record(REQUEST, user, req.client_id, handled_s, now)
        if req.api_key == codec.API_PRODUCE:
            size = sum(len(p.records or b"") for t in req.body.topic_data for p in t.partition_data)
            throttle = max(throttle, q.record(PRODUCE, user, req.client_id, size, now))
        elif req.api_key == codec.API_FETCH and body is not None:
            size = sum(len(p.records or b"") for t in body.responses for p in t.partitions)
            throttle = max(throttle, q.record(FETCH, user, req.client_id, size, now))
        if throttle > 0 and body is not None and hasattr(body, "throttle_time"):
            body = dataclasses.replace(body, throttle_time=datetime.timedelta(milliseconds=int(throttle * 1000)))
        return body, throttle

    # ---------------------------------------------------------------- ownership (several shims)
    @property
    def node_id(self) -> int:
        return self.ownership.node_id

    async def start(self, port: int | None = None, listeners: list[tuple[str, int]] = ()) -> None:
        """Register as a broker (``port``: the port actually listened on, when configured as 0;
        ``listeners``: (name, port) of every listener, advertised at ``config.host``)."""
        if port is not None and (self.config.port == 0 or listeners):
            self.ownership.port = port
        self.ownership.endpoints = tuple((name, self.config.host, p) for name, p in listeners)
        if any(name.startswith("SASL_") for name, _p in listeners):
            await ensure_identity(self.store)  # other listeners call this one as the broker user
        if self.authorizer is not None:
            await self.authorizer.start()
        await self.quotas.start()
        await self.ownership.start()
        self.txn.start()
        self._rebalancer = asyncio.get_running_loop().create_task(self._rebalance_loop(), name="kafka-rebalance")

    async def coordinator_node(self, key_type: int, key: str) -> tuple[int, str, int]:
        """(node id, host, port) of the shim coordinating ``key`` (a group when key_type is 0, a
        transactional id when 1): the holder of its coordinator key, else the preferred live shim."""
        b = await self.ownership.owner(coordinator_key(key_type, key)) or self.ownership.me
        return (b.node_id, *b.at(codec.current_listener()))

    async def is_coordinator(self, key_type: int, key: str) -> bool:
        """Whether this shim coordinates ``key`` now, claiming it if it is unowned and this shim is
        the preferred one (requests elsewhere get NOT_COORDINATOR)."""
        return await self.ownership.claim(coordinator_key(key_type, key))

    def _on_lost(self, resources: set[str]) -> None:
        """Our lease expired (we were paused or cut off): every partition may have moved."""
        logs, self._logs = list(self._logs.values()), {}
        for p in logs:
            asyncio.ensure_future(p.close())
        self.txn.forget()  # transactional ids may have moved too: load them again when claimed

    async def close(self) -> None:
        for task in (self._rebalancer, self._snapshotter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        logs, self._logs = list(self._logs.values()), {}
        for p in logs:
            await p.close()
        await self.txn.close()
        await self.groups.close()
        if self.authorizer is not None:
            await self.authorizer.close()
        await self.quotas.close()
        await self.ownership.close()

    # ---------------------------------------------------------------- topics and partitions
    def open_partitions(self) -> list[PartitionLog]:
        """The partitions open here now (a copy: opening and closing goes on)."""
        return list(self._logs.values())

    async def topic(self, name: str) -> TopicMeta | None:
        """The topic (a stream without a topic record is a one-partition topic), or None."""
        try:
            return await self.client.describe_topic(name)
        except NoSuchTopic:
            return None

    async def topics(self) -> list[TopicMeta]:
        return await self.client.list_topics()

    async def create_topic(self, name: str, partitions: int, configs: dict[str, str],
                           validate_only: bool = False) -> TopicMeta:
        try:
            check_topic_name(name)
        except InvalidTopicName as exc:
            raise InvalidTopic(str(exc)) from None
        if not 1 <= partitions <= self.config.max_partitions:
            raise InvalidPartitions(f"partitions must be 1..{self.config.max_partitions}, not {partitions}")
        if await self.topic(name) is not None:
            raise TopicAlreadyExists(f"topic {name!r} already exists")
        configs = check_topic_configs(configs)  # InvalidConfig
        await self.admin.check_tier(configs)  # remote.storage.enable / local.retention.* with the others
        if validate_only:
            return TopicMeta(name, partitions, configs=configs)
        c = self.config
        try:
            # partition streams left over by an interrupted create or delete are reused
            fragment_bytes, fragment_age = rollover_caps(configs)
            meta = await self.client.create_topic(name, partitions, configs, ensemble=c.ensemble,
                                                  write_quorum=c.write_quorum, ack_quorum=c.ack_quorum,
                                                  fragment_bytes_max=fragment_bytes, fragment_age_max_ms=fragment_age,
                                                  retention=retention_policy(configs) or None, reuse_streams=True)
        except TopicExists as exc:
            raise TopicAlreadyExists(str(exc)) from None
        # reused streams too; the broker's log.retention.* where the topic sets none
        await self.admin.apply_retention(name, range(partitions), await self.admin.topic_configs_in_force(configs),
                                         caps=any(k in configs for k in SEGMENT_KEYS))
        self._topic_reads.pop(name, None)
        self.topic_configs_changed(name)
        log.info("topic=%s created with %d partitions", name, partitions)
        return meta

    def topic_configs_changed(self, name: str) -> None:
        """A topic's configs changed here (created, altered, deleted): forget what was cached of them."""
        self._compacted.pop(name, None)

    async def compacted(self, topic: str) -> bool:
        """Whether the topic's cleanup.policy includes compact, as its streams' compaction policy
        says (partition 0's: every partition has the topic's; a stream created alone has its own),
        read at most every ``CLEANUP_POLICY_TTL_S``."""
        now = asyncio.get_running_loop().time()
        got = self._compacted.get(topic)
        if got is not None and now - got[0] < CLEANUP_POLICY_TTL_S:
            return got[1]
        try:
            meta, _ = await self.client.cluster.ledgers.get_ledger(partition_stream(topic, 0))
            compact = "compact" in str(meta.retention.get("cleanup_policy", "delete")).split(",")
        except NoSuchLedger:
            compact = False
        if len(self._compacted) > 4096:
            self._compacted.clear()
        self._compacted[topic] = (now, compact)
        return compact

    @staticmethod
    def _check_keys(topic: str, index: int, batches) -> None:
        """A compacted topic refuses records without a key (as Kafka: INVALID_RECORD, the whole
        partition's records, with record_errors naming each one)."""
        errors = []
        for b in batches:
            errors.extend(keyless_records(b))
        if errors:
            msg = f"Compacted topic cannot accept message without key in topic partition {topic}-{index}."
            exc = InvalidRecord(msg)
            exc.record_errors = [(i, msg) for i in errors]
            raise exc

    async def topic_names(self, ids) -> dict[uuid.UUID, str]:
        """Topic id -> name for those of ``ids`` that exist (Fetch v13+ names topics by id). An id not
        in the map has every topic listed (at most once a second); an entry older than
        ``TOPIC_IDS_TTL_S`` is confirmed by its name's own record (a topic deleted elsewhere, or
        deleted and created again under a new id, is forgotten within that long)."""
        now = asyncio.get_running_loop().time()
        known = self._topic_ids
        if any(i not in known for i in ids) and now - self._topic_ids_listed_at >= 1.0:
            self._topic_ids_listed_at = now
            known.update({m.topic_id: (now, m.name) for m in await self.topics()})
        for i in [i for i in ids if i in known and now - known[i][0] > TOPIC_IDS_TTL_S]:
            m = await self.topic(known[i][1])
            if m is not None and m.topic_id == i:
                known[i] = (now, m.name)
            else:
                del known[i]
        return {i: known[i][1] for i in ids if i in known}

    async def delete_topic(self, meta: TopicMeta) -> None:
        self._topic_ids.pop(meta.topic_id, None)
        self._topic_reads.pop(meta.name, None)
        self.topic_configs_changed(meta.name)
        for p in range(meta.partitions):
            plog = self._logs.pop((meta.name, p), None)
            if plog is not None:
                await plog.close()
        with contextlib.suppress(NoSuchTopic):
            await self.client.delete_topic(meta.name)
        for prefix in (f"{OWNERS}{meta.name}/", f"{PRODUCER_STATE_PREFIX}{meta.name}/"):
            for k, _ in await self.store.list_prefix(prefix):
                self.ownership.held.discard(k)
                await self.store.delete(k)
        log.info("topic=%s deleted", meta.name)

    async def partition(self, topic: str, index: int, write: bool = False) -> PartitionLog:
        """The open partition; opened on first use: read-only for reads (no take-over), writable
        (the stream's one writer, a take-over) for ``write``. A read-only one is replaced by a
        writable one on the first produce; a failed one (its writer fenced by another writer) is
        opened again."""
        key = (topic, index)
        if key in self._handing_over:
            raise NotLeaderOrFollower(f"{topic} partition {index} is being handed over to node "
                                      f"{self._handing_over[key]}")
        plog = self._logs.get(key)
        owned = self.ownership.owns(partition_key(topic, index))
        if plog is not None and plog.usable and owned and (plog.writable or not write):
            return plog
        if plog is not None and not plog.usable:  # its writer failed: open it again (if still ours)
            del self._logs[key]
            asyncio.ensure_future(plog.close())
        okey = (topic, index, write)
        opening = self._opening.get(okey)
        if opening is None:
            opening = asyncio.ensure_future(self._open(topic, index, write))
            self._opening[okey] = opening
            opening.add_done_callback(lambda _f: self._opening.pop(okey, None))
        return await asyncio.shield(opening)

    async def _open(self, topic: str, index: int, write: bool) -> PartitionLog:
        plog = self._logs.get((topic, index))
        if plog is not None and plog.usable and (plog.writable or not write):
            # open, but our lease was not known valid for a moment
            if self.ownership.owns(partition_key(topic, index)):
                return plog
            raise NotLeaderOrFollower(f"{topic} partition {index} is not served by node {self.node_id} now")
        meta = await self._topic_for_open(topic)
        if meta is None or not 0 <= index < meta.partitions:
            raise UnknownTopicOrPartition(f"unknown topic or partition {topic} partition {index}")
        # claimed before taking an open slot: the claims of a produce's partitions go to the store
        # together (one transaction per 128, ``Ownership.claim``), not one per freed slot
        if not await self.ownership.claim(partition_key(topic, index)):
            raise NotLeaderOrFollower(f"{topic} partition {index} is owned by another shim (this is node "
                                      f"{self.node_id})")
        async with self._open_slots:  # bounded: opens of many partitions run concurrently
            plog = PartitionLog(self.client, topic, index, self.config.partition, writable=write)
            plog.on_append = functools.partial(self._partition_appended, plog)
            plog.writer_lease = self.ownership.lease  # the writer's liveness key goes with the ownership
            try:
                await plog.open()
            except BaseException:
                await plog.close()
                raise
        if not self.ownership.owns(partition_key(topic, index)):  # lost while opening
            await plog.close()
            raise NotLeaderOrFollower(f"{topic} partition {index}: node {self.node_id} lost its lease while opening")
        if (topic, index) in self._handing_over:  # a hand-over started while it opened
            await plog.close()
            raise NotLeaderOrFollower(f"{topic} partition {index} is being handed over")
        old = self._logs.get((topic, index))
        if old is not None and old is not plog:
            if old.usable and old.writable and not write:  # a writable one opened meanwhile: keep it
                await plog.close()
                return old
            asyncio.ensure_future(old.close())
        self._logs[(topic, index)] = plog
        if write:
            self._snapshot_candidate(plog)  # (a take-over may have recovered batches past its last snapshot)
            if self._snapshotter is None:
                self._snapshotter = asyncio.get_running_loop().create_task(self._snapshot_loop(),
                                                                           name="kafka-snapshots")
        return plog

    def _partition_appended(self, plog: PartitionLog) -> None:
        self._snapshot_candidate(plog)
        self._notify_append()

    def _snapshot_candidate(self, plog: PartitionLog) -> None:
        self._snapshot_candidates.add(plog)
        self._snapshot_wanted.set()

    async def _snapshot_loop(self) -> None:
        """Producer-state snapshots of every writable partition that had batches acknowledged since
        its last one (``PartitionLog.snapshot_if_due``): one timer for the listener, however many
        partitions are open, and a bounded number of snapshot writes in flight. Only the partitions
        that had an append (or were opened) since the last round are looked at, and the task sleeps
        while there are none: idle partitions cost nothing."""
        while True:
            await self._snapshot_wanted.wait()
            await asyncio.sleep(self.config.partition.snapshot_interval_s)
            self._snapshot_wanted.clear()
            candidates, self._snapshot_candidates = self._snapshot_candidates, set()
            due = [p for p in candidates if self._logs.get((p.topic, p.partition)) is p and p.snapshot_due]
            for i in range(0, len(due), SNAPSHOT_CONCURRENCY):
                await asyncio.gather(*(p.snapshot_if_due() for p in due[i:i + SNAPSHOT_CONCURRENCY]))
            for p in due:
                if p.snapshot_due:  # the write failed, or more was acknowledged meanwhile: next round
                    self._snapshot_candidate(p)

    async def _topic_for_open(self, name: str) -> TopicMeta | None:
        """The topic, as ``topic`` answers it, read once for the partitions of a topic opened
        together (a first produce opens hundreds): a read started less than ``TOPIC_FOR_OPEN_S``
        ago is shared. Partitions only grow, and a deleted topic's streams are gone (the
        take-over fails), so a slightly old answer cannot open a partition that never was."""
        loop = asyncio.get_running_loop()
        got = self._topic_reads.get(name)
        if got is None or loop.time() - got[0] > TOPIC_FOR_OPEN_S or (got[1].done() and got[1].exception()):
            got = (loop.time(), asyncio.ensure_future(self.topic(name)))
            self._topic_reads[name] = got
            if len(self._topic_reads) > 1024:
                self._topic_reads = {k: v for k, v in self._topic_reads.items()
                                     if loop.time() - v[0] <= TOPIC_FOR_OPEN_S}
        meta = await asyncio.shield(got[1])
        if meta is None:
            self._topic_reads.pop(name, None)  # unknown now: the next open asks again
        return meta

    def _notify_append(self) -> None:
        ev, self._appended = self._appended, asyncio.Event()
        ev.set()

    # ---------------------------------------------------------------- rebalancing (several listeners)
    async def _rebalance_loop(self) -> None:
        """List the live listeners (one small read of ``kafka/brokers/``) when a watch on
        ``kafka/brokers/`` reports a change (at the latest every ``rebalance_recheck_s``), and every
        ``rebalance_check_s`` while a change is pending. Once a changed set has stayed the same for
        ``rebalance_delay_s`` (a starting cluster registers its listeners first), hand over the
        partitions this listener holds whose preferred node (rendezvous over the live listeners) is
        now another one (``_rebalance``); a pass that could not finish (a transaction open, a
        hand-over failed) is tried again at the next check. An idle cluster costs no request."""
        c = self.config
        loop = asyncio.get_running_loop()
        seen: tuple[int, ...] | None = None
        changed_at = loop.time()
        done_for: tuple[int, ...] | None = None
        changed = asyncio.Event()
        watcher = loop.create_task(self._watch_brokers(changed), name="kafka-brokers-watch")
        try:
            while True:
                if seen is not None and seen == done_for:  # settled: wait for a change
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), c.rebalance_recheck_s)
                    if changed.is_set():
                        await asyncio.sleep(c.rebalance_check_s)  # let a burst of changes land first
                else:
                    await asyncio.sleep(c.rebalance_check_s)
                if not self.ownership.valid:
                    continue
                changed.clear()  # before the listing: a change during it wakes the next check
                try:
                    live = tuple(b.node_id for b in await self.ownership.brokers())
                except Exception as exc:  # the store is busy or away: try again at the next check
                    log.info("node %d: listing the live listeners failed: %r", self.node_id, exc)
                    changed.set()
                    continue
                if live != seen:
                    if seen is not None:
                        log.info("node %d: live listeners now %s", self.node_id, list(live))
                    seen, changed_at = live, loop.time()
                if live == done_for or loop.time() - changed_at < c.rebalance_delay_s:
                    continue
                try:
                    if await self._rebalance(list(live)):
                        done_for = live
                except Exception as exc:
                    log.warning("node %d: rebalancing failed: %r", self.node_id, exc)
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher

    async def _watch_brokers(self, changed: asyncio.Event) -> None:
        """Set ``changed`` on every change under ``kafka/brokers/`` (listeners joining, leaving,
        registering again); a broken watch is opened again (and counts as a change)."""
        while True:
            watch = self.store.watch_prefix(OWNERSHIP_BROKERS)
            try:
                async for _event in watch:
                    changed.set()
                    self.txn.listeners_changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("node %d: the watch on the live listeners broke: %r", self.node_id, exc)
            finally:
                with contextlib.suppress(Exception):
                    await watch.aclose()
            changed.set()
            self.txn.listeners_changed()
            await asyncio.sleep(self.config.rebalance_check_s)

    def moves(self, live: list[int]) -> list[tuple[str, int]]:
        """(partition key, node) of every partition held here whose preferred node among ``live`` is
        another one (group and transaction coordinators stay where they are)."""
        me = self.node_id
        if me not in live:
            return []
        out = []
        for resource in self.ownership.held:
            if resource.startswith(OWNERS) and (target := preferred(resource, live)) != me:
                out.append((resource, target))
        return sorted(out)

    async def _rebalance(self, live: list[int]) -> bool:
        """Hand the partitions that prefer another live node over, ``rebalance_batch`` at a time;
        whether every one was (or there were none)."""
        moves = self.moves(live)
        if not moves:
            return True
        if not self.config.rebalance:
            log.info("node %d: %d partitions held here prefer another live listener; rebalancing is off, "
                     "they stay", self.node_id, len(moves))
            return True
        batch = self.config.rebalance_batch
        log.info("node %d: handing %d partitions over to nodes %s, at most %d at a time", self.node_id, len(moves),
                 sorted({n for _, n in moves}), batch)
        left = 0
        for i in range(0, len(moves), batch):
            chunk = moves[i:i + batch]
            results = await asyncio.gather(*(self._hand_over(r, n) for r, n in chunk), return_exceptions=True)
            for (r, _n), ok in zip(chunk, results, strict=True):
                if isinstance(ok, BaseException):
                    log.warning("node %d: handing %s over failed: %r", self.node_id, r, ok)
                left += ok is not True
            now = [b.node_id for b in await self.ownership.brokers(max_age_s=self.config.rebalance_check_s)]
            if now != live:  # the listeners changed again: the loop starts over once they settle
                return False
        return left == 0

    async def _hand_over(self, resource: str, target: int) -> bool:
        """Hand one partition over: refuse new produces and fetches for it (NOT_LEADER_OR_FOLLOWER:
        clients refresh their metadata), wait for its queued appends (``PartitionLog.retire``),
        close its writer cleanly (the producer-state snapshot is written, exact up to the high
        watermark), then release its ownership key, so that Metadata names ``target`` and ``target``
        claims it on the next request for it (a take-over with a new term, which fences this
        writer at the bookies had it not closed). A partition with a transaction open is left for
        a later pass (False)."""
        if resource not in self.ownership.held:
            return True
        key = parse_partition_key(resource)
        if key in self._handing_over:
            return False
        plog = self._logs.get(key)
        if plog is not None and plog.usable and plog.transaction_open:
            log.info("node %d: %s has a transaction open; its hand-over waits for it to end", self.node_id, resource)
            return False
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._handing_over[key] = target
        log.info("node %d: handing %s over to node %d (%d in hand-over)", self.node_id, resource, target,
                 len(self._handing_over))
        try:
            for write in (True, False):  # an open started before the hand-over ends first
                opening = self._opening.get((*key, write))
                if opening is not None:
                    await asyncio.wait([opening])
            plog = self._logs.get(key)
            if plog is not None:
                if not await plog.retire(self.config.hand_over_timeout_s):
                    log.info("node %d: %s has a transaction open; its hand-over waits for it to end", self.node_id,
                             resource)
                    return False
                if self._logs.get(key) is plog:
                    del self._logs[key]
                try:
                    await asyncio.wait_for(plog.close(), self.config.hand_over_timeout_s)
                except Exception as exc:  # the next owner's take-over fences this writer anyway
                    log.warning("node %d: closing %s for its hand-over: %r", self.node_id, resource, exc)
            await self.ownership.release(resource)
        finally:
            del self._handing_over[key]
        self.handed_over += 1
        log.info("node %d: handed %s over to node %d in %.0f ms", self.node_id, resource, target,
                 (loop.time() - started) * 1000)
        return True

    # ---------------------------------------------------------------- ApiVersions
    async def api_versions(self, req, resp_cls):
        version_cls = nested(resp_cls, "ApiVersion")
        keys = tuple(version_cls(api_key=k, min_version=lo, max_version=hi) for k, lo, hi in codec.our_api_ranges())
        return build(resp_cls, error_code=ErrorCode.none, api_keys=keys, throttle_time=ZERO_MS)

    # ---------------------------------------------------------------- Metadata
    async def metadata(self, req, resp_cls):
        version = resp_cls.__version__
        broker_cls = nested(resp_cls, "MetadataResponseBroker")
        topic_cls = nested(resp_cls, "MetadataResponseTopic")
        part_cls = nested(resp_cls, "MetadataResponsePartition")
        c = self.config
        now = asyncio.get_running_loop().time()
        if req.topics is None or (version == 0 and not req.topics):
            metas = [(m.name, m) for m in await self.topics()]
        else:
            allow = getattr(req, "allow_auto_topic_creation", True) and await self.admin.auto_create_topics()
            metas = []
            by_id = None
            for t in req.topics:
                name = t.name
                if name is None and version < 12:  # v10-11 carry topic ids, but their answers need names
                    metas.append(("", InvalidRequest(f"a null topic name in Metadata v{version} (topic ids: v12+)")))
                    continue
                if name is None:  # by topic id (v12+; KIP-848 consumers resolve their assignments so)
                    if by_id is None:
                        by_id = {m.topic_id: m for m in await self.topics()}
                    m = by_id.get(getattr(t, "topic_id", None))
                    metas.append((None, m) if m is not None else
                                 (None, UnknownTopicOrPartition(f"unknown topic id {getattr(t, 'topic_id', None)}")))
                    continue
                metas.append((name, await self._topic_or_create(name, allow)))
        live = await self.ownership.brokers(max_age_s=0.5)
        if not live:  # our own registration is being renewed: name ourselves rather than nobody
            live = [self.ownership.me]
        topics = []
        for name, m in metas:
            if isinstance(m, BaseException):
                topics.append(build(topic_cls, error_code=code_for(m), name=name, topic_id=None, is_internal=False,
                                    partitions=()))
                continue
            holders = await self.ownership.owners(f"{OWNERS}{m.name}/")
            parts = []
            for p in range(m.partitions):
                key = partition_key(m.name, p)
                leader = (self.ownership.owner_among(key, holders.get(key), live) or live[0]).node_id
                parts.append(build(part_cls, error_code=ErrorCode.none, partition_index=p, leader_id=leader,
                                   leader_epoch=-1, replica_nodes=(leader,), isr_nodes=(leader,), offline_replicas=()))
            topics.append(build(topic_cls, error_code=ErrorCode.none, name=m.name, topic_id=m.topic_id,
                                is_internal=False, partitions=tuple(parts)))
            self._topic_ids[m.topic_id] = (now, m.name)  # the id a client will fetch by (Fetch v13+)
        listener = codec.current_listener()
        brokers = tuple(build(broker_cls, node_id=b.node_id, host=b.at(listener)[0], port=b.at(listener)[1], rack=None)
                        for b in live)
        return build(resp_cls, throttle_time=ZERO_MS, brokers=brokers, cluster_id=c.cluster_id,
                     controller_id=live[0].node_id, topics=tuple(topics))

    async def _topic_or_create(self, name: str, allow_create: bool) -> TopicMeta | BaseException:
        try:
            m = await self.topic(name)
            if m is None and allow_create:
                try:
                    m = await self.create_topic(name, await self.admin.default_partitions(), {})
                except TopicAlreadyExists:
                    m = await self.topic(name)
            return m if m is not None else UnknownTopicOrPartition(f"unknown topic {name!r}")
        except Exception as exc:
            return exc

    # ---------------------------------------------------------------- Produce
    async def produce(self, req, resp_cls):
        timeout_s = min(max(req.timeout.total_seconds(), 0.0), self.config.max_produce_timeout_ms / 1000)
        pending: list[tuple[str, int, int, list, PartitionLog]] = []
        results: dict[tuple[str, int], tuple[BaseException | None, int, int]] = {}
        order = [(t.name, p.index) for t in req.topic_data for p in t.partition_data]
        idempotent = False
        old = resp_cls.__version__ < 3  # v0-2: magic 0/1 message sets, converted to one batch (batches.py)
        opened = await self._open_for_produce(req, order)
        for t in req.topic_data:
            for p in t.partition_data:
                try:
                    if req.acks not in (-1, 0, 1):
                        raise InvalidRequiredAcks(f"acks must be -1, 0 or 1, not {req.acks}")
                    batches = split_batches(upconvert(p.records or b"") if old else p.records or b"")
                    if batches and await self.compacted(t.name):
                        self._check_keys(t.name, p.index, batches)
                    idempotent = idempotent or any(b.producer_id >= 0 for b in batches)
                    plog = opened.pop((t.name, p.index), None)
                    if isinstance(plog, Exception):
                        raise plog
                    if not isinstance(plog, PartitionLog):
                        plog = await self.partition(t.name, p.index, write=True)
                    await self._check_transactional(req.transactional_id, batches, plog)
                    base, futs = await plog.append(batches)
                    pending.append((t.name, p.index, base, futs, plog))
                except Exception as exc:
                    self._log_error("produce", t.name, p.index, exc)
                    results[(t.name, p.index)] = (exc, -1, -1)
        codec.effects_applied()  # offsets assigned and entries queued: the next request may go on
        for name, index, base, futs, plog in pending:
            results[(name, index)] = await self._await_acks(futs, base, plog, timeout_s)
            if results[(name, index)][0] is not None:
                self._log_error("produce", name, index, results[(name, index)][0])
        every = self.config.drop_produce_response_every
        if every and idempotent and next(self._idempotent_produces) % every == 0:
            log.info("test fault injection: dropping the response to a produce request (batches stored)")
            raise DropConnection("test fault injection: produce response dropped")
        return self._produce_answer(req, resp_cls, order, results)

    @staticmethod
    def _produce_answer(req, resp_cls, order: list[tuple[str, int]], results: dict):
        """The Produce answer: each partition's error or base offset and log start, in request
        order (None for acks=0: nothing is answered)."""
        if req.acks == 0:
            return None
        topic_resp_cls = nested(resp_cls, "TopicProduceResponse")
        part_resp_cls = nested(resp_cls, "PartitionProduceResponse")
        by_topic: dict[str, list] = {}
        err_cls = _batch_error_cls(resp_cls)  # v8+
        for name, index in order:
            exc, base, log_start = results[(name, index)]
            record_errors = ()
            if err_cls is not None and getattr(exc, "record_errors", None):
                record_errors = tuple(err_cls(batch_index=i, batch_index_error_message=m)
                                      for i, m in exc.record_errors)
            by_topic.setdefault(name, []).append(build(
                part_resp_cls, index=index, error_code=code_for(exc) if exc else ErrorCode.none, base_offset=base,
                log_append_time=None, log_start_offset=log_start, record_errors=record_errors,
                error_message=str(exc) if exc else None))
        return build(resp_cls, throttle_time=ZERO_MS, responses=tuple(
            topic_resp_cls(name=n, partition_responses=tuple(ps)) for n, ps in by_topic.items()))

    def coalesce_key(self, req: codec.Request) -> tuple | None:
        """Pipelined Produce requests of one connection with the same key may be handled as one
        group (``produce_group``; the server groups those it has read together): what every
        request of a group must share — version, acks, timeout, client id — or None for a request
        that is handled alone (a transactional id, invalid acks, old message formats, ACLs on, the
        test fault injection)."""
        body = req.body
        if (req.api_key != codec.API_PRODUCE or req.api_version < 3 or body.transactional_id is not None
                or body.acks not in (-1, 0, 1) or self.authorizer is not None
                or self.config.drop_produce_response_every):
            return None
        return (req.api_version, body.acks, body.timeout, req.client_id)

    async def produce_group(self, reqs: list[codec.Request], answer: Callable[[int, Any], None]) -> None:
        """Several Produce requests of one connection (same ``coalesce_key``) handled as one: the
        batches of each partition are appended request after request in one
        ``PartitionLog.append_group`` (each request checked as if alone: a sequence error or a
        damaged batch fails that request's partition only); then, in request order, each request's
        own answer (its base offsets and errors, None for acks=0) handed to ``answer(index, body)``
        as soon as its batches are acknowledged (the request timeout counts from the group's
        start)."""
        resp_cls = _response_schema(codec.API_PRODUCE, reqs[0].api_version)
        codec.set_client_id(reqs[0].client_id)
        first = reqs[0].body
        timeout_s = min(max(first.timeout.total_seconds(), 0.0), self.config.max_produce_timeout_ms / 1000)
        orders = [[(t.name, p.index) for t in r.body.topic_data for p in t.partition_data] for r in reqs]
        results: list[dict] = [{} for _ in reqs]
        # partition -> [(request index, batches)], in request order
        todo: dict[tuple[str, int], list[tuple[int, list]]] = {}
        opened = await self._open_for_produce(first, [k for order in orders for k in order])
        for i, r in enumerate(reqs):
            for t in r.body.topic_data:
                for p in t.partition_data:
                    key = (t.name, p.index)
                    try:
                        batches = split_batches(p.records or b"")
                        if batches and await self.compacted(t.name):
                            self._check_keys(t.name, p.index, batches)
                        todo.setdefault(key, []).append((i, batches))
                    except Exception as exc:
                        self._log_error("produce", t.name, p.index, exc)
                        results[i][key] = (exc, -1, -1)
        pending: list[tuple[int, tuple[str, int], int, list, PartitionLog]] = []
        for key, entries in todo.items():
            try:
                plog = opened.pop(key, None)
                if isinstance(plog, Exception):
                    raise plog
                if not isinstance(plog, PartitionLog):
                    plog = await self.partition(*key, write=True)
                outcomes = [None] * len(entries)
                appended = []
                for n, (_i, batches) in enumerate(entries):
                    try:  # transactional batches without a transactional id: refused (as alone)
                        await self._check_transactional(None, batches, plog)
                        appended.append(n)
                    except Exception as exc:
                        outcomes[n] = exc
                for n, out in zip(appended, await plog.append_group([entries[n][1] for n in appended]), strict=True):
                    outcomes[n] = out
            except Exception as exc:
                outcomes = [exc] * len(entries)
            for (i, _batches), out in zip(entries, outcomes, strict=True):
                if isinstance(out, Exception):
                    self._log_error("produce", *key, out)
                    results[i][key] = (out, -1, -1)
                else:
                    pending.append((i, key, out[0], out[1], plog))
        codec.effects_applied()  # every request's offsets assigned and entries queued
        by_request: list[list] = [[] for _ in reqs]
        for entry in pending:
            by_request[entry[0]].append(entry)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for i, (r, order, res) in enumerate(zip(reqs, orders, results, strict=True)):
            # in request order, each as alone: its answer is made once its own batches are
            # acknowledged (or one failed), so an early one leaves before later ones are in
            for _i, key, base, futs, plog in by_request[i]:
                res[key] = out = await self._await_acks(futs, base, plog, max(0.0, deadline - loop.time()))
                if out[0] is not None:
                    self._log_error("produce", *key, out[0])
            answer(i, self._produce_answer(r.body, resp_cls, order, res))

    async def _check_transactional(self, txn_id: str | None, batches, plog: PartitionLog) -> None:
        """Transactional batches need the request's transactional id, the current producer and a
        partition added to its ongoing transaction (``TransactionCoordinator.check_produce``)."""
        txn = [b for b in batches if b.transactional]
        if not txn:
            return
        if txn_id is None:
            raise InvalidRequest("transactional record batches in a produce request without a transactional id")
        for b in txn:
            await self.txn.check_produce(txn_id, b.producer_id, b.producer_epoch, plog.topic, plog.partition,
                                         plog.txns.ongoing_at(b.producer_id, b.producer_epoch))

    async def _open_for_produce(self, req, keys: list[tuple[str, int]]) -> dict:
        """Open every partition of a produce request at once (each open is a take-over: one after
        another they would add up), before its batches are appended in request order: key -> the
        partition, or the error its open raised. Nothing is opened for a request refused whole."""
        if len(keys) < 2 or req.acks not in (-1, 0, 1):
            return {}
        todo = []
        for key in dict.fromkeys(keys):  # the steady state: every partition open already, nothing to do
            plog = self._logs.get(key)
            if plog is None or not plog.usable or not plog.writable or not self.ownership.owns(partition_key(*key)):
                todo.append(key)
        if len(todo) < 2:
            return {}
        results = await asyncio.gather(*(self.partition(t, i, write=True) for t, i in todo), return_exceptions=True)
        return dict(zip(todo, results))

    async def _await_acks(self, futs, base: int, plog: PartitionLog, timeout_s: float):
        pending = [f for f in futs if not f.done()]
        if pending and not await _all_done(pending, timeout_s):
            return RequestTimedOut(f"not acknowledged within {timeout_s}s"), -1, -1
        failed = None
        for f in futs:  # all done, or one failed (a cancelled one raises CancelledError, as gather did)
            exc = f.exception() if f.done() else None
            failed = failed or exc
        if failed is not None:
            return failed, -1, -1
        return None, base, plog.log_start

    def _log_error(self, what: str, topic: str, index: int, exc: BaseException) -> None:
        if isinstance(exc, KafkaError):
            log.info("%s topic=%s partition=%d: %s", what, topic, index, exc)
        else:
            log.warning("%s topic=%s partition=%d: %r", what, topic, index, exc)

    # ---------------------------------------------------------------- InitProducerId
    async def init_producer_id(self, req, resp_cls):
        if req.transactional_id is not None:  # the transaction coordinator's (transactions.py)
            try:
                pid, epoch = await self.txn.init_producer_id(
                    req.transactional_id, int(req.transaction_timeout.total_seconds() * 1000),
                    getattr(req, "producer_id", -1), getattr(req, "producer_epoch", -1))
            except Exception as exc:
                self._log_error("init_producer_id", req.transactional_id, -1, exc)
                return build(resp_cls, throttle_time=ZERO_MS, producer_id=-1, producer_epoch=-1,
                             error_code=txn_error_code(exc, codec.API_INIT_PRODUCER_ID, resp_cls.__version__))
            return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, producer_id=pid,
                         producer_epoch=epoch)
        try:
            pid, epoch = await self.producer_ids.init(getattr(req, "producer_id", -1),
                                                      getattr(req, "producer_epoch", -1))
        except Exception as exc:
            self._log_error("init_producer_id", "-", -1, exc)
            return build(resp_cls, throttle_time=ZERO_MS, error_code=code_for(exc), producer_id=-1,
                         producer_epoch=-1)
        log.info("init_producer_id: producer id %d epoch %d", pid, epoch)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, producer_id=pid,
                     producer_epoch=epoch)

    # ---------------------------------------------------------------- Fetch
    async def fetch(self, req, resp_cls):
        loop = asyncio.get_running_loop()
        started = time.perf_counter()  # not loop.time(): uvloop's is cached per loop turn, in ms
        wait_s = min(max(req.max_wait.total_seconds(), 0.0), self.config.max_fetch_wait_ms / 1000)
        deadline = loop.time() + wait_s
        max_bytes = max(1, min(req.max_bytes, self.config.max_fetch_bytes))
        window_bytes = None
        if self.quotas.quotas:  # as Kafka: a fetch asks for no more than its quota allows in a window
            window_bytes = self.quotas.max_in_window(FETCH, authorizer.principal().partition(":")[2],
                                                     codec.current_client_id())
            if window_bytes is not None:
                max_bytes = max(1, min(max_bytes, int(window_bytes)))
        names: dict[uuid.UUID, str] | None = None  # v13+: topics named by id
        if resp_cls.__version__ >= 13:
            names = await self.topic_names({t.topic_id for t in req.topics}
                                           | {f.topic_id for f in getattr(req, "forgotten_topics_data", ())})
        unknown = [t for t in req.topics if names is not None and t.topic_id not in names]
        wanted = [((names[t.topic_id] if names is not None else t.topic, p.partition), p.fetch_offset,
                   p.partition_max_bytes) for t in req.topics for p in t.partitions
                  if names is None or t.topic_id in names]
        session, full = None, True
        sid, epoch = getattr(req, "session_id", 0), getattr(req, "session_epoch", -1)  # v7+
        if (sid or epoch != -1) and (self.config.fetch_sessions or epoch > 0):
            forgotten = [(names.get(f.topic_id) if names is not None else f.topic, p)
                         for f in getattr(req, "forgotten_topics_data", ()) for p in f.partitions]
            try:
                session, full = self.fetch_sessions.begin(sid, epoch, wanted, forgotten, loop.time())
            except SessionError as exc:
                log.info("fetch: %s", exc)
                codec.effects_applied()
                return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode(exc.code), session_id=0,
                             responses=())
            if not full:  # the session's partitions, at their cached offsets
                wanted = [(tp, c.fetch_offset, c.max_bytes) for tp, c in session.partitions.items()]
        # the request quota's share (the long poll excluded), taken before the next request of the
        # connection starts: it starts eagerly, inside effects_applied() (server._start_eagerly)
        handled_s = time.perf_counter() - started
        codec.effects_applied()  # the session is updated; reads change nothing
        jobs: dict[str, list[tuple[int, int, int]]] = {}
        for (topic, index), offset, part_max in wanted:
            jobs.setdefault(topic, []).append((index, offset, part_max))
        # the first pass learns caught-up partitions' state (later ones are woken with it); within an
        # incremental session, for each partition at most every partition_refresh_s (_caught_up_now)
        refresh = True if session is None or full else _REFRESH_SOME
        while True:
            appended = self._appended
            rows, total, errors, followers = await self._fetch_once(jobs, max_bytes, refresh,
                                                                    getattr(req, "isolation_level", 0) == 1)
            refresh = False
            remaining = deadline - loop.time()
            if total >= req.min_bytes or total >= max_bytes or errors or remaining <= 0:
                break
            # wait for our own appends, or for another writer's on the partitions served read-only
            waits = [asyncio.ensure_future(appended.wait())]
            waits += [asyncio.ensure_future(f.wait_for_more(remaining)) for f in followers]
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
                for w in waits:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await w
        if resp_cls.__version__ < 4:  # v0-3 clients read magic 0 (v0-1) / 1 (v2-3) messages only
            rows = self._down_convert(rows, {tp: off for tp, off, _max in wanted}, 0 if resp_cls.__version__ < 2 else 1)
        throttle_s, empty = self._fetch_quotas(sum(len(p[1]) for _t, parts in rows for p in parts), handled_s,
                                                window_bytes)
        throttle_ms = datetime.timedelta(milliseconds=int(throttle_s * 1000)) if throttle_s > 0 else ZERO_MS
        if empty:  # Kafka's throttled answer: no partitions; a new session is not kept (the client opens another)
            if session is not None and full:
                self.fetch_sessions.drop(session.id)
            return build(resp_cls, throttle_time=throttle_ms, error_code=ErrorCode.none,
                         session_id=session.id if session is not None and not full else 0, responses=())
        ids = None
        if names is not None:
            ids = {name: i for i, (_at, name) in self._topic_ids.items()}
        topics = self._fetch_answer(resp_cls, rows, session if not full else None, ids)
        if unknown:  # Kafka answers a topic id it does not know per partition, with UNKNOWN_TOPIC_ID
            part_cls = nested(resp_cls, "PartitionData")
            topics += tuple(build(nested(resp_cls, "FetchableTopicResponse"), topic_id=t.topic_id, partitions=tuple(
                build(part_cls, partition_index=p.partition, error_code=ErrorCode.unknown_topic_id, high_watermark=-1,
                      last_stable_offset=-1, log_start_offset=-1, aborted_transactions=(), preferred_read_replica=-1,
                      records=b"") for p in t.partitions)) for t in unknown)
        if session is not None and full:  # the session remembers what its full answer said
            for t, parts in rows:
                for index, records, error, hw, start, lso, _aborted in parts:
                    session.must_answer((t, index), bool(records), error is not None, hw, lso, start)
        return build(resp_cls, throttle_time=throttle_ms, error_code=ErrorCode.none,
                     session_id=session.id if session is not None else 0, responses=topics)

    def _fetch_quotas(self, size: int, handled_s: float, window_bytes: float | None) -> tuple[float, bool]:
        """A fetch's request time and ``size`` record bytes recorded against its quotas, before it
        is answered (Kafka's ``handleFetchRequest``): (the throttle time in seconds, whether the
        answer must be empty). Over a quota, the answer carries no records and its bytes are taken
        back, except a fetch over its byte rate only because its answer's first batch is bigger
        than a window's worth (``window_bytes``, what the fetch asked for at most) while its entity
        had nothing recorded in the window: served (else that batch would never be), and the
        throttle holds the rate."""
        q = self.quotas
        if not q.quotas:
            return 0.0, False
        user, client_id = authorizer.principal().partition(":")[2], codec.current_client_id()
        now = asyncio.get_running_loop().time()
        request_s = q.record(REQUEST, user, client_id, handled_s, now)
        before = q.recorded(FETCH, user, client_id, now)
        bytes_s = q.record(FETCH, user, client_id, size, now)
        throttle = max(request_s, bytes_s)
        _FETCH_THROTTLE_S.set(throttle)
        oversized = window_bytes is not None and size > window_bytes
        if throttle <= 0 or (request_s <= 0 and before <= 0 and oversized):
            return throttle, False
        q.unrecord(FETCH, user, client_id, size, now)
        return throttle, True

    def _down_convert(self, rows, offsets: dict, magic: int):
        """Fetch v0-3: each partition's batches as messages of ``magic`` from its fetch offset on (as
        Kafka down-converts); a partition whose stored batches cannot be read answers CORRUPT_MESSAGE."""
        out = []
        for t, parts in rows:
            conv = []
            for index, records, error, *rest in parts:
                if records and error is None:
                    try:
                        records = downconvert(records, magic, offsets[(t, index)])
                    except Exception as exc:
                        self._log_error("fetch (down-conversion)", t, index, exc)
                        records, error = b"", CorruptMessage(f"records not down-convertible to magic {magic}: {exc!r}")
                conv.append((index, records, error, *rest))
            out.append((t, conv))
        return out

    async def _read_partition(self, topic: str, index: int, offset: int, room: int, refresh: bool,
                              committed: bool = False):
        """(records, error, high watermark, log start, the partition if it was read-only and caught up,
        last stable offset, aborted transactions (read_committed))."""
        try:
            for attempt in (1, 2):
                plog = await self.partition(topic, index)
                try:
                    if committed:
                        await plog.ensure_txns()
                    records = await plog.read(offset, max(room, 1), refresh or attempt == 2, committed)
                except StaleTermError:
                    if attempt == 2 or plog.usable:
                        raise
                    continue  # another writer took the stream over: serve it read-only from now on
                except NoSuchLedger:
                    # the stream was deleted by another client (and maybe created again): forget the
                    # open partition, so the next read opens what the name holds now
                    if self._logs.get((topic, index)) is plog:
                        del self._logs[(topic, index)]
                        self._topic_reads.pop(topic, None)
                        asyncio.ensure_future(plog.close())
                    if attempt == 2:
                        raise UnknownTopicOrPartition(f"{topic} partition {index} was deleted") from None
                    continue
                follower = plog if not plog.writable and offset >= plog.high_watermark else None
                lso = plog.last_stable_offset
                aborted = plog.txns.aborted_between(offset, lso) if committed and records else ()
                return records, None, plog.high_watermark, plog.log_start, follower, lso, aborted
        except Exception as exc:
            self._log_error("fetch", topic, index, exc)
            return b"", exc, -1, -1, None, -1, ()

    async def _fetch_once(self, wanted: dict[str, list[tuple[int, int, int]]], max_bytes: int, refresh,
                          committed: bool = False):
        """Partitions (``wanted``: topic -> [(partition, fetch offset, max bytes)]) are read
        concurrently (each up to its own limit); a partition whose records would take the response
        over ``max_bytes`` gets none this time (the first one always has its whole first batch, as in
        Kafka), and the client fetches it again. A partition open here and caught up is answered
        without a read (see ``_caught_up_now``). ``committed``: read_committed (up to the last stable
        offset, with the aborted transactions of what is served). Returns ([(topic, [(partition,
        records, error, high watermark, log start, last stable offset, aborted transactions)])],
        total bytes, errors, read-only partitions caught up)."""
        results: list = []
        reads = []
        for topic, parts in wanted.items():
            for index, offset, part_max in parts:
                quick = self._caught_up_now(topic, index, offset, refresh)
                if quick is None:
                    reads.append((len(results), (topic, index, offset, min(part_max, max_bytes), refresh,
                                                 committed)))
                results.append(quick)
        if len(reads) == 1:
            i, job = reads[0]
            results[i] = await self._read_partition(*job)
        elif reads:
            for (i, _), r in zip(reads, await asyncio.gather(*(self._read_partition(*j) for _, j in reads)),
                                 strict=True):
                results[i] = r
        it = iter(results)
        total, errors, rows, followers = 0, 0, [], []
        for t, parts_wanted in wanted.items():
            parts = []
            for index, _offset, _max in parts_wanted:
                records, error, hw, start, follower, lso, aborted = next(it)
                if follower is not None:
                    followers.append(follower)
                if error is not None:
                    errors += 1
                if total and total + len(records) > max_bytes:
                    records = b""
                total += len(records)
                parts.append((index, records, error, hw, start, lso, aborted))
            rows.append((t, parts))
        return rows, total, errors, followers

    @staticmethod
    def _fetch_answer(resp_cls, rows, incremental: FetchSession | None, ids: dict[str, uuid.UUID] | None = None) -> tuple:
        """The response's topics; for an ``incremental`` session fetch only the partitions with
        records, an error, or a changed high watermark, last stable offset or log start
        (``FetchSession.must_answer``). ``ids``: topic name -> id, for v13+ (topics by id)."""
        topic_cls = nested(resp_cls, "FetchableTopicResponse")
        part_cls = nested(resp_cls, "PartitionData")
        aborted_cls = nested(resp_cls, "AbortedTransaction")
        topics = []
        for t, parts in rows:
            out = [build(part_cls, partition_index=index, error_code=code_for(error) if error else ErrorCode.none,
                         high_watermark=hw, last_stable_offset=lso, log_start_offset=start,
                         aborted_transactions=tuple(aborted_cls(producer_id=pid, first_offset=first)
                                                    for pid, first in aborted),
                         preferred_read_replica=-1, records=records)
                   for index, records, error, hw, start, lso, aborted in parts
                   if incremental is None
                   or incremental.must_answer((t, index), bool(records), error is not None, hw, lso, start)]
            if out:
                topics.append(build(topic_cls, topic=t, topic_id=ids.get(t) if ids is not None else None,
                                    partitions=tuple(out)))
        return tuple(topics)

    def _caught_up_now(self, topic: str, index: int, offset: int, refresh):
        """A read's answer known without awaiting anything: the partition is open, usable and ours,
        and ``offset`` is its high watermark (nothing to serve). None otherwise, and also when the
        fetch's first pass learns the partition's state from the bookies (``refresh`` True:
        ``PartitionLog.caught_up``, one LAC read; ``_REFRESH_SOME``, an incremental session fetch:
        only if that was last done more than ``partition_refresh_s`` ago). So a session consumer of
        many idle partitions costs one LAC read per partition per ``partition_refresh_s``, not per
        fetch; records another writer appends meanwhile still wake a read-only partition's long poll,
        and a take-over by another writer is seen within ``partition_refresh_s``."""
        plog = self._logs.get((topic, index))
        if plog is None or not plog.usable or plog.retiring or offset != plog.high_watermark:
            return None
        if refresh is True or (refresh is _REFRESH_SOME and asyncio.get_running_loop().time() - plog.refreshed_at
                                   >= self.config.partition_refresh_s):
            return None
        if not self.ownership.owns(partition_key(topic, index)):
            return None
        follower = plog if not plog.writable else None
        return b"", None, plog.high_watermark, plog.log_start, follower, plog.last_stable_offset, ()

    # ---------------------------------------------------------------- ListOffsets
    async def list_offsets(self, req, resp_cls):
        topic_cls = nested(resp_cls, "ListOffsetsTopicResponse")
        part_cls = nested(resp_cls, "ListOffsetsPartitionResponse")
        topics = []
        for t in req.topics:
            parts = []
            for p in t.partitions:
                offset, ts, error = -1, -1, None
                try:
                    offset, ts = await self._list_offset(t.name, p.partition_index, p.timestamp,
                                                         getattr(req, "isolation_level", 0) == 1)
                except Exception as exc:
                    self._log_error("list_offsets", t.name, p.partition_index, exc)
                    error = exc
                parts.append(build(part_cls, partition_index=p.partition_index,
                                   error_code=code_for(error) if error else ErrorCode.none,
                                   timestamp=ts, offset=offset, leader_epoch=-1,
                                   old_style_offsets=(offset,) if offset >= 0 else ()))  # v0
            topics.append(topic_cls(name=t.name, partitions=tuple(parts)))
        return build(resp_cls, throttle_time=ZERO_MS, topics=tuple(topics))

    async def _list_offset(self, topic: str, index: int, timestamp: int, committed: bool = False) -> tuple[int, int]:
        for attempt in (1, 2):
            plog = await self.partition(topic, index)
            try:
                if timestamp in (-2, -4, -5):  # earliest, earliest-local, earliest-pending-upload
                    return await plog.refresh_log_start(), -1
                if timestamp < 0:  # -1 latest, -3 max timestamp: the high watermark (read_committed: the LSO)
                    await plog.caught_up()
                    if committed and timestamp == -1:
                        await plog.ensure_txns()
                        return plog.last_stable_offset, -1
                    return plog.high_watermark, -1
                return await plog.offset_for_timestamp(timestamp)
            except StaleTermError:
                if attempt == 2 or plog.usable:
                    raise
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- CreateTopics / DeleteTopics
    async def create_topics(self, req, resp_cls):
        result_cls = nested(resp_cls, "CreatableTopicResult")
        out = []
        for t in req.topics:
            n = len(t.assignments) if t.assignments else t.num_partitions
            n = await self.admin.default_partitions() if n == -1 else n
            configs = {c.name: c.value for c in t.configs if c.value is not None}
            try:
                meta = await self.create_topic(t.name, n, configs, req.validate_only)
                out.append(build(result_cls, name=t.name, topic_id=meta.topic_id, error_code=ErrorCode.none,
                                 error_message=None, num_partitions=n, replication_factor=REPLICATION_FACTOR,
                                 configs=()))
            except Exception as exc:
                self._log_error("create_topics", t.name, -1, exc)
                out.append(build(result_cls, name=t.name, topic_id=None, error_code=code_for(exc),
                                 error_message=str(exc), num_partitions=-1, replication_factor=-1, configs=None))
        return build(resp_cls, throttle_time=ZERO_MS, topics=tuple(out))

    async def delete_topics(self, req, resp_cls):
        result_cls = nested(resp_cls, "DeletableTopicResult")
        wanted = ([(t.name, t.topic_id) for t in req.topics] if hasattr(req, "topics")
                  else [(n, None) for n in req.topic_names])
        out = []
        for name, topic_id in wanted:
            try:
                meta = await self.topic(name) if name else None
                if name is None and topic_id is not None:
                    meta = next((m for m in await self.topics() if m.topic_id == topic_id), None)
                if meta is None:
                    raise UnknownTopicOrPartition(f"unknown topic {name or topic_id}")
                await self.delete_topic(meta)
                out.append(build(result_cls, name=meta.name, topic_id=meta.topic_id, error_code=ErrorCode.none,
                                 error_message=None))
            except Exception as exc:
                self._log_error("delete_topics", str(name), -1, exc)
                out.append(build(result_cls, name=name, topic_id=topic_id, error_code=code_for(exc),
                                 error_message=str(exc)))
        return build(resp_cls, throttle_time=ZERO_MS, responses=tuple(out))
