"""The compaction job: Kafka's log compaction on a stream's sealed fragments, crash-safely.

    report = await run_compaction(client)                        # every stream whose policy compacts
    report = await run_compaction(client, "orders", dry_run=True)

What a pass keeps is decided batch by batch by the sans-IO ``streams.cleaner`` (read its docstring
for Kafka's rules); which fragments a pass may touch and when, by the policy
(``fragments.compaction``). This module reads, writes and switches, in the lifecycle shape every
fragment job keeps (``shared/design/LIFECYCLE.md``): decide from metadata, do the slow work outside
it, switch by one compare-and-set, clean up idempotently.

**Cleanable range.** The sealed fragments from the log start, never the last fragment (the one
being written), never past a fragment whose last batch is younger than ``min_compaction_lag_ms``
and never past an open transaction (the cleaner's safe points: the fragment end before the first
transaction whose marker is not yet written). The dirty part is what lies at or above the
previous pass's end (``compaction.cleaned_to``). A pass runs when the dirty share of the
cleanable bytes exceeds ``min_cleanable_dirty_ratio``, or the oldest dirty record is older than
``max_compaction_lag_ms`` (or when asked with ``force``).

**One owner, replicated by the quorum.** A pass is done once per stream, by the one job holding
the stream's claim (``compaction.claim`` in the ledger record, taken by compare-and-set, with an
expiry so a crashed job's claim lapses). Its output is written through an ordinary ledger writer
onto an ensemble, replicated and acknowledged by the write quorum like any entry: bookies never
compact on their own, so no replica can disagree about which records a pass removed.

**Steps, and what a crash at each leaves.**

1. *Claim* (one CAS). A crash leaves a claim that lapses after ``claim_ttl_s``.
2. *Write* each changed fragment's new entries into a fresh **data ledger** named
   ``__compacted/<ledger id>/<started ms>-<pass id>-<fragment index>``: one entry per original
   entry (a removed batch becomes a hole) so entry ids map one to one, sealed, then read back and
   compared (CRC-32C of every entry). A crash leaves data ledgers nothing references: the sweep
   deletes them once older than ``grace_s`` (their names say whose they are and when they were
   made).
3. *Switch* (one CAS per up to 100 fragments, a prefix each time): each changed fragment's record
   now names its data ledger, first entry there and ensemble; same index, entry ids and first
   offset. Readers see either the old records or the new ones, and both hold every surviving
   record at the same offset: a reader inside a fragment being replaced finds its entry missing
   once the old copies go, re-reads the fragment records and goes on at the same entry id in
   the new data, skipping and repeating nothing (records are returned by offset, not by entry).
   The same CAS records what the switch superseded (the stream's own entries below the range's
   end, the data ledgers of an earlier pass) under ``compaction.superseded``.
4. *Clean up*: trim the superseded entries on their bookies, delete superseded data ledgers, and
   clear the list (one CAS). A crash leaves the list, finished by the next run first.

Retention composes: it removes a prefix of fragment records, compacted or not, and deletes the data
ledgers of those it removes (``streams/tools/retention.py``); both only move the log start
forward. A stream deleted whole leaves data ledgers the sweep deletes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import struct
import time
import uuid
from dataclasses import asdict, dataclass, field

from crc32c import crc32c

from bookie.errors import BookieError
from fragments.compaction import COMPACTION, DATA_LEDGER_PREFIX, CompactionPolicy, InvalidCompactionPolicy
from fragments.ledgers import LedgerStore, NoSuchLedger
from fragments.model import Fragment, LedgerConfig, LedgerMeta
from fragments.placement import BookieInfo, NotEnoughBookies, Placement
from fragments.store import MetadataError
from terms import entry as entry_codec

from ..batches import OFF_FIRST_TIMESTAMP, stored_batch
from ..cleaner import HOLE, DirtyScan, Rewriter, delete_horizon
from ..consumer import Consumer
from ..driver import ProducerOptions, WriterDriver
from ..errors import NoSuchStream, ScrollError
from .retention import _last_batch_timestamp, _with_offsets

log = logging.getLogger(__name__)

DATA_PREFIX = DATA_LEDGER_PREFIX
CLAIM_TTL_S = 600.0
# A data ledger is swept only once older than the grace, and a pass switches only while its claim
# (taken when its data ledgers are named) is unexpired: with the grace beyond the claim's life, a
# sweep never deletes what a pass may still switch in.
GRACE_S = CLAIM_TTL_S + 60.0
SCAN_CACHE_BYTES = 64 << 20  # dirty entries kept from the scan for the rewrite (not read twice)
_CAS_ATTEMPTS = 20
_SWITCH_BATCH = 100  # fragment records per switch transaction (etcd allows 128 writes)
_READ_CHUNK = 1000
_I64 = struct.Struct(">q")


class CompactionIncomplete(Exception):
    """A step could not finish (a bookie down, a lost CAS): the next run goes on from the metadata."""


@dataclass
class StreamCompaction:
    stream: str
    ledger_id: int
    dry_run: bool = False
    due: bool = False
    why: str = ""
    dirty_ratio: float = 0.0
    cleanable_fragments: list[int] = field(default_factory=list)
    rewritten_fragments: list[int] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    records_in: int = 0
    records_out: int = 0
    tombstones_dropped: int = 0
    markers_dropped: int = 0
    cleaned_to: int | None = None
    lag_ms: int | None = None  # age of the oldest dirty record
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def bytes_reclaimed(self) -> int:
        return max(0, self.bytes_in - self.bytes_out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bytes_reclaimed"] = self.bytes_reclaimed
        return d


@dataclass
class CompactionReport:
    streams: list[StreamCompaction]
    dry_run: bool = False
    swept: list[str] = field(default_factory=list)  # unreferenced data ledgers the sweep deleted

    @property
    def bytes_reclaimed(self) -> int:
        return sum(s.bytes_reclaimed for s in self.streams)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "bytes_reclaimed": self.bytes_reclaimed, "swept": self.swept,
                "streams": [s.to_dict() for s in self.streams]}


def is_data_ledger(name: str) -> bool:
    return name.startswith(DATA_PREFIX)


async def job_targets(client, stream: str | None, metas: list[LedgerMeta] | None,
                      names: set[str] | None) -> tuple[list[LedgerMeta], list[LedgerMeta] | None]:
    """What a lifecycle run (compaction, offload) acts on, and the ledger records it knows: only
    ``stream``'s record (``NoSuchStream`` if there is none; no records listed), or every user stream
    of ``metas`` (listed here when None) that ``names`` holds, when given."""
    ledgers: LedgerStore = client.cluster.ledgers
    if stream is not None:
        try:
            return [(await ledgers.get_ledger(stream))[0]], metas
        except NoSuchLedger:
            raise NoSuchStream(f"no stream named {stream!r}") from None
    metas = await ledgers.list_ledgers() if metas is None else metas
    return [m for m in metas if not is_data_ledger(m.name) and (names is None or m.name in names)], metas


def _data_name(ledger_id: int, started_ms: int, pass_id: str, index: int) -> str:
    return f"{DATA_PREFIX}{ledger_id:012d}/{started_ms}-{pass_id}-{index}"


def _parse_data_name(name: str) -> tuple[int, int, str] | None:
    """(owner ledger id, made at ms, pass id) of a data ledger's name."""
    try:
        owner, rest = name[len(DATA_PREFIX):].split("/", 1)
        ms, pass_id, _index = rest.split("-", 2)
        return int(owner), int(ms), pass_id
    except ValueError:
        return None


