"""The writing side of the ``scroll`` data source: batch and streaming writers that append rows to
one stream, exactly once per micro-batch.

Why staging. A stream has exactly one writer: opening a producer takes the stream over (a new
term), and a writer that was taken over fails. Spark runs a batch as many tasks on many executors,
so tasks cannot all append to the target: they would fence each other. Instead:

1. Each task (``write``, on an executor) encodes its rows as Scroll records. Up to
   ``stageInlineBytes`` (default 1 MiB) of them travel back to the driver inside the task's
   commit message; beyond that the task writes them to its own *staging stream*
   ``_spark.<query>.<batch>.<partition>.<attempt>`` (same replication as the target) and the
   message names it. Streaming rows carry one extra header, ``scroll.spark.batch`` =
   ``<queryId>:<batchId>``, which marks the micro-batch that wrote them.
2. The driver's ``commit(messages, batchId)`` is the only writer of the target. Using the commit
   record this query keeps in the target's ``LedgerMeta.extra["spark"][queryId]``:

   * ``batch >= batchId``: the batch was already committed (Spark replays the last batch after a
     restart); nothing is appended.
   * otherwise it records an *intent* ``{"pending": batchId, "from": P}`` by CAS, where ``P`` is
     the target's end position before the copy (a lower bound of where the copy lands), opens one
     producer, appends every staged record, flushes, closes, and CASes the record to
     ``{"batch": batchId, "end": E}``.
   * if the record already shows ``pending == batchId``, an earlier attempt crashed between the
     intent and the final CAS, possibly mid-copy. The records of the batch that made it are found
     by scanning the target from ``P`` for the batch's header, and only the missing ones are
     appended (matched by content: key, value and headers, as a multiset — so a re-executed batch
     whose rows come back in another order is still completed exactly). A take-over in between
     truncated any unacknowledged tail, so what the scan sees is final.

   Then the staging streams of this and earlier batches of the query are deleted. ``abort``
   deletes the batch's staging streams.

The metadata CASes change ``extra`` only (third parties may touch only ``first_fragment_index``,
``retention`` and ``extra``), and run while no producer of ours is open.

The query id is Spark's ``queryId`` (stable across restarts from the same checkpoint), which
executors see as the local property ``sql.streaming.queryId``; the batch id is
``streaming.sql.batchId``. The commit process on the driver gets both from the messages.

Batch (non-streaming) writes use the same staging and single-producer copy, with a fresh job id
and no commit record: a failed job that is re-run may append twice (as Kafka's batch sink).

Cost: every row is written twice when staged (inline rows once plus a trip through the driver),
and each committed micro-batch is one take-over of the target (one no-op position) plus two CASes.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType, TimestampType

from streams import records
from streams.errors import NoSuchStream, StaleTermError, StreamExists
from terms import entry as entry_codec

from .options import STAGING_PREFIX, ScrollOptionError, WriteOptions
from .runtime import runtime

log = logging.getLogger("spark_stream")

BATCH_HEADER = "scroll.spark.batch"
EXTRA_KEY = "spark"
_COMMIT_ATTEMPTS = 5


class ScrollWriteError(RuntimeError):
    """A row or a commit the sink cannot take (the batch fails and nothing of it is appended)."""


class FailpointHit(RuntimeError):
    """Raised by the test-only ``testFailpoint`` option."""


@dataclass
class StagedOutput(WriterCommitMessage):
    """What one task wrote: records inline, or the name of its staging stream."""

    query: str
    batch: int
    partition: int
    attempt: int
    count: int
    inline: list[bytes] = field(default_factory=list)
    staging: str | None = None


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


def _bytes(v, what: str) -> bytes | None:
    if v is None or isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytearray, memoryview)):
        return bytes(v)
    raise ScrollWriteError(f"{what} must be binary or string, got {type(v).__name__}")


def encode_row(row, cols: tuple[str, ...], extra_headers: list) -> bytes:
    d = row.asDict() if hasattr(row, "asDict") else dict(row)
    lower = {k.lower(): d[k] for k in cols}
    value = _bytes(lower.get("value"), "value")
    if value is None:
        raise ScrollWriteError("the scroll sink cannot write a row whose value is null")
    key = _bytes(lower.get("key"), "key")
    headers = []
    for h in lower.get("headers") or ():
        hk = h["key"]
        if hk is None:
            raise ScrollWriteError("a header key is null")
        headers.append((str(hk), _bytes(h["value"], f"header {hk!r}")))
    ts = lower.get("timestamp")
    ts_ms = int(ts.timestamp() * 1000) if isinstance(ts, datetime) else None
    return records.encode(value, key, headers + extra_headers, ts_ms)


def content_key(payload: bytes) -> bytes:
    """What identifies a copied record for completion after a crash: key, value and user headers."""
    r = records.decode(payload)
    user = [(k, v) for k, v in r.headers if k != BATCH_HEADER]
    return hashlib.blake2b(records.encode(r.value, r.key, user, 0), digest_size=16).digest()


def _has_tag(payload: bytes, tag: bytes) -> bool:
    if tag not in payload:  # cheap pre-check before decoding
        return False
    return any(k == BATCH_HEADER and v == tag for k, v in records.decode(payload).headers)


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


# ---------------------------------------------------------------------------------------- executors
class _Stager:
    """Appends one task's records to its own staging stream (async client on the runtime loop)."""

    def __init__(self, opts: WriteOptions, name: str):
        self.rt = runtime()
        self.client = self.rt.client(opts.metadata)
        self.name = name
        self.opts = opts
        self.futs: list = []
        self.producer = self.rt.run(self._open(), timeout=120)

    async def _open(self):
        target = await self.client.describe_stream(self.opts.stream)
        cfg = target.meta.config
        for _ in range(3):
            try:
                await self.client.create_stream(self.name, ensemble=cfg.ensemble_size, write_quorum=cfg.write_quorum,
                                                ack_quorum=cfg.ack_quorum)
                break
            except StreamExists:  # left by an earlier run of this batch that died: it is garbage
                await self.client.delete_stream(self.name)
        return await self.client.producer(self.name)

    def add(self, entries: list[bytes]) -> None:
        async def go():
            for e in entries:
                self.futs.append(await self.producer.append_raw(e))

        self.rt.run(go(), timeout=300)

    def finish(self) -> None:
        async def go():
            await asyncio.gather(*self.futs)
            await self.producer.close()

        self.rt.run(go(), timeout=300)


