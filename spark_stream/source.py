"""The reading side of the ``scroll`` data source: batch and streaming readers, partition planning,
and the executor-side read of one offset range.

Offsets. Every stream holds Kafka record batches with dense **record offsets** from 0 (see
``streams/batches.py``); a topic of N partitions is N streams (``orders``, ``orders:1``, ...). Spark's
offset for this source is a JSON object ``{stream: next offset}`` (the first record not yet read),
so a micro-batch is, per stream, the half-open range ``[start, end)`` of record offsets, and holds
exactly ``end - start`` records: take-over no-ops take no offsets. "Latest" is
``Consumer.end_position()``, one past the last record at or below the LAC: nothing above the LAC
is ever planned or read, so every planned range is immutable and a replayed batch reads the same
rows.

Planning runs on the driver, in the Python planner process Spark keeps for the query (the stream
reader object lives as long as the query, so it keeps its client). The streams are the named ones,
every partition stream of the named topics (looked up at every trigger, so partitions added later
are read from their beginning, as Kafka's source does), or those matching a pattern. Each range
becomes one ``ScrollPartition`` — a small picklable object (stream, metadata URL, from, until) —
or, with ``minPartitions``, several: a range is cut first at fragment boundaries (consecutive
fragments live on different ensembles, so the tasks read from different bookies; fragment records
carry their first offsets) and then evenly.

Reading runs on executors: ``read_partition`` opens a consumer on the stream, ``seek``s to the
range's first offset and reads raw entries (one replica read each, up to 1000 entries / 4 MiB),
parses the record batches in them (aiokafka's C parser, CRC checked) and yields one Arrow record
batch per replica read, cut to ``[from, until)``.

Data loss. Retention removes whole fragments from the front of a stream. A planned start below
the stream's earliest offset fails the query (``failOnDataLoss=true``, the default) with an error
naming the stream, the offset asked for and the new earliest; with ``false`` the reader logs a
warning and skips ahead. The same check runs on the executors, since retention can act between
planning and reading.

Offloaded fragments (tiered storage). Executors read through ``Consumer.read_raw``, which reads a
fragment whose bookie copies were released from its object (``streams/tier/reader.py``): no bookie
is in that path, a seek into it costs the object's index and one chunk, and a task's reads stream
with read-ahead. ``minPartitions`` cuts ranges at fragment boundaries first, so a task reads whole
objects unless more pieces are asked for than there are fragments (then each piece reads its part
of an object by range). A missing or corrupt object fails the task with ``ObjectDataLost`` naming
the stream, the offsets and the object key, with ``failOnDataLoss`` true **or false**: that option
is about records retention removed (the stream no longer has them, so skipping is consistent with
it); these records are still in the stream and cannot be read, and skipping them would silently
drop data that every other reader still sees as there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from datetime import UTC, datetime, timedelta

from aiokafka.record.default_records import DefaultRecordBatch
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from fragments.security import NO_SECURITY, ClientSecurity
from streams.batches import RecordFormatError, stored_batch
from streams.consumer import LATEST as C_LATEST
from streams.errors import DataRemovedError, NoSuchStream, NoSuchTopic
from streams.topics import stream_partition

from .options import (
    EARLIEST,
    JSON_EARLIEST,
    JSON_LATEST,
    LATEST,
    STAGING_PREFIX,
    TS_ERROR,
    ByTimestamp,
    ReadOptions,
    ScrollOptionError,
)
from .runtime import runtime

log = logging.getLogger("spark_stream")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class ScrollDataLossError(RuntimeError):
    """Records a query needs were removed by retention (and ``failOnDataLoss`` is true)."""


def data_loss_message(stream: str, offset: int, earliest: int) -> str:
    return (f"scroll: data loss in stream {stream!r}: offset {offset} was removed by retention; the earliest "
            f"offset now is {earliest} ({earliest - offset} records lost). Set the option "
            f"failOnDataLoss=false to skip ahead instead of failing.")


def schema_for(include_headers: bool) -> StructType:
    fields = [
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("stream", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("offset", LongType(), False),
        StructField("timestamp", TimestampType(), True),
    ]
    if include_headers:
        fields.append(StructField("headers", ArrayType(StructType([
            StructField("key", StringType(), False),
            StructField("value", BinaryType(), True),
        ]), False), True))
    return StructType(fields)


# ---------------------------------------------------------------------------------------- partitions
class ScrollPartition(InputPartition):
    """Record offsets ``first..last`` (inclusive) of one stream: what one Spark task reads."""

    def __init__(self, stream: str, metadata: str, first: int, last: int, fail_on_data_loss: bool,
                 include_headers: bool, security: ClientSecurity = NO_SECURITY):
        super().__init__((stream, first, last))
        self.stream = stream
        self.metadata = metadata
        self.security = security
        self.first = first
        self.last = last
        self.fail_on_data_loss = fail_on_data_loss
        self.include_headers = include_headers

    def __repr__(self) -> str:
        return f"ScrollPartition({self.stream!r}, {self.first}..{self.last})"


def split_ranges(ranges: dict[str, tuple[int, int]], fragment_starts: dict[str, list[int]],
                 min_partitions: int | None) -> list[tuple[str, int, int]]:
    """Cut ``{stream: (first, end)}`` (end exclusive) into ``(stream, first, last)`` pieces.

    Without ``min_partitions`` (or when there are already that many non-empty ranges) each stream's
    range is one piece, as in Kafka. Otherwise each stream gets a share of ``min_partitions``
    proportional to its range size (at least one), made of whole fragments where the range spans
    several (adjacent ones merged towards equal sizes), then split evenly.
    """
    live = {s: r for s, r in ranges.items() if r[1] > r[0]}
    if not min_partitions or min_partitions <= len(live):
        return [(s, a, b - 1) for s, (a, b) in live.items()]
    total = sum(b - a for a, b in live.values())
    out: list[tuple[str, int, int]] = []
    for s, (a, b) in live.items():
        size = b - a
        k = min(size, max(1, math.ceil(min_partitions * size / total)))
        cuts = sorted(f for f in fragment_starts.get(s, ()) if a < f < b)
        if len(cuts) >= k - 1:  # enough fragment boundaries: take the ones nearest the even cut points
            chosen: list[int] = []
            for j in range(1, k):
                ideal = a + j * size / k
                c = min((c for c in cuts if not chosen or c > chosen[-1]), key=lambda c: abs(c - ideal), default=None)
                if c is not None:
                    chosen.append(c)
            cuts = chosen
        bounds = [a, *cuts, b]
        pieces = list(zip(bounds, bounds[1:]))
        if len(pieces) < k:  # then split each piece evenly, in proportion to its size
            extra = allocate(k - len(pieces), {i: hi - lo - 1 for i, (lo, hi) in enumerate(pieces)})
            even = []
            for i, (lo, hi) in enumerate(pieces):
                n = 1 + extra[i]
                even.extend((lo + (hi - lo) * j // n, lo + (hi - lo) * (j + 1) // n) for j in range(n))
            pieces = even
        out.extend((s, lo, hi - 1) for lo, hi in pieces)
    return out


def allocate(limit: int, backlog: dict[str, int]) -> dict[str, int]:
    """Split ``limit`` records across streams in proportion to their backlog (largest remainder),
    never giving a stream more than its backlog; the shares add up to min(limit, total backlog)."""
    total = sum(backlog.values())
    if total <= limit:
        return dict(backlog)
    exact = {s: limit * n / total for s, n in backlog.items()}
    share = {s: min(backlog[s], int(x)) for s, x in exact.items()}
    left = limit - sum(share.values())
    for s in sorted(backlog, key=lambda s: (share[s] - exact[s], s)):
        if left <= 0:
            break
        if share[s] < backlog[s]:
            share[s] += 1
            left -= 1
    return share


# ---------------------------------------------------------------------------------------- planning (driver)
class _Planner:
    """Driver-side look-ups: which streams, and each one's earliest and end record offsets."""

    def __init__(self, opts: ReadOptions):
        self.opts = opts
        self.rt = runtime()
        self.client = self.rt.client(opts.metadata, opts.security)
        pat = opts.pattern or opts.topic_pattern
        self._pattern = re.compile(pat) if pat else None

    def streams(self) -> list[str]:
        o = self.opts
        if o.streams is not None:
            return list(o.streams)
        if o.topics is not None:
            async def streams_of(t: str) -> list[str]:
                try:
                    return (await self.client.describe_topic(t)).streams()
                except NoSuchTopic:
                    raise NoSuchTopic(f"scroll: no topic named {t!r} (option 'topics')") from None

            async def all_():
                return await asyncio.gather(*(streams_of(t) for t in o.topics))

            return [s for names in self.rt.run(all_(), timeout=60) for s in names]
        if o.topic_pattern is not None:
            topics = self.rt.run(self.client.list_topics(), timeout=60)
            return [s for t in topics if not t.name.startswith(STAGING_PREFIX) and self._pattern.fullmatch(t.name)
                    for s in t.streams()]
        metas = self.rt.run(self.client.list_streams(), timeout=60)
        return sorted(m.name for m in metas
                      if not m.name.startswith(STAGING_PREFIX) and self._pattern.fullmatch(m.name))

    def bounds(self, names: list[str], fragments: bool = False) -> dict[str, tuple[int, int, list[int]]]:
        """``{stream: (earliest offset, end offset, fragment first offsets)}`` (the last only with
        ``fragments``); a stream named in ``streams`` that does not exist is an error, one found by
        a topic or pattern that vanished since is left out."""

        async def one(name: str):
            try:
                c = await self.client.consumer(name, start=C_LATEST)
            except NoSuchStream:
                if self.opts.streams is not None:
                    raise NoSuchStream(f"scroll: no stream named {name!r} (option 'streams')") from None
                return name, None
            end = c.position
            earliest = await c.earliest_offset()
            firsts = [await c.first_offset_of(f) for f in c.fragments] if fragments else []
            return name, (earliest, max(end, earliest), firsts)

        async def all_():
            return await asyncio.gather(*(one(n) for n in names))

        return {n: b for n, b in self.rt.run(all_(), timeout=120) if b is not None}

    def resolve(self, spec, bounds, default_missing: str) -> dict[str, int]:
        """Offsets for ``earliest``/``latest``/JSON ``spec`` (JSON -2/-1; a stream the JSON leaves
        out gets ``default_missing``), or found by timestamp (``ByTimestamp``)."""
        if isinstance(spec, ByTimestamp):
            return self._by_timestamp(spec, bounds, default_missing)
        out = {}
        for s, (earliest, end, _) in bounds.items():
            v = spec if isinstance(spec, str) else spec.get(s, JSON_EARLIEST if default_missing == EARLIEST
                                                              else JSON_LATEST)
            if v in (EARLIEST, JSON_EARLIEST):
                out[s] = earliest
            elif v in (LATEST, JSON_LATEST):
                out[s] = end
            else:
                out[s] = int(v)
        return out

    def _by_timestamp(self, spec: ByTimestamp, bounds, default_missing: str) -> dict[str, int]:
        """Each stream's first record whose timestamp is >= its timestamp (record-exact, not the
        first record of the batch holding it); a stream without one gets its end (``if_none``
        latest) or fails the query (``error``)."""
        wanted = {s: spec.every if spec.every is not None else spec.per_stream.get(s) for s in bounds}
        out = self.resolve(spec.fallback, {s: b for s, b in bounds.items() if wanted[s] is None}, default_missing)

        async def one(name: str, ts: int) -> tuple[str, int, bool]:
            c = await self.client.consumer(name, start=C_LATEST)
            end = c.position
            offset = await c.seek_timestamp(ts)
            return name, offset, offset < end

        async def all_():
            return await asyncio.gather(*(one(s, ts) for s, ts in wanted.items() if ts is not None))

        for name, offset, found in self.rt.run(all_(), timeout=120):
            if not found and spec.if_none == TS_ERROR:
                raise ScrollOptionError(
                    f"stream {name!r} has no record with a timestamp >= {wanted[name]} (set "
                    "startingOffsetsByTimestampStrategy to latest to start such streams at their end)")
            out[name] = max(offset, bounds[name][0]) if found else bounds[name][1]
        return out

    def check_loss(self, stream: str, offset: int, earliest: int) -> int:
        """The offset to read from: ``offset``, or ``earliest`` when retention removed it and
        failOnDataLoss is false (raises when it is true)."""
        if offset >= earliest:
            return offset
        if self.opts.fail_on_data_loss:
            raise ScrollDataLossError(data_loss_message(stream, offset, earliest))
        log.warning("stream %r: offsets %s..%s were removed by retention; skipping to %s (failOnDataLoss=false)",
                    stream, offset, earliest - 1, earliest)
        return earliest

    def partitions(self, ranges: dict[str, tuple[int, int]], frags: dict[str, list[int]]) -> list[ScrollPartition]:
        o = self.opts
        return [ScrollPartition(s, o.metadata, a, b, o.fail_on_data_loss, o.include_headers, o.security)
                for s, a, b in split_ranges(ranges, frags, o.min_partitions)]


