"""Admin APIs: DescribeConfigs, AlterConfigs, IncrementalAlterConfigs, CreatePartitions, DescribeCluster.

How this works. A topic's configs are the ``configs`` map of its topic record
``/scroll/topics/<topic>`` (``streams/topics.py``, shared with the streams API; written by
CreateTopics and the alter APIs with ``ScrollClient.update_topic``, a compare-and-set that keeps
every other field of the record as it is; a stream created alone gets its record on the first
alter). Names are checked against
Kafka's topic config names and values against their type and Kafka's ranges; an unknown name or a
bad value is INVALID_CONFIG and nothing is written. These settings take effect, the others are
stored and reported:

- ``retention.ms`` / ``retention.bytes`` become the retention policy of every partition's stream
  (``LedgerMeta.retention`` keys ``max_age_s`` / ``max_bytes``; -1 removes the key), written with a
  CAS on the stream's meta record that changes only its ``retention`` and rollover caps, which the
  retention job honours. ``retention.bytes`` is per partition, as in Kafka.
- ``cleanup.policy`` (``delete``, ``compact`` or both, any order; stored as ``delete``, ``compact``
  or ``compact,delete``), ``min.compaction.lag.ms``, ``max.compaction.lag.ms``,
  ``min.cleanable.dirty.ratio`` and ``delete.retention.ms`` become the stream's compaction policy
  (``fragments/compaction.py``: the ``LedgerMeta.retention`` keys of the same names with ``_``; only
  values other than Kafka's defaults are written). A ``compact`` topic refuses records without a
  key (``broker.py``), and retention by age or size applies only to topics whose policy includes
  ``delete``.
- ``remote.storage.enable``, ``local.retention.ms`` and ``local.retention.bytes`` (KIP-405; -2: as
  retention.*, -1: no limit) become the stream's tier policy (``fragments/tier.py``: the keys of the
  same names with ``_``, non-defaults only), checked by ``fragments.tier.validate_change`` as Kafka
  3.9 checks them (not on a compacted topic, local not above total, never turned off once on).
- ``segment.bytes`` (at least ``MIN_SEGMENT_BYTES``) and ``segment.ms`` become the rollover caps of
  each stream (``LedgerConfig.fragment_bytes_max`` / ``fragment_age_max_ms``); a ``compact`` topic's
  age cap is min(segment.ms, max.compaction.lag.ms) (Kafka rolls the active segment for
  max.compaction.lag.ms too, KIP-354). Caps are written only when one of these configs changed; a
  live writer takes them within ``streams.driver.CAPS_REFRESH_S`` while active (at its next
  metadata write in any case), a new writer at once.
- ``message.timestamp.type`` must be ``CreateTime`` (batches are stored as the producer sent them).

DescribeConfigs answers a topic's stored configs (source DYNAMIC_TOPIC_CONFIG) over the defaults
(DEFAULT_CONFIG: no retention limit, as a stream has none unless asked), and the broker resource's
settings of this shim (read-only, STATIC_BROKER_CONFIG). CreatePartitions grows a topic with
``ScrollClient.add_partitions``: the new partitions' streams are created (a leftover stream is
reused) and only then is the record's partition count raised, so a reader of the record never sees
a partition without a stream; the topic's retention is then written to the new streams; shrinking, or asking for the current count, is INVALID_PARTITIONS. DescribeCluster
names this shim, controller included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from kio.schema.errors import ErrorCode

from fragments.compaction import (
    DEFAULT_DELETE_RETENTION_MS,
    DEFAULT_DIRTY_RATIO,
    KAFKA_LONG_MAX,
    InvalidCompactionPolicy,
    normalise_cleanup_policy,
)
from fragments.ledgers import NoSuchLedger
from fragments.model import LedgerConfig
from fragments.tier import InvalidTierPolicy, validate_change
from streams.errors import InvalidArgument, NoSuchTopic
from streams.topics import (  # noqa: F401 - compaction_policy is part of this module's interface
    DEFAULT_SEGMENT_BYTES,
    RETENTION_KEYS,
    SEGMENT_KEYS,
    TopicMeta,
    compaction_policy,
    partition_stream,
    retention_policy,
    rollover_caps,
    topic_key,
)

from .wire import codec
from .wire.codec import ZERO_MS, build, nested
from .wire.errors import (
    InvalidPartitions,
    InvalidRequest,
    KafkaError,
    OffsetOutOfRange,
    UnknownTopicOrPartition,
    code_for,
)

log = logging.getLogger(__name__)

RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4
SOURCE_DYNAMIC_TOPIC = 1
SOURCE_DYNAMIC_BROKER = 2
SOURCE_DYNAMIC_DEFAULT_BROKER = 3
SOURCE_STATIC_BROKER = 4
SOURCE_DEFAULT = 5
T_BOOLEAN, T_STRING, T_INT, T_SHORT, T_LONG, T_DOUBLE, T_LIST = 1, 2, 3, 4, 5, 6, 7
OP_SET, OP_DELETE, OP_APPEND, OP_SUBTRACT = 0, 1, 2, 3
ENTRY_OVERHEAD = 1  # the entry envelope byte in front of the stored batch


class InvalidConfig(KafkaError):
    code = ErrorCode.invalid_config


class PolicyViolation(KafkaError):
    code = ErrorCode.policy_violation


class InvalidReplicaAssignment(KafkaError):
    code = ErrorCode.invalid_replica_assignment


# Replicas per partition as Metadata shows them: the partition's leader alone (broker.py ``metadata``;
# the stream's data is replicated by the storage below, which Kafka clients do not see).
REPLICATION_FACTOR = 1


def check_new_partition_assignments(added: int, assignments: list[list[int]] | None, brokers: set[int],
                                    replication_factor: int = REPLICATION_FACTOR) -> None:
    """CreatePartitions' manual assignments, checked as Kafka's controller checks them (Kafka 3.9 /
    4.x ``ReplicationControlManager.createPartitions`` and ``validateManualPartitionAssignment``,
    messages included): as many assignments as partitions added; each a non-empty list of
    registered brokers (here: the live listeners' node ids), none twice, with as many replicas as
    the topic's existing partitions have (``replication_factor``). Raises InvalidReplicaAssignment."""
    if assignments is None:
        return
    if len(assignments) != added:
        raise InvalidReplicaAssignment(f"Attempted to add {added} additional partition(s), but only "
                                       f"{len(assignments)} assignment(s) were specified.")
    for replicas in assignments:
        if not replicas:
            raise InvalidReplicaAssignment("The manual partition assignment includes an empty replica list.")
        prev = None
        for b in sorted(replicas):
            if b not in brokers:
                raise InvalidReplicaAssignment(f"The manual partition assignment includes broker {b}, but no "
                                               "such broker is registered.")
            if b == prev:
                raise InvalidReplicaAssignment(f"The manual partition assignment includes the broker {b} more "
                                               "than once.")
            prev = b
        if len(replicas) != replication_factor:
            raise InvalidReplicaAssignment(
                f"The manual partition assignment includes a partition with {len(replicas)} replica(s), but "
                f"this is not consistent with previous partitions, which have {replication_factor} replica(s).")


# Kafka's topic config names and their types. Only retention.* act (see the module docstring).
TOPIC_CONFIG_TYPES: dict[str, int] = {
    "cleanup.policy": T_LIST, "compression.type": T_STRING, "delete.retention.ms": T_LONG,
    "file.delete.delay.ms": T_LONG, "flush.messages": T_LONG, "flush.ms": T_LONG,
    "follower.replication.throttled.replicas": T_LIST, "index.interval.bytes": T_INT,
    "leader.replication.throttled.replicas": T_LIST, "local.retention.bytes": T_LONG,
    "local.retention.ms": T_LONG, "max.compaction.lag.ms": T_LONG, "max.message.bytes": T_INT,
    "message.downconversion.enable": T_BOOLEAN, "message.format.version": T_STRING,
    "message.timestamp.after.max.ms": T_LONG, "message.timestamp.before.max.ms": T_LONG,
    "message.timestamp.difference.max.ms": T_LONG, "message.timestamp.type": T_STRING,
    "min.cleanable.dirty.ratio": T_DOUBLE, "min.compaction.lag.ms": T_LONG, "min.insync.replicas": T_INT,
    "preallocate": T_BOOLEAN, "remote.storage.enable": T_BOOLEAN, "retention.bytes": T_LONG,
    "retention.ms": T_LONG, "segment.bytes": T_INT, "segment.index.bytes": T_INT, "segment.jitter.ms": T_LONG,
    "segment.ms": T_LONG, "unclean.leader.election.enable": T_BOOLEAN,
}
_COMPRESSION = {"producer", "uncompressed", "gzip", "snappy", "lz4", "zstd"}
# Kafka's own floor for segment.bytes is 14 bytes (1 MiB since Kafka 4.0): a fragment must hold at
# least one entry of up to 1 MiB, and a fragment per batch would only churn metadata, so 1 MiB here.
MIN_SEGMENT_BYTES = 1 << 20
_INT_MAX = 2**31 - 1
_WAVE = 64  # partitions whose metadata is changed at once (apply_retention)
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1
# Kafka's ranges: name -> (lowest, highest) (None: no bound)
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "min.compaction.lag.ms": (0, None), "max.compaction.lag.ms": (1, None),
    "min.cleanable.dirty.ratio": (0, 1), "delete.retention.ms": (0, None),
    "segment.bytes": (MIN_SEGMENT_BYTES, None), "segment.ms": (1, None),
    "local.retention.ms": (-2, None), "local.retention.bytes": (-2, None),
}