def wanted(meta: LedgerMeta) -> bool:
    """Whether a run can do anything for this stream, judged from its meta record alone (a
    scheduler's choice: ``scroll standalone`` compacts only these): its policy does not parse (the
    run reports it), or it compacts (or was compacted) and has a pass's leftovers to clean or a
    sealed fragment before the last (only those are ever cleanable)."""
    if is_data_ledger(meta.name):
        return False
    try:
        policy = CompactionPolicy.from_dict(meta.retention)
    except InvalidCompactionPolicy:
        return True
    state = meta.retention.get(COMPACTION) or {}
    if not policy.compact and not state:
        return False
    return bool(state.get("superseded")) or meta.last_fragment_index > meta.first_fragment_index


async def run_compaction(client, stream: str | None = None, dry_run: bool = False, *, force: bool = False,
                         now_ms: int | None = None, grace_s: float = GRACE_S, claim_ttl_s: float = CLAIM_TTL_S,
                         metas: list[LedgerMeta] | None = None, names: set[str] | None = None,
                         _fault=None) -> CompactionReport:
    """Compact every stream whose policy says ``compact`` (or only ``stream``), when due (``force``:
    whatever the dirty ratio), and sweep data ledgers nothing references. ``metas``: every ledger
    record as the caller knows them (``scroll standalone``: its watched catalog), else they are listed
    here. ``names``: compact only these streams (a scheduler's choice, see ``wanted``); the sweep of
    data ledgers still looks at every record of ``metas``. ``_fault(step)`` is a test hook called after each step ("claimed",
    "written", "switched a chunk", "switched", "trimmed") that may raise to simulate a crash there."""
    targets, metas = await job_targets(client, stream, metas, names)
    reports = []
    for m in targets:
        try:
            policy = CompactionPolicy.from_dict(m.retention)
        except InvalidCompactionPolicy as exc:
            reports.append(StreamCompaction(m.name, m.ledger_id, dry_run, skipped=f"invalid policy: {exc}"))
            continue
        if not policy.compact and not m.retention.get(COMPACTION):
            continue
        try:
            rep = await compact_stream(client, m.name, policy, dry_run=dry_run, force=force, now_ms=now_ms,
                                       claim_ttl_s=claim_ttl_s, _fault=_fault)
        except NoSuchLedger:
            continue
        except (MetadataError, ScrollError, BookieError, CompactionIncomplete) as exc:
            if stream is not None and not isinstance(exc, CompactionIncomplete):
                raise
            log.warning("stream=%s compaction skipped: %s", m.name, exc)
            rep = StreamCompaction(m.name, m.ledger_id, dry_run, skipped=str(exc))
        reports.append(rep)
    swept = await sweep(client, metas, grace_s=grace_s, now_ms=now_ms) if stream is None and not dry_run else []
    return CompactionReport(reports, dry_run, swept)


