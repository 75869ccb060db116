"""One topic partition served by this shim: the stream ``<topic>-<partition>`` and its offsets.

How this works. Opening a partition opens the stream's producer, which is a take-over (a new
term): from then on this shim is the only writer, so it keeps ``next_offset`` (the next Kafka
offset to assign) in memory. On open it recovers ``next_offset`` from the last Kafka entry at or
below the LAC (scanning back over the few no-op entries take-overs leave). Kafka offsets are dense:
each batch takes ``offset_count`` offsets and no-ops take none, so take-overs leave no holes.

The high watermark is the end offset of the last acknowledged entry (our own appends' futures
resolve in order, so it is exact without asking a bookie); the log start is the base offset of
the first retained Kafka entry. To find the entry holding a fetch offset, ``OffsetIndex`` keeps
(entry id, base offset, end offset) points — every entry appended here, thinned when over its
limit — and the gap between two points is binary-searched by reading single entries.

Raw entries are read with ``RawReader``, a ``streams.consumer.Consumer`` whose replica selection,
fail-over and fragment handling we reuse through ``Consumer.read_raw``.

Idempotent producers (``compat_kafka.producer_ids``). Batches carrying a producer id are checked
against the partition's producer state before they are queued; a retry of a stored batch is
answered with its original base offset and not stored again. The state must survive a take-over,
so it is rebuilt on open: from a snapshot of the *acknowledged* state, kept in its own metadata key
``kafka/producer-state/<topic>/<partition>`` (JSON: stream id, entry id it is exact up to, term of
the writer, producers), then by scanning the entries after the snapshot up to the LAC — each
stored batch still carries producerId/epoch/baseSequence in its header. The owner rewrites the
snapshot (compare-and-set) every ``snapshot_interval_s`` when entries were acknowledged, so the
scan is short; a snapshot from a later term is never overwritten (we were taken over). The scan is
bounded by ``max_state_scan_entries``; beyond that the state is marked incomplete (unknown
producers are then accepted at any sequence, as Kafka does for producers without state). The
snapshot lives outside the stream's meta on purpose: the writer owns meta, and a separate key
cannot disturb it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

from streams.consumer import EARLIEST, Consumer
from streams.errors import PayloadTooLarge, WriterWithdrawn

from .batches import Batch, StoredBatch, decode_entry, encode_entry, entry_parts
from .errors import KafkaStorageError, OffsetOutOfRange, OutOfOrderSequenceNumber
from .producer_ids import BatchRecord, ProducerStateTable, StateSnapshot, in_sequence, state_key

log = logging.getLogger(__name__)
_I64 = struct.Struct(">q")


@dataclass(frozen=True)
class PartitionConfig:
    max_index_points: int = 100_000
    recovery_scan_entries: int = 64
    max_read_entries: int = 1000
    max_read_bytes: int = 8 << 20
    snapshot_interval_s: float = 1.0  # producer-state snapshots (when entries were acknowledged since)
    max_state_scan_entries: int = 200_000  # entries scanned on open to rebuild producer state
    max_producers: int = 10_000  # producer ids remembered per partition (least recently written go)

    def __post_init__(self):
        if self.max_index_points < 16 or self.recovery_scan_entries < 1 or self.max_read_bytes < 1024:
            raise ValueError(f"invalid partition config {self}")
        if self.snapshot_interval_s <= 0 or self.max_state_scan_entries < 1 or self.max_producers < 1:
            raise ValueError(f"invalid partition config {self}")


def stream_name(topic: str, partition: int) -> str:
    return f"{topic}-{partition}"


class RawReader(Consumer):
    """A consumer that hands back raw entries (envelope included) instead of decoded records."""

    async def entries(self, first: int, last: int):
        return await self.read_raw(first, last)


async def next_batch(reader: Consumer, first: int, last: int) -> StoredBatch | None:
    """The first Kafka entry in first..last (skipping no-ops), or None; reads 16 entries at a time."""
    while first <= last:
        for e in await reader.read_raw(first, min(last, first + 15)):
            first = e.entry_id + 1
            b = decode_entry(e.entry_id, e.data)
            if b is not None:
                return b
    return None


async def search_offset(next_batch_in, lo: int, hi: int, offset: int) -> tuple[StoredBatch | None, int]:
    """Binary search for the batch holding ``offset`` among the entries strictly between ``lo``
    and ``hi``, where every batch at or below ``lo`` ends at or below ``offset``: (the batch, or
    None; the entry id of the last batch seen that ends at or below it, else ``lo``).
    ``next_batch_in(first, last)`` is the first Kafka batch in first..last. O(log n) reads."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        b = await next_batch_in(mid, hi - 1)
        if b is None or b.base_offset > offset:
            hi = mid
        elif offset < b.end_offset:
            return b, lo
        else:
            lo = b.entry_id
    return None, lo


