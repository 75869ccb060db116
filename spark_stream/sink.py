"""The writing side of the ``scroll`` data source: batch and streaming writers that append rows to
one stream (or to the partitions of a topic, by key), exactly once per micro-batch.

Why staging. A stream has exactly one writer: opening a producer takes the stream over (a new
term), and a writer that was taken over fails. Spark runs a batch as many tasks on many executors,
so tasks cannot all append to the target: they would fence each other. Instead:

1. Each task (``write``, on an executor; Spark hands it Arrow record batches) builds its rows into
   **Kafka record batches** (aiokafka's builder, up to ``batchBytes``, ~1 MiB: the format every
   stream stores, see ``streams/batches.py``), one open batch per target partition: a row with a
   key goes to Kafka's default partition for it (murmur2), keyless rows of a task to partition
   ``task index mod partitions``. Up to ``stageInlineBytes`` (default 1 MiB) of batches travel back
   to the driver inside the task's commit message; beyond that the task appends them as they are
   (``Producer.append_batch``) to its own *staging stream* ``_spark.<query>.<batch>.<partition>.<attempt>``
   (same replication as the target) and the message names it and lists each batch's partition.
   Streaming rows carry one extra header, ``scroll.spark.batch`` = ``<queryId>:<batchId>``, which
   marks the micro-batch that wrote them.
2. The driver's ``commit(messages, batchId)`` is the only writer of the target. It forwards the
   batches as they are (``append_batch`` only sets each batch's base offset; no record is decoded
   or re-encoded), so the driver's cost is per batch, not per row. Using the commit record this
   query keeps in the target's ``LedgerMeta.extra["spark"][queryId]`` (of partition 0's stream for
   a topic):

   * ``batch >= batchId``: the batch was already committed (Spark replays the last batch after a
     restart); nothing is appended.
   * otherwise it records an *intent* ``{"pending": batchId, "from": {stream: P}}`` by CAS, where
     ``P`` is each target partition's end offset before the copy (a lower bound of where the copy
     lands), opens the producer(s), appends every staged batch, flushes, closes, and CASes the
     record to ``{"batch": batchId, "end": {stream: E}}``.
   * if the record already shows ``pending == batchId``, an earlier attempt crashed between the
     intent and the final CAS, possibly mid-copy. The records of the batch that made it are found
     by scanning each partition from its ``P`` for the batch's header, and only the missing ones are
     appended (matched by content: key, value and headers, as a multiset — so a re-executed batch
     whose rows come back in another order or other batches is still completed exactly; a batch
     with none of its records present is forwarded as is, the others re-built from the missing
     records). A take-over in between truncated any unacknowledged tail, so what the scan sees is
     final.

   Then the staging streams of this and earlier batches of the query are deleted. ``abort``
   deletes the batch's staging streams.

The metadata CASes change ``extra`` only (third parties may touch only ``first_fragment_index``,
``retention`` and ``extra``), and run while no producer of ours is open.

The query id is Spark's ``queryId`` (stable across restarts from the same checkpoint), which
executors see as the local property ``sql.streaming.queryId``; the batch id is
``streaming.sql.batchId``. The commit process on the driver gets both from the messages.

Batch (non-streaming) writes use the same staging and copy, with a fresh job id and no commit
record: a failed job that is re-run may append twice (as Kafka's batch sink).

Cost: staged rows are written twice (staging stream, then target); inline ones travel through the
driver once. Each committed micro-batch is one take-over of each target partition (a no-op entry,
no offsets) plus two CASes.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType, TimestampType

from streams.batches import COMPRESSION, records_of, stored_batch
from streams.driver import ProducerOptions
from streams.errors import DataRemovedError, NoSuchStream, NoSuchTopic, StaleTermError, StreamExists, TopicExists
from streams.topics import partition_for

from .options import STAGING_PREFIX, ScrollOptionError, WriteOptions
from .runtime import runtime

log = logging.getLogger("spark_stream")

BATCH_HEADER = "scroll.spark.batch"
EXTRA_KEY = "spark"
_COMMIT_ATTEMPTS = 5
_MAX_ENTRY_BYTES = 1 << 20
# The commit forwards whole ~1 MiB batches: a deeper window than an appending producer's keeps the
# bookies busy while acknowledgements come back.
_COPY_OPTIONS = ProducerOptions(max_inflight_batches=16)


class ScrollWriteError(RuntimeError):
    """A row or a commit the sink cannot take (the batch fails and nothing of it is appended)."""


class FailpointHit(RuntimeError):
    """Raised by the test-only ``testFailpoint`` option."""


@dataclass
class StagedOutput(WriterCommitMessage):
    """What one task wrote: record batches inline as (target partition, batch bytes), or the name
    of its staging stream and the target partition of each batch in it, in order."""

    query: str
    batch: int
    partition: int
    attempt: int
    count: int = 0
    partitions: int = 1  # the target's partition count the task partitioned by
    inline: list[tuple[int, bytearray]] = field(default_factory=list)
    staging: str | None = None
    staged: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- schema
def check_schema(schema: StructType) -> tuple[str, ...]:
    """The columns the sink uses; raises on a missing ``value`` or a column of the wrong type."""
    byname = {f.name.lower(): f for f in schema.fields}
    if "value" not in byname:
        raise ScrollOptionError(f"the scroll sink needs a 'value' column (binary or string); columns: "
                                f"{[f.name for f in schema.fields]}")
    text_or_bytes = (BinaryType, StringType)
    for name in ("key", "value"):
        f = byname.get(name)
        if f is not None and not isinstance(f.dataType, text_or_bytes):
            raise ScrollOptionError(f"column {f.name!r} must be binary or string, not {f.dataType.simpleString()}")
    h = byname.get("headers")
    if h is not None:
        t = h.dataType
        ok = (isinstance(t, ArrayType) and isinstance(t.elementType, StructType)
              and {x.name for x in t.elementType.fields} >= {"key", "value"})
        if not ok:
            raise ScrollOptionError(f"column 'headers' must be array<struct<key:string,value:binary>>, not "
                                    f"{t.simpleString()}")
    ts = byname.get("timestamp")
    if ts is not None and not isinstance(ts.dataType, TimestampType):
        ts = None  # a non-timestamp 'timestamp' column is ignored, records get the write time
    return tuple(byname[n].name for n in ("key", "value", "headers", "timestamp")
                 if n in byname and (n != "timestamp" or ts is not None))


def _bytes_list(col) -> list:
    """An Arrow binary or string column as a list of bytes (None kept)."""
    import pyarrow as pa

    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        col = col.cast(pa.large_binary())
    return col.to_pylist()


def _millis_list(col) -> list:
    """An Arrow timestamp column as epoch milliseconds (None kept)."""
    import pyarrow as pa

    ints = col.cast(pa.int64()).to_pylist()
    unit = col.type.unit
    if unit == "ms":
        return ints
    if unit == "s":
        return [None if v is None else v * 1000 for v in ints]
    div = 1000 if unit == "us" else 1_000_000
    return [None if v is None else v // div for v in ints]


def arrow_columns(batch, cols: tuple[str, ...]):
    """(values, keys, headers, timestamps in ms) of an Arrow record batch, as lists (keys, headers
    and timestamps None when the column is absent; headers as lists of (name, value) pairs)."""
    names = {n.lower(): n for n in batch.schema.names}
    lower = {c.lower() for c in cols}
    values = _bytes_list(batch.column(names["value"]))
    if None in values:
        raise ScrollWriteError("the scroll sink cannot write a row whose value is null")
    keys = _bytes_list(batch.column(names["key"])) if "key" in lower else None
    headers = None
    if "headers" in lower:
        headers = []
        for hs in batch.column(names["headers"]).to_pylist():
            row = []
            for h in hs or ():
                if h["key"] is None:
                    raise ScrollWriteError("a header key is null")
                row.append((h["key"], h["value"]))
            headers.append(row)
    stamps = _millis_list(batch.column(names["timestamp"])) if "timestamp" in lower else None
    return values, keys, headers, stamps


def content_key(key: bytes | None, value: bytes | None, headers) -> bytes:
    """What identifies a copied record for completion after a crash: key, value and user headers."""
    h = hashlib.blake2b(digest_size=16)
    for part in (key, value):
        h.update(b"\xff" if part is None else len(part).to_bytes(8, "big") + part)
    for k, v in headers:
        if k == BATCH_HEADER:
            continue
        kb = k.encode()
        h.update(len(kb).to_bytes(8, "big") + kb)
        h.update(b"\xff" if v is None else len(v).to_bytes(8, "big") + v)
    return h.digest()


def _has_tag(headers, tag: bytes) -> bool:
    return any(k == BATCH_HEADER and v == tag for k, v in headers)


def _batch_count(raw) -> int:
    """Records (offsets) of a record batch (no envelope): lastOffsetDelta + 1."""
    return int.from_bytes(raw[23:27], "big", signed=True) + 1


def staging_name(query: str, batch: int, partition: int, attempt: int) -> str:
    return f"{STAGING_PREFIX}{query}.{batch}.{partition}.{attempt}"


def _staging_batch(name: str, query: str) -> int | None:
    prefix = f"{STAGING_PREFIX}{query}."
    if not name.startswith(prefix):
        return None
    try:
        return int(name[len(prefix):].split(".")[0])
    except ValueError:
        return None


async def target_streams(client, name: str) -> list[str]:
    """The streams of a target: every partition of a topic, or the one stream (``t:p`` included)."""
    if ":" in name:
        await client.describe_stream(name)
        return [name]
    return (await client.describe_topic(name)).streams()


# ---------------------------------------------------------------------------------------- executors
class _Stager:
    """Appends one task's record batches to its own staging stream (async client on the runtime loop)."""

    def __init__(self, opts: WriteOptions, name: str):
        self.rt = runtime()
        self.client = self.rt.client(opts.metadata, opts.security)
        self.name = name
        self.opts = opts
        self.futs: list = []
        self.producer = self.rt.run(self._open(), timeout=120)

    async def _open(self):
        n = self.opts.stage_replicas
        for _ in range(3):
            try:
                await self.client.create_stream(self.name, ensemble=n, write_quorum=n, ack_quorum=min(n, 2))
                break
            except (StreamExists, TopicExists):  # left by an earlier run of this batch that died: it is garbage
                await self.client.delete_stream(self.name)
        return await self.client.producer(self.name)

    def add(self, batches: list[bytes]) -> None:
        async def go():
            for raw in batches:
                await self.producer.wait_for_space()
                self.futs.append(self.producer.append_batch(raw)[1])

        self.rt.run(go(), timeout=300)

    def finish(self) -> None:
        async def go():
            await asyncio.gather(*self.futs)
            await self.producer.close()

        self.rt.run(go(), timeout=300)