async def compact_stream(client, name: str, policy: CompactionPolicy | None = None, *, dry_run: bool = False,
                         force: bool = False, now_ms: int | None = None, claim_ttl_s: float = CLAIM_TTL_S,
                         _fault=None) -> StreamCompaction:
    """One stream's pass, when due (``force``: whatever the dirty ratio); see the module docstring."""
    started = time.monotonic()
    ledgers: LedgerStore = client.cluster.ledgers
    meta, _ = await ledgers.get_ledger(name)
    policy = policy or CompactionPolicy.from_dict(meta.retention)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rep = StreamCompaction(name, meta.ledger_id, dry_run)
    state = dict(meta.retention.get(COMPACTION) or {})
    if state.get("superseded") and not dry_run:
        await _clean_superseded(client, meta.ledger_id)
        meta, _ = await ledgers.get_ledger(meta.ledger_id)
        state = dict(meta.retention.get(COMPACTION) or {})
    if not policy.compact:
        rep.why = "cleanup.policy does not compact"
        return rep
    frags = await ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
    reader = await _reader(client, meta, frags)
    frags = await _with_offsets(reader, frags)
    cleaned_to = int(state.get("cleaned_to", 0))
    ends = {a.index: b.first_offset for a, b in zip(frags, frags[1:])}  # one past each fragment's records
    cleanable = await _cleanable(reader, frags, policy, now, cleaned_to)
    rep.cleanable_fragments = [f.index for f in cleanable]
    dirty = [f for f in cleanable if ends[f.index] > cleaned_to]
    total = sum(f.size_bytes or 0 for f in cleanable)
    dirty_bytes = sum(f.size_bytes or 0 for f in dirty)
    rep.dirty_ratio = dirty_bytes / total if total else 0.0
    if dirty:
        first_ts = await _first_timestamp(reader, dirty[0])
        rep.lag_ms = None if first_ts is None else max(0, now - first_ts)
    if not dirty:
        rep.why = "nothing dirty in the cleanable range"
        return rep
    over_lag = (policy.max_compaction_lag_ms is not None and rep.lag_ms is not None
                and rep.lag_ms >= policy.max_compaction_lag_ms)
    if force:
        rep.due, rep.why = True, "forced"
    elif rep.dirty_ratio > policy.min_cleanable_dirty_ratio:
        rep.due, rep.why = True, f"dirty ratio {rep.dirty_ratio:.2f} > {policy.min_cleanable_dirty_ratio:g}"
    elif over_lag:
        rep.due, rep.why = True, f"dirty record {rep.lag_ms} ms old >= max.compaction.lag.ms"
    else:
        rep.why = f"dirty ratio {rep.dirty_ratio:.2f} <= {policy.min_cleanable_dirty_ratio:g}"
        return rep
    if dry_run:
        return rep
    pass_id = uuid.uuid4().hex[:12]
    meta = await _claim(ledgers, meta.ledger_id, pass_id, now, claim_ttl_s)
    if meta is None:
        rep.skipped, rep.due = "another compaction holds this stream's claim", False
        return rep
    try:
        if _fault:
            _fault("claimed")
        await _pass(client, reader, meta, ends, cleanable, dirty, policy, now, pass_id, rep, _fault)
    finally:
        try:
            await _release(ledgers, meta.ledger_id, pass_id)
        except (MetadataError, NoSuchLedger) as exc:
            log.warning("stream=%s compaction: claim not released (it lapses by itself): %s", name, exc)
    rep.seconds = time.monotonic() - started
    return rep