class OffsetIndex:
    """Sorted (entry id, base offset, end offset) points, at most ``max_points`` of them."""

    def __init__(self, max_points: int):
        self.max_points = max_points
        self.eids: list[int] = []
        self.bases: list[int] = []
        self.ends: list[int] = []

    def add(self, b: StoredBatch | tuple[int, int, int]) -> None:
        eid, base, end = (b.entry_id, b.base_offset, b.end_offset) if isinstance(b, StoredBatch) else b
        i = bisect.bisect_left(self.eids, eid)
        if i < len(self.eids) and self.eids[i] == eid:
            return
        self.eids.insert(i, eid)
        self.bases.insert(i, base)
        self.ends.insert(i, end)
        if len(self.eids) > self.max_points:  # thin: keep every other point, and the last
            last = (self.eids[-1], self.bases[-1], self.ends[-1])
            self.eids, self.bases, self.ends = self.eids[::2], self.bases[::2], self.ends[::2]
            if self.eids[-1] != last[0]:
                self.eids.append(last[0])
                self.bases.append(last[1])
                self.ends.append(last[2])

    def bracket(self, offset: int) -> tuple[int | None, int | None, bool]:
        """(entry id of the last point with base <= offset, entry id of the first point with
        base > offset, whether the lower point holds ``offset``)."""
        i = bisect.bisect_right(self.bases, offset)
        lo = self.eids[i - 1] if i > 0 else None
        hi = self.eids[i] if i < len(self.eids) else None
        holds = i > 0 and offset < self.ends[i - 1]
        return lo, hi, holds


