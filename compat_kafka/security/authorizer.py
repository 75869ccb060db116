"""Kafka ACLs on the listener: the bindings in the metadata store, the decision for a request's
principal, the checks every API makes (``GUARDS``), and the ACL and SCRAM admin APIs.

How this works. Each binding is one key ``kafka/acls/<hash>`` (the binding, JSON). Every listener
keeps them all in memory (``acls.AclSet``) and reads them again when a watch on ``kafka/acls/``
reports a change (at most every ``refresh_s``, 0.5 s; without any change seen, every
``RECHECK_S``), so a change made through one listener applies on every other within about a
second; the listener that made the change applies it at once. Unchanged ACLs cost no request. Decisions are cached per (principal, host, resource, operation)
and the cache is dropped whenever the bindings change, so the produce/fetch path costs a dict
lookup per topic. The principal of a connection (``principal()``) is ``User:<name>`` after SASL,
else ``User:<subject DN>`` for a TLS client with a verified certificate, else ``User:ANONYMOUS``;
the host is the client's IP.

``GUARDS`` maps an API key to a check that runs before its handler (``Broker.handle``), as Kafka's
``KafkaApis`` checks: items the principal may not use (topics, groups, transactional ids, config
resources) are answered with the authorization error without reaching the handler, which sees the
request without them; a request refused as a whole is answered with the error in its top-level
error fields. An API without an entry (none is left among those served, ApiVersions and SASL aside)
needs ALTER on the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import typing
from typing import Any

from kio.schema.errors import ErrorCode

from ..wire import codec
from ..wire.codec import ZERO_MS, build, nested
from . import sasl
from .acls import (
    ANONYMOUS,
    CLUSTER_NAME,
    AclBinding,
    AclFilter,
    AclSet,
    InvalidAcl,
    Operation,
    ResourceType,
    principal_from_dn,
)

log = logging.getLogger(__name__)

PREFIX = "kafka/acls/"
REFRESH_S = 0.5
RECHECK_S = 60.0  # the bindings are read again this often even without a change seen (a lost watch)
MAX_CACHED_DECISIONS = 100_000

TOPIC, GROUP, CLUSTER, TXN = ResourceType.TOPIC, ResourceType.GROUP, ResourceType.CLUSTER, ResourceType.TRANSACTIONAL_ID
TOPIC_DENIED = ErrorCode.topic_authorization_failed
GROUP_DENIED = ErrorCode.group_authorization_failed
CLUSTER_DENIED = ErrorCode.cluster_authorization_failed
TXN_DENIED = ErrorCode.transactional_id_authorization_failed


def principal() -> str:
    """The principal of the connection the current request came on."""
    user = codec.current_principal()
    if user is not None:
        return f"User:{user}"
    subject = codec.current_tls_subject()
    if subject:
        return principal_from_dn(subject)
    return ANONYMOUS


def client_ip() -> str:
    return codec.current_client_host().lstrip("/")


class Authorizer:
    def __init__(self, store, super_users=frozenset(), refresh_s: float = REFRESH_S):
        self.store = store
        self.super_users = frozenset(super_users)
        self.refresh_s = refresh_s
        self.acls = AclSet((), self.super_users)
        self._versions: dict[str, int] = {}
        self._decisions: dict[tuple, bool] = {}
        self._refresher: asyncio.Task | None = None

    # ---------------------------------------------------------------- the bindings in force
    async def start(self) -> None:
        await self.reload()
        # watched from the revision after that read (etcd) / from now (memory): no change is missed
        watch = self.store.watch_prefix(PREFIX)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(watch), name="kafka-acls")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresher

    async def _refresh_loop(self, watch) -> None:
        changed = asyncio.Event()
        watcher = asyncio.get_running_loop().create_task(self._watch(watch, changed), name="kafka-acls-watch")
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECHECK_S)
                changed.clear()
                try:
                    await self.reload()
                except Exception as exc:  # the store unreachable: keep the bindings known, try again
                    log.warning("ACLs could not be read again: %r", exc)
                    changed.set()
                await asyncio.sleep(self.refresh_s)  # several changes close together: one read
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher

    async def _watch(self, watch, changed: asyncio.Event) -> None:
        """Set ``changed`` on every change under ``kafka/acls/``; a broken watch is opened again
        (and counts as a change: what happened meanwhile is read)."""
        while True:
            try:
                async for _event in watch:
                    changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("the watch on the ACLs broke: %r", exc)
            finally:
                with contextlib.suppress(Exception):
                    await watch.aclose()
            changed.set()
            await asyncio.sleep(self.refresh_s)
            watch = self.store.watch_prefix(PREFIX)

    async def reload(self) -> None:
        rows = await self.store.list_prefix(PREFIX)
        versions = {k: v.version for k, v in rows}
        if versions == self._versions:
            return
        bindings = []
        for k, v in rows:
            try:
                bindings.append(AclBinding.from_bytes(v.value))
            except Exception:
                log.warning("ignoring an unreadable ACL at %s", k)
        self.acls = AclSet(bindings, self.super_users)
        self._versions = versions
        self._decisions = {}

    # ---------------------------------------------------------------- decisions
    def allowed(self, rtype: ResourceType, name: str, op: Operation) -> bool:
        key = (principal(), client_ip(), rtype, name, op)
        got = self._decisions.get(key)
        if got is None:
            got = self.acls.authorize(*key)
            if len(self._decisions) >= MAX_CACHED_DECISIONS:
                self._decisions = {}
            self._decisions[key] = got
        return got

    def cluster(self, op: Operation) -> bool:
        return self.allowed(CLUSTER, CLUSTER_NAME, op)

    def any_allowed(self, rtype: ResourceType, op: Operation) -> bool:
        return self.acls.any_allowed(principal(), client_ip(), rtype, op)

    # ---------------------------------------------------------------- changes
    async def create(self, binding: AclBinding) -> None:
        """Store ``binding`` (applied here at the next ``reload``)."""
        await self.store.put(PREFIX + binding.key(), binding.to_bytes())

    async def delete_matching(self, f: AclFilter) -> list[AclBinding]:
        await self.reload()
        gone = []
        for b in self.acls.matching(f):
            if await self.store.delete(PREFIX + b.key()):
                gone.append(b)
        await self.reload()
        return gone


# ---------------------------------------------------------------- building answers
def blank(cls: type, **values: Any) -> Any:
    """An entity of ``cls`` with ``values`` and, for every other field without a default, an empty
    value (-1 numbers, None/empty strings, empty arrays)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            out[f.name] = values[f.name]
            continue
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        kind = f.metadata.get("kafka_type")
        origin = typing.get_origin(f.type)
        nullable = type(None) in typing.get_args(f.type)
        if kind == "error_code":
            out[f.name] = ErrorCode.none
        elif kind and kind.startswith("timedelta"):
            out[f.name] = ZERO_MS
        elif kind in ("int8", "int16", "int32", "int64", "uint16", "uint32"):
            out[f.name] = f.type(-1) if isinstance(f.type, type) else -1
        elif kind == "bool":
            out[f.name] = False
        elif nullable:
            out[f.name] = None
        elif kind == "string":
            out[f.name] = ""
        elif kind in ("bytes", "records"):
            out[f.name] = b""
        elif origin is tuple or f.type is tuple or kind is None:
            out[f.name] = ()
        else:
            out[f.name] = None
    return cls(**out)