def _partitions_of(opts: WriteOptions) -> int:
    if ":" in opts.stream:
        return 1
    rt = runtime()
    try:
        return rt.run(rt.client(opts.metadata, opts.security).describe_topic(opts.stream), timeout=60).partitions
    except NoSuchTopic:
        raise ScrollWriteError(f"scroll sink: no stream named {opts.stream!r}") from None


def write_task(opts: WriteOptions, cols: tuple[str, ...], batches, query: str, batch: int,
               tagged: bool, partition: int | None = None, attempt: int | None = None) -> StagedOutput:
    """One task's rows (Arrow record batches) as record batches, inline or staged; ``partition``
    and ``attempt`` default to the Spark task's."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if partition is None:
        partition = ctx.partitionId() if ctx else 0
    if attempt is None:
        attempt = ctx.attemptNumber() if ctx else 0
    nparts = _partitions_of(opts)
    keyless = partition % nparts
    extra = [(BATCH_HEADER, f"{query}:{batch}".encode())] if tagged else []
    out = StagedOutput(query, batch, partition, attempt, partitions=nparts)
    built: list[tuple[int, bytearray]] = []  # sealed batches not yet handed to the stager
    nbytes = 0
    stager: _Stager | None = None
    size = opts.batch_bytes
    codec = COMPRESSION[opts.compression]
    open_: dict[int, list] = {}  # partition -> [aiokafka builder, records in it]

    def seal(p: int) -> None:
        nonlocal nbytes, stager
        builder, _ = open_.pop(p)
        raw = builder.build()  # base offset 0: the target's producer sets it
        if len(raw) + 1 > _MAX_ENTRY_BYTES:
            raise ScrollWriteError(f"a row of {len(raw)} bytes (as a record batch) is over the "
                                   f"{_MAX_ENTRY_BYTES}-byte entry limit")
        built.append((p, raw))
        nbytes += len(raw)
        if stager is None and nbytes > opts.inline_bytes:
            stager = _Stager(opts, staging_name(query, batch, partition, attempt))
            out.staging = stager.name
        if stager is not None and len(built) >= 8:
            flush_to_stager()

    def flush_to_stager() -> None:
        stager.add([raw for _, raw in built])
        out.staged.extend(p for p, _ in built)
        built.clear()

    for rb in batches:
        values, keys, headers, stamps = arrow_columns(rb, cols)
        n = len(values)
        now_ms = int(time.time() * 1000)
        for i in range(n):
            key = keys[i] if keys is not None else None
            p = partition_for(key, nparts) if key is not None and nparts > 1 else keyless
            cur = open_.get(p)
            if cur is None:
                cur = open_[p] = [DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, size), 0]
            hs = extra if headers is None else headers[i] + extra
            ts = now_ms if stamps is None or stamps[i] is None else stamps[i]
            if cur[0].append(cur[1], ts, key, values[i], hs) is None:  # full: seal it, start the next
                seal(p)
                cur = open_[p] = [DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, size), 0]
                cur[0].append(0, ts, key, values[i], hs)  # the first record always goes in
            cur[1] += 1
        out.count += n
    for p in sorted(open_):
        seal(p)
    if stager is not None:
        if built:
            flush_to_stager()
        stager.finish()
    else:
        out.inline = list(built)
    return out


# ---------------------------------------------------------------------------------------- driver
async def _update_extra(client, stream: str, change) -> dict:
    """CAS ``LedgerMeta.extra`` (and nothing else) with ``change(extra)``; retries lost races."""
    ledgers = client.cluster.ledgers
    for attempt in range(100):
        meta, version = await ledgers.get_ledger(stream)
        extra = copy.deepcopy(meta.extra)
        change(extra)
        if await ledgers.cas_ledger(meta.with_(extra=extra), (), version) is not None:
            return extra
        await asyncio.sleep(min(0.2, 0.005 * (attempt + 1)))
    raise ScrollWriteError(f"could not update the commit record of stream {stream!r}: its metadata keeps changing")


async def _staged_batches(client, msgs: list[StagedOutput]):
    """Every staged record batch, message by message, as (target partition, batch bytes, count)."""
    for m in msgs:
        for p, raw in m.inline:
            yield p, raw, _batch_count(raw)
        if m.staging is None:
            continue
        c = await client.consumer(m.staging, start=0)
        entry, got, records = c.entry, 0, 0
        loop = asyncio.get_running_loop()
        stalled_since, recovered = None, False
        while got < len(m.staged):
            if entry > c.lac:
                await c.end_position()  # learns the LAC
            if entry > c.lac:
                # The LAC the bookies know can stop short of the staging producer's last acknowledged
                # entries (a producer that closes during a rollover may not push its LAC). A
                # take-over recovers the tail and publishes it; do that once, after a short wait.
                stalled_since = stalled_since or loop.time()
                if loop.time() - stalled_since < 2.0:
                    await asyncio.sleep(0.05)
                    continue
                if recovered:
                    break
                log.info("staging stream %r: %s of %s batches readable; recovering its tail", m.staging, got,
                         len(m.staged))
                p = await client.producer(m.staging)
                await p.close()
                c = await client.consumer(m.staging, start=0)
                recovered, stalled_since = True, None
                continue
            stalled_since = None
            entries = await c.read_raw(entry, c.lac)
            for e in entries:
                b = stored_batch(e.entry_id, e.data)
                if b is None:
                    continue
                if got >= len(m.staged):
                    raise ScrollWriteError(f"staging stream {m.staging!r} holds more batches than the task wrote")
                yield m.staged[got], bytes(b.batch), b.offset_count
                got += 1
                records += b.offset_count
            entry = entries[-1].entry_id + 1
        if got != len(m.staged) or records + sum(_batch_count(r) for _, r in m.inline) != m.count:
            raise ScrollWriteError(f"staging stream {m.staging!r} holds {got} readable batches ({records} records), "
                                   f"the task wrote {len(m.staged)} ({m.count} records in all)")


async def _publish_tail(client, stream: str, end: int, wait_s: float = 2.0) -> None:
    """Make sure readers can see up to offset ``end`` (exclusive) after our producer closed: if the
    LAC the bookies know stays short of it (see docs/spark.md, limitations), a take-over publishes it."""
    c = await client.consumer(stream, start="latest")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while await c.end_position() < end:
        if loop.time() > deadline:
            log.info("stream %r: LAC short of offset %s after close; taking over to publish the tail", stream, end)
            p = await client.producer(stream)
            await p.close()
            return
        await asyncio.sleep(0.05)


def _failpoint(spec: str | None, where: str, batch: int, copied: int = 0) -> None:
    """``testFailpoint`` = ``<where>:<batch>[:<n>]`` (test only): fail the commit of that batch at
    ``mid-copy`` (once at least n records are durably appended), ``after-copy`` or ``after-commit``."""
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != where or int(parts[1]) != batch:
        return
    if where == "mid-copy" and copied < int(parts[2]):
        return
    raise FailpointHit(f"scroll test failpoint {spec!r} hit")


async def _end_offsets(client, streams: list[str]) -> dict[str, int]:
    async def one(s):
        return s, (await client.consumer(s, start="latest")).position

    return dict(await asyncio.gather(*(one(s) for s in streams)))


async def _present(client, producers: dict[str, object], start: dict[str, int], tag: bytes) -> Counter:
    """Content keys of the records tagged ``tag`` in each stream from ``start[stream]`` up to what
    its (just opened) producer found: what an earlier attempt of the batch appended."""
    present: Counter = Counter()
    for s, frm in start.items():
        prod = producers.get(s)
        if prod is None or frm >= prod.next_offset:
            continue
        try:
            c = await client.consumer(s, start=frm)
        except DataRemovedError as exc:  # retention took the front: what it removed is not ours to redo
            c = await client.consumer(s, start=exc.earliest)
        entry, last = c.entry, prod.lac
        while entry <= last:
            for e in await c.read_raw(entry, last):
                entry = e.entry_id + 1
                b = stored_batch(e.entry_id, e.data)
                if b is None or b.end_offset <= frm:
                    continue
                for r in records_of(b, s, frm):
                    if _has_tag(r.headers, tag):
                        present[content_key(r.key, r.value, r.headers)] += 1
    return present


def _missing(raw: bytes, present: Counter) -> list | None:
    """The records of batch ``raw`` that ``present`` does not account for (consuming what it does),
    as append_many tuples; None when none of them is present (the batch goes as it is)."""
    from streams.batches import StoredBatch

    recs = records_of(StoredBatch(0, b"\x00" + raw))
    keys = [content_key(r.key, r.value, r.headers) for r in recs]
    if not any(present[k] > 0 for k in keys):
        return None
    out = []
    for r, k in zip(recs, keys):
        if present[k] > 0:
            present[k] -= 1
        else:
            out.append((r.value, r.key, list(r.headers), r.timestamp_ms))
    return out


async def commit_batch(opts: WriteOptions, msgs: list[StagedOutput], query: str, batch: int, exactly_once: bool):
    """Copy the staged record batches of one batch into the target (see the module docstring)."""
    client = runtime().client(opts.metadata, opts.security)
    streams = await target_streams(client, opts.stream)
    home = streams[0]  # the stream whose metadata holds the commit record
    total = sum(m.count for m in msgs)
    resume_from: dict[str, int] | None = None
    if exactly_once:
        meta, _ = await client.cluster.ledgers.get_ledger(home)
        rec = meta.extra.get(EXTRA_KEY, {}).get(query, {})
        if rec.get("batch", -1) >= batch:
            log.info("stream %r: batch %s of query %s is already committed; skipping", home, batch, query)
            return "skipped"
        if rec.get("pending") == batch:
            resume_from = dict(rec["from"])
            new = [s for s in streams if s not in resume_from]
            if new:  # partitions added since the intent: nothing of this batch is there yet
                ends = await _end_offsets(client, new)

                def widen(extra):
                    extra[EXTRA_KEY][query]["from"].update(ends)

                await _update_extra(client, home, widen)
                resume_from.update(ends)
        elif total == 0:
            return "empty"
        else:
            start = await _end_offsets(client, streams)

            def intent(extra):
                e = extra.setdefault(EXTRA_KEY, {}).setdefault(query, {})
                e.update({"pending": batch, "from": start})

            await _update_extra(client, home, intent)
    elif total == 0:
        return "empty"

    opened = await client.producer(opts.stream, _COPY_OPTIONS)
    prods = list(getattr(opened, "producers", [opened]))
    by_stream = dict(zip(streams, prods))
    try:
        present: Counter = Counter()
        if resume_from is not None:
            present = await _present(client, by_stream, resume_from, f"{query}:{batch}".encode())
            log.info("stream %r: completing batch %s of query %s: %s of %s records already there",
                     opts.stream, batch, query, sum(present.values()), total)
        futs = []
        copied = 0
        async for p, raw, count in _staged_batches(client, msgs):
            if p >= len(prods):
                raise ScrollWriteError(f"target {opts.stream!r} has {len(prods)} partitions; a task wrote to "
                                       f"partition {p}")
            prod = prods[p]
            todo = _missing(raw, present) if present else None
            if todo is None:
                await prod.wait_for_space()
                futs.append(prod.append_batch(raw)[1])
            elif todo:
                futs.append(asyncio.ensure_future(prod.append_many(todo)))
                count = len(todo)
            else:
                continue
            copied += count
            if opts.test_fail and opts.test_fail.startswith("mid-copy"):
                await asyncio.gather(*futs)
                _failpoint(opts.test_fail, "mid-copy", batch, copied)
            if len(futs) >= 1000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
        for prod in prods:
            await prod.flush()
        end = {s: prod.next_offset for s, prod in by_stream.items()}
    finally:
        await opened.close()
    for s, e in end.items():
        await _publish_tail(client, s, e)
    _failpoint(opts.test_fail, "after-copy", batch)
    if exactly_once:
        def done(extra):
            extra.setdefault(EXTRA_KEY, {})[query] = {"batch": batch, "end": end}

        await _update_extra(client, home, done)
        _failpoint(opts.test_fail, "after-commit", batch)
    return "committed"


async def delete_staging(client, query: str, up_to_batch: int, names=()) -> None:
    """Delete the named staging streams and any other of this query's batches <= ``up_to_batch``
    (left by failed task attempts or by a run that died)."""
    doomed = set(n for n in names if n)
    for m in await client.list_streams():
        b = _staging_batch(m.name, query)
        if b is not None and b <= up_to_batch:
            doomed.add(m.name)
    for n in doomed:
        try:
            await client.delete_stream(n)
        except NoSuchStream:
            pass


def _commit(opts: WriteOptions, messages, batch: int | None, exactly_once: bool) -> None:
    msgs = [m for m in messages if isinstance(m, StagedOutput)]
    if not msgs:
        return
    query = msgs[0].query
    b = msgs[0].batch if batch is None else batch
    rt = runtime()
    client = rt.client(opts.metadata, opts.security)
    for attempt in range(_COMMIT_ATTEMPTS):
        try:
            outcome = rt.run(commit_batch(opts, msgs, query, b, exactly_once), timeout=3600)
            break
        except StaleTermError:
            # Another writer took the target over mid-copy. With a commit record the retry completes
            # the batch exactly (resume path); without one (batch jobs) it would duplicate: fail.
            if not exactly_once or attempt == _COMMIT_ATTEMPTS - 1:
                raise
            log.warning("stream %r: taken over during the commit of batch %s; retrying", opts.stream, b)
    log.info("stream %r: batch %s of %s: %s (%s records)", opts.stream, b, query, outcome, sum(m.count for m in msgs))
    rt.run(delete_staging(client, query, b, [m.staging for m in msgs]), timeout=300)


def _abort(opts: WriteOptions, messages, batch: int | None) -> None:
    msgs = [m for m in messages if isinstance(m, StagedOutput)]
    if not msgs:
        return
    rt = runtime()
    b = msgs[0].batch if batch is None else batch
    rt.run(delete_staging(rt.client(opts.metadata, opts.security), msgs[0].query, b, [m.staging for m in msgs]),
           timeout=300)


def ensure_target(opts: WriteOptions) -> None:
    """On the driver when the write starts: the target must exist (or be created with createStream)."""
    rt = runtime()
    client = rt.client(opts.metadata, opts.security)

    async def go():
        try:
            await target_streams(client, opts.stream)
        except (NoSuchStream, NoSuchTopic):
            if not opts.create:
                raise ScrollOptionError(f"scroll sink: no stream named {opts.stream!r}; create it first "
                                        "(scroll stream create) or set the option createStream=true") from None
            if ":" in opts.stream:
                raise ScrollOptionError(f"scroll sink: no stream named {opts.stream!r}; createStream creates "
                                        "whole topics, not single partitions") from None
            try:
                await client.create_topic(opts.stream, opts.partitions, ensemble=opts.ensemble,
                                          write_quorum=opts.write_quorum, ack_quorum=opts.ack_quorum)
            except (StreamExists, TopicExists):
                pass

    rt.run(go(), timeout=120)


# ---------------------------------------------------------------------------------------- writers
class ScrollStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, opts: WriteOptions, cols: tuple[str, ...]):
        self.opts = opts
        self.cols = cols

    def write(self, iterator):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        query = ctx.getLocalProperty("sql.streaming.queryId") if ctx else None
        batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        if not query or batch is None:
            raise ScrollWriteError("the scroll streaming sink could not find the query id and batch id "
                                   "(TaskContext local properties sql.streaming.queryId / streaming.sql.batchId)")
        return write_task(self.opts, self.cols, iterator, query, int(batch), tagged=True)

    def commit(self, messages, batchId: int) -> None:
        _commit(self.opts, messages, batchId, exactly_once=True)

    def abort(self, messages, batchId: int) -> None:
        _abort(self.opts, messages, batchId)


class ScrollBatchWriter(DataSourceArrowWriter):
    def __init__(self, opts: WriteOptions, cols: tuple[str, ...]):
        self.opts = opts
        self.cols = cols
        self.job = f"job-{uuid.uuid4()}"

    def write(self, iterator):
        return write_task(self.opts, self.cols, iterator, self.job, 0, tagged=False)

    def commit(self, messages) -> None:
        _commit(self.opts, messages, 0, exactly_once=False)

    def abort(self, messages) -> None:
        _abort(self.opts, messages, 0)