# ---------------------------------------------------------------------------------------- readers
class ScrollBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions):
        self.opts = opts

    def partitions(self):
        p = _Planner(self.opts)
        bounds = p.bounds(p.streams(), fragments=bool(self.opts.min_partitions))
        start = p.resolve(self.opts.starting, bounds, EARLIEST)
        end = p.resolve(self.opts.ending, bounds, LATEST)
        ranges = {}
        for s, (earliest, latest, _) in bounds.items():
            e = min(end[s], latest)  # never past the LAC
            a = p.check_loss(s, start[s], earliest) if start[s] < e else start[s]
            ranges[s] = (a, max(a, e))
        parts = p.partitions(ranges, {s: b[2] for s, b in bounds.items()})
        return parts

    def read(self, partition):
        if not isinstance(partition, ScrollPartition):  # nothing to read: Spark's one default partition
            return iter(())
        return read_partition(partition)


class ScrollStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader. Lives in the driver's planner process for the whole query."""

    def __init__(self, opts: ReadOptions):
        self.opts = opts
        self._planner: _Planner | None = None
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow: stop here
        self._latest: dict[str, int] | None = None

    def __getstate__(self):  # shipped to executors for read(): the driver-side client stays behind
        state = dict(self.__dict__)
        state["_planner"] = None
        return state

    @property
    def planner(self) -> _Planner:
        if self._planner is None:
            self._planner = _Planner(self.opts)
        return self._planner

    def initialOffset(self) -> dict:
        p = self.planner
        bounds = p.bounds(p.streams())
        return p.resolve(self.opts.starting, bounds, LATEST)

    def getDefaultReadLimit(self):
        n = self.opts.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        p = self.planner
        self._target = {s: b[1] for s, b in p.bounds(p.streams()).items()}

    def latestOffset(self, start: dict, limit) -> dict:
        p = self.planner
        names = list(self._target) if self._target is not None else p.streams()
        bounds = p.bounds(names)
        firsts, backlog = {}, {}
        for s, (earliest, end, _) in bounds.items():
            if self._target is not None:
                end = min(end, self._target[s])
            first = int(start.get(s, 0))  # a stream (or partition) found after the query started: from its beginning
            if first < end:
                first = p.check_loss(s, first, earliest)
            firsts[s] = first
            backlog[s] = max(0, end - first)
        self._latest = {s: firsts[s] + backlog[s] for s in firsts}
        share = allocate(limit.max_rows, backlog) if isinstance(limit, ReadMaxRows) else backlog
        out = {s: int(v) for s, v in start.items()}  # streams that vanished keep their offset
        for s in firsts:
            out[s] = max(int(start.get(s, 0)), firsts[s] + share[s])
        return out

    def reportLatestOffset(self):
        return self._latest

    def partitions(self, start: dict, end: dict):
        ranges = {}
        for s, e in end.items():
            a = int(start.get(s, 0))
            if int(e) > a:
                ranges[s] = (a, int(e))
        if not ranges:
            return []
        frags: dict[str, list[int]] = {}
        if self.opts.min_partitions and self.opts.min_partitions > len(ranges):
            frags = {s: b[2] for s, b in self.planner.bounds(list(ranges), fragments=True).items()}
        return self.planner.partitions(ranges, frags)

    def read(self, partition):
        return read_partition(partition)

    def commit(self, end: dict) -> None:
        pass

    def stop(self) -> None:
        self._planner = None