def refused(resp_cls: type, code: ErrorCode, message: str | None = None) -> Any:
    """A whole request refused: the code in the top-level error fields."""
    names = {f.name for f in dataclasses.fields(resp_cls)}
    values: dict[str, Any] = {"error_code": code} if "error_code" in names else {}
    if "error_message" in names:
        values["error_message"] = message or "Authorization failed."
    return blank(resp_cls, throttle_time=ZERO_MS, **values) if "throttle_time" in names else blank(resp_cls, **values)


async def _split(call, req, resp_cls, field: str, out_field: str, ok, deny):
    """Items of ``req.<field>`` for which ``ok(item)`` is false are answered ``deny(item)`` (entries
    of ``resp.<out_field>``); the handler gets the rest (when there is any)."""
    items = getattr(req, field) or ()
    good = tuple(i for i in items if ok(i))
    if len(good) == len(items):
        return await call(req)
    denied = tuple(deny(i) for i in items if not ok(i))
    if good:
        resp = await call(dataclasses.replace(req, **{field: good}))
        if resp is None:
            return None
    else:
        resp = refused(resp_cls, ErrorCode.none)
        if "error_message" in {f.name for f in dataclasses.fields(resp_cls)}:
            resp = dataclasses.replace(resp, error_message=None)
    return dataclasses.replace(resp, **{out_field: tuple(getattr(resp, out_field) or ()) + denied})


def _parts(resp_cls, topic_cls: str, part_cls: str, name_field: str, parts_field: str, part_index: str,
           code: ErrorCode, topic_name: str, indexes, **extra):
    pc = nested(resp_cls, part_cls)
    return blank(nested(resp_cls, topic_cls), **{name_field: topic_name, parts_field: tuple(
        blank(pc, **{part_index: i, "error_code": code}, **extra) for i in indexes)})


# ---------------------------------------------------------------- the checks per API
async def _produce(az: Authorizer, req, resp_cls, call):
    if req.transactional_id is not None and not az.allowed(TXN, req.transactional_id, Operation.WRITE):
        code = TXN_DENIED
        ok = lambda t: False  # noqa: E731
    else:
        code = TOPIC_DENIED
        ok = lambda t: az.allowed(TOPIC, t.name, Operation.WRITE)  # noqa: E731
    tc, pc = nested(resp_cls, "TopicProduceResponse"), nested(resp_cls, "PartitionProduceResponse")
    resp = await _split(call, req, resp_cls, "topic_data", "responses", ok, lambda t: tc(name=t.name, partition_responses=tuple(
        build(pc, index=p.index, error_code=code, base_offset=-1, log_append_time=None, log_start_offset=-1,
              record_errors=(), error_message=None) for p in t.partition_data)))
    return None if req.acks == 0 else resp  # acks=0: no answer, refused or not


