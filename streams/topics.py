"""Topics: named sets of partition streams, the same for the streams API and the Kafka listener.

A topic record lives in the metadata store at ``/scroll/topics/<name>`` (JSON: partitions, topic
id, configs). Partition ``p`` of topic ``t`` is the stream ``partition_stream(t, p)``: ``t`` itself
for partition 0 and ``t:p`` after it. Kafka topic names cannot hold ``:`` and stream names created
alone may not either, so the mapping reads back one way only: ``orders-2023`` is the topic
``orders-2023`` (partition 0), never partition 2023 of ``orders``. A stream created alone is a
one-partition topic of its own name, so ``kcat -L`` lists it and Kafka clients read it.

Writing by key uses Kafka's default partitioner (murmur2 of the key, positive, modulo the partition
count; a sticky partition for records without a key, changed when a batch fills), so a key lands on
the same partition whichever client wrote it.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import uuid
from dataclasses import dataclass, field

from aiokafka.partitioner import murmur2

from fragments.compaction import DEFAULT_DELETE_RETENTION_MS, DEFAULT_DIRTY_RATIO, KAFKA_LONG_MAX, CompactionPolicy
from fragments.compaction import POLICY_KEYS as COMPACTION_KEYS
from fragments.model import LedgerConfig
from fragments.tier import USE_TOTAL, TierPolicy

TOPICS = "/scroll/topics/"
MAX_PARTITIONS = 10_000
_TOPIC_NAME = re.compile(r"^[a-zA-Z0-9._-]{1,200}$")


class InvalidTopicName(ValueError):
    pass


# ------------------------------------------------------------ what a topic's Kafka configs mean for its streams
# (the Kafka listener checks the configs first, compat_kafka/admin.py; the streams API takes them as is
# and lets CompactionPolicy / LedgerConfig refuse what is out of range)
DEFAULT_SEGMENT_BYTES = LedgerConfig().fragment_bytes_max
SEGMENT_KEYS = ("segment.bytes", "segment.ms", "max.compaction.lag.ms", "cleanup.policy")  # what the caps follow
# the tier keys topic configs own (KIP-405's three; ``offload_lag_ms`` is native only and kept as set)
TIER_KEYS = ("remote_storage_enable", "local_retention_ms", "local_retention_bytes")
RETENTION_KEYS = ("max_age_s", "max_bytes", *COMPACTION_KEYS, *TIER_KEYS)  # the retention keys topic configs own


def compaction_policy(configs: dict[str, str]) -> CompactionPolicy:
    """The compaction policy the (checked) topic configs ask for."""
    max_lag = int(configs.get("max.compaction.lag.ms", KAFKA_LONG_MAX))
    return CompactionPolicy(
        cleanup_policy=configs.get("cleanup.policy", "delete"),
        min_compaction_lag_ms=int(configs.get("min.compaction.lag.ms", 0)),
        max_compaction_lag_ms=None if max_lag >= KAFKA_LONG_MAX else max_lag,
        min_cleanable_dirty_ratio=float(configs.get("min.cleanable.dirty.ratio", DEFAULT_DIRTY_RATIO)),
        delete_retention_ms=int(configs.get("delete.retention.ms", DEFAULT_DELETE_RETENTION_MS)),
    )


def tier_policy(configs: dict[str, str]) -> TierPolicy:
    """The tier policy the topic configs ask for: remote.storage.enable, local.retention.ms/.bytes
    (KIP-405; offload_lag_ms at its default, topic configs do not set it)."""
    enable = str(configs.get("remote.storage.enable", "false")).strip().lower()
    if enable not in ("true", "false"):
        raise ValueError(f"remote.storage.enable must be true or false, not {enable!r}")
    return TierPolicy(remote_storage_enable=enable == "true",
                      local_retention_ms=int(configs.get("local.retention.ms", USE_TOTAL)),
                      local_retention_bytes=int(configs.get("local.retention.bytes", USE_TOTAL)))


def retention_policy(configs: dict[str, str]) -> dict:
    """The stream retention keys the topic configs ask for ({} for no limit, no compaction and no
    tier): ``max_age_s`` / ``max_bytes`` (fragments/retention.py), and the compaction policy's
    (fragments/compaction.py) and tier policy's (``TIER_KEYS``, fragments/tier.py) keys other than
    their defaults."""
    out: dict = {}
    ms = int(configs.get("retention.ms", "-1"))
    nbytes = int(configs.get("retention.bytes", "-1"))
    if ms >= 0:
        out["max_age_s"] = ms / 1000
    if nbytes >= 0:
        out["max_bytes"] = nbytes
    out.update(compaction_policy(configs).to_dict())
    tier, default = tier_policy(configs).to_dict(), TierPolicy().to_dict()
    out.update({k: tier[k] for k in TIER_KEYS if tier[k] != default[k]})
    return out


def rollover_caps(configs: dict[str, str]) -> tuple[int, int | None]:
    """(fragment_bytes_max, fragment_age_max_ms) the topic configs ask for: segment.bytes (default
    the stream default, 64 MiB) and segment.ms, lowered to max.compaction.lag.ms on a compact topic
    (None: no age cap)."""
    nbytes = int(configs.get("segment.bytes", DEFAULT_SEGMENT_BYTES))
    ages = [int(configs["segment.ms"])] if "segment.ms" in configs else []
    policy = compaction_policy(configs)
    if policy.compact and policy.max_compaction_lag_ms is not None:
        ages.append(policy.max_compaction_lag_ms)
    age = min(ages) if ages else None
    return nbytes, (age if age is None or age < KAFKA_LONG_MAX else None)


def topic_key(name: str) -> str:
    return TOPICS + name


def partition_stream(topic: str, partition: int) -> str:
    """The stream holding partition ``partition`` of ``topic``."""
    return topic if partition == 0 else f"{topic}:{partition}"


def stream_partition(stream: str) -> tuple[str, int]:
    """(topic, partition) of a stream name: the inverse of ``partition_stream``."""
    topic, sep, p = stream.rpartition(":")
    if sep and p.isdigit() and topic:
        return topic, int(p)
    return stream, 0


def check_topic_name(name: str) -> None:
    if not _TOPIC_NAME.match(name) or name in (".", ".."):
        raise InvalidTopicName(f"invalid topic name {name!r} (1-200 of [a-zA-Z0-9._-])")


def partition_for(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for a keyed record."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass(frozen=True)
class TopicMeta:
    name: str
    partitions: int
    topic_id: uuid.UUID = field(default_factory=uuid.uuid4)
    configs: dict[str, str] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"partitions": self.partitions, "topic_id": str(self.topic_id),
                           "configs": self.configs}, sort_keys=True).encode()

    @classmethod
    def decode(cls, name: str, raw: bytes) -> TopicMeta:
        d = json.loads(raw)
        return cls(name, int(d["partitions"]), uuid.UUID(d["topic_id"]), dict(d.get("configs", {})))

    def streams(self) -> list[str]:
        return [partition_stream(self.name, p) for p in range(self.partitions)]


class TopicProducer:
    """Writes a topic's partitions: keyed records by murmur2, keyless ones to a sticky partition
    that moves on when the open batch there is sealed. ``append`` returns (partition, offset)."""

    def __init__(self, topic: TopicMeta, producers: list):
        self.topic = topic
        self.producers = producers
        self._sticky = random.randrange(len(producers))
        self._sticky_next = producers[self._sticky].next_offset

    def partition_of(self, key: bytes | None) -> int:
        if key is not None:
            return partition_for(key, len(self.producers))
        p = self.producers[self._sticky]
        if p.next_offset != self._sticky_next and len(self.producers) > 1:  # its batch was sealed
            self._sticky = random.choice([i for i in range(len(self.producers)) if i != self._sticky])
            self._sticky_next = self.producers[self._sticky].next_offset
        return self._sticky

    async def append(self, value: bytes, key: bytes | None = None, headers=None,
                     timestamp_ms: int | None = None) -> tuple[int, int]:
        p = self.partition_of(key)
        return p, await self.producers[p].append(value, key, headers, timestamp_ms)

    async def append_many(self, records) -> list[tuple[int, int]]:
        """As ``Producer.append_many``; returns (partition, offset) per record, in order."""
        per: dict[int, list[tuple[int, object]]] = {}
        for i, r in enumerate(records):
            key = None
            if isinstance(r, dict):
                key = r.get("key")
            elif isinstance(r, tuple) and len(r) > 1:
                key = r[1]
            per.setdefault(self.partition_of(key), []).append((i, r))
        out: list[tuple[int, int]] = [(-1, -1)] * sum(len(v) for v in per.values())
        parts = list(per.items())
        results = await asyncio.gather(*(self.producers[p].append_many([r for _, r in items]) for p, items in parts))
        for (p, items), offsets in zip(parts, results):
            for (i, _), off in zip(items, offsets):
                out[i] = (p, off)
        return out

    async def flush(self) -> None:
        for p in self.producers:
            await p.flush()

    async def close(self, seal: bool = False) -> None:
        for p in self.producers:
            await p.close(seal)

    async def __aenter__(self) -> TopicProducer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