# ---------------------------------------------------------------------------------------- executors
_READ_TIMEOUT_S = 120.0


def _records(entries, stream: str, first: int, until: int, with_headers: bool):
    """Columns of the records with offsets in ``[first, until)`` of raw entries (no-ops skipped):
    (keys, values, offsets, timestamps in ms, headers or None, done) where ``done`` says a batch at
    or past ``until`` was met.

    The batches' own CRCs are not checked again: every entry carries a CRC32C digest over its
    whole payload, made by the writer's client and verified by the bookie client on every read
    (``bookie/client.py``), so a damaged batch never gets here. Skipping it halves the parse cost."""
    keys: list = []
    values: list = []
    offsets: list = []
    stamps: list = []
    headers: list | None = [] if with_headers else None
    ka, va, oa, ta = keys.append, values.append, offsets.append, stamps.append
    done = False
    for e in entries:
        b = stored_batch(e.entry_id, e.data)
        if b is None:
            continue
        base, end = b.base_offset, b.end_offset
        if base >= until:
            done = True
            break
        if end <= first:
            continue
        try:
            rb = DefaultRecordBatch(b.batch)
            if rb.is_control_batch:
                continue
            if base >= first and end <= until and headers is None:  # the common case: all of it
                for r in rb:
                    ka(r.key)
                    va(r.value)
                    oa(r.offset)
                    ta(r.timestamp)
            else:
                for r in rb:
                    o = r.offset
                    if o < first or o >= until:
                        continue
                    ka(r.key)
                    va(r.value)
                    oa(o)
                    ta(r.timestamp)
                    if headers is not None:
                        headers.append(r.headers)
        except Exception as exc:  # the C parser raises CorruptRecordException / ValueError / struct.error
            raise RecordFormatError(f"stream {stream!r} entry {e.entry_id}: malformed record batch: {exc!r}") from exc
        if end >= until:
            done = True
            break
    return keys, values, offsets, stamps, headers, done