async def _pass(client, reader: Consumer, meta: LedgerMeta, ends: dict[int, int], cleanable, dirty, policy, now,
                pass_id, rep, fault) -> None:
    # scan: the offset map over the dirty fragments, up to the last safe point; their entries are
    # kept for the rewrite while they fit SCAN_CACHE_BYTES
    scan = DirtyScan()
    cache: dict[int, list] = {}
    cached_bytes = 0
    for f in dirty:
        entries = [e async for e in _entries(reader, f)]
        scan.fragment([b for e in entries if (b := stored_batch(e.entry_id, e.data)) is not None])
        size = sum(len(e.data) for e in entries)
        if cached_bytes + size <= SCAN_CACHE_BYTES:
            cache[f.index] = entries
            cached_bytes += size
        if scan.full:
            break
    safe = dirty[:scan.safe_fragments]
    if not safe:
        rep.why += "; an open transaction starts in the first dirty fragment"
        return
    end_index = safe[-1].index
    rewriter = Rewriter(scan, now, policy.delete_retention_ms)
    written: list[tuple[Fragment, Fragment]] = []  # (old record, new record) not switched in yet
    try:
        for f in (f for f in cleanable if f.index <= end_index):
            entries = cache.pop(f.index, None) or [e async for e in _entries(reader, f)]
            out = rewriter.fragment(entries)
            rep.bytes_in += out.bytes_in
            rep.records_in += out.records_in
            rep.records_out += out.records_out
            rep.tombstones_dropped += out.tombstones_dropped
            rep.markers_dropped += out.markers_dropped
            if not out.changed:
                rep.bytes_out += out.bytes_in
                continue
            new = await _write_data_ledger(client, meta, f, out.entries, now, pass_id)
            written.append((f, new))
            rep.bytes_out += new.size_bytes or 0
            rep.rewritten_fragments.append(f.index)
        if fault:
            fault("written")
        await _switch(client, meta.ledger_id, pass_id, written, ends[end_index], now, fault)
        rep.cleaned_to = ends[end_index]
    finally:
        for _old, new in written:  # not switched in: nothing references them (the sweep's job if this fails)
            try:
                await _delete_data_ledger(client, new.data_ledger, new.ensemble)
            except (BookieError, CompactionIncomplete, MetadataError) as exc:
                log.warning("stream=%s: unused data ledger %s left to the sweep: %s", meta.name, new.data_ledger, exc)
    if fault:
        fault("switched")
    await _clean_superseded(client, meta.ledger_id, fault)