def write_task(opts: WriteOptions, cols: tuple[str, ...], iterator, query: str, batch: int,
               tagged: bool) -> StagedOutput:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx else 0
    attempt = ctx.attemptNumber() if ctx else 0
    extra = [(BATCH_HEADER, f"{query}:{batch}".encode())] if tagged else []
    out = StagedOutput(query, batch, partition, attempt, 0)
    buf: list[bytes] = []
    nbytes = 0
    stager: _Stager | None = None
    for row in iterator:
        raw = encode_row(row, cols, extra)
        out.count += 1
        buf.append(raw)
        nbytes += len(raw)
        if stager is None and nbytes > opts.inline_bytes:
            stager = _Stager(opts, staging_name(query, batch, partition, attempt))
            out.staging = stager.name
        if stager is not None and len(buf) >= 1000:
            stager.add(buf)
            buf = []
    if stager is not None:
        if buf:
            stager.add(buf)
        stager.finish()
    else:
        out.inline = buf
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


async def _staged_payloads(client, msgs: list[StagedOutput]):
    """Every staged record, message by message, as record payloads (envelope removed)."""
    for m in msgs:
        for raw in m.inline:
            yield raw
        if m.staging is None:
            continue
        c = await client.consumer(m.staging, start=0)
        pos, got = 0, 0
        loop = asyncio.get_running_loop()
        stalled_since, recovered = None, False
        while got < m.count:
            end = await c.end_position()
            if pos >= end:
                # The LAC the bookies know can stop short of the staging producer's last acknowledged
                # entries (a producer that closes during a rollover may not push its LAC). A
                # take-over recovers the tail and publishes it; do that once, after a short wait.
                stalled_since = stalled_since or loop.time()
                if loop.time() - stalled_since < 2.0:
                    await asyncio.sleep(0.05)
                    continue
                if recovered:
                    break
                log.info("staging stream %r: %s of %s records readable; recovering its tail", m.staging, got, m.count)
                p = await client.producer(m.staging)
                await p.close()
                c = await client.consumer(m.staging, start=pos)
                recovered, stalled_since = True, None
                continue
            stalled_since = None
            entries = await c.read_raw(pos, end - 1)
            for e in entries:
                if not entry_codec.is_noop(e.data):
                    got += 1
                    yield entry_codec.payload_of(e.data)
            pos = entries[-1].entry_id + 1
        if got != m.count:
            raise ScrollWriteError(f"staging stream {m.staging!r} holds {got} readable records, the task wrote "
                                   f"{m.count}")


