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
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

from streams.consumer import EARLIEST, Consumer
from streams.errors import PayloadTooLarge, WriterWithdrawn

from .batches import Batch, StoredBatch, decode_entry, encode_entry, patch_base_offset
from .errors import KafkaStorageError, OffsetOutOfRange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionConfig:
    max_index_points: int = 100_000
    recovery_scan_entries: int = 64
    max_read_entries: int = 1000
    max_read_bytes: int = 8 << 20

    def __post_init__(self):
        if self.max_index_points < 16 or self.recovery_scan_entries < 1 or self.max_read_bytes < 1024:
            raise ValueError(f"invalid partition config {self}")


def stream_name(topic: str, partition: int) -> str:
    return f"{topic}-{partition}"


class RawReader(Consumer):
    """A consumer that hands back raw entries (envelope included) instead of decoded records."""

    async def entries(self, first: int, last: int):
        return await self.read_raw(first, last)


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
        self.failure: BaseException | None = None
        self._lock = asyncio.Lock()

    # ---------------------------------------------------------------- life cycle
    async def open(self) -> None:
        self.producer = await self.client.producer(self.stream)
        meta, _ = await self.client.cluster.ledgers.get_ledger(self.stream)
        self.reader = RawReader(self.client.cluster, meta, max_read_entries=self.config.max_read_entries,
                                max_read_bytes=self.config.max_read_bytes)
        await self.reader.start_at(EARLIEST)
        lac = self.producer.lac
        self.last_acked_entry = lac
        last = await self._last_batch_at_or_below(lac)
        self.next_offset = self.high_watermark = last.end_offset if last else 0
        self.log_start = await self._first_offset()
        log.info("topic=%s partition=%d stream=%s term=%s open: LAC %d, offsets %d..%d", self.topic,
                 self.partition, self.stream, self.producer.term, lac, self.log_start, self.next_offset)

    async def close(self) -> None:
        if self.producer is not None:
            try:
                await self.producer.close()
            except Exception as exc:  # closing a failed writer: nothing more to save
                log.debug("stream=%s close: %r", self.stream, exc)

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
        while first <= last:
            for e in await self.reader.entries(first, min(last, first + 15)):
                first = e.entry_id + 1
                b = decode_entry(e.entry_id, e.data)
                if b is not None:
                    self.index.add(b)
                    return b
        return None

    # ---------------------------------------------------------------- appends
    async def append(self, batches: list[Batch]) -> tuple[int, list[asyncio.Future]]:
        """Assign offsets and queue one entry per batch: (base offset of the first, ack futures)."""
        async with self._lock:
            self._check_usable()
            first = self.next_offset
            futures = []
            for b in batches:
                base = self.next_offset
                try:
                    fut = await self.producer.append_raw(encode_entry(base, b))
                except PayloadTooLarge:
                    if futures:  # part of the request is queued: our offsets may no longer match the log
                        self._fail(WriterWithdrawn("a partial append"))
                    raise
                except Exception as exc:  # the writer failed (fenced, withdrawn): re-open on next use
                    self._fail(exc)
                    raise
                self.next_offset += b.offset_count
                fut.add_done_callback(self._acked_callback(base, b.offset_count))
                futures.append(fut)
            return first, futures

    def _acked_callback(self, base: int, count: int):
        def done(fut: asyncio.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self._fail(fut.exception() if not fut.cancelled() else asyncio.CancelledError())
                return
            eid = fut.result()
            self.index.add((eid, base, base + count))
            self.last_acked_entry = max(self.last_acked_entry, eid)
            self.high_watermark = max(self.high_watermark, base + count)
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
        out: list[bytes] = []
        total = 0
        while eid <= last and total < max_bytes:
            entries = await self.reader.entries(eid, last)
            for e in entries:
                eid = e.entry_id + 1
                b = decode_entry(e.entry_id, e.data)
                if b is None or b.end_offset <= offset:
                    continue
                if out and total + len(b.raw) > max_bytes:
                    return b"".join(out)
                out.append(patch_base_offset(b.raw, b.base_offset))
                total += len(b.raw)
        return b"".join(out)

    async def locate(self, offset: int) -> int:
        """The entry id of the batch holding ``offset`` (log_start <= offset < high watermark)."""
        lo, hi, holds = self.index.bracket(offset)
        if holds:
            return lo
        lo = self.reader.earliest() - 1 if lo is None else lo
        hi = self.last_acked_entry + 1 if hi is None else hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            b = await self._next_batch(mid, hi - 1)
            if b is None or b.base_offset > offset:
                hi = mid
            elif offset < b.end_offset:
                return b.entry_id
            else:
                lo = b.entry_id
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