async def _cleanable(reader: Consumer, frags: list[Fragment], policy: CompactionPolicy, now: int,
                     cleaned_to: int) -> list[Fragment]:
    """The sealed prefix a pass may touch: up to the first fragment that is not sealed, is the
    last, or holds a record younger than ``min_compaction_lag_ms`` (what an earlier pass cleaned
    stays cleanable)."""
    out = []
    for f, nxt in zip(frags, frags[1:]):
        if not f.sealed or f.first_offset is None or nxt.first_offset is None:
            break
        if policy.min_compaction_lag_ms and nxt.first_offset > max(f.first_offset, cleaned_to):
            # dirty records: the newest one's age decides
            ts = await _last_batch_timestamp(reader, f)
            if ts is None or ts > now - policy.min_compaction_lag_ms:
                break
        out.append(f)
    return out


async def _first_timestamp(reader: Consumer, f: Fragment) -> int | None:
    async for e in _entries(reader, f):
        b = stored_batch(e.entry_id, e.data)
        if b is not None:  # a dirty batch has no delete horizon: its base timestamp is its first record's
            return None if delete_horizon(b) is not None else _I64.unpack_from(b.data, 1 + OFF_FIRST_TIMESTAMP)[0]
    return None


async def _entries(reader: Consumer, f: Fragment):
    at = f.first_entry_id
    while at <= f.last_entry_id:
        got = await reader.read_raw(at, min(f.last_entry_id, at + _READ_CHUNK - 1))
        if not got:
            raise CompactionIncomplete(f"stream {reader.name!r}: no replica served entry {at}")
        for e in got:
            yield e
        at = got[-1].entry_id + 1


async def _reader(client, meta: LedgerMeta, frags: list[Fragment]) -> Consumer:
    await client.cluster.refresh_bookies(max_age_s=1.0)
    reader = Consumer(client.cluster, meta, read_ahead=False)
    reader.fragments = list(frags)  # only sealed fragments are read: every entry is at or below the LAC
    return reader


# ------------------------------------------------------------------------------------ claim
async def _edit_state(ledgers: LedgerStore, ledger_id: int, edit) -> LedgerMeta | None:
    """CAS the stream's compaction state: ``edit(meta, state)`` changes ``state`` (a copy) and says
    whether to write it (False: leave the record alone and return None). Retried on conflict."""
    for _attempt in range(_CAS_ATTEMPTS):
        meta, version = await ledgers.get_ledger(ledger_id)
        state = dict(meta.retention.get(COMPACTION) or {})
        if not edit(meta, state):
            return None
        new = meta.with_(retention={**meta.retention, COMPACTION: state})
        if await ledgers.cas_ledger(new, (), version) is not None:
            return new
    raise MetadataError(f"ledger {ledger_id}: the compaction state kept changing")


async def _claim(ledgers: LedgerStore, ledger_id: int, pass_id: str, now: int, ttl_s: float) -> LedgerMeta | None:
    def edit(_meta, state) -> bool:
        claim = state.get("claim")
        if claim and claim.get("until_ms", 0) > now:
            return False
        state["claim"] = {"pass": pass_id, "until_ms": int(now + ttl_s * 1000)}
        return True

    return await _edit_state(ledgers, ledger_id, edit)


async def _release(ledgers: LedgerStore, ledger_id: int, pass_id: str) -> None:
    def edit(_meta, state) -> bool:
        if (state.get("claim") or {}).get("pass") != pass_id:
            return False
        del state["claim"]
        return True

    await _edit_state(ledgers, ledger_id, edit)


