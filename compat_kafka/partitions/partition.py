"""One topic partition served by this listener: the stream ``partition_stream(topic, p)``.

How this works. Every stream holds the one log format (``streams/batches.py``): each data entry is
one Kafka RecordBatch v2 whose baseOffset is the stream's record offset of its first record, and
record offsets are dense from 0. A Kafka offset *is* that record offset, so nothing here keeps
offsets of its own:

- A partition is opened **read-only** for Fetch and ListOffsets: no take-over, so a Python
  producer (or any other writer) keeps the stream while Kafka consumers tail it. The high
  watermark is then the offset after the LAC the bookies report (``Consumer.end_position``),
  learnt again when a fetch reaches it; a caught-up fetch long-polls the LAC on a bookie
  (``Consumer.wait_lac``), so it is woken by the other writer's append.
- The first Produce opens it **writable**: the stream's ``Producer`` (a take-over, a new term) is
  then the one writer and learns the next offset from the last batch at or below the LAC. A
  produce batch (checked by ``compat_kafka.batches.split_batches``) is queued with
  ``Producer.append_batch``, which assigns its base offset and writes it into the batch — except a
  small plain one (no producer id, uncompressed, up to ``PartitionConfig.merge_batch_bytes``): its
  records are decoded (a damaged one refuses the request whole) and queued into the producer's
  open batch (``Producer.append_records``), which goes out as one entry when the loop is idle and
  no entry is in flight, else when one is acknowledged; so under load the small batches of a Kafka
  producer with a short linger share entries instead of paying a bookie entry each. Their records
  keep offsets, keys, values, headers and timestamps; only the batch boundaries differ. The high
  watermark is the end offset of the last acknowledged entry (the producer's futures resolve in
  offset order, so it is exact without asking a bookie). A fetch serves entries whole, so it must
  never lie inside one: when a Kafka batch's records are split over two merged entries, the first
  entry's acknowledgement moves it to that entry's end, not only the batch's last one's (else a
  tailing consumer got records past the high watermark and its next fetch was out of range). When a fetch or ListOffsets finds the
  partition caught up, one LAC read tells whether another writer has taken the stream over since
  (the bookies answer with their term); if so the writer is dropped and the partition is served
  read-only again, so records written elsewhere become visible without a Kafka produce failing
  first.
- The log start is the first record offset retention kept (``Consumer.earliest_offset``: fragment
  metadata).
- A Fetch finds the entry holding its offset with ``Consumer.locate`` (fragment first offsets, then
  a binary search over entries; cached) — or, for a consumer reading on from where its last fetch
  ended, from a small cursor table (end offset -> next entry id) with no search at all — and then
  serves the stored batches byte for byte (the entry minus its envelope byte): no re-encoding,
  no patching. An entry that is not a record batch is refused (``RecordFormatError``, answered as
  CORRUPT_MESSAGE) rather than served.

Transactions (``compat_kafka.transactions``). The partition keeps a transaction index of its
acknowledged batches (``PartitionTxns``): each producer's open transaction (first offset), the
aborted ranges, and the coordinator epoch of each producer's last marker. The last stable offset is
the first offset of the earliest open transaction, else the high watermark; read_committed fetches
stop there. Markers (``append_marker``) are control batches appended like any batch (one offset
each); they raise the producer's epoch here, so an older epoch is fenced. The index is saved in the
producer-state snapshot and rebuilt by the same scan on open; a partition served read-only builds
it on its first read_committed fetch (``ensure_txns``).

Idempotent producers (``compat_kafka.producer_ids``). Batches carrying a producer id are checked
against the partition's producer state before they are queued; a retry of a stored batch is
answered with its original base offset and not stored again. The state must survive a take-over,
so it is rebuilt on open: from a snapshot of the *acknowledged* state, kept in its own metadata key
``kafka/producer-state/<topic>/<partition>`` (JSON: stream id, the record offset it is exact up to,
term of the writer, producers), then by scanning the batches after that offset up to the LAC —
each stored batch still carries producerId/epoch/baseSequence in its header. The owner rewrites the
snapshot (compare-and-set) every ``snapshot_interval_s`` when batches were acknowledged (one task
per listener asks every open partition, ``snapshot_if_due``), so the scan is short; a snapshot from a later term is never overwritten (we were taken over). The scan is
bounded by ``max_state_scan_entries``; beyond that the state is marked incomplete (unknown
producers are then accepted at any sequence, as Kafka does for producers without state). The
snapshot lives outside the stream's meta on purpose: the writer owns meta, and a separate key
cannot disturb it.

Hand-over (rebalancing onto another listener, ``Broker._hand_over``): ``retire`` refuses new appends
and markers (NOT_LEADER_OR_FOLLOWER) and waits for the queued ones to be acknowledged or fail;
``close`` then writes the snapshot, exact up to the high watermark, so the next owner's producer
state answers a retry of any acknowledged batch as a duplicate. A partition with a transaction open
is not handed over (``retire`` answers False and appends resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from streams.batches import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    OFF_ATTRIBUTES,
    OFF_COUNT,
    RecordFormatError,
    StoredBatch,
    records_of,
    stored_batch,
)
from streams.consumer import Consumer
from streams.driver import ProducerOptions
from streams.errors import DataRemovedError, PayloadTooLarge, StaleTermError, WriterWithdrawn
from streams.offsets import next_batch, search_timestamp
from streams.producer import Producer, records_of_batch
from streams.topics import partition_stream

from ..transactions.coordinator import PartitionTxns, TransactionCoordinatorFenced, control_batch, parse_marker
from ..transactions.producer_ids import BatchRecord, ProducerStateTable, StateSnapshot, in_sequence, state_key
from ..wire.batches import Batch, increment_sequence
from ..wire.errors import (
    CorruptMessage,
    InvalidProducerEpoch,
    NotLeaderOrFollower,
    OffsetOutOfRange,
    OutOfOrderSequenceNumber,
)
from .tailcache import TailCache

log = logging.getLogger(__name__)

# The listener appends whole batches (``append_batch``) and the records of small plain ones
# (``append_records``, ``PartitionConfig.merge_batch_bytes``): those accumulate in the producer's open
# batch while an entry is in flight (its Nagle rule), so under load many small Kafka batches share
# one entry. In-flight entries are bounded by the writer's limits rather than a small batch window.
# A merged batch is at most MERGED_BATCH_BYTES: a loaded listener otherwise merged up to 1 MiB into
# one batch, which a consumer then had to take whole (the first batch of a fetch always is) however
# small its max.partition.fetch.bytes, and which a fetch quota's window could not hold.
_I32 = struct.Struct(">i")
MERGED_BATCH_BYTES = 256 << 10
LISTENER_PRODUCER = ProducerOptions(max_inflight_batches=100_000, batch_bytes=MERGED_BATCH_BYTES)
_MAX_CURSORS = 4096


@dataclass(frozen=True)
class PartitionConfig:
    max_read_entries: int = 1000
    max_read_bytes: int = 8 << 20
    snapshot_interval_s: float = 1.0  # producer-state snapshots (when batches were acknowledged since)
    max_state_scan_entries: int = 200_000  # entries scanned on open to rebuild producer state
    max_producers: int = 10_000  # producer ids remembered per partition (least recently written go)
    # plain produce batches (no producer id, uncompressed) up to this size have their records queued
    # into the producer's open batch (``Producer.append_records``): many small batches, one entry.
    # Bigger ones (and every other batch) are stored as they came. 0: always as they came.
    merge_batch_bytes: int = 64 << 10
    # writable: the last entries acknowledged, to answer tailing fetches without a bookie read
    # (``tailcache.py``; besides, all partitions of a process share ``tailcache.PROCESS_BUDGET``). 0: off
    tail_cache_entries: int = 32
    tail_cache_bytes: int = 1 << 20

    def __post_init__(self):
        if self.merge_batch_bytes < 0:
            raise ValueError(f"invalid partition config {self}")
        if self.max_read_entries < 1 or self.max_read_bytes < 1024:
            raise ValueError(f"invalid partition config {self}")
        if self.snapshot_interval_s <= 0 or self.max_state_scan_entries < 1 or self.max_producers < 1:
            raise ValueError(f"invalid partition config {self}")


def records_deleted_below(meta) -> int:
    """The offset DeleteRecords (or a retention ``keep_from``) moved the log start to: records
    below it are gone for Kafka clients even before the retention job removes their fragments."""
    keep = meta.retention.get("keep_from") if meta.retention else None
    return keep if isinstance(keep, int) and not isinstance(keep, bool) else 0


class PartitionLog:
    def __init__(self, client, topic: str, partition: int, config: PartitionConfig,
                 on_append: Callable[[], None] = lambda: None, *, writable: bool = True):
        self.client = client
        self.writable = writable  # False: served read-only, no take-over (see the module docstring)
        self.store = client.cluster.store
        self.topic = topic
        self.partition = partition
        self.stream = partition_stream(topic, partition)
        self.config = config
        self.on_append = on_append
        self.producer: Producer | None = None
        self.writer_lease = None  # the ownership lease: the writer's liveness key lives under it (streams.producer)
        self.reader: Consumer | None = None
        self.high_watermark = 0
        self.log_start = 0
        self.stream_id = -1
        self._last_entry = -1  # read-only: the LAC the high watermark was learnt at
        self.refreshed_at = -1e9  # loop time of the last caught_up (state learnt from the bookies)
        self.failure: BaseException | None = None
        self.retiring = False  # being handed over to another listener: appends are refused (see ``retire``)
        self._lock = asyncio.Lock()
        self._cursors: dict[int, int] = {}  # end offset of a batch served -> the entry after it
        self.live_state = ProducerStateTable(config.max_producers)  # includes batches in flight
        self.acked_state = ProducerStateTable(config.max_producers)  # exactly the batches below high_watermark
        self.txns = PartitionTxns()  # transactions of the acked batches (ongoing, aborted ranges): the LSO
        self._txns_built = writable  # read-only: built on the first read_committed fetch (``ensure_txns``)
        self._marker_epochs: dict[int, int] = {}  # producer id -> coordinator epoch of its last marker queued
        self._snapshot_key = state_key(topic, partition)
        self._snapshot_version = 0
        self._snapshot_offset = -1
        self._snapshots_stopped = False
        self._tail: TailCache | None = None  # writable: the entries acknowledged last (``tailcache.py``)

    @property
    def next_offset(self) -> int:
        """The offset the next stored batch gets."""
        return self.producer.next_offset if self.producer is not None else 0

    # ---------------------------------------------------------------- life cycle
    async def open(self) -> None:
        if not self.writable:
            meta, _ = await self.client.cluster.ledgers.get_ledger(self.stream)
            self.reader = Consumer(self.client.cluster, meta, max_read_entries=self.config.max_read_entries,
                                   max_read_bytes=self.config.max_read_bytes)
            self.stream_id = meta.ledger_id
            await self.follow()
            self.log_start = min(max(await self.reader.earliest_offset(), records_deleted_below(meta)),
                                 self.high_watermark)
            log.info("topic=%s partition=%d stream=%s open read-only: LAC %d, offsets %d..%d", self.topic,
                     self.partition, self.stream, self._last_entry, self.log_start, self.high_watermark)
            return
        # the one writer of this partition's stream (a take-over; it recovers the next offset)
        self.producer = await self.client.producer(self.topic, LISTENER_PRODUCER, partition=self.partition,
                                                   writer_lease=self.writer_lease)
        self.reader = self.producer.reader  # the consumer it learnt its next offset with (fragments read once)
        if self.reader is None:
            self.reader = Consumer(self.client.cluster, self.producer.meta)
        self.reader.max_read_entries = self.config.max_read_entries
        self.reader.max_read_bytes = self.config.max_read_bytes
        if self.config.tail_cache_entries > 0:
            self._tail = TailCache(self.config.tail_cache_entries, self.config.tail_cache_bytes)
            self.producer.on_acked = self._tail.add
        self.stream_id = self.producer.stream_id
        lac = self.producer.lac
        self.high_watermark = self.producer.next_offset
        self.log_start = min(max(await self.reader.earliest_offset(), records_deleted_below(self.producer.meta)),
                             self.high_watermark)
        scanned = await self._rebuild_producer_state(self.producer.last_data_entry_at_open)
        log.info("topic=%s partition=%d stream=%s term=%s open: LAC %d, offsets %d..%d, %d producers "
                 "(%d entries scanned)", self.topic, self.partition, self.stream, self.producer.term, lac,
                 self.log_start, self.high_watermark, len(self.acked_state.producers), scanned)

    async def close(self) -> None:
        self._drop_tail()
        if self.producer is not None:
            try:
                await self.producer.close()
            except Exception as exc:  # closing a failed writer: nothing more to save
                log.debug("stream=%s close: %r", self.stream, exc)
        if self.producer is not None and self.failure is None and self.high_watermark > self._snapshot_offset:
            with contextlib.suppress(Exception):
                await self.write_snapshot()

    # ---------------------------------------------------------------- producer state
    async def _rebuild_producer_state(self, lac: int) -> int:
        """Load the snapshot and replay the batches after it up to the LAC; returns entries scanned."""
        start, snap, skip_below = self.reader.earliest_entry(), None, 0
        cur = await self.store.get(self._snapshot_key)
        if cur is not None:
            self._snapshot_version = cur.version
            try:
                snap = StateSnapshot.decode(cur.value)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("stream=%s: ignoring an unreadable producer-state snapshot: %r", self.stream, exc)
        state = ProducerStateTable(self.config.max_producers)
        txns = PartitionTxns()
        if snap is not None and snap.stream_id == self.stream_id and snap.offset <= self.high_watermark:
            state = ProducerStateTable.from_json(snap.producers, self.config.max_producers)
            txns = PartitionTxns.from_json(snap.txns)
            skip_below = self._snapshot_offset = snap.offset
            if snap.offset >= self.high_watermark:
                start = lac + 1
            elif snap.offset > self.log_start:
                start = await self._locate(snap.offset)
        if lac - start + 1 > self.config.max_state_scan_entries:
            start = lac - self.config.max_state_scan_entries + 1
            state.complete = False
            log.warning("stream=%s: producer state rebuilt from the last %d entries only", self.stream,
                        self.config.max_state_scan_entries)
        eid = start
        while eid <= lac:
            for e in await self.reader.read_raw(eid, lac):
                eid = e.entry_id + 1
                b = stored_batch(e.entry_id, e.data)
                if b is None or b.end_offset <= skip_below:
                    continue
                pid, epoch, first = b.producer()
                attrs = b.attributes
                if attrs & ATTR_CONTROL:  # a transaction marker
                    commit, coord_epoch = parse_marker(b.batch)
                    txns.on_marker(pid, b.base_offset, commit, coord_epoch)
                    state.fence(pid, epoch)
                elif pid >= 0:
                    last = increment_sequence(first, b.offset_count - 1)
                    state.record(pid, epoch, BatchRecord(first, last, b.base_offset, b.offset_count))
                    if attrs & ATTR_TRANSACTIONAL:
                        txns.on_batch(pid, b.base_offset, epoch)
        txns.trim(self.log_start)
        self.acked_state = state
        self.live_state = state.copy()
        self.txns = txns
        self._marker_epochs = dict(txns.coordinator_epochs)
        self._txns_built = True
        return max(0, lac - start + 1)

    async def ensure_txns(self) -> None:
        """Read-only: build the transaction index once (the snapshot and a scan after it up to the
        LAC seen), for read_committed fetches (librdkafka's default). Transactional data and markers
        are only written through a writable partition, which builds its own on open and snapshots
        it; a stream without a snapshot was never written by a listener (a Python producer's, say:
        no transactions), so it is not scanned."""
        if self._txns_built:
            return
        async with self._lock:
            if not self._txns_built and await self.store.get(self._snapshot_key) is None:
                self._txns_built = True
            if not self._txns_built:
                states = (self.live_state, self.acked_state)
                await self._rebuild_producer_state(self._last_entry)
                self.live_state, self.acked_state = states  # read-only: only the transactions are needed

    @property
    def last_stable_offset(self) -> int:
        return self.txns.lso(self.high_watermark)

    async def write_snapshot(self) -> bool:
        """Write the acked producer state (compare-and-set); False if a later term's snapshot is there."""
        if self._snapshots_stopped:
            return False
        self.txns.trim(self.log_start)
        snap = StateSnapshot(self.stream_id, self.high_watermark, self.producer.term, self.acked_state.to_json(),
                             self.txns.to_json() if (self.txns.ongoing or self.txns.aborted
                                                     or self.txns.coordinator_epochs) else None)
        data = snap.encode()
        for _ in range(3):
            v = await self.store.cas(self._snapshot_key, data, self._snapshot_version)
            if v is not None:
                self._snapshot_version, self._snapshot_offset = v, snap.offset
                return True
            cur = await self.store.get(self._snapshot_key)
            if cur is not None:
                try:
                    other = StateSnapshot.decode(cur.value)
                except (ValueError, KeyError, TypeError):
                    other = None
                if other is not None and other.stream_id == snap.stream_id and other.term > snap.term:
                    log.info("stream=%s: a later writer (term %d) snapshots this partition now", self.stream,
                             other.term)
                    self._snapshots_stopped = True
                    return False
            self._snapshot_version = cur.version if cur is not None else 0
        return False

    @property
    def snapshot_due(self) -> bool:
        """Whether batches were acknowledged since the last producer-state snapshot (the listener's
        one snapshot task asks every ``snapshot_interval_s``: no timer per partition)."""
        return (self.producer is not None and self.failure is None and not self._snapshots_stopped
                and self.high_watermark > self._snapshot_offset)

    async def snapshot_if_due(self) -> None:
        if self.snapshot_due:
            try:
                await self.write_snapshot()
            except Exception as exc:
                log.warning("stream=%s: writing the producer-state snapshot failed: %r", self.stream, exc)

    # ---------------------------------------------------------------- appends
    async def append(self, batches: list[Batch]) -> tuple[int, list[asyncio.Future]]:
        """Assign offsets and queue one entry per batch: (base offset of the first, ack futures).
        Idempotent duplicates are not queued again: they answer with the original base offset (and
        wait for the original's acknowledgement if it is still in flight)."""
        async with self._lock:
            return await self._append_locked(batches)

    async def append_group(self, requests: list[list[Batch]]) -> list[tuple[int, list[asyncio.Future]] | Exception]:
        """The batches of several produce requests (a connection's pipelined ones, handled as one
        group by the server), one request after another under one hold of the lock: per request,
        what ``append`` would have answered it alone at that point — (base offset, ack futures), or
        the exception it would have raised (a sequence error, a batch too large, a failed writer).
        One request's error does not stop the next ones: each is checked against the state the
        earlier ones left, as if sent alone."""
        out: list = []
        async with self._lock:
            for batches in requests:
                try:
                    out.append(await self._append_locked(batches))
                except Exception as exc:  # noqa: BLE001 - that request's answer (the next ones go on)
                    out.append(exc)
        return out

    async def _append_locked(self, batches: list[Batch]) -> tuple[int, list[asyncio.Future]]:
        self._check_usable()
        self._check_not_retiring()
        if not self.writable:
            raise WriterWithdrawn(f"{self.stream}: opened read-only")
        dups = self._check_sequences(batches)
        merged = [self._records_to_merge(b) if dup is None else None for b, dup in zip(batches, dups, strict=True)]
        first = None
        futures = []
        queued = 0
        p = self.producer
        for b, dup, recs in zip(batches, dups, merged, strict=True):
            if dup is not None:
                first = dup.base_offset if first is None else first
                if dup.future is not None and not dup.future.done():
                    futures.append(dup.future)
                continue
            try:
                if not p.has_space():
                    await p.wait_for_space()
                if recs is not None:
                    ends: list[int] = []
                    base, futs = p.append_records(recs, ends)
                    queued += 1
                    first = base if first is None else first
                    # records split over entries: each entry acknowledged moves the high watermark
                    # to its end (a fetch serves entries whole, so the high watermark is always an
                    # entry's end: never inside one a consumer has been given)
                    for f, end in zip(futs, ends):  # all but the last
                        f.add_done_callback(self._entry_acked_callback(end))
                    futs[-1].add_done_callback(self._acked_callback(base, b))  # its last record's batch
                    futures.extend(futs)
                    continue
                base, fut = p.append_batch(b.raw)
            except PayloadTooLarge:
                if queued:  # part of the request is queued: our offsets may no longer match the log
                    self._fail(WriterWithdrawn("a partial append"))
                raise
            except Exception as exc:  # the writer failed (fenced, withdrawn): re-open on next use
                self._fail(exc)
                raise
            queued += 1
            first = base if first is None else first
            if b.producer_id >= 0:
                self.live_state.record(b.producer_id, b.producer_epoch, BatchRecord(
                    b.base_sequence, b.last_sequence, base, b.offset_count, fut))
            fut.add_done_callback(self._acked_callback(base, b))
            futures.append(fut)
        return (p.next_offset if first is None else first), futures

    def _records_to_merge(self, b: Batch) -> list | None:
        """The records of a batch that may share an entry with others (``merge_batch_bytes``), or
        None to store it as it came: small, no producer id (no sequence to keep per batch),
        attributes all zero (uncompressed, CreateTime, neither transactional nor control), as many
        records as offsets. Raises CorruptMessage (before anything of the request is queued) when a
        record cannot be decoded."""
        raw = b.raw
        if not (b.producer_id < 0 and len(raw) <= self.config.merge_batch_bytes
                and raw[OFF_ATTRIBUTES] == 0 and raw[OFF_ATTRIBUTES + 1] == 0
                and _I32.unpack_from(raw, OFF_COUNT)[0] == b.offset_count):
            return None
        try:
            recs = records_of_batch(raw)
        except RecordFormatError as exc:
            raise CorruptMessage(f"{self.topic} partition {self.partition}: {exc}") from exc
        if len(recs) != b.offset_count:
            raise CorruptMessage(f"{self.topic} partition {self.partition}: a batch says {b.offset_count} records "
                                 f"and holds {len(recs)}")
        return recs

    def _check_sequences(self, batches: list[Batch]) -> list[BatchRecord | None]:
        """Per batch: None to append it, or the stored batch it duplicates. Raises before anything
        is queued if any batch is out of sequence (or from a fenced epoch)."""
        if len(batches) == 1:
            b = batches[0]
            if b.producer_id < 0:
                return [None]
            return [self.live_state.check(b.producer_id, b.producer_epoch, b.base_sequence, b.last_sequence)]
        out: list[BatchRecord | None] = []
        pending: dict[int, tuple[int, int]] = {}  # producer id -> (epoch, last sequence) of this request
        for b in batches:
            if b.producer_id < 0:
                out.append(None)
                continue
            prev = pending.get(b.producer_id)
            if prev is None:
                dup = self.live_state.check(b.producer_id, b.producer_epoch, b.base_sequence, b.last_sequence)
            elif prev[0] != b.producer_epoch or not in_sequence(prev[1], b.base_sequence):
                raise OutOfOrderSequenceNumber(f"producer {b.producer_id}: batches of one request out of sequence")
            else:
                dup = None
            if dup is None:
                pending[b.producer_id] = (b.producer_epoch, b.last_sequence)
            out.append(dup)
        return out

    def _entry_acked_callback(self, end: int):
        """A merged entry holding the first records of a batch whose last ones went into a later
        entry: acknowledged, every offset below ``end`` is (a failure is the last entry's to report)."""

        def done(fut: asyncio.Future) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self.high_watermark = max(self.high_watermark, end)
                self.on_append()

        return done

    def _acked_callback(self, base: int, batch: Batch):
        count = batch.offset_count

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self._fail(fut.exception() if not fut.cancelled() else asyncio.CancelledError())
                return
            self.high_watermark = max(self.high_watermark, base + count)
            if batch.producer_id >= 0:
                self.acked_state.record(batch.producer_id, batch.producer_epoch, BatchRecord(
                    batch.base_sequence, batch.last_sequence, base, count))
                if batch.transactional:
                    self.txns.on_batch(batch.producer_id, base, batch.producer_epoch)
            self.on_append()

        return done

    async def append_marker(self, producer_id: int, epoch: int, commit: bool,
                            coordinator_epoch: int) -> asyncio.Future:
        """Queue a transaction marker (a control batch, one offset) for ``producer_id``; returns
        its acknowledgement future. Refused (TRANSACTION_COORDINATOR_FENCED) from a coordinator
        epoch older than one already seen for that producer, and (INVALID_PRODUCER_EPOCH) at an
        epoch older than the producer's here. From then on an older epoch's batches are fenced."""
        async with self._lock:
            self._check_usable()
            self._check_not_retiring()
            if not self.writable:
                raise WriterWithdrawn(f"{self.stream}: opened read-only")
            if coordinator_epoch < self._marker_epochs.get(producer_id, -1):
                raise TransactionCoordinatorFenced(
                    f"{self.topic} partition {self.partition}: marker for producer {producer_id} from coordinator "
                    f"epoch {coordinator_epoch}, older than {self._marker_epochs[producer_id]}")
            entry = self.live_state.producers.get(producer_id)
            if entry is not None and epoch < entry.epoch:
                raise InvalidProducerEpoch(f"{self.topic} partition {self.partition}: marker for producer "
                                           f"{producer_id} at epoch {epoch}, older than {entry.epoch}")
            p = self.producer
            try:
                if not p.has_space():
                    await p.wait_for_space()
                base, fut = p.append_batch(control_batch(producer_id, epoch, commit, coordinator_epoch))
            except Exception as exc:
                self._fail(exc)
                raise
            self._marker_epochs[producer_id] = coordinator_epoch
            self.live_state.fence(producer_id, epoch)

            def done(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    self._fail(f.exception() if not f.cancelled() else asyncio.CancelledError())
                    return
                self.high_watermark = max(self.high_watermark, base + 1)
                self.acked_state.fence(producer_id, epoch)
                self.txns.on_marker(producer_id, base, commit, coordinator_epoch)
                self.on_append()

            fut.add_done_callback(done)
            return fut

    def _drop_tail(self) -> None:
        """Give the tail cache's bytes back to the process budget (a writer that failed or closed)."""
        if self._tail is not None:
            self._tail.clear()
            self._tail = None
            if self.producer is not None:
                self.producer.on_acked = None

    def _fail(self, exc: BaseException) -> None:
        self._drop_tail()
        if self.failure is None:
            log.warning("topic=%s partition=%d stream=%s writer failed: %r; re-opening on next use",
                        self.topic, self.partition, self.stream, exc)
            self.failure = exc

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _check_not_retiring(self) -> None:
        if self.retiring:
            raise NotLeaderOrFollower(f"{self.topic} partition {self.partition} is being handed over to another "
                                      "listener")

    @property
    def transaction_open(self) -> bool:
        """Whether a transaction has acknowledged batches here and no marker yet."""
        return bool(self.txns.ongoing)

    async def retire(self, timeout_s: float) -> bool:
        """The first step of handing the partition over to another listener: from now on appends
        and markers are refused with NOT_LEADER_OR_FOLLOWER (the client refreshes its metadata and
        retries at the new owner), and the appends already queued are awaited: each is acknowledged
        (durable: its produce is answered with success) or fails (its produce gets a retriable
        error). Never more than ``timeout_s``: appends still unacknowledged then are left to the
        request's own timeout (a retriable error) — whether or not they became durable, the next
        owner's take-over finds them and its producer state (rebuilt from the snapshot and the log)
        answers their retries as duplicates. False, with appends admitted again, if a transaction
        is open here after the wait (its data and marker stay on this listener: the move waits for
        the transaction to end)."""
        async with self._lock:  # an append queuing now finishes first; later ones see ``retiring``
            self.retiring = True
        if self.producer is not None and self.failure is None:
            try:
                await asyncio.wait_for(asyncio.shield(self.producer.flush()), timeout_s)
            except TimeoutError:
                log.warning("topic=%s partition=%d: appends still unacknowledged after %.1f s of hand-over",
                            self.topic, self.partition, timeout_s)
                self._fail(WriterWithdrawn(f"{self.stream}: handed over with appends unacknowledged"))
        if self.writable and self.usable and self.transaction_open:
            self.retiring = False
            return False
        return True

    @property
    def usable(self) -> bool:
        return self.failure is None

    # ---------------------------------------------------------------- reads
    def check_offset(self, offset: int) -> None:
        """Out of range below the log start or past the log end, as in Kafka: the log end is the next
        offset the writer assigns (records queued but not acknowledged yet are below it, and a fetch
        there answers nothing until the high watermark passes it), read-only the high watermark."""
        end = self.high_watermark
        if self.producer is not None and self.usable:
            end = max(end, self.producer.next_offset)
        if offset < self.log_start or offset > end:
            raise OffsetOutOfRange(f"offset {offset} outside {self.log_start}..{end} of "
                                   f"{self.topic} partition {self.partition}")

    async def follow(self) -> None:
        """Read-only: learn the high watermark again from the LAC the bookies report."""
        lac = await self.reader.wait_lac(-1, 0.0)
        end = await self.reader.offset_after(lac)
        self._last_entry = max(self._last_entry, lac)
        self.high_watermark = max(self.high_watermark, end)

    async def wait_for_more(self, timeout_s: float) -> None:
        """Read-only: wait up to ``timeout_s`` for an entry past the high watermark's LAC, and
        learn the high watermark again when one came."""
        if await self.reader.wait_lac(self._last_entry, timeout_s) > self._last_entry:
            await self.follow()

    async def caught_up(self) -> None:
        """At the high watermark: read-only, learn it again; writable, check (one LAC read) that no
        other writer took the stream over, else fail with StaleTermError (the broker then serves
        the partition read-only)."""
        self.refreshed_at = asyncio.get_running_loop().time()
        if not self.writable:
            await self.follow()
            return
        self._check_usable()
        r = self.reader
        await r.wait_lac(-1, 0.0)
        if r.seen_term > self.producer.term:
            exc = StaleTermError(f"stream {self.stream!r} was taken over (term {r.seen_term}; this listener wrote "
                                 f"in term {self.producer.term})")
            self._fail(exc)
            raise exc

    async def read(self, offset: int, max_bytes: int, refresh: bool = True, committed: bool = False) -> bytes:
        """The stored record batches from the one holding ``offset`` up to the high watermark, at
        most ``max_bytes`` except that the first batch is always whole (as Kafka does).
        ``refresh``: at the high watermark, ``caught_up`` first (one LAC read). ``committed``
        (read_committed): only up to the last stable offset."""
        if offset >= self.high_watermark and refresh:
            await self.caught_up()
        self.check_offset(offset)
        hw = self.last_stable_offset if committed else self.high_watermark
        if offset >= hw:
            return b""
        # every entry up to ``last`` is acknowledged; batches from hw on are not served yet
        last = self.producer.lac if self.writable else self._last_entry
        eid = self._cursors.pop(offset, None)
        if eid is None:
            eid = await self._locate(offset)
        out: list = []  # views of the stored batches (copied once, by the join)
        total = 0
        end = offset
        tail = self._tail
        try:
            while eid <= last and total < max_bytes and end < hw:
                got = tail.run(eid, last, self.producer.fragment_first_entry) if tail is not None else ()
                if got:  # just written and acknowledged here: no bookie read (``tailcache.py``)
                    tail.hits += len(got)
                else:
                    if tail is not None:
                        tail.misses += 1
                    got = [b if b is not None else e.entry_id
                           for e in await self.reader.read_raw(eid, last)
                           for b in (stored_batch(e.entry_id, e.data),)]
                for b in got:
                    if type(b) is int:  # a no-op or a hole: no batch
                        eid = b + 1
                        continue
                    if b.end_offset > offset:
                        if b.base_offset >= hw:
                            break
                        size = len(b.batch)
                        if out and total + size > max_bytes:
                            break
                        out.append(b.batch)
                        total += size
                        end = b.end_offset
                    eid = b.entry_id + 1
                else:
                    continue
                break
        except DataRemovedError as exc:  # retention removed it since: the client resets its offset
            self.log_start = max(self.log_start, exc.earliest)
            raise OffsetOutOfRange(f"offset {offset} of {self.topic} partition {self.partition} was removed by "
                                   f"retention; log start is {exc.earliest}") from exc
        if out:
            if len(self._cursors) >= _MAX_CURSORS:
                self._cursors.clear()
            self._cursors[end] = eid
        return b"".join(out)

    async def _locate(self, offset: int) -> int:
        """The entry id of the batch holding ``offset`` (log_start <= offset < high watermark)."""
        if self._tail is not None and (eid := self._tail.locate(offset, self.producer.fragment_first_entry)) is not None:
            return eid
        r = self.reader
        if self.writable:
            r.lac = max(r.lac, self.producer.lac)  # the bookies may not have been told our LAC yet
        return await r.locate(offset)

    async def refresh_log_start(self) -> int:
        """Re-read the first retained offset from the fragment records (retention may have run) and
        the records deleted below (DeleteRecords, maybe by another listener)."""
        meta, _ = await self.client.cluster.ledgers.get_ledger(self.stream)
        fresh = Consumer(self.client.cluster, meta, max_read_entries=16)
        start = max(self.log_start, await fresh.earliest_offset(), records_deleted_below(meta))
        self.log_start = min(start, self.high_watermark)
        return self.log_start

    def delete_below(self, offset: int) -> None:
        """DeleteRecords: the log starts at ``offset`` from now on (the stream's retention
        ``keep_from``, already written, removes the fragments below it)."""
        self.log_start = min(max(self.log_start, offset), self.high_watermark)

    async def offset_for_timestamp(self, ts: int) -> tuple[int, int]:
        """(offset, timestamp) of the first record whose timestamp is >= ``ts``; (-1, -1) if none.
        Batches' max timestamps are taken as non-decreasing (producer time), as Kafka's time index does."""
        if not self.writable:
            await self.follow()
        r = self.reader
        hw = self.high_watermark

        async def next_in(first: int, last: int) -> StoredBatch | None:
            return await next_batch(r.read_raw, first, last)

        last = self.producer.lac if self.writable else self._last_entry
        b = await search_timestamp(next_in, r.earliest_entry() - 1, last + 1, ts, narrow=r._narrow_timestamp)
        while b is not None and b.base_offset < hw:
            for rec in records_of(b, self.stream, max(b.base_offset, self.log_start)):
                if rec.timestamp_ms >= ts:
                    return rec.offset, rec.timestamp_ms
            if not b.attributes & ATTR_CONTROL:
                break
            b = await next_in(b.entry_id + 1, last)  # a transaction marker holds no record: the next batch
        return -1, -1