def check_topic_configs(configs: dict[str, str | None]) -> dict[str, str]:
    """Validated topic configs (None values dropped); ``InvalidConfig`` names the first bad one."""
    out = {}
    for name, value in configs.items():
        if value is None:
            continue
        kind = TOPIC_CONFIG_TYPES.get(name)
        if kind is None:
            raise InvalidConfig(f"unknown topic config {name!r}")
        try:
            if kind in (T_INT, T_LONG, T_SHORT):
                n = int(value)
                lo, hi = (-(2**31), _INT_MAX) if kind == T_INT else (_LONG_MIN, _LONG_MAX)
                if not lo <= n <= hi:
                    raise ValueError(value)
            elif kind == T_DOUBLE:
                n = float(value)
                if n != n:
                    raise ValueError(value)
            elif kind == T_BOOLEAN:
                if value.strip().lower() not in ("true", "false"):
                    raise ValueError(value)
                value = value.strip().lower()
        except ValueError:
            raise InvalidConfig(f"config {name}: {value!r} is not a valid {_TYPE_NAMES[kind]}") from None
        if name in _RANGES:
            lo, hi = _RANGES[name]
            if (lo is not None and n < lo) or (hi is not None and n > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
                raise InvalidConfig(f"Invalid value {value} for configuration {name}: Value must be {bound}")
        if name in ("retention.ms", "retention.bytes") and int(value) < -1:
            raise InvalidConfig(f"config {name} must be -1 (no limit) or >= 0, not {value}")
        if name == "cleanup.policy":
            try:
                value = normalise_cleanup_policy(value)
            except InvalidCompactionPolicy:
                raise InvalidConfig(f"Invalid value {value} for configuration cleanup.policy: String must be one "
                                    f"of: compact, delete") from None
        if name == "message.timestamp.type" and value != "CreateTime":
            raise InvalidConfig("message.timestamp.type: only CreateTime is supported")
        if name == "compression.type" and value not in _COMPRESSION:
            raise InvalidConfig(f"compression.type {value!r}: one of {sorted(_COMPRESSION)}")
        if name == "max.message.bytes" and int(value) < 0:
            raise InvalidConfig("max.message.bytes must be >= 0")
        out[name] = value
    lo, hi = out.get("min.compaction.lag.ms"), out.get("max.compaction.lag.ms")
    if lo is not None and hi is not None and int(lo) > int(hi):
        raise InvalidConfig(f"conflict topic configs: min.compaction.lag.ms ({lo}) must not be greater than "
                            f"max.compaction.lag.ms ({hi})")
    return out


def check_tier_configs(configs: dict[str, str], old: dict[str, str] | None = None) -> None:
    """remote.storage.enable / local.retention.* against the topic's other configs (``configs``:
    checked, with the broker's log.retention.* defaults filled in), as Kafka 3.9 checks them, by
    ``fragments.tier.validate_change`` (the native API's check too): not on a compacted topic,
    local.retention.* not above retention.*, and not turned off once on (``old``: the configs
    before the change). InvalidConfig."""
    try:
        validate_change(retention_policy(old) if old is not None else None, retention_policy(configs))
    except InvalidTierPolicy as exc:
        raise InvalidConfig(str(exc)) from None


_TYPE_NAMES = {T_BOOLEAN: "boolean", T_STRING: "string", T_INT: "int", T_SHORT: "short", T_LONG: "long",
               T_DOUBLE: "double", T_LIST: "list"}


# Dynamic broker settings (AlterConfigs / IncrementalAlterConfigs on the broker resource), kept in
# the metadata store: ``kafka/broker-configs/default`` for the cluster default (resource name "")
# and ``kafka/broker-configs/<node id>`` for one listener, JSON {name: value}. A listener reads them
# again at most every ``DYNAMIC_TTL_S`` when it needs one. Every other broker setting is static
# (INVALID_REQUEST, as Kafka answers for a setting it cannot change dynamically); an unknown name
# is INVALID_CONFIG.
BROKER_CONFIGS = "kafka/broker-configs/"
DYNAMIC_TTL_S = 1.0
BROKER_DYNAMIC_TYPES: dict[str, int] = {
    "log.retention.ms": T_LONG,  # the retention.ms of topics that set none
    "log.retention.bytes": T_LONG,  # the retention.bytes of topics that set none
    "num.partitions": T_INT,  # partitions of an auto-created topic (and CreateTopics with -1)
    "auto.create.topics.enable": T_BOOLEAN,  # Metadata creates topics it is asked for
}
# broker log.* default -> the topic config it is the default of
TOPIC_DEFAULT_OF = {"log.retention.ms": "retention.ms", "log.retention.bytes": "retention.bytes"}


def check_broker_configs(configs: dict[str, str | None], max_partitions: int, static: set[str]) -> dict[str, str]:
    """Validated dynamic broker settings (None values dropped)."""
    out = {}
    for name, value in configs.items():
        if value is None:
            continue
        kind = BROKER_DYNAMIC_TYPES.get(name)
        if kind is None:
            if name in static:
                raise InvalidRequest(f"broker config {name} cannot be changed dynamically (set it on the command "
                                     f"line); dynamic ones: {', '.join(sorted(BROKER_DYNAMIC_TYPES))}")
            raise InvalidConfig(f"unknown broker config {name!r}")
        try:
            if kind == T_BOOLEAN:
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                value = value.lower()
            else:
                n = int(value)
                if name == "num.partitions" and not 1 <= n <= max_partitions:
                    raise InvalidConfig(f"num.partitions must be 1..{max_partitions}, not {n}")
                if name.startswith("log.retention.") and n < -1:
                    raise InvalidConfig(f"{name} must be -1 (no limit) or >= 0, not {n}")
        except ValueError:
            raise InvalidConfig(f"config {name}: {value!r} is not a valid {_TYPE_NAMES[kind]}") from None
        out[name] = value
    return out


def caps_changed(old: dict[str, str], new: dict[str, str]) -> bool:
    return any(old.get(k) != new.get(k) for k in SEGMENT_KEYS)


class Admin:
    """The admin APIs of one shim (``broker`` gives the client, store, config and topic metadata)."""

    def __init__(self, broker):
        self.broker = broker
        self.store = broker.store
        self.client = broker.client
        self._dynamic: dict[str, dict[str, str]] = {}  # resource ("default" or node id) -> settings
        self._dynamic_at = -1e9
        self._dynamic_lock = asyncio.Lock()

    def handlers(self) -> dict[int, Callable]:
        return {
            codec.API_DESCRIBE_CONFIGS: self.describe_configs,
            codec.API_ALTER_CONFIGS: self.alter_configs,
            codec.API_INCREMENTAL_ALTER_CONFIGS: self.incremental_alter_configs,
            codec.API_CREATE_PARTITIONS: self.create_partitions,
            codec.API_DESCRIBE_CLUSTER: self.describe_cluster,
            codec.API_DELETE_RECORDS: self.delete_records,
        }

    # ------------------------------------------------------------ dynamic broker settings
    async def _load_dynamic(self, fresh: bool = False) -> dict[str, dict[str, str]]:
        async with self._dynamic_lock:
            if fresh or time.monotonic() - self._dynamic_at > DYNAMIC_TTL_S:
                loaded = {}
                for key, kv in await self.store.list_prefix(BROKER_CONFIGS):
                    try:
                        loaded[key[len(BROKER_CONFIGS):]] = {str(k): str(v) for k, v in json.loads(kv.value).items()}
                    except (ValueError, AttributeError) as exc:
                        log.warning("ignoring unreadable broker configs %s: %r", key, exc)
                self._dynamic, self._dynamic_at = loaded, time.monotonic()
            return self._dynamic

    async def dynamic_settings(self) -> dict[str, tuple[str, int]]:
        """The dynamic broker settings in force here: name -> (value, source)."""
        d = await self._load_dynamic()
        out = {k: (v, SOURCE_DYNAMIC_DEFAULT_BROKER) for k, v in d.get("default", {}).items()}
        out.update({k: (v, SOURCE_DYNAMIC_BROKER) for k, v in d.get(str(self._node_id()), {}).items()})
        return out

    async def setting(self, name: str) -> str:
        """One broker setting's value in force (dynamic over the command line's)."""
        got = (await self.dynamic_settings()).get(name)
        return got[0] if got is not None else self._broker_configs()[name][0]

    async def default_partitions(self) -> int:
        return int(await self.setting("num.partitions"))

    async def auto_create_topics(self) -> bool:
        return (await self.setting("auto.create.topics.enable")) == "true"

    async def check_tier(self, configs: dict[str, str], old: dict[str, str] | None = None,
                         topic: TopicMeta | None = None) -> None:
        """``check_tier_configs`` of checked topic configs with the broker's defaults in force;
        ``topic`` (the record as it would be written): its partition streams too (remote storage
        turned on natively stays on)."""
        defaults = await self.topic_configs_in_force({})
        check_tier_configs({**defaults, **configs}, None if old is None else {**defaults, **old})
        if topic is not None:
            try:
                await self.client.check_tier_streams(topic, retention_policy({**defaults, **configs}))
            except InvalidArgument as exc:
                raise InvalidConfig(str(exc)) from None

    async def topic_configs_in_force(self, configs: dict[str, str]) -> dict[str, str]:
        """A topic's configs with the broker's log.retention.* defaults filled in where it sets none."""
        out = dict(configs)
        for broker_name, topic_name in TOPIC_DEFAULT_OF.items():
            if topic_name not in out:
                value = await self.setting(broker_name)
                if value != "-1":
                    out[topic_name] = value
        return out

    def _resource_key(self, name: str) -> str:
        if name == "":
            return "default"
        try:
            if int(name) >= 0:
                return str(int(name))
        except ValueError:
            pass
        raise InvalidRequest(f"broker resource name must be '' (every listener) or a node id, not {name!r}")

    async def _alter_broker(self, name: str, edit: Callable[[dict[str, str]], dict[str, str]],
                            validate_only: bool) -> None:
        key = BROKER_CONFIGS + self._resource_key(name)
        static = set(self._broker_configs())
        for _ in range(20):
            cur = await self.store.get(key)
            old = {str(k): str(v) for k, v in json.loads(cur.value).items()} if cur is not None else {}
            new = check_broker_configs(edit(dict(old)), self.broker.config.max_partitions, static)
            if validate_only or new == old:
                return
            data = json.dumps(new, sort_keys=True).encode()
            done = (await self.store.cas(key, data, cur.version) if cur is not None
                    else await self.store.create(key, data))
            if done:
                break
        else:
            raise PolicyViolation(f"broker configs {name!r}: the record kept changing")
        await self._load_dynamic(fresh=True)
        log.info("broker configs %r set to %s", name or "<default>", new)
        if any(old.get(k) != new.get(k) for k in TOPIC_DEFAULT_OF):
            await self._apply_default_retention()

    async def _apply_default_retention(self) -> None:
        """log.retention.* changed: the topics that set no retention of their own follow it."""
        for t in await self.client.list_topics():
            if await self.store.get(topic_key(t.name)) is None:
                continue  # a stream created alone keeps the retention its owner set
            own = dict(t.configs)
            if all(n in own for n in TOPIC_DEFAULT_OF.values()):
                continue
            try:
                await self.apply_retention(t.name, range(t.partitions), await self.topic_configs_in_force(own))
            except Exception as exc:
                log.warning("topic=%s: the new default retention was not applied: %r", t.name, exc)

    # ------------------------------------------------------------ DeleteRecords
    async def delete_records(self, req, resp_cls):
        """DeleteRecords: the log start of each partition moves to the offset at once (-1: the high
        watermark), and the stream's retention ``keep_from`` is raised to it, so the retention job
        removes the fragments wholly below it (through its two phases); low_watermark answers the new
        log start. An offset above the high watermark is OFFSET_OUT_OF_RANGE."""
        topic_cls = nested(resp_cls, "DeleteRecordsTopicResult")
        part_cls = nested(resp_cls, "DeleteRecordsPartitionResult")
        topics = []
        for t in req.topics:
            parts = []
            for p in t.partitions:
                low, error = -1, None
                try:
                    low = await self._delete_below(t.name, p.partition_index, p.offset)
                except Exception as exc:
                    self._log("delete_records", f"{t.name}/{p.partition_index}", exc)
                    error = exc
                parts.append(build(part_cls, partition_index=p.partition_index, low_watermark=low,
                                   error_code=code_for(error) if error else ErrorCode.none))
            topics.append(build(topic_cls, name=t.name, partitions=tuple(parts)))
        return build(resp_cls, throttle_time=ZERO_MS, topics=tuple(topics))

    async def _delete_below(self, topic: str, index: int, offset: int) -> int:
        from streams.tools import retention  # the retention job's policy writer (operator tools)

        plog = await self.broker.partition(topic, index)  # NOT_LEADER_OR_FOLLOWER unless ours
        await plog.caught_up()
        hw = plog.high_watermark
        target = hw if offset == -1 else offset
        if not 0 <= target <= hw:
            raise OffsetOutOfRange(f"cannot delete records of {topic} partition {index} below {offset}: the "
                                   f"offsets are {plog.log_start}..{hw}")
        start = await plog.refresh_log_start()
        if target <= start:
            return start
        # a CAS that only raises keep_from: a concurrent DeleteRecords (or retention change) with a
        # lower offset cannot move the stored log start back
        meta = await retention.raise_keep_from(self.client, plog.stream, target)
        plog.delete_below(target)
        log.info("topic=%s partition=%d: records below %d deleted (stream %s retention %s)", topic, index, target,
                 plog.stream, meta.retention)
        task = asyncio.ensure_future(retention.run_retention(self.client, plog.stream))
        task.add_done_callback(_log_retention_run)
        return plog.log_start

    # ------------------------------------------------------------ topic records
    async def _topic_record(self, name: str, for_change: bool = False) -> TopicMeta:
        """The topic's record. ``for_change``: a stream created alone (no record yet) gets one now
        (same topic id), so that its configs and partition count can be changed like any topic's."""
        try:
            meta = await self.client.describe_topic(name)
        except NoSuchTopic:
            raise UnknownTopicOrPartition(f"unknown topic {name!r}") from None
        if for_change and await self.store.get(topic_key(name)) is None:
            await self.store.create(topic_key(name), meta.encode())  # lost to a concurrent create: fine
        return meta

    async def _update_topic(self, name: str, change: Callable[[TopicMeta], TopicMeta],
                            validate_only: bool) -> TopicMeta:
        """Compare-and-set the topic record: ``change`` returns the new record (or raises)."""
        cur = await self._topic_record(name, for_change=not validate_only)
        if validate_only:
            return change(cur)
        try:
            return await self.client.update_topic(name, change)
        except NoSuchTopic:
            raise UnknownTopicOrPartition(f"unknown topic {name!r}") from None

    async def apply_retention(self, topic: str, partitions: range | list[int], configs: dict[str, str],
                              caps: bool = False) -> None:
        """Write the topic's retention and compaction policy into each partition stream's meta (CAS
        on ``retention`` only; ``caps``: also the rollover caps of its config, see ``rollover_caps``)."""
        policy = retention_policy(configs)
        fragment_bytes, fragment_age = rollover_caps(configs)
        ledgers = self.client.cluster.ledgers

        async def one(p: int) -> None:
            stream = partition_stream(topic, p)
            for _ in range(50):
                try:
                    meta, version = await ledgers.get_ledger(stream)
                except NoSuchLedger:
                    log.warning("topic=%s: no stream %s to set retention on", topic, stream)
                    return
                retention = {k: v for k, v in meta.retention.items() if k not in RETENTION_KEYS}
                retention.update(policy)
                config = meta.config
                if caps:
                    try:
                        config = meta.config.with_caps(LedgerConfig(
                            fragment_bytes_max=fragment_bytes, fragment_entries_max=meta.config.fragment_entries_max,
                            fragment_age_max_ms=fragment_age))
                    except ValueError as exc:
                        raise InvalidConfig(str(exc)) from None
                if retention == meta.retention and config == meta.config:
                    return
                if await ledgers.cas_ledger(meta.with_(retention=retention, config=config), (), version) is not None:
                    log.info("stream=%s retention %s caps bytes=%s age_ms=%s", stream, retention,
                             config.fragment_bytes_max, config.fragment_age_max_ms)
                    return
            raise PolicyViolation(f"stream {stream}: retention not set (its meta kept changing)")

        # the partitions a wave at a time: the listener's batching store sends a wave's reads, then
        # its compare-and-sets, as one request each (one partition at a time: 2 requests each)
        partitions = list(partitions)
        for lo in range(0, len(partitions), _WAVE):
            done = await asyncio.gather(*(one(p) for p in partitions[lo:lo + _WAVE]), return_exceptions=True)
            failed = next((x for x in done if isinstance(x, BaseException)), None)
            if failed is not None:
                raise failed

    # ------------------------------------------------------------ DescribeConfigs
    def _topic_defaults(self) -> dict[str, tuple[str, int]]:
        c = self.broker.config
        max_msg = getattr(self.client.cluster, "max_entry_bytes", 1 << 20) - ENTRY_OVERHEAD
        return {
            "cleanup.policy": ("delete", T_LIST),
            "min.compaction.lag.ms": ("0", T_LONG),
            "max.compaction.lag.ms": (str(KAFKA_LONG_MAX), T_LONG),
            "min.cleanable.dirty.ratio": (str(DEFAULT_DIRTY_RATIO), T_DOUBLE),
            "delete.retention.ms": (str(DEFAULT_DELETE_RETENTION_MS), T_LONG),
            "segment.bytes": (str(DEFAULT_SEGMENT_BYTES), T_INT),
            "segment.ms": (str(KAFKA_LONG_MAX), T_LONG),  # no age cap unless set (Kafka's is 7 days)
            "retention.ms": ("-1", T_LONG),
            "retention.bytes": ("-1", T_LONG),
            "remote.storage.enable": ("false", T_BOOLEAN),
            "local.retention.ms": ("-2", T_LONG),
            "local.retention.bytes": ("-2", T_LONG),
            "max.message.bytes": (str(max_msg), T_INT),
            "compression.type": ("producer", T_STRING),
            "message.timestamp.type": ("CreateTime", T_STRING),
            "min.insync.replicas": (str(c.ack_quorum), T_INT),
        }

    def _broker_configs(self) -> dict[str, tuple[str, int]]:
        c = self.broker.config
        g = getattr(getattr(self.broker, "groups", None), "config", None)
        out = {
            "broker.id": (str(self._node_id()), T_INT),
            "num.partitions": (str(c.default_partitions), T_INT),
            "auto.create.topics.enable": (str(c.auto_create_topics).lower(), T_BOOLEAN),
            # Kafka clients see one replica per partition (Metadata's replica and ISR lists name the
            # leader alone), so that is the replication factor a new topic gets: not the storage's
            # write quorum, which Kafka clients never see
            "default.replication.factor": (str(REPLICATION_FACTOR), T_INT),
            **self._listener_configs(),
            "min.insync.replicas": (str(c.ack_quorum), T_INT),
            "message.max.bytes": (self._topic_defaults()["max.message.bytes"][0], T_INT),
            "log.retention.ms": ("-1", T_LONG),
            "log.retention.bytes": ("-1", T_LONG),
            "log.cleanup.policy": ("delete", T_LIST),
            "log.cleaner.min.compaction.lag.ms": ("0", T_LONG),
            "log.cleaner.max.compaction.lag.ms": (str(KAFKA_LONG_MAX), T_LONG),
            "log.cleaner.min.cleanable.ratio": (str(DEFAULT_DIRTY_RATIO), T_DOUBLE),
            "log.cleaner.delete.retention.ms": (str(DEFAULT_DELETE_RETENTION_MS), T_LONG),
            "log.segment.bytes": (str(DEFAULT_SEGMENT_BYTES), T_INT),
            "log.roll.ms": (str(KAFKA_LONG_MAX), T_LONG),
            # tiered storage (KIP-405): offered wherever a tier is configured; topics turn it on
            "remote.log.storage.system.enable": ("true", T_BOOLEAN),
            "log.local.retention.ms": ("-2", T_LONG),
            "log.local.retention.bytes": ("-2", T_LONG),
        }
        if g is not None:
            out.update({
                "group.initial.rebalance.delay.ms": (str(g.initial_rebalance_delay_ms), T_INT),
                "group.min.session.timeout.ms": (str(g.min_session_timeout_ms), T_INT),
                "group.max.session.timeout.ms": (str(g.max_session_timeout_ms), T_INT),
                "group.max.size": (str(g.max_group_size), T_INT),
                "offset.metadata.max.bytes": (str(g.max_metadata_bytes), T_INT),
            })
        return out

    def _listener_configs(self) -> dict[str, tuple[str, int]]:
        """``listeners`` (where this process binds) and ``advertised.listeners`` (the addresses
        Metadata gives clients), in Kafka's ``NAME://host:port,...`` syntax, as registered."""
        def fmt(endpoints) -> str:
            return ",".join(f"{n}://{f'[{h}]' if ':' in h else h}:{p}" for n, h, p in endpoints)

        own = getattr(self.broker, "ownership", None)
        if own is not None:
            me = own.me
            advertised = me.endpoints or (("PLAINTEXT", me.host, me.port),)
        else:
            c = self.broker.config
            advertised = (("PLAINTEXT", c.host, c.port),)
        bound = getattr(self.broker, "bound_listeners", ()) or advertised
        return {"listeners": (fmt(bound), T_STRING), "advertised.listeners": (fmt(advertised), T_STRING)}

    async def describe_configs(self, req, resp_cls):
        result_cls = nested(resp_cls, "DescribeConfigsResult")
        entry_cls = nested(resp_cls, "DescribeConfigsResourceResult")
        out = []
        for r in req.resources:
            rows: list = []
            try:
                if r.resource_type == RESOURCE_TOPIC:
                    stored = dict((await self._topic_record(r.resource_name)).configs)
                    entries = {k: (v, t, SOURCE_DEFAULT, False) for k, (v, t) in self._topic_defaults().items()}
                    dynamic = await self.dynamic_settings()
                    for broker_name, topic_name in TOPIC_DEFAULT_OF.items():
                        if broker_name in dynamic:
                            value, source = dynamic[broker_name]
                            entries[topic_name] = (value, T_LONG, source, False)
                    for k, v in stored.items():
                        entries[k] = (v, TOPIC_CONFIG_TYPES.get(k, T_STRING), SOURCE_DYNAMIC_TOPIC, False)
                elif r.resource_type == RESOURCE_BROKER:
                    if r.resource_name not in ("", str(self._node_id())):
                        raise InvalidRequest(f"this is broker {self._node_id()}, not {r.resource_name}")
                    entries = {k: (v, t, SOURCE_STATIC_BROKER, k not in BROKER_DYNAMIC_TYPES)
                               for k, (v, t) in self._broker_configs().items()}
                    for k, (v, source) in (await self.dynamic_settings()).items():
                        entries[k] = (v, BROKER_DYNAMIC_TYPES[k], source, False)
                else:
                    raise InvalidRequest(f"resource type {r.resource_type} is not served (2: topic, 4: broker)")
                keys = r.configuration_keys
                for name in sorted(entries if not keys else [k for k in keys if k in entries]):
                    value, kind, source, read_only = entries[name]
                    rows.append(build(entry_cls, name=name, value=value, read_only=read_only, config_source=source,
                                      is_default=source == SOURCE_DEFAULT, is_sensitive=False, synonyms=(),
                                      config_type=kind, documentation=None))
                out.append(build(result_cls, error_code=ErrorCode.none, error_message=None,
                                 resource_type=r.resource_type, resource_name=r.resource_name, configs=tuple(rows)))
            except Exception as exc:
                self._log("describe_configs", r.resource_name, exc)
                out.append(build(result_cls, error_code=code_for(exc), error_message=str(exc),
                                 resource_type=r.resource_type, resource_name=r.resource_name, configs=()))
        return build(resp_cls, throttle_time=ZERO_MS, results=tuple(out))

    # ------------------------------------------------------------ AlterConfigs / IncrementalAlterConfigs
    async def _alter_topic(self, name: str, edit: Callable[[dict[str, str]], dict[str, str]],
                           validate_only: bool) -> None:
        old: dict[str, str] = {}
        defaults = await self.topic_configs_in_force({})

        def change(t: TopicMeta) -> TopicMeta:
            old.clear()
            old.update(t.configs)
            configs = check_topic_configs(edit(dict(t.configs)))
            check_tier_configs({**defaults, **configs}, {**defaults, **t.configs})
            return TopicMeta(t.name, t.partitions, t.topic_id, configs)

        preview = change(await self._topic_record(name))  # the partition streams' tier first: nothing written yet
        await self.check_tier(dict(preview.configs), old, preview)
        new = await self._update_topic(name, change, validate_only)
        if not validate_only:
            self.broker.topic_configs_changed(name)
            await self.apply_retention(name, range(new.partitions), await self.topic_configs_in_force(new.configs),
                                       caps=caps_changed(old, dict(new.configs)))

    async def _alter(self, req, resp_cls, edit_for):
        result_cls = nested(resp_cls, "AlterConfigsResourceResponse")
        out = []
        for r in req.resources:
            try:
                if r.resource_type == RESOURCE_BROKER:
                    await self._alter_broker(r.resource_name, edit_for(r, BROKER_DYNAMIC_TYPES, {}),
                                             req.validate_only)
                elif r.resource_type == RESOURCE_TOPIC:
                    await self._alter_topic(r.resource_name, edit_for(r, TOPIC_CONFIG_TYPES, self._topic_defaults()),
                                            req.validate_only)
                else:
                    raise InvalidRequest(f"resource type {r.resource_type} is not served (2: topic, 4: broker)")
                out.append(build(result_cls, error_code=ErrorCode.none, error_message=None,
                                 resource_type=r.resource_type, resource_name=r.resource_name))
            except Exception as exc:
                self._log("alter_configs", r.resource_name, exc)
                out.append(build(result_cls, error_code=code_for(exc), error_message=str(exc),
                                 resource_type=r.resource_type, resource_name=r.resource_name))
        return build(resp_cls, throttle_time=ZERO_MS, responses=tuple(out))

    async def alter_configs(self, req, resp_cls):
        """AlterConfigs replaces a topic's whole config set."""
        return await self._alter(req, resp_cls, lambda r, _types, _defaults: lambda _old: {c.name: c.value
                                                                                         for c in r.configs})

    async def incremental_alter_configs(self, req, resp_cls):
        def edit_for(r, types: dict[str, int], defaults: dict[str, tuple[str, int]]):
            def edit(cfg: dict[str, str]) -> dict[str, str]:
                for c in r.configs:
                    op = c.config_operation
                    if op == OP_SET:
                        cfg[c.name] = c.value
                    elif op == OP_DELETE:
                        cfg.pop(c.name, None)
                    elif op in (OP_APPEND, OP_SUBTRACT):
                        if types.get(c.name) != T_LIST:
                            raise InvalidConfig(f"{c.name} is not a list config: cannot append/subtract")
                        default = defaults.get(c.name, ("", T_LIST))[0]
                        cur = [v for v in cfg.get(c.name, default).split(",") if v]
                        vals = [v for v in (c.value or "").split(",") if v]
                        cur = cur + [v for v in vals if v not in cur] if op == OP_APPEND else \
                            [v for v in cur if v not in vals]
                        cfg[c.name] = ",".join(cur)
                    else:
                        raise InvalidRequest(f"config operation {op} unknown (0 set, 1 delete, 2 append, 3 subtract)")
                return cfg

            return edit

        return await self._alter(req, resp_cls, edit_for)

    # ------------------------------------------------------------ CreatePartitions
    async def grow_topic(self, name: str, count: int, assignments, validate_only: bool) -> None:
        rec = await self._topic_record(name)
        current = rec.partitions
        limit = self.broker.config.max_partitions
        if count < current:
            raise InvalidPartitions(f"The topic {name} currently has {current} partition(s); {count} would not "
                                    "be an increase.")  # Kafka's messages (ReplicationControlManager)
        if count == current:
            raise InvalidPartitions(f"Topic already has {current} partition(s).")
        if count > limit:
            raise InvalidPartitions(f"at most {limit} partitions per topic, not {count}")
        if assignments is not None:
            brokers = {n for n, _h, _p in await self.live_brokers()}
            check_new_partition_assignments(count - current, [list(a.broker_ids) for a in assignments], brokers)
        if validate_only:
            return
        # streams first (leftovers reused), then the record's count: never a partition without a stream
        grown = await self.client.add_partitions(name, count)
        await self.apply_retention(name, range(current, grown.partitions),
                                   await self.topic_configs_in_force(dict(grown.configs)), caps=any(k in grown.configs for k in SEGMENT_KEYS))
        log.info("topic=%s grown from %d to %d partitions", name, current, grown.partitions)

    async def create_partitions(self, req, resp_cls):
        result_cls = nested(resp_cls, "CreatePartitionsTopicResult")
        names = [t.name for t in req.topics]
        out = []
        for t in req.topics:
            try:
                if names.count(t.name) > 1:
                    raise InvalidRequest(f"topic {t.name!r} appears more than once")
                await self.grow_topic(t.name, t.count, t.assignments, req.validate_only)
                out.append(build(result_cls, name=t.name, error_code=ErrorCode.none, error_message=None))
            except Exception as exc:
                self._log("create_partitions", t.name, exc)
                out.append(build(result_cls, name=t.name, error_code=code_for(exc), error_message=str(exc)))
        return build(resp_cls, throttle_time=ZERO_MS, results=tuple(out))

    # ------------------------------------------------------------ DescribeCluster
    def _node_id(self) -> int:
        return getattr(self.broker, "node_id", self.broker.config.node_id)

    async def live_brokers(self) -> list[tuple[int, str, int]]:
        """(node id, host, port) of every live shim, by node id (just this one when running alone)."""
        own = getattr(self.broker, "ownership", None)
        if own is None:
            c = self.broker.config
            return [(c.node_id, c.host, c.port)]
        live = await own.brokers(max_age_s=0.5) or [own.me]
        listener = codec.current_listener()
        return [(b.node_id, *b.at(listener)) for b in live]

    async def describe_cluster(self, req, resp_cls):
        broker_cls = nested(resp_cls, "DescribeClusterBroker")
        live = await self.live_brokers()
        brokers = tuple(build(broker_cls, broker_id=n, host=h, port=p, rack=None, is_fenced=False) for n, h, p in live)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, error_message=None,
                     endpoint_type=1, cluster_id=self.broker.config.cluster_id, controller_id=live[0][0],
                     brokers=brokers, cluster_authorized_operations=-2147483648)

    @staticmethod
    def _log(what: str, name: str, exc: BaseException) -> None:
        if isinstance(exc, KafkaError):
            log.info("%s %s: %s", what, name, exc)
        else:
            log.warning("%s %s: %r", what, name, exc)


def _log_retention_run(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("retention run after DeleteRecords failed (the scheduled job retries): %r", task.exception())