class PartitionLog:
    def __init__(self, client, topic: str, partition: int, config: PartitionConfig,
                 on_append: Callable[[], None] = lambda: None):
        self.client = client
        self.store = client.cluster.store
        self.topic = topic
        self.partition = partition
        self.stream = stream_name(topic, partition)
        self.config = config
        self.on_append = on_append
        self.producer = None
        self.reader: RawReader | None = None
        self.index = OffsetIndex(config.max_index_points)
        self.next_offset = 0
        self.high_watermark = 0
        self.log_start = 0
        self.last_acked_entry = -1
        self.stream_id = -1
        self.failure: BaseException | None = None
        self._lock = asyncio.Lock()
        self.live_state = ProducerStateTable(config.max_producers)  # includes batches in flight
        self.acked_state = ProducerStateTable(config.max_producers)  # exactly what is up to last_acked_entry
        self._snapshot_key = state_key(topic, partition)
        self._snapshot_version = 0
        self._snapshot_entry = -1
        self._snapshot_task: asyncio.Task | None = None
        self._snapshots_stopped = False

    # ---------------------------------------------------------------- life cycle
    async def open(self) -> None:
        self.producer = await self.client.producer(self.stream)
        meta, _ = await self.client.cluster.ledgers.get_ledger(self.stream)
        self.stream_id = meta.ledger_id
        self.reader = RawReader(self.client.cluster, meta, max_read_entries=self.config.max_read_entries,
                                max_read_bytes=self.config.max_read_bytes)
        await self.reader.start_at(EARLIEST)
        lac = self.producer.lac
        self.last_acked_entry = lac
        last, scanned = await self._rebuild_producer_state(lac)
        if last is None:
            last = await self._last_batch_at_or_below(lac - scanned)
        self.next_offset = self.high_watermark = last.end_offset if last else 0
        self.log_start = await self._first_offset()
        self._snapshot_task = asyncio.get_running_loop().create_task(self._snapshot_loop(),
                                                                     name=f"kafka-snapshots-{self.stream}")
        log.info("topic=%s partition=%d stream=%s term=%s open: LAC %d, offsets %d..%d, %d producers "
                 "(%d entries scanned)", self.topic, self.partition, self.stream, self.producer.term, lac,
                 self.log_start, self.next_offset, len(self.acked_state.producers), scanned)

    async def close(self) -> None:
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._snapshot_task
        if self.producer is not None:
            try:
                await self.producer.close()
            except Exception as exc:  # closing a failed writer: nothing more to save
                log.debug("stream=%s close: %r", self.stream, exc)
        if self.producer is not None and self.failure is None and self.last_acked_entry > self._snapshot_entry:
            with contextlib.suppress(Exception):
                await self.write_snapshot()

    # ---------------------------------------------------------------- producer state
    async def _rebuild_producer_state(self, lac: int) -> tuple[StoredBatch | None, int]:
        """Load the snapshot and replay the entries after it: (last Kafka batch seen, entries scanned)."""
        earliest = self.reader.earliest()
        start, snap = earliest, None
        cur = await self.store.get(self._snapshot_key)
        if cur is not None:
            self._snapshot_version = cur.version
            try:
                snap = StateSnapshot.decode(cur.value)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("stream=%s: ignoring an unreadable producer-state snapshot: %r", self.stream, exc)
        state = ProducerStateTable(self.config.max_producers)
        if snap is not None and snap.stream_id == self.stream_id and snap.entry_id <= lac:
            state = ProducerStateTable.from_json(snap.producers, self.config.max_producers)
            start = max(earliest, snap.entry_id + 1)
            self._snapshot_entry = snap.entry_id
        if lac - start + 1 > self.config.max_state_scan_entries:
            start = lac - self.config.max_state_scan_entries + 1
            state.complete = False
            log.warning("stream=%s: producer state rebuilt from the last %d entries only", self.stream,
                        self.config.max_state_scan_entries)
        last = None
        eid = start
        while eid <= lac:
            for e in await self.reader.entries(eid, lac):
                eid = e.entry_id + 1
                b = decode_entry(e.entry_id, e.data)
                if b is None:
                    continue
                last = b
                self.index.add(b)
                pid, epoch, first, last_seq = b.producer()
                if pid >= 0:
                    state.record(pid, epoch, BatchRecord(first, last_seq, b.base_offset, b.offset_count))
        self.acked_state = state
        self.live_state = state.copy()
        return last, max(0, lac - start + 1)

    async def write_snapshot(self) -> bool:
        """Write the acked producer state (compare-and-set); False if a later term's snapshot is there."""
        if self._snapshots_stopped:
            return False
        snap = StateSnapshot(self.stream_id, self.last_acked_entry, self.producer.term,
                             self.acked_state.to_json())
        data = snap.encode()
        for _ in range(3):
            v = await self.store.cas(self._snapshot_key, data, self._snapshot_version)
            if v is not None:
                self._snapshot_version, self._snapshot_entry = v, snap.entry_id
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

    async def _snapshot_loop(self) -> None:
        while self.failure is None and not self._snapshots_stopped:
            await asyncio.sleep(self.config.snapshot_interval_s)
            if self.last_acked_entry > self._snapshot_entry:
                try:
                    await self.write_snapshot()
                except Exception as exc:
                    log.warning("stream=%s: writing the producer-state snapshot failed: %r", self.stream, exc)

    async def _last_batch_at_or_below(self, lac: int) -> StoredBatch | None:
        earliest = self.reader.earliest()
        hi = lac
        while hi >= earliest:
            lo = max(earliest, hi - self.config.recovery_scan_entries + 1)
            entries = await self._read_all(lo, hi)
            for e in reversed(entries):
                b = decode_entry(e.entry_id, e.data)
                if b is not None:
                    self.index.add(b)
                    return b
            hi = lo - 1
        return None

    async def _first_offset(self) -> int:
        """Base offset of the first retained Kafka entry (next_offset when there is none)."""
        eid = self.reader.earliest()
        while eid <= self.last_acked_entry:
            b = await self._next_batch(eid, self.last_acked_entry)
            if b is None:
                break
            return b.base_offset
        return self.next_offset

    async def _read_all(self, first: int, last: int):
        out = []
        while first <= last:
            got = await self.reader.entries(first, last)
            out.extend(got)
            first = got[-1].entry_id + 1
        return out

    async def _next_batch(self, first: int, last: int) -> StoredBatch | None:
        """The first Kafka entry in first..last (skipping no-ops), or None."""
        b = await next_batch(self.reader, first, last)
        if b is not None:
            self.index.add(b)
        return b

    # ---------------------------------------------------------------- appends
    async def append(self, batches: list[Batch]) -> tuple[int, list[asyncio.Future]]:
        """Assign offsets and queue one entry per batch: (base offset of the first, ack futures).
        Idempotent duplicates are not queued again: they answer with the original base offset (and
        wait for the original's acknowledgement if it is still in flight)."""
        async with self._lock:
            self._check_usable()
            dups = self._check_sequences(batches)
            first = None
            futures = []
            queued = 0
            for b, dup in zip(batches, dups, strict=True):
                if dup is not None:
                    first = dup.base_offset if first is None else first
                    if dup.future is not None and not dup.future.done():
                        futures.append(dup.future)
                    continue
                base = self.next_offset
                try:
                    fut = await self.producer.append_raw(encode_entry(base, b))
                except PayloadTooLarge:
                    if queued:  # part of the request is queued: our offsets may no longer match the log
                        self._fail(WriterWithdrawn("a partial append"))
                    raise
                except Exception as exc:  # the writer failed (fenced, withdrawn): re-open on next use
                    self._fail(exc)
                    raise
                queued += 1
                self.next_offset += b.offset_count
                first = base if first is None else first
                if b.producer_id >= 0:
                    self.live_state.record(b.producer_id, b.producer_epoch, BatchRecord(
                        b.base_sequence, b.last_sequence, base, b.offset_count, fut))
                fut.add_done_callback(self._acked_callback(base, b))
                futures.append(fut)
            return (self.next_offset if first is None else first), futures

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

    def _acked_callback(self, base: int, batch: Batch):
        count = batch.offset_count

        def done(fut: asyncio.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self._fail(fut.exception() if not fut.cancelled() else asyncio.CancelledError())
                return
            eid = fut.result()
            self.index.add((eid, base, base + count))
            self.last_acked_entry = max(self.last_acked_entry, eid)
            self.high_watermark = max(self.high_watermark, base + count)
            if batch.producer_id >= 0:
                self.acked_state.record(batch.producer_id, batch.producer_epoch, BatchRecord(
                    batch.base_sequence, batch.last_sequence, base, count))
            self.on_append()

        return done

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            log.warning("topic=%s partition=%d stream=%s writer failed: %r; re-opening on next use",
                        self.topic, self.partition, self.stream, exc)
            self.failure = exc

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise self.failure

    @property
    def usable(self) -> bool:
        return self.failure is None

    # ---------------------------------------------------------------- reads
    def check_offset(self, offset: int) -> None:
        if offset < self.log_start or offset > self.high_watermark:
            raise OffsetOutOfRange(f"offset {offset} outside {self.log_start}..{self.high_watermark} of "
                                   f"{self.topic}-{self.partition}")

    async def read(self, offset: int, max_bytes: int) -> bytes:
        """Record batches from the one holding ``offset`` up to the high watermark, at most
        ``max_bytes`` except that the first batch is always whole (as Kafka does)."""
        self.check_offset(offset)
        if offset == self.high_watermark:
            return b""
        last = self.last_acked_entry
        eid = await self.locate(offset)
        out: list = []  # patched baseOffset, then the rest of the stored batch (not copied until the join)
        total = 0
        while eid <= last and total < max_bytes:
            entries = await self.reader.entries(eid, last)
            for e in entries:
                eid = e.entry_id + 1
                parts = entry_parts(e.data)
                if parts is None or parts[0] + parts[1] <= offset:
                    continue
                size = len(parts[2]) + 8
                if out and total + size > max_bytes:
                    return b"".join(out)
                out.append(_I64.pack(parts[0]))
                out.append(parts[2])
                total += size
        return b"".join(out)

    async def locate(self, offset: int) -> int:
        """The entry id of the batch holding ``offset`` (log_start <= offset < high watermark)."""
        lo, hi, holds = self.index.bracket(offset)
        if holds:
            return lo
        lo = self.reader.earliest() - 1 if lo is None else lo
        hi = self.last_acked_entry + 1 if hi is None else hi
        found, _below = await search_offset(self._next_batch, lo, hi, offset)
        if found is not None:
            return found.entry_id
        raise KafkaStorageError(f"{self.stream}: no entry holds offset {offset} (between entries {lo} and {hi})")

    async def offset_for_timestamp(self, ts: int) -> tuple[int, int]:
        """(offset, timestamp) of the first batch whose max timestamp is >= ``ts``; (-1, -1) if none.
        Batches' max timestamps are taken as non-decreasing (producer time), as a binary search needs."""
        lo, hi = self.reader.earliest() - 1, self.last_acked_entry + 1
        found: StoredBatch | None = None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            b = await self._next_batch(mid, hi - 1)
            if b is None:
                hi = mid
            elif b.max_timestamp >= ts:
                found, hi = b, mid
            else:
                lo = b.entry_id
        if found is None:
            return -1, -1
        return max(found.base_offset, self.log_start), found.max_timestamp