# ------------------------------------------------------------------------------------ write
async def _write_data_ledger(client, meta: LedgerMeta, f: Fragment, entries: list, now: int,
                             pass_id: str) -> Fragment:
    """Write ``entries`` into a fresh data ledger, seal it, read it back and compare; the new record
    of ``f`` that names it."""
    cluster = client.cluster
    entries = [HOLE if entry_codec.is_noop(d) else d for d in entries]  # a no-op's term means nothing there
    await cluster.refresh_bookies(max_age_s=1.0)
    c = meta.config
    config = LedgerConfig(c.write_quorum, c.write_quorum, c.ack_quorum, 1 << 62, 1 << 62)
    live = [BookieInfo(b.bookie_id, b.rack) for b in cluster.live() if not getattr(b, "read_only", False)]
    try:
        ens = Placement(random.Random(), live).choose(config.ensemble_size)
    except NotEnoughBookies as exc:
        raise CompactionIncomplete(f"cannot place a data ledger: {exc}") from exc
    name = _data_name(meta.ledger_id, now, pass_id, f.index)
    await cluster.ledgers.create_ledger(name, config, tuple(ens), {"owner": meta.ledger_id})
    driver = WriterDriver(cluster, name, ProducerOptions())
    await driver.open()
    first = None
    try:
        futs = []
        for data in entries:
            payload = bytes(data[1:])
            while not driver.can_append(len(payload) + 1):
                await driver.wait_for_space()
            futs.append(driver.append_nowait(payload))
        ids = await asyncio.gather(*futs)
        first = ids[0]
        if ids != list(range(first, first + len(ids))):
            raise CompactionIncomplete(f"data ledger {name}: entries not contiguous")
    except BaseException:
        await driver.close()
        await _delete_data_ledger(client, None, (), name=name)
        raise
    await driver.close(seal=True)
    dmeta, _ = await cluster.ledgers.get_ledger(name)
    dfrags = await cluster.ledgers.fragments(dmeta.ledger_id, dmeta.first_fragment_index, dmeta.last_fragment_index)
    holders = [g for g in dfrags if g.contains(first) and g.contains(first + len(entries) - 1)]
    if not holders:  # an ensemble changed while writing: one fragment must hold them all
        await _delete_data_ledger(client, dmeta.ledger_id, tuple({b for g in dfrags for b in g.ensemble}))
        raise CompactionIncomplete(f"data ledger {name}: its entries span fragments; retried next run")
    g = holders[0]
    try:
        await _verify(cluster, dmeta, first, entries)
    except BaseException:
        await _delete_data_ledger(client, dmeta.ledger_id, g.ensemble)
        raise
    return dataclasses.replace(f, data_ledger=dmeta.ledger_id, data_first_entry=first, ensemble=g.ensemble,
                               created_term=g.created_term, size_bytes=sum(len(d) - 1 for d in entries),
                               compacted_ms=now)


async def _verify(cluster, dmeta: LedgerMeta, first: int, entries: list) -> None:
    """Read every entry back from the sealed data ledger and compare CRC-32C."""
    reader = Consumer(cluster, dmeta, read_ahead=False)
    reader.fragments = await cluster.ledgers.fragments(dmeta.ledger_id, dmeta.first_fragment_index,
                                                       dmeta.last_fragment_index)
    reader.lac = dmeta.last_entry_id
    last = first + len(entries) - 1
    at = first
    while at <= last:
        got = await reader.read_raw(at, min(last, at + _READ_CHUNK - 1))
        if not got:
            raise CompactionIncomplete(f"data ledger {dmeta.name}: entry {at} could not be read back")
        for e in got:
            if crc32c(bytes(e.data)) != crc32c(bytes(entries[e.entry_id - first])):
                raise CompactionIncomplete(f"data ledger {dmeta.name}: entry {e.entry_id} read back differs")
        at = got[-1].entry_id + 1


