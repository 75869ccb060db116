"""The producer: records into record batches, batches into entries, offsets assigned in order.

How this works. A producer is the stream's one writer (it took the stream over when it opened),
so it assigns record offsets itself: it learnt the next offset on open from the last batch at or
below the LAC, and every batch it seals takes the next ``count`` offsets. Records accumulate in an
open batch (aiokafka's builder). The open batch is sealed and sent

- at once when it reaches ``batch_bytes``;
- when the event loop goes idle (``call_soon``), if fewer than ``eager_inflight_batches`` (1) are
  in flight: a lone record goes out with no added delay; with ``linger_ms`` it waits that long for
  company;
- otherwise when an earlier batch is acknowledged: under load batches grow instead of
  multiplying (Nagle's rule, for batches), which is what makes one entry carry thousands of
  records at full speed and a few per entry at moderate rates. Every entry costs a message, a
  journal fsync and a wake-up on each bookie; fewer, fuller entries cut latency under load, since
  the CPU they save is what queues the next ones. Full batches pipeline up to
  ``max_inflight_batches``.

Sealed batches wait in order for the writer's in-flight space; ``buffer_bytes`` bounds what waits
(appends then wait for space). Each batch has one future, resolved to its base offset when the
writer acknowledges the entry; a record's offset is base + its index. If the writer is taken over
(``StaleTermError``) or withdraws, every unacknowledged batch fails with that error.

Liveness (``_Liveness``, one per client). An open producer holds its stream's **writer key**
``/scroll/writers/<ledger id>`` -> ``{"term", ...}`` under a lease: the client's own (granted with
the first producer, kept alive by one task, revoked when the last producer closes) or one it is
given (``writer_lease``: the Kafka listener hands over its partition-ownership lease, so no other
lease is kept). The key says "the writer of this term is alive": autorecovery leaves the open
fragment of such a stream to its writer and takes over only a stream whose key is gone (the
process died, its lease expired) or names an older term. In turn a live writer must replace a lost
bookie even when idle: the client keeps **one watch** on the bookie registry while it has
producers, and when a bookie leaves it every open writer whose current ensemble names it makes an
ensemble change (``WriterDriver.bookie_left``): the written prefix becomes a sealed fragment
(autorecovery re-replicates it) and the open fragment moves to a live bookie. No timer per stream,
no listing while nothing changes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka.record.default_records import DefaultRecordBatch

from fragments.ledgers import BOOKIES, ROOT
from fragments.memstore import LeaseExpired
from fragments.store import MetadataError

from .batches import (
    COMPRESSION,
    OFF_LAST_DELTA,
    BatchBuilder,
    RecordFormatError,
    check_batch,
    normalise_headers,
    set_base_offset,
)
from .driver import ProducerOptions, WriterDriver
from .errors import KeyRequired, PayloadTooLarge

log = logging.getLogger(__name__)

_I32 = struct.Struct(">i")
WRITERS = f"{ROOT}/writers/"  # <ledger id> -> {"term", "host", "pid", "since"} under the writer's lease
WRITER_LEASE_TTL_S = 10.0  # the client's own writer lease: a dead writer's key is gone this long after


def writer_key(ledger_id: int) -> str:
    return f"{WRITERS}{ledger_id}"

_BATCH_OVERHEAD = 256  # batch header + one record's varints, with margin


@dataclass(slots=True)
class _Sealed:
    data: bytearray | bytes
    base: int
    end: int
    fut: asyncio.Future
    record_futs: list | None = None  # (index, future) of records appended with append_future


class Producer:
    def __init__(self, driver: WriterDriver, max_entry_bytes: int, next_offset: int,
                 options: ProducerOptions | None = None, *, reader=None):
        o = options or driver.options
        self._driver = driver
        # the Consumer the next offset was learnt with (fragments as of the take-over): a caller
        # that reads the stream it writes (the Kafka listener) takes it over instead of building
        # another, which would read the same metadata again
        self.reader = reader
        self.options = o
        self.max_entry_bytes = max_entry_bytes
        self.next_offset = next_offset  # the offset the next sealed batch starts at
        driver.writer.next_offset = next_offset
        self._compression = COMPRESSION[o.compression]
        self._batch_bytes = max(1024, min(o.batch_bytes, max_entry_bytes - 1))
        self._max_record = max_entry_bytes - 1 - _BATCH_OVERHEAD
        self._loop = asyncio.get_running_loop()
        self._open: BatchBuilder | None = None
        self._open_fut: asyncio.Future | None = None
        self._open_rfuts: list = []
        self._sent: dict[int, _Sealed] = {}  # handed to the writer, not yet acknowledged
        self._opened_at = 0.0
        self._ready: collections.deque[_Sealed] = collections.deque()
        self._ready_bytes = 0
        self._unacked: collections.deque[asyncio.Future] = collections.deque()
        self._idle_scheduled = False
        self._failure: BaseException | None = None
        self._space = asyncio.Event()
        self._liveness: _Liveness | None = None
        self._writer_key_version: int | None = None
        self._writer_lease_given = False
        driver.on_space.append(self._pump)
        # called with (entry id, the batch) of each acknowledged entry, in entry order (the Kafka
        # listener keeps the last ones to answer tailing fetches without a bookie read)
        self.on_acked: Callable[[int, bytearray | bytes], None] | None = None
        # a compacted stream refuses records without a key (its policy as of the take-over; a
        # change of cleanup_policy applies to producers opened after it)
        self._key_required = "compact" in str(driver.writer.ledger.retention.get("cleanup_policy", "delete")).split(",")

    # ---------------------------------------------------------------- facts
    @property
    def term(self) -> int:
        return self._driver.writer.term

    @property
    def fragment_first_entry(self) -> int:
        """The first entry id of the fragment being written (entries before it are in sealed
        fragments, which compaction and offload may rewrite)."""
        return self._driver.writer.fragment.first_entry_id

    @property
    def stream_id(self) -> int:
        """The ledger id of the stream this producer writes."""
        return self._driver.writer.ledger.ledger_id

    @property
    def meta(self):
        """The stream's ledger record as this producer's writer last wrote it (after the take-over)."""
        return self._driver.writer.ledger

    @property
    def lac(self) -> int:
        """The last entry id this producer has had acknowledged."""
        return self._driver.writer.lac

    @property
    def last_data_entry_at_open(self) -> int:
        """The last entry id that may hold a batch when this producer opened: its LAC then, or the
        entry before it when that is the take-over's own no-op (no need to read it back)."""
        w = self._driver.writer
        first = w.open_entry_id if w.open_entry_id is not None else w.lac + 1
        return first - 2 if w.noop_entry_id is not None and w.noop_entry_id == first - 1 else first - 1

    # ---------------------------------------------------------------- appends
    async def append(self, value: bytes, key: bytes | None = None, headers=None,
                     timestamp_ms: int | None = None) -> int:
        """Append one record; returns its offset once acknowledged (in order, at AQ)."""
        if not self._has_space():
            await self._wait_for_space()
        fut, i = self._add(value, key, headers, timestamp_ms)
        return await fut + i

    async def append_future(self, value: bytes, key: bytes | None = None, headers=None,
                            timestamp_ms: int | None = None) -> asyncio.Future:
        """Queue one record (waiting only for buffer space); the future resolves to its offset."""
        if not self._has_space():
            await self._wait_for_space()
        _, i = self._add(value, key, headers, timestamp_ms)
        out = self._loop.create_future()
        self._open_rfuts.append((i, out))  # resolved directly on acknowledgement (no callback each)
        return out

    async def append_many(self, records) -> list[int]:
        """Append many records and wait for all; returns their offsets in order. Each item is a
        value (bytes), a tuple ``(value, key, headers, timestamp_ms)`` (trailing items optional),
        or a dict with those keys. On a compacted stream every record needs a key: a record without
        one raises ``KeyRequired`` before anything of the call is appended."""
        if self._key_required:
            records = list(records)
            for r in records:
                key = r.get("key") if isinstance(r, dict) else (r[1] if isinstance(r, tuple) and len(r) > 1 else None)
                if key is None:
                    raise KeyRequired(f"stream {self._driver.name!r} is compacted (cleanup_policy "
                                      f"{self.meta.retention.get('cleanup_policy')}): every record needs a key")
        parts: list[tuple[asyncio.Future, int, int]] = []  # (batch future, first index, count)
        run: list = []  # consecutive plain values go through the fast path together
        for r in records:
            if isinstance(r, (bytes, bytearray)):
                run.append(r)
                continue
            if run:
                await self._add_values(run, parts)
                run = []
            if not self._has_space():
                await self._wait_for_space()
            if isinstance(r, dict):
                fut, i = self._add(r["value"], r.get("key"), r.get("headers"), r.get("timestamp_ms"))
            else:
                fut, i = self._add(*r, *(None,) * (4 - len(r)))  # trailing items are optional
            _note(parts, fut, i, 1)
        if run:
            await self._add_values(run, parts)
        out: list[int] = []
        for fut, first, n in parts:
            base = await fut
            out.extend(range(base + first, base + first + n))
        return out

    async def _add_values(self, values: list, parts: list) -> None:
        """The hot loop of ``append_many`` for plain values: the builder's append called directly,
        one timestamp for the call, a batch sealed whenever it fills."""
        limit = self._max_record
        if self._key_required and values:
            raise KeyRequired(f"stream {self._driver.name!r} is compacted (cleanup_policy "
                              f"{self.meta.retention.get('cleanup_policy')}): every record needs a key")
        for v in values:
            if len(v) > limit:
                raise PayloadTooLarge(f"record of {len(v)} bytes is over the {self.max_entry_bytes}-byte entry limit")
        ts = int(time.time() * 1000)
        no_headers: list = []
        k, n = 0, len(values)
        while k < n:
            if self._failure is not None:
                raise self._failure
            if not self._has_space():
                await self._wait_for_space()
            b = self._open if self._open is not None else self._new_batch()
            app = b.raw_append
            i = first = b.count
            while k < n:
                if app(i, ts, None, values[k], no_headers) is None:
                    if i == 0:  # the first record always fits; the builder says so by not failing
                        raise AssertionError("an empty batch refused a record")
                    break
                i += 1
                k += 1
            b.count = i
            _note(parts, self._open_fut, first, i - first)
            self._after_add(full=k < n)

    def append_batch(self, batch: bytes | bytearray) -> tuple[int, asyncio.Future]:
        """Queue a record batch built elsewhere (the Kafka listener stores produce batches as they
        came): returns (its base offset, a future resolving to it once acknowledged). The caller
        checks the batch first (``streams.batches.check_batch``) and waits for space itself."""
        if self._failure is not None:
            raise self._failure
        check_batch(batch, "append_batch")
        if len(batch) + 1 > self.max_entry_bytes:
            raise PayloadTooLarge(f"batch of {len(batch)} bytes is over the {self.max_entry_bytes}-byte entry limit")
        self._seal()
        buf = bytearray(batch)
        count = _I32.unpack_from(buf, OFF_LAST_DELTA)[0] + 1
        base = self.next_offset
        set_base_offset(buf, base)
        self.next_offset = base + count
        fut = self._loop.create_future()
        self._queue(_Sealed(buf, base, base + count, fut))
        self._pump()
        return base, fut

    def append_records(self, records: list, ends: list[int] | None = None) -> tuple[int, list[asyncio.Future]]:
        """Queue the records of a plain record batch built elsewhere into the open batch, as
        ``append_many`` does, so that small batches (a Kafka producer with a short linger sends one
        per partition per request) share one entry instead of paying an entry each. Every record
        keeps its timestamp, key, value and headers, and the order; the batch's own header
        (compression, producer fields) is not kept, so the caller passes only uncompressed batches
        without a producer id, not transactional, whose offsets have no gaps, and small enough that
        each record fits an entry (it checked them, and waits for space itself). ``records``:
        (timestamp_ms, key, value, headers) of each, decoded by the caller (``records_of_batch``) so
        that a damaged batch is refused before any of it is queued. Returns (the offset of its first
        record, the futures of the batches now holding its records: each resolves to that batch's
        base offset once acknowledged). ``ends``: if given, the end offset of each batch sealed here
        (all futures but the last) is appended to it: once such a future resolves, every offset below
        its end is acknowledged, although these records' own last batch may still be in flight."""
        if self._failure is not None:
            raise self._failure
        # the open batch is the next one sealed (append_batch seals it first): its base is next_offset
        first = self.next_offset + (self._open.count if self._open is not None else 0)
        futs: list[asyncio.Future] = []
        b = self._open if self._open is not None else self._new_batch()
        app, i = b.raw_append, b.count
        for ts, key, value, headers in records:
            if app(i, ts, key, value, headers) is None:
                b.count = i
                futs.append(self._open_fut)
                self._seal()
                if ends is not None:
                    ends.append(self.next_offset)
                self._pump()
                b = self._new_batch()
                app, i = b.raw_append, 0
                if app(i, ts, key, value, headers) is None:
                    raise AssertionError("an empty batch refused a record")
            i += 1
        b.count = i
        futs.append(self._open_fut)
        self._after_add()
        return first, futs

    def _after_add(self, full: bool = False) -> None:
        """After records went into the open batch: seal and send it once it is ``full`` or at its
        size, else see to it that it goes when the loop is idle (or its linger has passed)."""
        if full or self._open.size() >= self._batch_bytes:
            self._seal()
            self._pump()
        elif not self._idle_scheduled:
            self._idle_scheduled = True
            self._loop.call_soon(self._on_idle)

    def has_space(self) -> bool:
        return self._has_space()

    async def wait_for_space(self) -> None:
        await self._wait_for_space()

    async def flush(self) -> None:
        """Send what is buffered and wait until everything appended so far is acknowledged."""
        self._seal()
        self._pump()
        if self._unacked:
            await asyncio.gather(*list(self._unacked), return_exceptions=True)

    async def close(self, seal: bool = False) -> None:
        try:
            await self.flush()
        finally:
            try:
                await self._driver.close(seal=seal)
            finally:
                await self.stop_liveness()

    async def start_liveness(self, lease=None) -> None:
        """Hold the stream's writer key (under ``lease``, else the client's writer lease) and have
        this writer told when a bookie of its ensemble leaves the registry (``_Liveness``)."""
        live = _Liveness.of(self._driver.cluster)
        await live.join(self, lease)
        self._liveness = live

    async def stop_liveness(self) -> None:
        live, self._liveness = getattr(self, "_liveness", None), None
        if live is not None:
            await live.leave(self)

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------- internals
    def _add(self, value, key, headers, timestamp_ms) -> tuple[asyncio.Future, int]:
        if self._failure is not None:
            raise self._failure
        if not isinstance(value, (bytes, bytearray, memoryview)) and value is not None:
            raise TypeError(f"record value must be bytes, not {type(value).__name__}")
        if key is None and self._key_required:
            raise KeyRequired(f"stream {self._driver.name!r} is compacted (cleanup_policy "
                              f"{self.meta.retention.get('cleanup_policy')}): every record needs a key")
        if headers:
            headers = normalise_headers(headers)
        else:
            headers = []
        size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
        if headers:
            size += sum(len(n) + (len(v) if v is not None else 0) + 10 for n, v in headers)
        if size > self._max_record:
            raise PayloadTooLarge(f"record of {size} bytes is over the {self.max_entry_bytes}-byte entry limit")
        b = self._open
        if b is None:
            b = self._new_batch()
        if not b.append(value, key, headers, timestamp_ms):
            self._seal()
            self._pump()
            b = self._new_batch()
            b.append(value, key, headers, timestamp_ms)
        fut = self._open_fut
        i = b.count - 1
        self._after_add()
        return fut, i

    def _new_batch(self) -> BatchBuilder:
        self._open = BatchBuilder(self._compression, self._batch_bytes)
        self._open_fut = self._loop.create_future()
        self._opened_at = time.monotonic()
        return self._open

    def _seal(self) -> None:
        b = self._open
        if b is None or b.count == 0:
            return
        base = self.next_offset
        self.next_offset = base + b.count
        self._queue(_Sealed(b.build(base), base, base + b.count, self._open_fut, self._open_rfuts or None))
        self._open = self._open_fut = None
        self._open_rfuts = []

    def _queue(self, s: _Sealed) -> None:
        self._ready.append(s)
        self._ready_bytes += len(s.data)
        self._unacked.append(s.fut)

    def _on_idle(self) -> None:
        self._idle_scheduled = False
        b = self._open
        if b is None or b.count == 0:
            return
        linger = self.options.linger_ms / 1000.0
        if linger > 0:
            wait = self._opened_at + linger - time.monotonic()
            if wait > 0:
                self._idle_scheduled = True
                self._loop.call_later(wait, self._on_idle)
                return
        if len(self._sent) < self.options.eager_inflight_batches and not self._ready:
            self._seal()
        # else: it is sent when an in-flight batch is acknowledged (``_acked``)
        self._pump()
        self._driver.flush_adds_now()  # the loop is idle: nothing else comes this turn

    def _pump(self) -> None:
        """Hand sealed batches to the writer, in order, while in-flight space allows."""
        if self._failure is not None:
            return
        d = self._driver
        while self._ready and len(self._sent) < self.options.max_inflight_batches:
            s = self._ready[0]
            try:
                if not d.can_append(len(s.data) + 1):
                    break
                efut = d.append_nowait(s.data, (s.base, s.end))
            except Exception as exc:  # noqa: BLE001 - taken over or withdrawn: fail what waits
                self._fail(exc)
                return
            self._ready.popleft()
            self._ready_bytes -= len(s.data)
            self._sent[id(s)] = s
            efut.add_done_callback(lambda f, s=s: self._acked(s, f))
        if self._has_space():
            self._space.set()

    def _acked(self, s: _Sealed, efut: asyncio.Future) -> None:
        self._sent.pop(id(s), None)
        if efut.cancelled() or efut.exception() is not None:
            self._fail(efut.exception() if not efut.cancelled() else asyncio.CancelledError(), s)
            return
        if self.on_acked is not None:
            self.on_acked(efut.result(), s.data)
        if not s.fut.done():
            s.fut.set_result(s.base)
        if s.record_futs:
            base = s.base
            for i, f in s.record_futs:
                if not f.done():
                    f.set_result(base + i)
        while self._unacked and self._unacked[0].done():
            self._unacked.popleft()
        if not self._ready and self._open is not None and self._open.count and not self._idle_scheduled:
            self._seal()  # what accumulated while the window was full goes out now
        self._pump()

    def _fail(self, exc: BaseException, failed: _Sealed | None = None) -> None:
        if self._failure is None:
            self._failure = exc
        self._seal()
        for s in self._ready:
            if not s.fut.done():
                s.fut.set_exception(self._failure)
        for s in [*self._sent.values(), *self._ready, *([failed] if failed is not None else [])]:
            for _, f in s.record_futs or ():
                if not f.done():
                    f.set_exception(self._failure)
        for f in self._unacked:
            if not f.done():
                f.set_exception(self._failure)
                f.exception()  # retrieved: a batch nobody awaits must not log "never retrieved"
        self._ready.clear()
        self._ready_bytes = 0
        self._space.set()

    @property
    def held_bytes(self) -> int:
        """Bytes this producer holds: sealed batches waiting for the writer, and entries the writer
        keeps until every bookie of their write quorum has them (to resend them)."""
        return self._ready_bytes + self._driver.writer.inflight_bytes

    def _has_space(self) -> bool:
        open_bytes = self._open.size() if self._open is not None else 0
        return self._ready_bytes + open_bytes < self.options.buffer_bytes

    async def _wait_for_space(self) -> None:
        while not self._has_space():
            if self._failure is not None:
                raise self._failure
            self._space.clear()
            await self._space.wait()
        if self._failure is not None:
            raise self._failure