async def _fetch(az, broker, req, resp_cls, call):
    by_id = resp_cls.__version__ >= 13  # topics named by id (KIP-516): READ is checked on their names
    names = await broker.topic_names({t.topic_id for t in req.topics}) if by_id else {}

    def name(t):
        return names.get(t.topic_id) if by_id else t.topic

    def deny(t):
        return _parts(resp_cls, "FetchableTopicResponse", "PartitionData", "topic_id" if by_id else "topic",
                      "partitions", "partition_index", TOPIC_DENIED, t.topic_id if by_id else t.topic,
                      [p.partition for p in t.partitions], high_watermark=-1, last_stable_offset=-1,
                      log_start_offset=-1, aborted_transactions=None, records=None)

    # an id that names no topic is the handler's to answer (UNKNOWN_TOPIC_ID, as Kafka)
    ok = lambda t: (by_id and name(t) is None) or az.allowed(TOPIC, name(t), Operation.READ)  # noqa: E731
    if req.topics and not any(ok(t) for t in req.topics):  # answered at once (no long poll)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none,
                     session_id=getattr(req, "session_id", 0), responses=tuple(deny(t) for t in req.topics))
    resp = await _split(call, req, resp_cls, "topics", "responses", ok, deny)
    if by_id:  # a session's answer may name topics this request did not
        names |= await broker.topic_names({t.topic_id for t in resp.responses} - names.keys())
    # an incremental fetch session (KIP-227) serves partitions added by earlier requests: what READ no
    # longer allows is answered TOPIC_AUTHORIZATION_FAILED without its records
    if any(not ok(t) and t.partitions and t.partitions[0].error_code != TOPIC_DENIED for t in resp.responses):
        resp = dataclasses.replace(resp, responses=tuple(
            t if ok(t) else dataclasses.replace(t, partitions=tuple(dataclasses.replace(
                p, error_code=TOPIC_DENIED, records=None, aborted_transactions=None) for p in t.partitions))
            for t in resp.responses))
    return resp


async def _list_offsets(az, req, resp_cls, call):
    return await _split(call, req, resp_cls, "topics", "topics", lambda t: az.allowed(TOPIC, t.name, Operation.DESCRIBE),
                        lambda t: _parts(resp_cls, "ListOffsetsTopicResponse", "ListOffsetsPartitionResponse", "name",
                                         "partitions", "partition_index", TOPIC_DENIED, t.name,
                                         [p.partition_index for p in t.partitions]))


async def _metadata(az, broker, req, resp_cls, call):
    topic_cls = nested(resp_cls, "MetadataResponseTopic")
    listing = req.topics is None or (resp_cls.__version__ == 0 and not req.topics)
    if listing:
        resp = await call(req)
        return dataclasses.replace(resp, topics=tuple(
            t for t in resp.topics if t.name is None or az.allowed(TOPIC, t.name, Operation.DESCRIBE)))
    denied = []
    good = []
    # auto-creation (Kafka: the broker allows it and the request asks) needs CREATE on the cluster or topic
    creating = (getattr(req, "allow_auto_topic_creation", True) and not az.cluster(Operation.CREATE)
                and await broker.admin.auto_create_topics())
    for t in req.topics:
        if t.name is None:  # by id: checked on the answer
            good.append(t)
        elif not az.allowed(TOPIC, t.name, Operation.DESCRIBE):
            denied.append(t.name)
        elif creating and not az.allowed(TOPIC, t.name, Operation.CREATE) and await broker.topic(t.name) is None:
            denied.append(t.name)  # Kafka: unknown and not allowed to create it
        else:
            good.append(t)
    resp = await call(dataclasses.replace(req, topics=tuple(good))) if good else None
    topics = [] if resp is None else [
        t if t.name is None or t.error_code or az.allowed(TOPIC, t.name, Operation.DESCRIBE)
        else build(topic_cls, error_code=TOPIC_DENIED, name=t.name, topic_id=None, is_internal=False, partitions=())
        for t in resp.topics]
    topics += [build(topic_cls, error_code=TOPIC_DENIED, name=n, topic_id=None, is_internal=False, partitions=())
               for n in denied]
    if resp is None:  # nothing asked about is visible: the brokers still (v0: () lists every topic)
        fields = {f.name for f in dataclasses.fields(req)}
        resp = await call(dataclasses.replace(req, topics=(), **({"allow_auto_topic_creation": False}
                                                                 if "allow_auto_topic_creation" in fields else {})))
    return dataclasses.replace(resp, topics=tuple(topics))


def _create_topics_ok(az):
    create_all = az.cluster(Operation.CREATE)
    return lambda t: create_all or az.allowed(TOPIC, t.name, Operation.CREATE)


async def _create_topics(az, req, resp_cls, call):
    rc = nested(resp_cls, "CreatableTopicResult")
    return await _split(call, req, resp_cls, "topics", "topics", _create_topics_ok(az),
                        lambda t: build(rc, name=t.name, topic_id=None, error_code=TOPIC_DENIED,
                                        error_message="Authorization failed.", num_partitions=-1,
                                        replication_factor=-1, configs=None))