# ------------------------------------------------------------------------------------ switch
async def _switch(client, ledger_id: int, pass_id: str, written: list, end_offset: int, now: int,
                  fault=None) -> None:
    """Name the data ledgers in the fragment records, a prefix at a time (``written`` loses each
    chunk once switched in). Each CAS checks that this pass still holds an unexpired claim (the
    sweep may delete the data ledgers of a pass whose claim lapsed) and that the records are those
    it read; it records what the new records supersede."""
    ledgers: LedgerStore = client.cluster.ledgers
    while True:
        chunk = written[:_SWITCH_BATCH]
        last_chunk = len(written) <= _SWITCH_BATCH
        for _attempt in range(_CAS_ATTEMPTS):
            meta, version = await ledgers.get_ledger(ledger_id)
            state = dict(meta.retention.get(COMPACTION) or {})
            claim = state.get("claim") or {}
            if claim.get("pass") != pass_id or claim.get("until_ms", 0) <= time.time() * 1000:
                raise CompactionIncomplete("the pass's claim lapsed before its switch; the pass is dropped")
            puts, superseded = [], list(state.get("superseded") or [])
            for old, new in chunk:
                cur = await ledgers.get_fragment(ledger_id, old.index) if old.index >= meta.first_fragment_index \
                    else None
                if cur is None:  # retention removed it meanwhile: its new data is not needed
                    superseded.append({"ledger": new.data_ledger, "bookies": list(new.ensemble)})
                    continue
                if cur != old:
                    raise CompactionIncomplete(f"fragment {old.index} changed during the pass")
                puts.append(new)
                if old.data_ledger is not None:  # an earlier pass's data ledger
                    superseded.append({"ledger": old.data_ledger, "bookies": list(old.ensemble)})
                else:  # the stream's own entries of this fragment (unchanged fragments keep theirs)
                    superseded.append({"ledger": ledger_id, "first_entry": old.first_entry_id,
                                       "last_entry": old.last_entry_id, "bookies": list(old.ensemble)})
            state["superseded"] = superseded
            if last_chunk:
                state["cleaned_to"] = max(int(state.get("cleaned_to", 0)), end_offset)
                state["last_run_ms"] = now
            new_meta = meta.with_(retention={**meta.retention, COMPACTION: state})
            if await ledgers.cas_ledger(new_meta, tuple(puts), version) is not None:
                break
        else:
            raise CompactionIncomplete("the ledger record kept changing; retried next run")
        del written[:len(chunk)]
        if last_chunk:
            return
        if fault:
            fault("switched a chunk")


# ------------------------------------------------------------------------------------ clean up
async def _clean_superseded(client, ledger_id: int, fault=None) -> None:
    """Trim or delete what switches superseded, then drop those items from the list (one CAS);
    an item whose bookies cannot all be reached stays for the next run."""
    meta, _ = await client.cluster.ledgers.get_ledger(ledger_id)
    items = list((meta.retention.get(COMPACTION) or {}).get("superseded") or [])
    if not items:
        return
    done = []
    for item in items:
        try:
            if item["ledger"] == ledger_id:
                await _trim(client, ledger_id, int(item["first_entry"]), int(item["last_entry"]), item["bookies"])
            else:
                await _delete_data_ledger(client, int(item["ledger"]), tuple(item.get("bookies", [])))
            done.append(item)
        except (BookieError, CompactionIncomplete) as exc:
            log.warning("stream ledger=%d: superseded data not removed yet (retried next run): %s", ledger_id, exc)
    if fault:
        fault("trimmed")

    def edit(_meta, state) -> bool:
        left = [i for i in (state.get("superseded") or []) if i not in done]
        if left:
            state["superseded"] = left
        else:
            state.pop("superseded", None)
        return True

    await _edit_state(client.cluster.ledgers, ledger_id, edit)


