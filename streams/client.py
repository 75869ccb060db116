"""The client API: streams, producers and consumers.

    client = await streams.connect("etcd://127.0.0.1:2379")
    await client.create_stream("orders", ensemble=3, write_quorum=3, ack_quorum=2)
    async with await client.producer("orders") as p:
        offset = await p.append(b"hello", key=b"k1", headers={"source": b"web"})
    c = await client.consumer("orders", start="earliest")
    async for record in c: ...

A stream is one unbounded ledger whose entries are record batches with dense record offsets (see
``streams.batches``). Opening a producer takes the stream over (a new term): from then on it is the
only writer and assigns the offsets, and a producer that was taken over fails its next append with
``StaleTermError``. See ``streams.sync`` for the blocking form.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from dataclasses import dataclass

from bookie.runtime import tune_malloc
from fragments.compaction import DATA_LEDGER_PREFIX, CompactionPolicy, InvalidCompactionPolicy, normalise_cleanup_policy
from fragments.compaction import POLICY_KEYS as COMPACTION_KEYS
from fragments.ledgers import LedgerExists, NoSuchLedger, fragment_zero
from fragments.model import Fragment, InvalidConfig, LedgerConfig, LedgerMeta
from fragments.placement import BookieInfo, NotEnoughBookies, Placement
from fragments.retention import POLICY_KEYS as RETENTION_POLICY_KEYS
from fragments.security import ClientSecurity
from fragments.stores import open_store
from fragments.tier import POLICY_KEYS as TIER_POLICY_KEYS
from fragments.tier import InvalidTierPolicy, TierPolicy, validate_change

from .cluster import Cluster
from .consumer import EARLIEST, Consumer
from .driver import ProducerOptions, WriterDriver
from .errors import (
    InvalidArgument,
    NoBookiesAvailable,
    NoSuchStream,
    NoSuchTopic,
    ScrollError,
    StreamExists,
    TopicExists,
)
from .producer import Producer
from .topics import (
    MAX_PARTITIONS,
    RETENTION_KEYS,
    SEGMENT_KEYS,
    TOPICS,
    InvalidTopicName,
    TopicMeta,
    TopicProducer,
    check_topic_name,
    partition_stream,
    retention_policy,
    rollover_caps,
    topic_key,
)

CREATE_CONCURRENCY = 64  # partitions of a new topic created at once

# what a new partition takes over from partition 0's retention: the policies, not the jobs' state
# nor keep_from (a record offset of partition 0's)
_COPIED_POLICY_KEYS = tuple(k for k in (*RETENTION_POLICY_KEYS, *COMPACTION_KEYS, *TIER_POLICY_KEYS)
                            if k != "keep_from")


def check_tier(old: dict | None, new: dict) -> None:
    """``fragments.tier.validate_change`` of a stream's retention dict, as InvalidArgument."""
    try:
        validate_change(old, new)
    except InvalidTierPolicy as exc:
        raise InvalidArgument(str(exc)) from exc

MAX_ENTRY_BYTES = 1 << 20


@dataclass(frozen=True)
class StreamInfo:
    meta: LedgerMeta
    fragments: list[Fragment]

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def bytes(self) -> int:
        return sum(f.size_bytes or 0 for f in self.fragments)