async def _delete_topics(az, broker, req, resp_cls, call):
    rc = nested(resp_cls, "DeletableTopicResult")
    field = "topics" if hasattr(req, "topics") else "topic_names"
    by_id: dict = {}
    if field == "topics" and any(t.name is None for t in req.topics):  # v6 by topic id: its name decides
        by_id = {m.topic_id: m.name for m in await broker.topics()}

    def name(t):
        return t if field == "topic_names" else t.name if t.name is not None else by_id.get(t.topic_id)

    # an unknown topic id is left for the handler to answer
    return await _split(call, req, resp_cls, field, "responses",
                        lambda t: name(t) is None or az.allowed(TOPIC, name(t), Operation.DELETE),
                        lambda t: build(rc, name=name(t), topic_id=getattr(t, "topic_id", None), error_code=TOPIC_DENIED,
                                        error_message="Authorization failed."))


def _group_whole(op: Operation):
    async def guard(az, req, resp_cls, call):
        if not az.allowed(GROUP, req.group_id, op):
            return refused(resp_cls, GROUP_DENIED)
        return await call(req)
    return guard


async def _offset_commit(az, req, resp_cls, call, txn: bool = False):
    tn, pn = ("TxnOffsetCommitResponseTopic", "TxnOffsetCommitResponsePartition") if txn else \
        ("OffsetCommitResponseTopic", "OffsetCommitResponsePartition")
    if txn and not az.allowed(TXN, req.transactional_id, Operation.WRITE):
        whole = TXN_DENIED
    elif not az.allowed(GROUP, req.group_id, Operation.READ):
        whole = GROUP_DENIED
    else:
        whole = None
    ok = (lambda t: False) if whole else (lambda t: az.allowed(TOPIC, t.name, Operation.READ))  # noqa: E731
    return await _split(call, req, resp_cls, "topics", "topics", ok, lambda t: _parts(
        resp_cls, tn, pn, "name", "partitions", "partition_index", whole or TOPIC_DENIED, t.name,
        [p.partition_index for p in t.partitions]))


async def _offset_fetch(az, req, resp_cls, call):
    if hasattr(req, "groups"):  # v8+: per group
        gc = nested(resp_cls, "OffsetFetchResponseGroup")
        resp = await _split(call, req, resp_cls, "groups", "groups",
                            lambda g: az.allowed(GROUP, g.group_id, Operation.DESCRIBE),
                            lambda g: blank(gc, group_id=g.group_id, topics=(), error_code=GROUP_DENIED))
        all_asked = {g.group_id for g in req.groups if g.topics is None}
        return dataclasses.replace(resp, groups=tuple(
            dataclasses.replace(g, topics=_visible_offsets(az, g.topics, g.group_id in all_asked)) for g in resp.groups))
    if not az.allowed(GROUP, req.group_id, Operation.DESCRIBE):
        return refused(resp_cls, GROUP_DENIED)
    resp = await call(req)
    return dataclasses.replace(resp, topics=_visible_offsets(az, resp.topics, req.topics is None))


def _visible_offsets(az, topics, listing: bool):
    """Committed offsets of topics not DESCRIBE-able: left out when all were asked for, else answered
    TOPIC_AUTHORIZATION_FAILED (as Kafka)."""
    out = []
    for t in topics:
        if az.allowed(TOPIC, t.name, Operation.DESCRIBE):
            out.append(t)
        elif not listing:
            out.append(dataclasses.replace(t, partitions=tuple(
                dataclasses.replace(p, committed_offset=-1, metadata=None, error_code=TOPIC_DENIED)
                for p in t.partitions)))
    return tuple(out)


async def _find_coordinator(az, req, resp_cls, call):
    def ok(key_type, key):
        return az.allowed(TXN, key, Operation.DESCRIBE) if key_type == 1 else az.allowed(GROUP, key, Operation.DESCRIBE)

    code = lambda key_type: TXN_DENIED if key_type == 1 else GROUP_DENIED  # noqa: E731
    if hasattr(req, "coordinator_keys"):
        cc = nested(resp_cls, "Coordinator")
        return await _split(call, req, resp_cls, "coordinator_keys", "coordinators", lambda k: ok(req.key_type, k),
                            lambda k: build(cc, key=k, node_id=-1, host="", port=-1, error_code=code(req.key_type),
                                            error_message="Authorization failed."))
    if not ok(getattr(req, "key_type", 0), req.key):
        return build(resp_cls, throttle_time=ZERO_MS, error_code=code(getattr(req, "key_type", 0)),
                     error_message="Authorization failed.", node_id=-1, host="", port=-1)
    return await call(req)


async def _describe_groups(az, req, resp_cls, call):
    gc = nested(resp_cls, "DescribedGroup")
    return await _split(call, req, resp_cls, "groups", "groups", lambda g: az.allowed(GROUP, g, Operation.DESCRIBE),
                        lambda g: blank(gc, error_code=GROUP_DENIED, group_id=g, group_state="", protocol_type="",
                                        protocol_data="", members=(), authorized_operations=-2**31))


async def _consumer_group_describe(az, req, resp_cls, call):
    gc = nested(resp_cls, "DescribedGroup")
    return await _split(call, req, resp_cls, "group_ids", "groups", lambda g: az.allowed(GROUP, g, Operation.DESCRIBE),
                        lambda g: blank(gc, error_code=GROUP_DENIED, error_message="Authorization failed.", group_id=g,
                                        group_state="", assignor_name="", members=(), authorized_operations=-2**31))