async def _trim(client, ledger_id: int, first: int, last: int, bookies) -> None:
    """Delete entries first..last of the stream on the bookies that held them (each must answer),
    and best-effort on every other live bookie (which can only hold leftovers)."""
    cluster = client.cluster
    regs = await cluster.refresh_bookies(max_age_s=1.0)
    for b in list(bookies) + [r.bookie_id for r in regs if r.bookie_id not in bookies]:
        bc = cluster.client(b)
        try:
            if bc is None:
                raise CompactionIncomplete(f"bookie {b} is not registered")
            await bc.trim(ledger_id, first, last)
        except (BookieError, CompactionIncomplete):
            if b in bookies:
                raise
            log.info("ledger=%d best-effort trim of %d..%d on %s failed", ledger_id, first, last, b)


async def _delete_data_ledger(client, data_ledger: int | None, bookies, *, name: str | None = None) -> None:
    """Delete a data ledger's entries on its bookies, then its metadata (idempotent)."""
    cluster = client.cluster
    ledgers: LedgerStore = cluster.ledgers
    if data_ledger is None and name is not None:
        try:
            meta, _ = await ledgers.get_ledger(name)
        except NoSuchLedger:
            return
        data_ledger = meta.ledger_id
    try:
        meta, _ = await ledgers.get_ledger(data_ledger)
        frags = await ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        bookies = set(bookies) | {b for f in frags for b in f.ensemble}
    except NoSuchLedger:
        meta = None
    await cluster.refresh_bookies(max_age_s=1.0)
    for b in sorted(bookies):
        bc = cluster.client(b)
        if bc is None:
            raise CompactionIncomplete(f"bookie {b} is not registered")
        await bc.delete_ledger(data_ledger)
    if meta is not None:
        try:
            await ledgers.delete_ledger(meta.name)
        except NoSuchLedger:
            pass


async def delete_data_ledger(client, data_ledger: int, bookies) -> None:
    """Delete one data ledger (retention removing a compacted fragment); idempotent."""
    await _delete_data_ledger(client, data_ledger, tuple(bookies))


async def sweep(client, metas: list[LedgerMeta] | None = None, *, grace_s: float = GRACE_S,
                now_ms: int | None = None) -> list[str]:
    """Delete data ledgers that no fragment references and no pass in progress may still switch
    in, once older than ``grace_s`` (an interrupted pass's output, a deleted stream's data)."""
    ledgers: LedgerStore = client.cluster.ledgers
    metas = await ledgers.list_ledgers() if metas is None else metas
    now = int(time.time() * 1000) if now_ms is None else now_ms
    by_id = {m.ledger_id: m for m in metas if not is_data_ledger(m.name)}
    referenced: dict[int, set[int]] = {}
    removed = []
    for m in metas:
        if not is_data_ledger(m.name):
            continue
        parsed = _parse_data_name(m.name)
        if parsed is None:
            continue
        owner_id, made_ms, pass_id = parsed
        if now - made_ms < grace_s * 1000:
            continue
        owner = by_id.get(owner_id)
        if owner is not None:
            claim = (owner.retention.get(COMPACTION) or {}).get("claim") or {}
            if claim.get("pass") == pass_id and claim.get("until_ms", 0) > now:
                continue
            if owner_id not in referenced:
                try:
                    frags = await ledgers.fragments(owner_id, owner.first_fragment_index, owner.last_fragment_index)
                except (NoSuchLedger, MetadataError):
                    continue
                referenced[owner_id] = {f.data_ledger for f in frags if f.data_ledger is not None}
                superseded = (owner.retention.get(COMPACTION) or {}).get("superseded") or []
                referenced[owner_id] |= {int(i["ledger"]) for i in superseded}
            if m.ledger_id in referenced[owner_id]:
                continue
        try:
            await _delete_data_ledger(client, m.ledger_id, ())
            removed.append(m.name)
            log.info("compaction sweep: deleted unreferenced data ledger %s", m.name)
        except (BookieError, CompactionIncomplete, MetadataError) as exc:
            log.warning("compaction sweep: %s not deleted yet: %s", m.name, exc)
    return removed