def _arrow_batch(pa, schema, stream: str, cols, include_headers: bool):
    import pyarrow.compute as pc

    keys, values, offsets, stamps, headers = cols
    n = len(offsets)
    topic, partition = stream_partition(stream)
    arrays = [
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array([stream] * n, pa.string()),
        pa.array([topic] * n, pa.string()),
        pa.array([partition] * n, pa.int32()),
        pa.array(offsets, pa.int64()),
        pc.multiply(pa.array(stamps, pa.int64()), 1000).cast(schema.field(6).type),
    ]
    if include_headers:
        arrays.append(pa.array([[{"key": k, "value": v} for k, v in h] for h in headers], schema.field(7).type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _row(stream: str, cols, i: int, include_headers: bool) -> tuple:
    keys, values, offsets, stamps, headers = cols
    topic, partition = stream_partition(stream)
    row = (keys[i], values[i], stream, topic, partition, offsets[i], _EPOCH + timedelta(milliseconds=stamps[i]))
    return row + ([(k, v) for k, v in headers[i]],) if include_headers else row


async def _open_at(client, p: ScrollPartition, offset: int):
    """A consumer of ``p.stream`` positioned at ``offset`` (or at the earliest offset, when retention
    removed ``offset`` and failOnDataLoss is false)."""
    while True:
        try:
            return await client.consumer(p.stream, start=offset)
        except DataRemovedError as exc:
            if p.fail_on_data_loss:
                raise ScrollDataLossError(data_loss_message(p.stream, offset, exc.earliest)) from None
            log.warning("stream %r: offsets %s..%s were removed by retention while reading; skipping ahead "
                        "(failOnDataLoss=false)", p.stream, offset, exc.earliest - 1)
            offset = exc.earliest


async def _read_chunk(client, p: ScrollPartition, state: dict):
    """The next replica read of the range: column lists of its records in ``[state.next, until)``.
    The read after it is started before this one is parsed (it runs while the caller and Spark
    take these rows)."""
    until = p.last + 1
    c = state.get("consumer")
    if c is None:
        c = state["consumer"] = await _open_at(client, p, state["next"])
        state["next"], state["entry"] = c.position, c.entry
    ahead = state.pop("ahead", None)
    try:
        if ahead is not None:
            entries = await ahead
        else:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _READ_TIMEOUT_S
            while state["entry"] > c.lac:
                # the planner saw these records at or below the LAC; this bookie's answer may lag it
                await c.end_position()
                if state["entry"] > c.lac:
                    if loop.time() > deadline:
                        raise TimeoutError(f"stream {p.stream!r}: offsets {state['next']}..{p.last} were planned "
                                           f"but the LAC is {c.lac} (entry {state['entry']} needed)")
                    await asyncio.sleep(0.05)
            entries = await c.read_raw(state["entry"], c.lac)
    except DataRemovedError as exc:
        if p.fail_on_data_loss:
            raise ScrollDataLossError(data_loss_message(p.stream, state["next"], exc.earliest)) from None
        log.warning("stream %r: offsets %s..%s were removed by retention while reading; skipping ahead "
                    "(failOnDataLoss=false)", p.stream, state["next"], exc.earliest - 1)
        state["consumer"] = None
        state["next"] = exc.earliest
        return None
    state["entry"] = entries[-1].entry_id + 1
    last = entries[-1]
    b = stored_batch(last.entry_id, last.data)
    more = b is None or b.end_offset < until
    if more and state["entry"] <= c.lac:
        ahead = state["ahead"] = asyncio.ensure_future(c.read_raw(state["entry"], c.lac))
        ahead.add_done_callback(lambda t: t.cancelled() or t.exception())  # a dropped one is not "never retrieved"
    *cols, done = _records(entries, p.stream, state["next"], until, p.include_headers)
    if cols[2]:
        state["next"] = cols[2][-1] + 1
    if done:
        state["next"] = until
    return cols


def _drop_ahead(state: dict) -> None:
    ahead = state.pop("ahead", None)
    if ahead is not None:
        ahead.cancel()


def read_partition(p: ScrollPartition, arrow: bool = True):
    """Yield the records at offsets ``p.first..p.last`` of ``p.stream``: as pyarrow RecordBatches,
    one per replica read (faster: Spark takes them as they are), or with ``arrow=False`` as tuples
    in schema order."""
    rt = runtime()
    client = rt.client(p.metadata, p.security)
    if arrow:
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        arrow_schema = to_arrow_schema(schema_for(p.include_headers), timezone="UTC")
    state = {"next": p.first, "consumer": None}
    try:
        while state["next"] <= p.last:
            cols = rt.run(_read_chunk(client, p, state), timeout=_READ_TIMEOUT_S + 60)
            if not cols or not cols[2]:
                continue
            if arrow:
                yield _arrow_batch(pa, arrow_schema, p.stream, cols, p.include_headers)
            else:
                for i in range(len(cols[2])):
                    yield _row(p.stream, cols, i, p.include_headers)
    finally:
        if state.get("ahead") is not None:
            rt.loop.call_soon_threadsafe(_drop_ahead, state)