async def _list_groups(az, req, resp_cls, call):
    resp = await call(req)
    if az.cluster(Operation.DESCRIBE):
        return resp
    return dataclasses.replace(resp, groups=tuple(g for g in resp.groups
                                                  if az.allowed(GROUP, g.group_id, Operation.DESCRIBE)))


async def _delete_groups(az, req, resp_cls, call):
    rc = nested(resp_cls, "DeletableGroupResult")
    return await _split(call, req, resp_cls, "groups_names", "results",
                        lambda g: az.allowed(GROUP, g, Operation.DELETE),
                        lambda g: build(rc, group_id=g, error_code=GROUP_DENIED))


async def _offset_delete(az, req, resp_cls, call):
    if not az.allowed(GROUP, req.group_id, Operation.DELETE):
        return refused(resp_cls, GROUP_DENIED)
    return await _split(call, req, resp_cls, "topics", "topics", lambda t: az.allowed(TOPIC, t.name, Operation.READ),
                        lambda t: _parts(resp_cls, "OffsetDeleteResponseTopic", "OffsetDeleteResponsePartition", "name",
                                         "partitions", "partition_index", TOPIC_DENIED, t.name,
                                         [p.partition_index for p in t.partitions]))


async def _init_producer_id(az, req, resp_cls, call):
    if req.transactional_id is not None:
        ok, code = az.allowed(TXN, req.transactional_id, Operation.WRITE), TXN_DENIED
    else:
        ok = az.cluster(Operation.IDEMPOTENT_WRITE) or az.any_allowed(TOPIC, Operation.WRITE)
        code = CLUSTER_DENIED
    return await call(req) if ok else refused(resp_cls, code)


async def _add_partitions_to_txn(az, req, resp_cls, call):
    if not hasattr(req, "v3_and_below_topics"):  # v4+: brokers' batches, cluster action
        return await call(req) if az.cluster(Operation.CLUSTER_ACTION) else refused(resp_cls, CLUSTER_DENIED)
    if not az.allowed(TXN, req.v3_and_below_transactional_id, Operation.WRITE):
        ok, code = (lambda t: False), TXN_DENIED  # noqa: E731
    else:
        ok, code = (lambda t: az.allowed(TOPIC, t.name, Operation.WRITE)), TOPIC_DENIED  # noqa: E731
    topics = req.v3_and_below_topics
    if all(ok(t) for t in topics):
        return await call(req)
    # Kafka answers OPERATION_NOT_ATTEMPTED for the allowed partitions when some are refused
    tc = nested(resp_cls, "AddPartitionsToTxnTopicResult")
    pc = nested(resp_cls, "AddPartitionsToTxnPartitionResult")
    return build(resp_cls, throttle_time=ZERO_MS, results_by_topic_v3_and_below=tuple(
        tc(name=t.name, results_by_partition=tuple(
            pc(partition_index=p, partition_error_code=ErrorCode.operation_not_attempted if ok(t) else code)
            for p in t.partitions)) for t in topics))


async def _add_offsets_to_txn(az, req, resp_cls, call):
    if not az.allowed(TXN, req.transactional_id, Operation.WRITE):
        return refused(resp_cls, TXN_DENIED)
    if not az.allowed(GROUP, req.group_id, Operation.READ):
        return refused(resp_cls, GROUP_DENIED)
    return await call(req)


async def _end_txn(az, req, resp_cls, call):
    return await call(req) if az.allowed(TXN, req.transactional_id, Operation.WRITE) else refused(resp_cls, TXN_DENIED)


async def _describe_transactions(az, req, resp_cls, call):
    sc = nested(resp_cls, "TransactionState")
    return await _split(call, req, resp_cls, "transactional_ids", "transaction_states",
                        lambda t: az.allowed(TXN, t, Operation.DESCRIBE),
                        lambda t: blank(sc, error_code=TXN_DENIED, transactional_id=t, transaction_state="",
                                        topics=()))


async def _list_transactions(az, req, resp_cls, call):
    resp = await call(req)
    return dataclasses.replace(resp, transaction_states=tuple(
        s for s in resp.transaction_states if az.allowed(TXN, s.transactional_id, Operation.DESCRIBE)))


def _cluster_whole(op: Operation):
    async def guard(az, req, resp_cls, call):
        return await call(req) if az.cluster(op) else refused(resp_cls, CLUSTER_DENIED)
    return guard


def _configs(op: Operation, result_cls: str, out_field: str):
    async def guard(az, req, resp_cls, call):
        def ok(r):
            if r.resource_type == 2:
                return az.allowed(TOPIC, r.resource_name, op)
            if r.resource_type in (4, 8):  # broker, broker logger
                return az.cluster(op)
            return True  # other kinds are answered by the handler (unsupported)

        rc = nested(resp_cls, result_cls)
        return await _split(call, req, resp_cls, "resources", out_field, ok, lambda r: blank(
            rc, error_code=TOPIC_DENIED if r.resource_type == 2 else CLUSTER_DENIED,
            error_message="Authorization failed.", resource_type=r.resource_type, resource_name=r.resource_name,
            configs=()))
    return guard