class ScrollClient:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    # ---------------------------------------------------------------- streams and topics
    async def create_stream(
        self,
        name: str,
        ensemble: int = 3,
        write_quorum: int = 3,
        ack_quorum: int = 2,
        fragment_bytes_max: int = 64 << 20,
        fragment_entries_max: int = 1_000_000,
        retention: dict | None = None,
        *,
        fragment_age_max_ms: int | None = None,
        cleanup_policy: str | None = None,
        min_compaction_lag_ms: int | None = None,
        max_compaction_lag_ms: int | None = None,
        min_cleanable_dirty_ratio: float | None = None,
        delete_retention_ms: int | None = None,
    ) -> StreamInfo:
        """A stream of its own: a one-partition topic of the same name (readable by Kafka clients).

        ``cleanup_policy`` ("delete", "compact" or "compact,delete") and the other compaction
        settings (Kafka's, in its units; ``fragments.compaction.CompactionPolicy``) are stored in the
        stream's retention policy; a ``compact`` stream refuses records without a key. A compact
        stream's ``max_compaction_lag_ms`` also caps its fragments' age (with ``fragment_age_max_ms``,
        Kafka's segment.ms: the open fragment rolls over once its first entry is that old).

        The tier policy (``fragments.tier.TierPolicy``: ``remote_storage_enable``,
        ``local_retention_ms``, ``local_retention_bytes``, ``offload_lag_ms``) is given in
        ``retention`` too, and checked as Kafka checks remote.storage.enable / local.retention.*."""
        given = dict(cleanup_policy=cleanup_policy, min_compaction_lag_ms=min_compaction_lag_ms,
                     max_compaction_lag_ms=max_compaction_lag_ms, min_cleanable_dirty_ratio=min_cleanable_dirty_ratio,
                     delete_retention_ms=delete_retention_ms)
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            try:
                policy = CompactionPolicy.from_dict({**(retention or {}), **given})
            except InvalidCompactionPolicy as exc:
                raise InvalidArgument(str(exc)) from exc
            retention = {k: v for k, v in (retention or {}).items() if k not in COMPACTION_KEYS}
            retention.update(policy.to_dict())
            if policy.compact and policy.max_compaction_lag_ms is not None:
                fragment_age_max_ms = min(fragment_age_max_ms or policy.max_compaction_lag_ms,
                                          policy.max_compaction_lag_ms)
        _, made = await self._create_topic(name, 1, None, ensemble=ensemble, write_quorum=write_quorum,
                                           ack_quorum=ack_quorum, fragment_bytes_max=fragment_bytes_max,
                                           fragment_entries_max=fragment_entries_max,
                                           fragment_age_max_ms=fragment_age_max_ms, retention=retention or None,
                                           reuse_streams=False)
        return made[0]  # what the one transaction wrote: no read-back

    async def create_topic(self, name: str, partitions: int = 1, configs: dict[str, str] | None = None, *,
                           ensemble: int = 3, write_quorum: int = 3, ack_quorum: int = 2,
                           fragment_bytes_max: int = 64 << 20, fragment_entries_max: int = 1_000_000,
                           fragment_age_max_ms: int | None = None,
                           retention: dict | None = None, reuse_streams: bool = False) -> TopicMeta:
        """A topic of ``partitions`` streams (partition p is ``topics.partition_stream(name, p)``).
        ``reuse_streams``: a partition stream left by an interrupted create is taken as is.

        ``configs``: Kafka topic configs, stored in the topic record; the ones that act
        (``retention.ms``/``.bytes``, ``cleanup.policy`` and the compaction settings, ``segment.bytes``
        / ``segment.ms``: ``topics.retention_policy`` / ``rollover_caps``) become each stream's
        retention policy and rollover caps, over ``retention`` and the ``fragment_*`` arguments."""
        meta, _ = await self._create_topic(name, partitions, configs, ensemble=ensemble, write_quorum=write_quorum,
                                           ack_quorum=ack_quorum, fragment_bytes_max=fragment_bytes_max,
                                           fragment_entries_max=fragment_entries_max,
                                           fragment_age_max_ms=fragment_age_max_ms, retention=retention,
                                           reuse_streams=reuse_streams)
        return meta

    async def _create_topic(self, name: str, partitions: int, configs: dict[str, str] | None, *, ensemble: int,
                            write_quorum: int, ack_quorum: int, fragment_bytes_max: int, fragment_entries_max: int,
                            fragment_age_max_ms: int | None, retention: dict | None,
                            reuse_streams: bool) -> tuple[TopicMeta, list[StreamInfo]]:
        """``create_topic``, also returning the streams it made (as written, for ``create_stream``)."""
        try:
            check_topic_name(name)
        except InvalidTopicName as exc:
            raise InvalidArgument(str(exc)) from exc
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise InvalidArgument(f"partitions must be 1..{MAX_PARTITIONS}, not {partitions}")
        configs = {str(k): str(v) for k, v in (configs or {}).items()}
        if configs:
            try:
                if "cleanup.policy" in configs:
                    configs["cleanup.policy"] = normalise_cleanup_policy(configs["cleanup.policy"])
                acting = retention_policy(configs)
                if any(k in configs for k in SEGMENT_KEYS):
                    seg_bytes, seg_age = rollover_caps(configs)
                    if "segment.bytes" in configs:
                        fragment_bytes_max = seg_bytes
                    if seg_age is not None:
                        fragment_age_max_ms = seg_age
            except ValueError as exc:  # not a number, or out of range (InvalidCompactionPolicy)
                raise InvalidArgument(f"topic configs {configs}: {exc}") from exc
            retention = {**{k: v for k, v in (retention or {}).items() if k not in RETENTION_KEYS}, **acting} or None
        check_tier(None, retention or {})
        try:
            config = LedgerConfig(ensemble, write_quorum, ack_quorum, fragment_bytes_max, fragment_entries_max,
                                  fragment_age_max_ms)
        except InvalidConfig as exc:
            raise InvalidArgument(str(exc)) from exc
        meta = TopicMeta(name, partitions, configs=configs)
        if partitions == 1:
            # One transaction writes the stream and the topic record (a stream of its own, or a
            # one-partition topic): both or neither exist, and a create costs one etcd write.
            made = await self._create_partition_streams(name, range(1), config, retention, reuse_streams,
                                                        topic_record=meta.encode())
            return meta, made
        if await self.cluster.store.get(topic_key(name)) is not None:
            raise TopicExists(f"topic {name!r} already exists")
        made = await self._create_partition_streams(name, range(partitions), config, retention, reuse_streams)
        if await self.cluster.store.create(topic_key(name), meta.encode()) is None:
            raise TopicExists(f"topic {name!r} already exists")
        return meta, made

    async def _create_partition_streams(self, topic: str, partitions: range, config: LedgerConfig, retention,
                                        reuse: bool, topic_record: bytes | None = None) -> list[StreamInfo]:
        """The streams of ``partitions``: one look at the bookies (a listing up to a second old is
        good enough: a writer replaces a bookie that turns out dead), one placer (the partitions
        spread evenly), one block of ledger ids, and CREATE_CONCURRENCY streams created at once (a
        batching store sends each wave's reads and transactions as one request). ``topic_record``
        (one partition only): the topic's record, written in the stream's own transaction."""
        await self.cluster.refresh_bookies(max_age_s=1.0)
        placement = Placement(random.Random(), [BookieInfo(b.bookie_id, b.rack) for b in self.cluster.live()])
        ids = await self.cluster.ledgers.allocate_ids(len(partitions))
        todo = list(zip(partitions, ids, strict=True))
        made: list[StreamInfo] = []
        for lo in range(0, len(todo), CREATE_CONCURRENCY):
            done = await asyncio.gather(*(
                self._create_partition_stream(partition_stream(topic, p), config, retention, reuse,
                                              placement=placement, ledger_id=i, topic_record=topic_record)
                for p, i in todo[lo:lo + CREATE_CONCURRENCY]), return_exceptions=True)
            failed = next((x for x in done if isinstance(x, BaseException)), None)
            if failed is not None:  # (after the whole wave: no creation is left running)
                raise failed
            made += [x for x in done if x is not None]
        return made

    async def _create_partition_stream(self, name: str, config: LedgerConfig, retention, reuse: bool, *,
                                       placement: Placement, ledger_id: int,
                                       topic_record: bytes | None = None) -> StreamInfo | None:
        try:
            ens = placement.choose(config.ensemble_size)
        except NotEnoughBookies as exc:
            raise NoBookiesAvailable(f"cannot create {name!r}: {exc}") from exc
        also = {topic_key(name): topic_record} if topic_record is not None else None
        try:
            meta, _ = await self.cluster.ledgers.create_ledger(name, config, ens, retention, ledger_id=ledger_id,
                                                               also_create=also)
        except LedgerExists as exc:
            if also and await self.cluster.store.get(topic_key(name)) is not None:
                raise TopicExists(f"topic {name!r} already exists") from exc
            if not reuse:
                raise StreamExists(f"stream {name!r} already exists") from exc
            if also and await self.cluster.store.create(topic_key(name), topic_record) is None:
                raise TopicExists(f"topic {name!r} already exists") from exc  # (raced)
            return None
        return StreamInfo(meta, [fragment_zero(ens)])

    async def describe_topic(self, name: str) -> TopicMeta:
        """The topic record; a stream without one (none is left by ``create_stream``, but one may
        be made by tools) is a one-partition topic of its own name."""
        v = await self.cluster.store.get(topic_key(name))
        if v is not None:
            return TopicMeta.decode(name, v.value)
        if ":" not in name:
            try:
                await self._meta(name)
                return TopicMeta(name, 1, uuid.uuid5(uuid.NAMESPACE_URL, "scroll:" + name))
            except NoSuchStream:
                pass
        raise NoSuchTopic(f"no topic named {name!r}")

    async def list_topics(self) -> list[TopicMeta]:
        rows = await self.cluster.store.list_prefix(TOPICS)
        out = {k[len(TOPICS):]: TopicMeta.decode(k[len(TOPICS):], v.value) for k, v in rows}
        for m in await self.list_streams():
            if ":" not in m.name and m.name not in out:
                out[m.name] = TopicMeta(m.name, 1, uuid.uuid5(uuid.NAMESPACE_URL, "scroll:" + m.name))
        return sorted(out.values(), key=lambda t: t.name)

    async def update_topic(self, name: str, change) -> TopicMeta:
        """Compare-and-set the topic record: ``change(TopicMeta) -> TopicMeta`` (retried on conflict)."""
        for _ in range(20):
            v = await self.cluster.store.get(topic_key(name))
            if v is None:
                raise NoSuchTopic(f"no topic named {name!r}")
            new = change(TopicMeta.decode(name, v.value))
            if await self.cluster.store.cas(topic_key(name), new.encode(), v.version) is not None:
                return new
        raise ScrollError(f"topic {name!r}: the record kept changing; try again")

    async def alter_topic_configs(self, name: str, set_configs: dict[str, str] | None = None,
                                  delete: list[str] | tuple[str, ...] = ()) -> TopicMeta:
        """Change a topic's configs (``set_configs`` set, ``delete`` removed) and apply the ones that
        act to every partition stream: retention and compaction policy (``LedgerMeta.retention``)
        and, when segment.* / max.compaction.lag.ms / cleanup.policy changed, the rollover caps
        (``LedgerConfig``; a live writer takes them within ``driver.CAPS_REFRESH_S`` while active).
        The Kafka listener's AlterConfigs does the same with Kafka's own checks. Remote storage, once
        on (in the configs or on any partition stream), stays on (``fragments.tier.validate_change``)."""
        set_configs = {str(k): str(v) for k, v in (set_configs or {}).items()}
        if "cleanup.policy" in set_configs:
            try:
                set_configs["cleanup.policy"] = normalise_cleanup_policy(set_configs["cleanup.policy"])
            except InvalidCompactionPolicy as exc:
                raise InvalidArgument(str(exc)) from exc
        cur = await self.describe_topic(name)
        if await self.cluster.store.get(topic_key(name)) is None:  # a stream created alone: give it a record
            await self.cluster.store.create(topic_key(name), cur.encode())
        old: dict[str, str] = {}

        def change(t: TopicMeta) -> TopicMeta:
            old.clear()
            old.update(t.configs)
            new = {k: v for k, v in {**t.configs, **set_configs}.items() if k not in delete}
            try:
                policy = retention_policy(new)
                rollover_caps(new)
            except ValueError as exc:
                raise InvalidArgument(f"topic configs {new}: {exc}") from exc
            check_tier(retention_policy(t.configs), policy)
            return TopicMeta(t.name, t.partitions, t.topic_id, new)

        await self.check_tier_streams(change(cur))

        meta = await self.update_topic(name, change)
        caps = any(old.get(k) != meta.configs.get(k) for k in SEGMENT_KEYS)
        for s in meta.streams():
            await self._apply_configs(s, meta.configs, caps)
        return meta

    async def check_tier_streams(self, topic: TopicMeta, policy: dict | None = None) -> None:
        """Refuse configs that would turn remote storage off on a partition stream that has it on
        (set natively, or by earlier configs). ``policy``: the retention keys the configs ask for."""
        policy = retention_policy(topic.configs) if policy is None else policy
        for s in topic.streams():
            try:
                meta, _ = await self.cluster.ledgers.get_ledger(s)
            except NoSuchLedger:
                continue
            check_tier(meta.retention, {**{k: v for k, v in meta.retention.items() if k not in RETENTION_KEYS},
                                        **policy})

    async def set_tier_policy(self, stream: str, *, remote_storage_enable: bool | None = None,
                              local_retention_ms: int | None = None, local_retention_bytes: int | None = None,
                              offload_lag_ms: int | None = None) -> LedgerMeta:
        """Change one stream's tier policy (settings not given are kept; Kafka's units and ranges:
        ``fragments.tier.TierPolicy``), by CAS of its record's ``retention``. Checked as Kafka
        checks a topic's: not with compaction, local limits not above retention's, and remote storage
        once on stays on (InvalidArgument). Returns the stream's new record."""
        given = dict(remote_storage_enable=remote_storage_enable, local_retention_ms=local_retention_ms,
                     local_retention_bytes=local_retention_bytes, offload_lag_ms=offload_lag_ms)
        given = {k: v for k, v in given.items() if v is not None}
        default = TierPolicy().to_dict()
        ledgers = self.cluster.ledgers
        for _ in range(50):
            try:
                meta, version = await ledgers.get_ledger(stream)
            except NoSuchLedger:
                raise NoSuchStream(f"no stream named {stream!r}") from None
            retention = dict(meta.retention)
            for k, v in given.items():
                if v == default[k] and type(v) is type(default[k]):
                    retention.pop(k, None)  # a stream stores only what differs from the defaults
                else:
                    retention[k] = v
            check_tier(meta.retention, retention)
            if retention == meta.retention:
                return meta
            new = meta.with_(retention=retention)
            if await ledgers.cas_ledger(new, (), version) is not None:
                return new
        raise ScrollError(f"stream {stream!r}: its record kept changing; try again")

    async def _apply_configs(self, stream: str, configs: dict[str, str], caps: bool) -> None:
        policy = retention_policy(configs)
        seg_bytes, seg_age = rollover_caps(configs)
        ledgers = self.cluster.ledgers
        for _ in range(50):
            try:
                meta, version = await ledgers.get_ledger(stream)
            except NoSuchLedger:
                raise NoSuchStream(f"no stream named {stream!r}") from None
            retention = {k: v for k, v in meta.retention.items() if k not in RETENTION_KEYS}
            retention.update(policy)
            config = meta.config
            if caps:
                try:
                    config = config.with_caps(LedgerConfig(fragment_bytes_max=seg_bytes,
                                                           fragment_entries_max=config.fragment_entries_max,
                                                           fragment_age_max_ms=seg_age))
                except InvalidConfig as exc:
                    raise InvalidArgument(str(exc)) from exc
            if retention == meta.retention and config == meta.config:
                return
            if await ledgers.cas_ledger(meta.with_(retention=retention, config=config), (), version) is not None:
                return
        raise ScrollError(f"stream {stream!r}: its record kept changing; try again")

    async def add_partitions(self, name: str, total: int) -> TopicMeta:
        """Grow a topic to ``total`` partitions (partitions never shrink)."""
        cur = await self.describe_topic(name)
        if total <= cur.partitions or total > MAX_PARTITIONS:
            raise InvalidArgument(f"topic {name!r} has {cur.partitions} partitions; cannot grow it to {total}")
        first, _ = await self.cluster.ledgers.get_ledger(partition_stream(name, 0))
        retention = {k: v for k, v in first.retention.items() if k in _COPIED_POLICY_KEYS}
        await self._create_partition_streams(name, range(cur.partitions, total), first.config, retention or None,
                                             reuse=True)
        if await self.cluster.store.get(topic_key(name)) is None:
            await self.cluster.store.create(topic_key(name), cur.encode())
        return await self.update_topic(name, lambda t: TopicMeta(t.name, max(t.partitions, total), t.topic_id,
                                                                 t.configs))

    async def delete_topic(self, name: str) -> None:
        meta = await self.describe_topic(name)
        await self.cluster.store.delete(topic_key(name))
        for s in meta.streams():
            try:
                await self.cluster.ledgers.delete_ledger(s)
            except NoSuchLedger:
                pass

    async def describe_stream(self, name: str) -> StreamInfo:
        meta = await self._meta(name)
        frags = await self.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        return StreamInfo(meta, frags)

    async def list_streams(self) -> list[LedgerMeta]:
        """Every stream (the data ledgers compaction writes are not streams: see
        ``streams/tools/compaction.py``)."""
        return [m for m in await self.cluster.ledgers.list_ledgers() if not m.name.startswith(DATA_LEDGER_PREFIX)]

    async def delete_stream(self, name: str) -> None:
        """Delete one stream; a stream that is a whole one-partition topic takes its topic record along."""
        await self._meta(name)
        v = await self.cluster.store.get(topic_key(name))
        if v is not None and TopicMeta.decode(name, v.value).partitions == 1:
            await self.cluster.store.delete(topic_key(name))
        await self.cluster.ledgers.delete_ledger(name)

    async def _meta(self, name: str) -> LedgerMeta:
        try:
            meta, _ = await self.cluster.ledgers.get_ledger(name)
        except NoSuchLedger as exc:
            raise NoSuchStream(f"no stream named {name!r}") from exc
        return meta

    # ---------------------------------------------------------------- producers and consumers
    async def producer(self, stream: str, options: ProducerOptions | None = None, *,
                       partition: int | None = None, writer_lease=None) -> Producer | TopicProducer:
        """The stream's one writer (a take-over). For a topic of several partitions, a
        ``TopicProducer`` over all of them, partitioning by key as Kafka's default partitioner;
        ``partition``: the writer of that one partition of the topic ``stream``. While open it
        holds the stream's writer key (``streams.producer``: liveness) under ``writer_lease``, or
        under a lease this client keeps for its producers."""
        if partition is not None:
            stream = partition_stream(stream, partition)
        elif ":" not in stream:
            v = await self.cluster.store.get(topic_key(stream))
            if v is not None and (t := TopicMeta.decode(stream, v.value)).partitions > 1:
                producers = []
                try:
                    for p in range(t.partitions):
                        producers.append(await self.producer(stream, options, partition=p))
                except BaseException:
                    for p in producers:
                        await p.close()
                    raise
                return TopicProducer(t, producers)
        driver = WriterDriver(self.cluster, stream, options)
        try:
            await driver.open()
        except NoSuchLedger as exc:
            raise NoSuchStream(f"no stream named {stream!r}") from exc
        try:
            w = driver.writer
            reader = Consumer(self.cluster, w.ledger)  # the meta as the take-over left it
            if w.ledger.first_fragment_index == w.ledger.last_fragment_index == w.fragment.index \
                    and w.cas_reason is None and not w.dirty:
                reader.seed_fragments([w.fragment])  # its one fragment, as the take-over committed it
            # from the last batch at or below the LAC (the take-over's no-op at the LAC holds none)
            last = w.lac - 1 if w.noop_entry_id is not None and w.noop_entry_id == w.lac else w.lac
            next_offset = await reader.offset_after(last)
        except BaseException:
            await driver.close()
            raise
        p = Producer(driver, self.cluster.max_entry_bytes, next_offset, options, reader=reader)
        try:
            await p.start_liveness(writer_lease)
        except BaseException:
            await p.close()
            raise
        return p

    async def consumer(self, stream: str, start=EARLIEST, *, partition: int | None = None, **options) -> Consumer:
        """A consumer of one stream (``partition``: of that partition of the topic ``stream``),
        starting at ``start``: "earliest", "latest" or a record offset."""
        if partition is not None:
            stream = partition_stream(stream, partition)
        meta = await self._meta(stream)
        c = Consumer(self.cluster, meta, **options)
        await c.start_at(start)
        return c

    async def live_bookies(self):
        return await self.cluster.refresh_bookies()

    async def close(self) -> None:
        await self.cluster.close()

    async def __aenter__(self) -> ScrollClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def connect(metadata_url: str, *, security: ClientSecurity | None = None, add_timeout_s: float = 10.0,
                  call_timeout_s: float = 10.0, max_entry_bytes: int = MAX_ENTRY_BYTES,
                  batch_metadata: bool = False) -> ScrollClient:
    """Connect to a Scroll cluster through its metadata store (``etcd://host:port`` or ``memory://``).

    ``security``: TLS, client certificate and token for the bookies (``fragments.security``). A
    bookie that refuses them makes connect raise ``AuthenticationFailed`` (one Info call checks).

    The first connect in a process keeps buffers up to 64 MiB on malloc's heap (as bookies do,
    ``bookie.runtime.tune_malloc``): batches of ~1 MiB otherwise come from fresh mmaps, and the page
    faults of touching them cost more CPU than building them (measured: 25% of a producer's CPU).
    ``SCROLL_MALLOC_TUNING=0`` leaves malloc alone.

    ``batch_metadata``: the metadata reads and transactions made in one event-loop turn go to the
    store as one request (``fragments.batching.BatchingStore``): for a process that opens many
    streams at once (the Kafka listener)."""
    if os.environ.get("SCROLL_MALLOC_TUNING", "1") != "0":
        tune_malloc()
    store = await open_store(metadata_url, security=security)  # etcd user/password and TLS, if given
    if batch_metadata:
        from fragments.batching import BatchingStore

        store = BatchingStore(store)
    cluster = Cluster(store, add_timeout_s=add_timeout_s, call_timeout_s=call_timeout_s,
                      max_entry_bytes=max_entry_bytes, security=security)
    try:
        await cluster.check_credentials()
    except BaseException:
        await cluster.close()
        raise
    return ScrollClient(cluster)


async def connect_properties(path, **options) -> ScrollClient:
    """``connect`` with the metadata URL and credentials of a client settings file (``metadata=``,
    ``tls.ca=``, ``token=``, ...: ``fragments.security.read_client_properties``), such as the
    ``scroll-client.properties`` that ``scroll standalone --secure`` writes."""
    from fragments.security import ClientSecurity, read_client_properties

    props = read_client_properties(path)
    if not props.get("metadata"):
        raise ValueError(f"{path}: no metadata= line (the metadata store URL)")
    return await connect(props["metadata"], security=ClientSecurity.from_options(props), **options)
