"""The retention job: remove the sealed fragments a stream's policy lets go, crash-safely.

    report = await run_retention(client)                       # every stream
    report = await run_retention(client, "orders", dry_run=True)
    await apply(client, "orders", keep_from=1200)              # one-shot: drop records below offset 1200

What goes is decided by the pure ``fragments.retention.evaluate`` (read its docstring for the
rules); this module gathers its inputs (the visible fragments with their first record offsets,
the floors of layers above, the timestamps of fragments' last batches) and carries the decision
out.

**Offsets.** ``keep_from``, floors, the report's ``new_earliest`` and ``DataRemovedError.earliest``
are record offsets (``streams/batches.py``). A fragment record carries its first offset when its
writer knew it; where it did not, a ``Consumer`` learns it from the entries
(``first_offset_of``: the end of the last batch before the fragment). A fragment goes only when
every record in it is below the limit, i.e. the next fragment's first offset is <= it. When the
first fragment kept is sealed and its record lacks its first offset, the mark writes it in, so the
earliest offset stays known without reading data.

**Floors.** Layers above register async callables ``(client, meta) -> int | None`` in the entry
point group ``scroll.retention_floors`` (the Kafka shim's committed consumer-group offsets, say):
the lowest record offset they still need. They are consulted unless the policy says
``respect_consumers: false``. A floor that cannot be loaded or raises makes the job skip that
stream with a warning: an error never deletes anything.

**Age** comes from the max timestamp in the header of a fragment's last batch (every stream's
entries are record batches, whoever wrote them), read through a ``Consumer`` from its replicas;
no-ops are skipped. A fragment whose last batch cannot be read has no known age, which keeps it.

**Deletion is two-phase**, so a crash at any point leaves either the old state or a state the next
run finishes:

1. *Mark.* One CAS of the ledger record that changes only ``first_fragment_index`` (to the first
   fragment kept) and ``retention["deleting"]`` = {from_index, below_index, below_entry,
   below_offset, bookies, started_ms} (in the same transaction, the first kept fragment's record
   gains its first offset if it lacked it). From here on readers see the new earliest offset at
   once (a reader below it gets ``DataRemovedError``); the removed fragments' records still exist
   but are outside the visible range. A writer's concurrent CAS (rollover, ensemble change) is rebased over this change by the
   writer (``terms.writer``: a CAS that keeps the term and only moves first_fragment_index,
   retention or extra is not a take-over); term, status, last_fragment_index and last_entry_id are
   never touched here.
2. *Trim.* Every bookie of the removed fragments' ensembles (recorded in the mark) is told to delete
   the ledger's entries ``0 .. below_entry - 1`` (idempotent); live bookies outside those ensembles
   get the same trim best-effort (they can only hold leftovers). A bookie that is down leaves the
   mark in place: the next run retries the trims before doing anything else for that stream, so no
   orphan entries stay behind on a bookie that was down (it is retried, not trimmed on restart from
   metadata). The bookie reclaims the disk space in its GC (``bookie/gc.py``: logs whose live share
   falls under ``gc_live_threshold`` are compacted, empty logs deleted).
3. *Drop.* The removed fragment records are deleted and the mark cleared in one CAS (records beyond
   one transaction's limit are deleted first, in batches; they are invisible already).

A run first finishes any mark it finds, then evaluates the policy again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from bookie.errors import BookieError
from fragments.ledgers import LedgerStore, NoSuchLedger, fragment_key, meta_key
from fragments.model import Fragment, LedgerMeta
from fragments.retention import DELETING, Decision, InvalidPolicy, Policy, evaluate
from fragments.store import MetadataError
from fragments.tier import POLICY_KEYS as TIER_KEYS
from fragments.tier import local as tier_local

from ..batches import RecordFormatError, stored_batch
from ..client import check_tier
from ..consumer import Consumer
from ..errors import InvalidArgument, NoSuchStream, ScrollError

log = logging.getLogger(__name__)

FLOOR_GROUP = "scroll.retention_floors"
_CAS_ATTEMPTS = 20
_DROP_BATCH = 100
_SCAN_BACK = 16  # entries read at a time when looking back for a fragment's last batch

Floor = Callable  # async (client, meta) -> int | None
Progress = Callable[[str, str, int, int], None]  # (stage, stream, done, total)


@dataclass
class StreamReport:
    stream: str
    ledger_id: int
    dry_run: bool = False
    fragments: list[int] = field(default_factory=list)  # indexes removed (or that would be)
    first_offset: int | None = None  # the first record offset removed
    records: int | None = 0  # record offsets removed (None: unknown)
    first_entry: int | None = None  # entry ids removed (protocol facts; no-ops count)
    last_entry: int | None = None
    entries: int = 0
    bytes: int = 0
    new_earliest: int | None = None  # the earliest record offset once removed
    new_earliest_entry: int | None = None
    kept_because: str = ""
    completed_pending: list[int] = field(default_factory=list)  # fragments of an interrupted run finished now
    pending: dict | None = None  # a mark still in place (a bookie could not be trimmed)
    skipped: str | None = None  # why nothing was done (a floor failed, bad policy, ...)
    floors: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RetentionReport:
    streams: list[StreamReport]
    dry_run: bool = False

    @property
    def fragments(self) -> int:
        return sum(len(s.fragments) for s in self.streams)

    @property
    def entries(self) -> int:
        return sum(s.entries for s in self.streams)

    @property
    def records(self) -> int:
        return sum(s.records or 0 for s in self.streams)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.streams)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "fragments": self.fragments, "records": self.records, "entries": self.entries,
                "bytes": self.bytes,
                "streams": [s.to_dict() for s in self.streams]}


class RetentionIncomplete(Exception):
    """Phase 2 could not reach every bookie: the mark stays and the next run retries."""


# ------------------------------------------------------------------------------------ floors
def load_floors(extra: Iterable[Floor] = (), *, include_entry_points: bool = True) -> list[tuple[str, Floor]]:
    """The floors of the entry point group, plus ``extra`` (tests, embedders). A floor that cannot
    be loaded is kept as one that always fails, so the streams it would protect are skipped."""
    from importlib.metadata import entry_points

    out: list[tuple[str, Floor]] = []
    for ep in entry_points(group=FLOOR_GROUP) if include_entry_points else ():
        try:
            out.append((ep.name, ep.load()))
        except Exception as exc:  # noqa: BLE001 - any import failure must block deletion, not crash the job
            out.append((ep.name, _broken_floor(ep.name, ep.value, exc)))
    for i, fn in enumerate(extra):
        out.append((getattr(fn, "__name__", f"extra-{i}"), fn))
    return out


def _broken_floor(name: str, value: str, exc: Exception) -> Floor:
    async def broken(client, meta):
        raise RuntimeError(f"retention floor {name!r} ({value}) cannot be loaded: {exc!r}")

    return broken


async def _floor_values(client, meta: LedgerMeta, floors: list[tuple[str, Floor]]) -> list[int]:
    values = []
    for name, fn in floors:
        try:
            v = fn(client, meta)
            if inspect.isawaitable(v):
                v = await v
        except Exception as exc:
            raise RuntimeError(f"retention floor {name!r} failed: {exc}") from exc
        if v is not None:
            values.append(int(v))
    return values


# ------------------------------------------------------------------------------------ the job
def wanted(meta: LedgerMeta) -> bool:
    """Whether a run can do anything for this stream, judged from its meta record alone (a
    scheduler's choice: ``scroll standalone`` runs only these). True when a removal is half done
    (its mark), when the policy does not parse (the run reports it), or when the policy can remove
    something and the stream has a fragment that may go: the last fragment never goes, so a stream
    of one fragment has nothing to remove whatever its policy."""
    if meta.retention.get(DELETING) is not None:
        return True
    try:
        policy = Policy.from_dict(_policy_part(meta.retention))
    except InvalidPolicy:
        return True
    return policy.active and meta.last_fragment_index > meta.first_fragment_index


async def run_retention(client, stream: str | None = None, dry_run: bool = False, progress: Progress | None = None,
                        *, floors: list[tuple[str, Floor]] | None = None, now_ms: int | None = None,
                        names: list[str] | None = None,
                        _fault: Callable[[str], None] | None = None) -> RetentionReport:
    """Apply every stream's retention policy (or only ``stream``'s, or only those of ``names``: a
    scheduler that knows which streams can need it, see ``wanted``). ``floors``: None loads the
    entry point group. ``_fault`` is a test hook called after each phase ("marked", "trimmed",
    "trimmed:<bookie>") that may raise to simulate a crash there."""
    floors = load_floors() if floors is None else floors
    if stream is not None:
        names = [stream]
    elif names is None:
        names = [m.name for m in await client.list_streams()]
    reports = []
    for i, name in enumerate(names):
        if progress:
            progress("stream", name, i, len(names))
        try:
            rep = await _run_stream(client, name, None, dry_run, floors, now_ms, progress, _fault)
        except NoSuchLedger:
            if stream is not None:
                raise NoSuchStream(f"no stream named {name!r}") from None
            continue  # deleted while we ran
        except MetadataError as exc:
            if stream is not None:
                raise
            log.warning("stream=%s retention skipped: %s", name, exc)  # the other streams still run
            rep = StreamReport(name, -1, dry_run, skipped=f"metadata error: {exc}")
        reports.append(rep)
    if progress:
        progress("done", "", len(names), len(names))
    return RetentionReport(reports, dry_run)


async def apply(client, stream_name: str, keep_from: int, *, dry_run: bool = False,
                floors: list[tuple[str, Floor]] | None = None, respect_consumers: bool | None = None,
                _fault: Callable[[str], None] | None = None) -> StreamReport:
    """Remove the sealed fragments whose records are all below record offset ``keep_from`` now,
    whatever the stored policy says (floors still apply unless the stream's policy, or
    ``respect_consumers``, turns them off)."""
    if not isinstance(keep_from, int) or isinstance(keep_from, bool) or keep_from < 0:
        raise InvalidArgument(f"keep_from must be a record offset >= 0, got {keep_from!r}")
    try:
        meta, _ = await client.cluster.ledgers.get_ledger(stream_name)
    except NoSuchLedger:
        raise NoSuchStream(f"no stream named {stream_name!r}") from None
    respect = Policy.from_dict(_policy_part(meta.retention)).respect_consumers if respect_consumers is None \
        else respect_consumers
    override = Policy(keep_from=keep_from, respect_consumers=respect)
    floors = load_floors() if floors is None else floors
    return await _run_stream(client, stream_name, override, dry_run, floors, None, None, _fault)


def _policy_part(retention: dict) -> dict:
    return {k: v for k, v in (retention or {}).items() if k != DELETING}


async def _run_stream(client, name: str, override: Policy | None, dry_run: bool, floors, now_ms, progress,
                      fault) -> StreamReport:
    ledgers: LedgerStore = client.cluster.ledgers
    meta, version = await ledgers.get_ledger(name)
    rep = StreamReport(name, meta.ledger_id, dry_run)
    mark = meta.retention.get(DELETING)
    if mark is not None:
        if dry_run:
            rep.pending = mark
        else:
            try:
                rep.completed_pending = await _finish(client, meta.ledger_id, mark, progress, fault)
            except RetentionIncomplete as exc:
                rep.pending, rep.skipped = mark, str(exc)
                log.warning("stream=%s retention: %s", name, exc)
                return rep
    for _attempt in range(_CAS_ATTEMPTS):
        meta, version = await ledgers.get_ledger(meta.ledger_id)
        try:
            policy = override or Policy.from_dict(_policy_part(meta.retention))
        except InvalidPolicy as exc:
            rep.skipped = f"invalid retention policy: {exc}"
            log.warning("stream=%s retention skipped: %s", name, rep.skipped)
            return rep
        if not policy.active:
            rep.kept_because = policy.inactive_reason
            return rep
        frags = await ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        try:
            fl = await _floor_values(client, meta, floors) if policy.respect_consumers else []
        except RuntimeError as exc:
            rep.skipped = str(exc)
            log.warning("stream=%s retention skipped (nothing deleted): %s", name, exc)
            return rep
        rep.floors = fl
        reader = await _reader(client, meta, frags)
        known = await _with_offsets(reader, frags)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        stamps = await _last_timestamps(reader, known, policy, now) if policy.age_s is not None else {}
        decision = evaluate(policy, known, now, fl, stamps)
        _describe(rep, decision)
        if not decision.remove or dry_run:
            return rep
        new_mark = {
            "from_index": meta.first_fragment_index,
            "below_index": decision.new_first_index,
            "below_entry": decision.new_earliest_entry,
            "below_offset": decision.new_earliest,
            "bookies": sorted({b for f in decision.remove for b in f.ensemble
                               if f.data_ledger is None and tier_local(f)}),
            "started_ms": now,
        }
        compacted = [[f.data_ledger, list(f.ensemble)] for f in decision.remove if f.data_ledger is not None]
        if compacted:  # their entries live in data ledgers of their own (streams/tools/compaction.py)
            new_mark["data_ledgers"] = compacted
        objects = [f.tier["key"] for f in decision.remove if f.tier and f.tier.get("key")]
        if objects:  # offloaded (or being offloaded) to the object store (streams/tools/tier.py)
            new_mark["objects"] = objects
        retention = dict(meta.retention)
        retention[DELETING] = new_mark
        marked = meta.with_(first_fragment_index=decision.new_first_index, retention=retention)
        stored = next(f for f in frags if f.index == decision.new_first_index)
        if not await _cas_mark(ledgers, marked, version, stored, decision.keep_first):
            continue  # the writer (or someone) changed the record: look again
        log.info("stream=%s retention: removing fragments %s..%s (offsets < %s, entries < %s)", name,
                 new_mark["from_index"], new_mark["below_index"] - 1, new_mark["below_offset"],
                 new_mark["below_entry"])
        if fault:
            fault("marked")
        try:
            await _finish(client, meta.ledger_id, new_mark, progress, fault)
        except RetentionIncomplete as exc:
            rep.pending, rep.skipped = new_mark, str(exc)
            log.warning("stream=%s retention: %s", name, exc)
        return rep
    rep.skipped = "the ledger record kept changing; retried next run"
    return rep


def _describe(rep: StreamReport, d: Decision) -> None:
    rep.fragments = [f.index for f in d.remove]
    rep.first_offset = d.remove[0].first_offset if d.remove else None
    rep.records = d.records
    rep.entries = d.entries
    rep.bytes = d.bytes
    rep.first_entry = d.remove[0].first_entry_id if d.remove else None
    rep.last_entry = d.remove[-1].last_entry_id if d.remove else None
    rep.new_earliest = d.new_earliest
    rep.new_earliest_entry = d.new_earliest_entry
    rep.kept_because = d.kept_because


async def _reader(client, meta: LedgerMeta, frags: list[Fragment]) -> Consumer:
    """A consumer over exactly the fragments being judged (it reads entries, never moves)."""
    await client.cluster.refresh_bookies(max_age_s=1.0)
    reader = Consumer(client.cluster, meta)
    reader.fragments = list(frags)
    return reader


async def _with_offsets(reader: Consumer, frags: list[Fragment]) -> list[Fragment]:
    """The fragments with every first offset the records lack filled in by the consumer (left
    None when no replica answers: ``evaluate`` keeps what it cannot decide)."""
    out = []
    for f in frags:
        if f.first_offset is None:
            try:
                f = dataclasses.replace(f, first_offset=await reader.first_offset_of(f))
            except (ScrollError, BookieError, RecordFormatError) as exc:
                log.warning("stream=%s fragment %d: first offset unknown: %s", reader.name, f.index, exc)
        out.append(f)
    return out


async def _cas_mark(ledgers: LedgerStore, marked: LedgerMeta, version: int, stored: Fragment,
                    keep_first: Fragment) -> bool:
    """The mark's CAS. If the first kept fragment is sealed and its record lacks the first offset
    the consumer learnt, the same transaction writes it in (comparing that record's version too,
    so a concurrent ensemble move is not undone)."""
    if stored.first_offset is None and keep_first.first_offset is not None and stored.sealed:
        key = fragment_key(marked.ledger_id, stored.index)
        cur = await ledgers.store.get(key)
        if cur is not None and Fragment.from_json(cur.value) == stored:
            filled = dataclasses.replace(stored, first_offset=keep_first.first_offset)
            res = await ledgers.store.txn({meta_key(marked.ledger_id): version, key: cur.version},
                                          {meta_key(marked.ledger_id): marked.to_json().encode(),
                                           key: filled.to_json().encode()})
            return res.succeeded
    return await ledgers.cas_ledger(marked, (), version) is not None


async def _finish(client, ledger_id: int, mark: dict, progress: Progress | None, fault) -> list[int]:
    """Phases 2 and 3 for a mark: trim the bookies, drop the records, clear the mark."""
    cluster = client.cluster
    below = int(mark["below_entry"])
    required = list(mark.get("bookies", []))
    regs = await cluster.refresh_bookies()
    extra = [r.bookie_id for r in regs if r.bookie_id not in required]
    failed = []
    targets = required + extra
    for i, b in enumerate(targets):
        if progress:
            progress("trim", b, i, len(targets))
        if below <= 0:
            continue
        bc = cluster.client(b)
        try:
            if bc is None:
                raise BookieError(f"bookie {b} is not registered")
            await bc.trim(ledger_id, 0, below - 1)
        except BookieError as exc:
            if b in required:
                failed.append(f"{b}: {exc}")
            else:
                log.info("ledger=%d best-effort trim on %s failed: %s", ledger_id, b, exc)
            continue
        if fault and b in required:
            fault(f"trimmed:{b}")
    if mark.get("data_ledgers"):
        from .compaction import CompactionIncomplete, delete_data_ledger
        for data_ledger, bookies in mark["data_ledgers"]:
            try:
                await delete_data_ledger(client, int(data_ledger), bookies)
            except (BookieError, CompactionIncomplete) as exc:
                failed.append(f"data ledger {data_ledger}: {exc}")
    if failed:
        raise RetentionIncomplete(f"could not trim entries < {below} on {'; '.join(failed)}; "
                                  f"the deletion mark stays and the next run retries")
    if mark.get("objects"):
        await _delete_objects(client, ledger_id, mark["objects"])
    if fault:
        fault("trimmed")
    return await _drop(cluster.ledgers, ledger_id, mark)


async def _delete_objects(client, ledger_id: int, keys: list[str]) -> None:
    """Delete the removed fragments' objects (idempotent). One the store does not delete now is
    left to the tier sweep, which deletes unreferenced objects after its grace period: retention
    does not wait for an object store that is down."""
    from ..tier.objstore import ObjectStoreError
    from .tier import delete_objects, object_store_of

    try:
        objects = await object_store_of(client)
        failed = await delete_objects(objects, keys) if objects is not None else [f"{len(keys)} objects: no store"]
    except (ObjectStoreError, MetadataError) as exc:
        failed = [str(exc)]
    if failed:
        log.warning("ledger=%d retention: objects not deleted now, the tier sweep deletes them later: %s",
                    ledger_id, "; ".join(failed)[:500])


async def _drop(ledgers: LedgerStore, ledger_id: int, mark: dict) -> list[int]:
    indexes = list(range(int(mark["from_index"]), int(mark["below_index"])))
    head, tail = indexes[:-_DROP_BATCH] if len(indexes) > _DROP_BATCH else [], indexes[-_DROP_BATCH:]
    for i in range(0, len(head), _DROP_BATCH):
        keys = tuple(fragment_key(ledger_id, j) for j in head[i:i + _DROP_BATCH])
        await ledgers.store.txn({}, {}, keys)
    for _attempt in range(_CAS_ATTEMPTS):
        meta, version = await ledgers.get_ledger(ledger_id)
        if meta.retention.get(DELETING) != mark:
            return indexes  # someone else finished it
        retention = {k: v for k, v in meta.retention.items() if k != DELETING}
        if await ledgers.cas_ledger(meta.with_(retention=retention), (), version, drop_fragments=tail) is not None:
            return indexes
    raise MetadataError(f"ledger {ledger_id}: could not clear the retention mark (the record kept changing)")


# ------------------------------------------------------------------------------------ ages
async def _last_timestamps(reader: Consumer, frags: list[Fragment], policy: Policy,
                           now_ms: int) -> dict[int, int | None]:
    """Max timestamps of the last batches of the front fragments, read only until the first one
    that is too young (or unknown): the walk in ``evaluate`` stops there anyway. A fragment that
    holds no record needs none."""
    out: dict[int, int | None] = {}
    limit = now_ms - policy.age_s * 1000
    for f, nxt in zip(frags, frags[1:]):
        if not f.sealed:
            break
        if f.first_offset is not None and nxt.first_offset == f.first_offset:
            continue  # no-ops only
        ts = await _last_batch_timestamp(reader, f)
        out[f.index] = ts
        if ts is None or ts > limit:
            break
    return out


async def fragment_last_timestamp(cluster, meta: LedgerMeta, f: Fragment) -> int | None:
    """The max timestamp of the last batch in sealed fragment ``f`` (None: no batch readable)."""
    await cluster.refresh_bookies(max_age_s=1.0)
    reader = Consumer(cluster, meta)
    reader.fragments = await cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                       meta.last_fragment_index)
    return await _last_batch_timestamp(reader, f)


async def _last_batch_timestamp(reader: Consumer, f: Fragment) -> int | None:
    hi = f.last_entry_id
    try:
        while hi is not None and hi >= f.first_entry_id:
            lo = max(f.first_entry_id, hi - _SCAN_BACK + 1)
            got, at = [], lo
            while at <= hi:
                part = await reader.read_raw(at, hi)
                if not part:
                    break
                got.extend(part)
                at = part[-1].entry_id + 1
            for e in reversed(got):
                b = stored_batch(e.entry_id, e.data)
                if b is not None:
                    return b.max_timestamp
            hi = lo - 1
    except (ScrollError, BookieError, RecordFormatError) as exc:
        log.info("stream=%s fragment %d: age unknown: %s", reader.name, f.index, exc)
    return None


async def set_policy(client, stream_name: str, changes: dict) -> LedgerMeta:
    """Merge ``changes`` (None values remove a setting) into the stream's retention policy, by CAS
    of the ``retention`` field only."""
    def edit(retention: dict) -> None:
        for k, v in changes.items():
            if v is None:
                retention.pop(k, None)
            else:
                retention[k] = v

    return await _update_policy(client, stream_name, edit)


async def raise_keep_from(client, stream_name: str, offset: int) -> LedgerMeta:
    """Set ``keep_from`` to ``offset`` unless it is already at or above it (one CAS: concurrent
    callers never lower it)."""
    def edit(retention: dict) -> None:
        cur = retention.get("keep_from")
        if not isinstance(cur, int) or cur < offset:
            retention["keep_from"] = offset

    return await _update_policy(client, stream_name, edit)


async def _update_policy(client, stream_name: str, edit: Callable[[dict], None]) -> LedgerMeta:
    ledgers: LedgerStore = client.cluster.ledgers
    for _attempt in range(_CAS_ATTEMPTS):
        try:
            meta, version = await ledgers.get_ledger(stream_name)
        except NoSuchLedger:
            raise NoSuchStream(f"no stream named {stream_name!r}") from None
        retention = dict(meta.retention)
        edit(retention)
        if retention == meta.retention:
            return meta
        try:
            Policy.from_dict(_policy_part(retention))
        except InvalidPolicy as exc:
            raise InvalidArgument(str(exc)) from exc
        if any(meta.retention.get(k) != retention.get(k) for k in (*TIER_KEYS, "max_age_s", "max_bytes")):
            check_tier(meta.retention, retention)  # the tier policy with the limits (fragments/tier.py), as Kafka
        new = meta.with_(retention=retention)
        if await ledgers.cas_ledger(new, (), version) is not None:
            return new
        await asyncio.sleep(0.01)
    raise MetadataError(f"stream {stream_name!r}: the ledger record kept changing")