async def _create_partitions(az, req, resp_cls, call):
    rc = nested(resp_cls, "CreatePartitionsTopicResult")
    return await _split(call, req, resp_cls, "topics", "results", lambda t: az.allowed(TOPIC, t.name, Operation.ALTER),
                        lambda t: build(rc, name=t.name, error_code=TOPIC_DENIED, error_message="Authorization failed."))


async def _delete_records(az, req, resp_cls, call):
    return await _split(call, req, resp_cls, "topics", "topics", lambda t: az.allowed(TOPIC, t.name, Operation.DELETE),
                        lambda t: _parts(resp_cls, "DeleteRecordsTopicResult", "DeleteRecordsPartitionResult", "name",
                                         "partitions", "partition_index", TOPIC_DENIED, t.name,
                                         [p.partition_index for p in t.partitions], low_watermark=-1))


async def _free(az, req, resp_cls, call):
    return await call(req)


async def _own_check(az, req, resp_cls, call):  # the handler checks (ACL and SCRAM admin APIs)
    return await call(req)


GUARDS = {
    codec.API_API_VERSIONS: _free,
    codec.API_PRODUCE: _produce,
    codec.API_LIST_OFFSETS: _list_offsets,
    codec.API_METADATA: None,  # needs the broker (see check)
    codec.API_CREATE_TOPICS: _create_topics,
    codec.API_DELETE_TOPICS: None,  # needs the broker (see check)
    codec.API_INIT_PRODUCER_ID: _init_producer_id,
    codec.API_FIND_COORDINATOR: _find_coordinator,
    codec.API_JOIN_GROUP: _group_whole(Operation.READ),
    codec.API_SYNC_GROUP: _group_whole(Operation.READ),
    codec.API_HEARTBEAT: _group_whole(Operation.READ),
    codec.API_LEAVE_GROUP: _group_whole(Operation.READ),
    codec.API_CONSUMER_GROUP_HEARTBEAT: _group_whole(Operation.READ),
    codec.API_OFFSET_COMMIT: _offset_commit,
    codec.API_OFFSET_FETCH: _offset_fetch,
    codec.API_LIST_GROUPS: _list_groups,
    codec.API_DESCRIBE_GROUPS: _describe_groups,
    codec.API_CONSUMER_GROUP_DESCRIBE: _consumer_group_describe,
    codec.API_DELETE_GROUPS: _delete_groups,
    codec.API_OFFSET_DELETE: _offset_delete,
    codec.API_ADD_PARTITIONS_TO_TXN: _add_partitions_to_txn,
    codec.API_ADD_OFFSETS_TO_TXN: _add_offsets_to_txn,
    codec.API_END_TXN: _end_txn,
    codec.API_TXN_OFFSET_COMMIT: lambda az, req, resp_cls, call: _offset_commit(az, req, resp_cls, call, txn=True),
    codec.API_WRITE_TXN_MARKERS: _cluster_whole(Operation.CLUSTER_ACTION),
    codec.API_DESCRIBE_TRANSACTIONS: _describe_transactions,
    codec.API_LIST_TRANSACTIONS: _list_transactions,
    codec.API_DESCRIBE_CONFIGS: _configs(Operation.DESCRIBE_CONFIGS, "DescribeConfigsResult", "results"),
    codec.API_ALTER_CONFIGS: _configs(Operation.ALTER_CONFIGS, "AlterConfigsResourceResponse", "responses"),
    codec.API_INCREMENTAL_ALTER_CONFIGS: _configs(Operation.ALTER_CONFIGS, "AlterConfigsResourceResponse",
                                                  "responses"),
    codec.API_CREATE_PARTITIONS: _create_partitions,
    codec.API_DESCRIBE_CLUSTER: _free,  # as Kafka: DESCRIBE on the cluster only for its authorized operations
    codec.API_DELETE_RECORDS: _delete_records,
    codec.API_DESCRIBE_ACLS: _own_check,
    codec.API_CREATE_ACLS: _own_check,
    codec.API_DELETE_ACLS: _own_check,
    codec.API_DESCRIBE_USER_SCRAM_CREDENTIALS: _own_check,
    codec.API_ALTER_USER_SCRAM_CREDENTIALS: _own_check,
    codec.API_DESCRIBE_CLIENT_QUOTAS: _own_check,  # DESCRIBE_CONFIGS / ALTER_CONFIGS on the cluster (quotas.py)
    codec.API_ALTER_CLIENT_QUOTAS: _own_check,
}


async def check(az: Authorizer, broker, req: codec.Request, resp_cls, handler):
    """The request's answer, its authorization checked (``GUARDS``)."""
    call = lambda body: handler(body, resp_cls)  # noqa: E731
    if req.api_key == codec.API_METADATA:
        return await _metadata(az, broker, req.body, resp_cls, call)
    if req.api_key == codec.API_DELETE_TOPICS:
        return await _delete_topics(az, broker, req.body, resp_cls, call)
    if req.api_key == codec.API_FETCH:
        return await _fetch(az, broker, req.body, resp_cls, call)
    guard = GUARDS.get(req.api_key)
    if guard is None:
        guard = _cluster_whole(Operation.ALTER)
    return await guard(az, req.body, resp_cls, call)


