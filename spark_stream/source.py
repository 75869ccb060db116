"""The reading side of the ``scroll`` data source: batch and streaming readers, partition planning,
and the executor-side read of one position range.

Offsets. A stream position is an entry id: dense, assigned by the writer, never reused. Spark's
offset for this source is a JSON object ``{stream: next position}`` (the first position not yet
read), so a micro-batch is, per stream, the half-open range ``[start, end)`` of positions. Entries
that are no-ops (written at the end of every writer take-over) keep their position but are never
returned, so a range of N positions holds at most N records; ``maxRecordsPerTrigger`` therefore
counts positions. "Latest" is ``Consumer.end_position()`` = LAC + 1: nothing above the LAC is
ever planned or read, so every planned range is immutable and a replayed batch reads the same rows.

Planning runs on the driver, in the Python planner process Spark keeps for the query (the stream
reader object lives as long as the query, so it keeps its client). Each range becomes one
``ScrollPartition`` — a small picklable object (stream, metadata URL, first, last) — or, with
``minPartitions``, several: a range is cut first at fragment boundaries (consecutive fragments
live on different ensembles, so the tasks read from different bookies) and then evenly.

Reading runs on executors: ``read_partition`` opens a consumer on the stream and reads raw entries
``first..last`` in chunks (one replica read each), skipping no-ops and decoding records, and
yields one tuple per record in schema order.

Data loss. Retention removes whole fragments from the front of a stream. A planned start below
the stream's earliest position fails the query (``failOnDataLoss=true``, the default) with an
error naming the stream, the position asked for and the new earliest; with ``false`` the reader
logs a warning and skips ahead. The same check runs on the executors, since retention can act
between planning and reading.
"""

from __future__ import annotations

import logging
import math
import re
from datetime import UTC, datetime, timedelta

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from streams import records
from streams.consumer import EARLIEST as C_EARLIEST
from streams.errors import DataRemovedError, NoSuchStream
from terms import entry as entry_codec

from .options import EARLIEST, JSON_EARLIEST, JSON_LATEST, LATEST, STAGING_PREFIX, ReadOptions
from .runtime import runtime

log = logging.getLogger("spark_stream")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class ScrollDataLossError(RuntimeError):
    """Positions a query needs were removed by retention (and ``failOnDataLoss`` is true)."""


def data_loss_message(stream: str, position: int, earliest: int) -> str:
    return (f"scroll: data loss in stream {stream!r}: position {position} was removed by retention; the earliest "
            f"position now is {earliest} ({earliest - position} positions lost). Set the option "
            f"failOnDataLoss=false to skip ahead instead of failing.")