def records_of_batch(batch) -> list[tuple]:
    """(timestamp_ms, key, value, headers) of every record of an uncompressed RecordBatch v2, for
    ``Producer.append_records``. Raises RecordFormatError when a record cannot be decoded."""
    try:
        return [(r.timestamp, r.key, r.value, r.headers) for r in DefaultRecordBatch(batch)]
    except Exception as exc:  # aiokafka's CorruptRecordException, or a struct error
        raise RecordFormatError(f"a record of the batch cannot be decoded: {exc}") from exc


def _note(parts: list, fut: asyncio.Future, first: int, n: int) -> None:
    if not n:
        return
    if parts and parts[-1][0] is fut:
        f, start, m = parts[-1]
        parts[-1] = (f, start, m + n)
    else:
        parts.append((fut, first, n))


class _Liveness:
    """One per client (kept on its ``Cluster``) while it has open producers: the lease their
    writer keys live under (unless a producer was given one) and one watch on the bookie registry.
    See the module docstring."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.store = cluster.store
        self.producers: set[Producer] = set()
        self._lease = None
        self._lease_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def of(cls, cluster) -> _Liveness:
        live = getattr(cluster, "_writer_liveness", None)
        if live is None:
            live = cluster._writer_liveness = cls(cluster)
        return live

    async def join(self, p: Producer, lease=None) -> None:
        given = lease is not None and lease is not self._lease
        if lease is None:
            lease = await self._own_lease()
        w = p._driver.writer
        value = json.dumps({"term": w.term, "stream": p._driver.name, "host": socket.gethostname(), "pid": os.getpid(),
                            "since": time.time()}).encode()
        try:
            p._writer_key_version = await self.store.put(writer_key(p.stream_id), value, lease=lease)
        except LeaseExpired:
            if given:
                raise
            # our lease lapsed (the process stalled past its TTL) before the keep-alive noticed
            lease = await self._replace_lease(lease)
            p._writer_key_version = await self.store.put(writer_key(p.stream_id), value, lease=lease)
        p._writer_lease_given = given
        self.producers.add(p)
        if not any(t.get_name() == "writer-registry-watch" and not t.done() for t in self._tasks):
            self._tasks.append(asyncio.get_running_loop().create_task(self._watch(), name="writer-registry-watch"))

    async def leave(self, p: Producer) -> None:
        if p not in self.producers:
            return
        self.producers.discard(p)
        if p._writer_key_version is not None:  # a newer writer's key (a take-over) is not ours to delete
            with contextlib.suppress(MetadataError, Exception):
                await self.store.delete(writer_key(p.stream_id), expected_version=p._writer_key_version)
        if not self.producers:
            await self.stop()

    async def stop(self) -> None:
        """No producer left (or the client closes): end the watch, revoke our lease."""
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            while not t.done():
                # cancelled again until it ends: closing the store's watch may swallow a cancellation
                t.cancel()
                await asyncio.wait({t}, timeout=1.0)
            if not t.cancelled():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    t.result()
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(MetadataError, Exception):
                await lease.revoke()

    async def _own_lease(self):
        async with self._lease_lock:
            if self._lease is None:
                self._lease = await self.store.grant_lease(WRITER_LEASE_TTL_S)
                self._tasks.append(asyncio.get_running_loop().create_task(self._keepalive(), name="writer-lease"))
            return self._lease

    async def _keepalive(self) -> None:
        while True:
            lease = self._lease
            await asyncio.sleep(lease.ttl_s / 3)
            try:
                try:
                    await lease.refresh()
                except LeaseExpired:
                    await self._replace_lease(lease)
            except MetadataError as exc:  # (the store is unreachable: the next round tries again)
                log.warning("keeping the writer lease alive failed: %s", exc)

    async def _replace_lease(self, old):
        """``old``, our lease, expired: this process was stalled past the TTL and its writer keys
        are gone (autorecovery may take those streams over; the writers then learn it as
        StaleTermError). A new lease, and the keys of writers still open put again under it."""
        async with self._lease_lock:
            if self._lease is not old and self._lease is not None:
                return self._lease  # replaced already (by the keep-alive or another join)
            log.warning("the writer lease expired: writer keys are put again under a new one")
            new = self._lease = await self.store.grant_lease(WRITER_LEASE_TTL_S)
        for p in list(self.producers):
            if not p._writer_lease_given and p._driver.writer.engaged and p._failure is None:
                with contextlib.suppress(MetadataError):
                    await self.join(p, new)
        return new

    async def _watch(self) -> None:
        while True:
            try:
                watch = self.store.watch_prefix(BOOKIES)
                try:
                    async for ev in watch:
                        if ev.value is None:
                            self._bookie_left(ev.key[len(BOOKIES):])
                finally:
                    with contextlib.suppress(Exception, asyncio.TimeoutError):
                        await asyncio.wait_for(watch.aclose(), 2.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store may be down for a while: watch again
                log.debug("watch on the bookie registry: %r", exc)
            await asyncio.sleep(1.0)

    def _bookie_left(self, bookie: str) -> None:
        if any(bookie in p._driver.writer.fragment.ensemble for p in self.producers if p._failure is None):
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.get_running_loop().create_task(self._tell(bookie), name="writer-bookie-left"))

    async def _tell(self, bookie: str) -> None:
        """One refresh of the live bookies for every writer (they place the replacement from it),
        then each writer whose open ensemble names ``bookie`` replaces it."""
        try:
            await self.cluster.refresh_bookies()
        except Exception as exc:  # noqa: BLE001 - place from the view we have
            log.debug("refreshing the live bookies failed: %r", exc)
        if bookie in {r.bookie_id for r in self.cluster.live()}:
            return  # registered again meanwhile (a restart): nothing to replace
        for p in list(self.producers):
            if p._failure is None:
                p._driver.bookie_left(bookie)