def may_write(az: Authorizer | None, topic: str) -> bool:
    """For ``Broker.prepare``: whether a produce to ``topic`` would be allowed (no partition is
    opened for one that will be refused)."""
    return az is None or az.allowed(TOPIC, topic, Operation.WRITE)


# ---------------------------------------------------------------- ACL APIs (29, 30, 31)
class AclApis:
    """DescribeAcls, CreateAcls, DeleteAcls; with ACLs off they answer SECURITY_DISABLED, as Kafka
    without an authorizer."""

    def __init__(self, broker):
        self.broker = broker

    def handlers(self) -> dict:
        return {codec.API_DESCRIBE_ACLS: self.describe_acls, codec.API_CREATE_ACLS: self.create_acls,
                codec.API_DELETE_ACLS: self.delete_acls}

    async def describe_acls(self, req, resp_cls):
        az = self.broker.authorizer
        if az is None:
            return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.security_disabled,
                         error_message="No Authorizer is configured on the broker", resources=())
        if not az.cluster(Operation.DESCRIBE):
            return build(resp_cls, throttle_time=ZERO_MS, error_code=CLUSTER_DENIED,
                         error_message="Authorization failed.", resources=())
        try:
            f = AclFilter.make(req.resource_type_filter, req.resource_name_filter, req.pattern_type_filter,
                               req.principal_filter, req.host_filter, req.operation, req.permission_type)
        except InvalidAcl as exc:
            return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.invalid_request,
                         error_message=str(exc), resources=())
        await az.reload()  # what was just created elsewhere is listed
        by_resource: dict[tuple, list[AclBinding]] = {}
        for b in az.acls.matching(f):
            by_resource.setdefault((b.resource_type, b.name, b.pattern_type), []).append(b)
        rc, ac = nested(resp_cls, "DescribeAclsResource"), nested(resp_cls, "AclDescription")
        resources = tuple(build(rc, resource_type=int(rt), resource_name=name, pattern_type=int(pt), acls=tuple(
            ac(principal=b.principal, host=b.host, operation=int(b.operation), permission_type=int(b.permission))
            for b in bs)) for (rt, name, pt), bs in sorted(by_resource.items()))
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, error_message=None,
                     resources=resources)

    async def create_acls(self, req, resp_cls):
        az = self.broker.authorizer
        rc = nested(resp_cls, "AclCreationResult")
        if az is None or not az.cluster(Operation.ALTER):
            code = ErrorCode.security_disabled if az is None else CLUSTER_DENIED
            return build(resp_cls, throttle_time=ZERO_MS, results=tuple(
                rc(error_code=code, error_message="No Authorizer is configured on the broker" if az is None
                   else "Authorization failed.") for _ in req.creations))
        out = []
        for c in req.creations:
            try:
                b = AclBinding.make(c.resource_type, c.resource_name, c.resource_pattern_type, c.principal, c.host,
                                    c.operation, c.permission_type)
                await az.create(b)
                log.info("ACL created: %s", b)
                out.append(rc(error_code=ErrorCode.none, error_message=None))
            except InvalidAcl as exc:
                out.append(rc(error_code=ErrorCode.invalid_request, error_message=str(exc)))
            except Exception as exc:
                log.warning("ACL creation failed: %r", exc)
                out.append(rc(error_code=ErrorCode.unknown_server_error, error_message=str(exc)))
        await az.reload()
        return build(resp_cls, throttle_time=ZERO_MS, results=tuple(out))

    async def delete_acls(self, req, resp_cls):
        az = self.broker.authorizer
        fc, mc = nested(resp_cls, "DeleteAclsFilterResult"), nested(resp_cls, "DeleteAclsMatchingAcl")
        if az is None or not az.cluster(Operation.ALTER):
            code = ErrorCode.security_disabled if az is None else CLUSTER_DENIED
            return build(resp_cls, throttle_time=ZERO_MS, filter_results=tuple(
                fc(error_code=code, error_message="Authorization failed." if az else
                   "No Authorizer is configured on the broker", matching_acls=()) for _ in req.filters))
        out = []
        for f in req.filters:
            try:
                flt = AclFilter.make(f.resource_type_filter, f.resource_name_filter, f.pattern_type_filter,
                                     f.principal_filter, f.host_filter, f.operation, f.permission_type)
                gone = await az.delete_matching(flt)
            except InvalidAcl as exc:
                out.append(fc(error_code=ErrorCode.invalid_request, error_message=str(exc), matching_acls=()))
                continue
            except Exception as exc:
                log.warning("ACL deletion failed: %r", exc)
                out.append(fc(error_code=ErrorCode.unknown_server_error, error_message=str(exc), matching_acls=()))
                continue
            for b in gone:
                log.info("ACL deleted: %s", b)
            out.append(fc(error_code=ErrorCode.none, error_message=None, matching_acls=tuple(build(
                mc, error_code=ErrorCode.none, error_message=None, resource_type=int(b.resource_type),
                resource_name=b.name, pattern_type=int(b.pattern_type), principal=b.principal, host=b.host,
                operation=int(b.operation), permission_type=int(b.permission)) for b in gone)))
        await az.reload()
        return build(resp_cls, throttle_time=ZERO_MS, filter_results=tuple(out))