def schema_for(include_headers: bool) -> StructType:
    fields = [
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("stream", StringType(), False),
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
    """Positions ``first..last`` (inclusive) of one stream: what one Spark task reads."""

    def __init__(self, stream: str, metadata: str, first: int, last: int, fail_on_data_loss: bool,
                 include_headers: bool):
        super().__init__((stream, first, last))
        self.stream = stream
        self.metadata = metadata
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
    """Split ``limit`` positions across streams in proportion to their backlog (largest remainder),
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
    """Driver-side look-ups: which streams, and each one's earliest and end (LAC + 1) positions."""

    def __init__(self, opts: ReadOptions):
        self.opts = opts
        self.rt = runtime()
        self.client = self.rt.client(opts.metadata)
        self._pattern = re.compile(opts.pattern) if opts.pattern else None

    def streams(self) -> list[str]:
        if self.opts.streams is not None:
            return list(self.opts.streams)
        metas = self.rt.run(self.client.list_streams(), timeout=60)
        return sorted(m.name for m in metas
                      if not m.name.startswith(STAGING_PREFIX) and self._pattern.fullmatch(m.name))

    def bounds(self, names: list[str]) -> dict[str, tuple[int, int, list[int]]]:
        """``{stream: (earliest, end, fragment first positions)}``; a stream named in ``streams`` that
        does not exist is an error, one matched by a pattern that vanished is left out."""

        async def one(name: str):
            try:
                c = await self.client.consumer(name, start=C_EARLIEST)
            except NoSuchStream:
                if self.opts.streams is not None:
                    raise NoSuchStream(f"scroll: no stream named {name!r} (option 'streams')") from None
                return name, None
            end = await c.end_position()
            return name, (c.earliest(), max(end, c.earliest()), [f.first_entry_id for f in c.fragments])

        async def all_():
            import asyncio

            return await asyncio.gather(*(one(n) for n in names))

        return {n: b for n, b in self.rt.run(all_(), timeout=120) if b is not None}

    def resolve(self, spec, bounds, default_missing: str) -> dict[str, int]:
        """Positions for ``earliest``/``latest``/JSON ``spec`` (JSON -2/-1; a stream the JSON leaves
        out gets ``default_missing``)."""
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

    def check_loss(self, stream: str, position: int, earliest: int) -> int:
        """The position to read from: ``position``, or ``earliest`` when retention removed it and
        failOnDataLoss is false (raises when it is true)."""
        if position >= earliest:
            return position
        if self.opts.fail_on_data_loss:
            raise ScrollDataLossError(data_loss_message(stream, position, earliest))
        log.warning("stream %r: positions %s..%s were removed by retention; skipping to %s (failOnDataLoss=false)",
                    stream, position, earliest - 1, earliest)
        return earliest

    def partitions(self, ranges: dict[str, tuple[int, int]], frags: dict[str, list[int]]) -> list[ScrollPartition]:
        o = self.opts
        return [ScrollPartition(s, o.metadata, a, b, o.fail_on_data_loss, o.include_headers)
                for s, a, b in split_ranges(ranges, frags, o.min_partitions)]


# ---------------------------------------------------------------------------------------- readers
class ScrollBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions):
        self.opts = opts

    def partitions(self):
        p = _Planner(self.opts)
        bounds = p.bounds(p.streams())
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
            first = int(start.get(s, 0))  # a stream found after the query started is read from its beginning
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
            frags = {s: b[2] for s, b in self.planner.bounds(list(ranges)).items()}
        return self.planner.partitions(ranges, frags)

    def read(self, partition):
        return read_partition(partition)

    def commit(self, end: dict) -> None:
        pass

    def stop(self) -> None:
        self._planner = None


# ---------------------------------------------------------------------------------------- executors
def _row(r: records.Record, stream: str, include_headers: bool) -> tuple:
    ts = _EPOCH + timedelta(milliseconds=r.timestamp_ms)
    if include_headers:
        return (r.key, r.value, stream, r.position, ts, [(k, v) for k, v in r.headers])
    return (r.key, r.value, stream, r.position, ts)


def _arrow_batch(pa, schema, rows: list[records.Record], stream: str, include_headers: bool):
    n = len(rows)
    cols = [
        pa.array([r.key for r in rows], pa.binary()),
        pa.array([r.value for r in rows], pa.binary()),
        pa.array([stream] * n, pa.string()),
        pa.array([r.position for r in rows], pa.int64()),
        pa.array([r.timestamp_ms * 1000 for r in rows], pa.int64()).cast(schema.field(4).type),
    ]
    if include_headers:
        cols.append(pa.array([[{"key": k, "value": v} for k, v in r.headers] for r in rows], schema.field(5).type))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def read_partition(p: ScrollPartition, arrow: bool = True):
    """Yield the records at positions ``p.first..p.last`` of ``p.stream`` (no-ops are skipped): as
    pyarrow RecordBatches, one per replica read (faster: Spark takes them as they are), or with
    ``arrow=False`` as tuples in schema order."""
    rt = runtime()
    client = rt.client(p.metadata)
    consumer = rt.run(client.consumer(p.stream, start=p.first), timeout=60)
    if arrow:
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        arrow_schema = to_arrow_schema(schema_for(p.include_headers), timezone="UTC")
    pos = p.first
    while pos <= p.last:
        try:
            entries = rt.run(consumer.read_raw(pos, p.last), timeout=120)
        except DataRemovedError as exc:
            if p.fail_on_data_loss:
                raise ScrollDataLossError(data_loss_message(p.stream, pos, exc.earliest)) from None
            log.warning("stream %r: positions %s..%s were removed by retention while reading; skipping ahead "
                        "(failOnDataLoss=false)", p.stream, pos, exc.earliest - 1)
            pos = exc.earliest
            continue
        recs = [r for e in entries if e.entry_id <= p.last and not entry_codec.is_noop(e.data)
                for r in records.decode_entry(entry_codec.payload_of(e.data), e.entry_id, p.stream)]  # Kafka batch: many
        pos = entries[-1].entry_id + 1
        if not recs:
            continue
        if arrow:
            yield _arrow_batch(pa, arrow_schema, recs, p.stream, p.include_headers)
        else:
            for r in recs:
                yield _row(r, p.stream, p.include_headers)