async def _publish_tail(client, stream: str, end: int, wait_s: float = 2.0) -> None:
    """Make sure readers can see up to ``end`` (exclusive) after our producer closed: if the LAC the
    bookies know stays short of it (see docs/spark.md, limitations), a take-over publishes it."""
    c = await client.consumer(stream, start=0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while await c.end_position() < end:
        if loop.time() > deadline:
            log.info("stream %r: LAC short of %s after close; taking over to publish the tail", stream, end)
            p = await client.producer(stream)
            await p.close()
            return
        await asyncio.sleep(0.05)


def _failpoint(spec: str | None, where: str, batch: int, copied: int = 0) -> None:
    """``testFailpoint`` = ``<where>:<batch>[:<n>]`` (test only): fail the commit of that batch at
    ``mid-copy`` (after n records are durably appended), ``after-copy`` or ``after-commit``."""
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != where or int(parts[1]) != batch:
        return
    if where == "mid-copy" and copied < int(parts[2]):
        return
    raise FailpointHit(f"scroll test failpoint {spec!r} hit")


async def commit_batch(opts: WriteOptions, msgs: list[StagedOutput], query: str, batch: int, exactly_once: bool):
    """Copy the staged records of one batch into the target (see the module docstring)."""
    client = runtime().client(opts.metadata)
    stream = opts.stream
    total = sum(m.count for m in msgs)
    resume_from = None
    if exactly_once:
        meta, _ = await client.cluster.ledgers.get_ledger(stream)
        rec = meta.extra.get(EXTRA_KEY, {}).get(query, {})
        if rec.get("batch", -1) >= batch:
            log.info("stream %r: batch %s of query %s is already committed; skipping", stream, batch, query)
            return "skipped"
        if rec.get("pending") == batch:
            resume_from = int(rec["from"])
        elif total == 0:
            return "empty"
        else:
            c = await client.consumer(stream, start=0)
            start = await c.end_position()

            def intent(extra):
                e = extra.setdefault(EXTRA_KEY, {}).setdefault(query, {})
                e.update({"pending": batch, "from": start})

            await _update_extra(client, stream, intent)
    elif total == 0:
        return "empty"

    producer = await client.producer(stream)
    try:
        present: Counter = Counter()
        if resume_from is not None:
            tag = f"{query}:{batch}".encode()
            c = await client.consumer(stream, start=resume_from)
            pos, last = resume_from, producer.lac
            while pos <= last:
                entries = await c.read_raw(pos, last)
                for e in entries:
                    if not entry_codec.is_noop(e.data):
                        p = entry_codec.payload_of(e.data)
                        if _has_tag(p, tag):
                            present[content_key(p)] += 1
                pos = entries[-1].entry_id + 1
            log.info("stream %r: completing batch %s of query %s: %s of %s records already there",
                     stream, batch, query, sum(present.values()), total)
        futs = []
        copied = 0
        async for payload in _staged_payloads(client, msgs):
            if present:
                k = content_key(payload)
                if present[k] > 0:
                    present[k] -= 1
                    continue
            futs.append(await producer.append_raw(payload))
            copied += 1
            if len(futs) >= 20_000:  # bound what is held; the producer keeps its own window anyway
                await asyncio.gather(*futs)
                futs = []
            if opts.test_fail and opts.test_fail.startswith("mid-copy"):
                await asyncio.gather(*futs)
                _failpoint(opts.test_fail, "mid-copy", batch, copied)
        await asyncio.gather(*futs)
        await producer.flush()
        end = producer.lac + 1
    finally:
        await producer.close()
    await _publish_tail(client, stream, end)
    _failpoint(opts.test_fail, "after-copy", batch)
    if exactly_once:
        def done(extra):
            extra.setdefault(EXTRA_KEY, {})[query] = {"batch": batch, "end": end}

        await _update_extra(client, stream, done)
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
    client = rt.client(opts.metadata)
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
    rt.run(delete_staging(rt.client(opts.metadata), msgs[0].query, b, [m.staging for m in msgs]), timeout=300)


def ensure_target(opts: WriteOptions) -> None:
    """On the driver when the write starts: the target must exist (or be created with createStream)."""
    rt = runtime()
    client = rt.client(opts.metadata)

    async def go():
        try:
            await client.describe_stream(opts.stream)
        except NoSuchStream:
            if not opts.create:
                raise ScrollOptionError(f"scroll sink: no stream named {opts.stream!r}; create it first "
                                        "(scroll stream create) or set the option createStream=true") from None
            try:
                await client.create_stream(opts.stream, ensemble=opts.ensemble, write_quorum=opts.write_quorum,
                                           ack_quorum=opts.ack_quorum)
            except StreamExists:
                pass

    rt.run(go(), timeout=120)


# ---------------------------------------------------------------------------------------- writers
class ScrollStreamWriter(DataSourceStreamWriter):
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


class ScrollBatchWriter(DataSourceWriter):
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