# ---------------------------------------------------------------- SCRAM admin APIs (50, 51)
_MECH_IDS = {1: "SCRAM-SHA-256", 2: "SCRAM-SHA-512"}
_MECH_NUMS = {v: k for k, v in _MECH_IDS.items()}
MIN_ITERATIONS, MAX_ITERATIONS = 4096, 16384  # Kafka's ScramMechanism bounds


class ScramApis:
    """DescribeUserScramCredentials (DESCRIBE on the cluster) and AlterUserScramCredentials (ALTER
    on the cluster) over the credentials of ``sasl.py``."""

    def __init__(self, broker):
        self.broker = broker

    def handlers(self) -> dict:
        return {codec.API_DESCRIBE_USER_SCRAM_CREDENTIALS: self.describe,
                codec.API_ALTER_USER_SCRAM_CREDENTIALS: self.alter}

    def _allowed(self, op: Operation) -> bool:
        az = self.broker.authorizer
        return az is None or az.cluster(op)

    async def describe(self, req, resp_cls):
        rc, ic = nested(resp_cls, "DescribeUserScramCredentialsResult"), nested(resp_cls, "CredentialInfo")
        if not self._allowed(Operation.DESCRIBE):
            return build(resp_cls, throttle_time=ZERO_MS, error_code=CLUSTER_DENIED,
                         error_message="Authorization failed.", results=())
        store = self.broker.store
        users = await sasl.list_users(store)
        wanted = [u.name for u in req.users] if req.users else list(users)
        out = []
        for name in dict.fromkeys(wanted):
            if wanted.count(name) > 1:
                out.append(rc(user=name, error_code=ErrorCode.duplicate_resource,
                              error_message=f"Cannot describe SCRAM credentials for the same user twice: {name}",
                              credential_infos=()))
                continue
            mechs = users.get(name)
            if not mechs:
                out.append(rc(user=name, error_code=ErrorCode.resource_not_found,
                              error_message=f"Attempt to describe a user credential that does not exist: {name}",
                              credential_infos=()))
                continue
            infos = []
            for m in mechs:
                cred = await sasl.load_credential(store, name, m)
                if cred is not None and m in _MECH_NUMS:
                    infos.append(ic(mechanism=_MECH_NUMS[m], iterations=cred.iterations))
            out.append(rc(user=name, error_code=ErrorCode.none, error_message=None, credential_infos=tuple(infos)))
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, error_message=None,
                     results=tuple(out))

    async def alter(self, req, resp_cls):
        rc = nested(resp_cls, "AlterUserScramCredentialsResult")
        users = list(dict.fromkeys([d.name for d in req.deletions] + [u.name for u in req.upsertions]))
        if not self._allowed(Operation.ALTER):
            return build(resp_cls, throttle_time=ZERO_MS, results=tuple(
                rc(user=u, error_code=CLUSTER_DENIED, error_message="Authorization failed.") for u in users))
        errors: dict[str, tuple[ErrorCode, str]] = {}
        seen: set[tuple[str, int]] = set()
        for op in [*req.deletions, *req.upsertions]:
            if (op.name, op.mechanism) in seen:
                errors.setdefault(op.name, (ErrorCode.duplicate_resource,
                                            "A user credential cannot be altered twice in the same request"))
            seen.add((op.name, op.mechanism))
            try:
                sasl.check_user_name(op.name)
            except ValueError as exc:
                errors.setdefault(op.name, (ErrorCode.unacceptable_credential, str(exc)))
            if op.mechanism not in _MECH_IDS:
                errors.setdefault(op.name, (ErrorCode.unsupported_sasl_mechanism,
                                            f"Unknown SCRAM mechanism {op.mechanism}"))
        for u in req.upsertions:
            if not MIN_ITERATIONS <= u.iterations <= MAX_ITERATIONS:
                errors.setdefault(u.name, (ErrorCode.unacceptable_credential,
                                           f"Iterations {u.iterations} not in {MIN_ITERATIONS}..{MAX_ITERATIONS}"))
            elif not u.salt or not u.salted_password:
                errors.setdefault(u.name, (ErrorCode.unacceptable_credential, "Empty salt or salted password"))
        store = self.broker.store
        for d in req.deletions:
            if d.name not in errors and await store.get(sasl.cred_key(d.name, _MECH_IDS[d.mechanism])) is None:
                errors[d.name] = (ErrorCode.resource_not_found,
                                  "Attempt to delete a user credential that does not exist")
        for d in req.deletions:
            if d.name not in errors:
                await store.delete(sasl.cred_key(d.name, _MECH_IDS[d.mechanism]))
        for u in req.upsertions:
            if u.name not in errors:
                mech = _MECH_IDS[u.mechanism]
                cred = sasl.credential_from_salted(mech, u.salted_password, u.salt, u.iterations)
                await store.put(sasl.cred_key(u.name, mech), cred.to_bytes())
                log.info("SCRAM credential %s of %s set", mech, u.name)
        return build(resp_cls, throttle_time=ZERO_MS, results=tuple(
            rc(user=u, error_code=errors.get(u, (ErrorCode.none, None))[0],
               error_message=errors.get(u, (ErrorCode.none, None))[1]) for u in users))
