"""The offload job: sealed fragments copied to the object store, bookie copies released by the
local policy, crash-safely and with no orphan objects.

    report = await run_tier(client)                       # every stream with remote storage on
    report = await run_tier(client, "orders", dry_run=True)

It keeps the lifecycle shape every fragment job keeps (``shared/design/LIFECYCLE.md``): decide from
metadata (``fragments.tier``: which fragments to offload, which to release), do the slow work
outside it, move each fragment's record one step by compare-and-set, clean up idempotently.

**Steps of one fragment, and what a crash at each leaves** (each CAS is on the stream's ledger
record, so it also fails when anything else changed the stream meanwhile; the fragment record is
re-read and checked after every conflict):

1. *Intent* (CAS ``tier = uploading{key, uid, until_ms}``) before the first byte is sent. The key
   names the stream, the fragment and the attempt. The intent is also the fragment's claim: a
   second offloader leaves a fragment alone while another's intent is unexpired. A crash leaves
   the intent; once it expires the next run looks for its object: a whole, valid object is adopted
   (step 3), anything else is deleted and the upload redone under a new intent.
2. *Upload*: the fragment's entries read from its bookies into one object (``streams.tier.segment``:
   batches back to back, index, footer), sent with **one conditional PUT** (``If-None-Match``):
   no multipart upload to leave behind, and a key is never overwritten.
3. *Verify, then switch* (CAS ``tier = offloaded{key, size, crc, offsets, local: true}``): the
   object's size is checked by a HEAD and its footer and index read back and compared with what
   was built. A CAS lost because the fragment is gone (retention removed it, the stream was
   deleted) or taken by another attempt deletes this attempt's object.
4. *Release*, when the local policy lets the fragment go (``fragments.tier.to_release``): CAS
   ``local: false, trimmed: false`` — from then on readers use the object — then the bookie
   copies are trimmed and a last CAS drops ``trimmed``. A crash leaves ``trimmed: false``: the
   next run trims again (trims are idempotent).

**Sweep.** Objects under the tier's prefix that no fragment record references (neither as its
offloaded object nor as its current intent) are deleted once older than ``grace_s``: an upload
cut by a crash after its PUT and whose intent was replaced, a stream deleted whole. An object's
owner is decidable from its name alone (``<prefix>/<ledger id>/<fragment index>.<uid>.seg``).

Retention deletes the objects of the fragments it removes (``streams/tools/retention.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field

from bookie.errors import BookieError
from fragments import tier as tierpolicy
from fragments.ledgers import LedgerStore, NoSuchLedger
from fragments.model import Fragment, LedgerMeta, LedgerStatus
from fragments.retention import InvalidPolicy
from fragments.retention import Policy as RetentionPolicy
from fragments.store import MetadataError
from fragments.tier import OFFLOADED, TIER_CONFIG_KEY, UPLOADING, TierPolicy

from ..consumer import Consumer
from ..errors import NoSuchStream, ScrollError
from ..tier.objstore import ObjectExists, ObjectMissing, ObjectStore, ObjectStoreError, TierConfig
from ..tier.segment import FOOTER_BYTES, SegmentBuilder, SegmentFormatError, verify
from .compaction import CompactionIncomplete, _trim, delete_data_ledger, is_data_ledger, job_targets
from .retention import _last_batch_timestamp, _with_offsets

log = logging.getLogger(__name__)

INTENT_TTL_S = 600.0  # an upload intent older than this is someone's crash
GRACE_S = INTENT_TTL_S + 60.0  # the sweep spares younger objects: an upload may still switch them in
_CAS_ATTEMPTS = 20
_READ_CHUNK = 1000


class TierIncomplete(Exception):
    """A step could not finish (a bookie or the store down, a lost CAS): the next run goes on from
    the metadata."""


@dataclass
class StreamTier:
    stream: str
    ledger_id: int
    dry_run: bool = False
    to_offload: list[int] = field(default_factory=list)  # fragment indexes
    offloaded: list[int] = field(default_factory=list)
    adopted: list[int] = field(default_factory=list)  # objects of an interrupted upload, verified and kept
    to_release: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    bytes_offloaded: int = 0
    bytes_released: int = 0
    skipped: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TierReport:
    streams: list[StreamTier]
    dry_run: bool = False
    swept: list[str] = field(default_factory=list)
    configured: bool = True

    @property
    def bytes_offloaded(self) -> int:
        return sum(s.bytes_offloaded for s in self.streams)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "configured": self.configured, "bytes_offloaded": self.bytes_offloaded,
                "swept": self.swept, "streams": [s.to_dict() for s in self.streams]}


# ------------------------------------------------------------------------------ the tier's store
async def load_tier_config(store) -> TierConfig | None:
    """The cluster's object store settings (``fragments.tier.TIER_CONFIG_KEY``), or None."""
    got = await store.get(TIER_CONFIG_KEY)
    return TierConfig.from_dict(json.loads(got.value)) if got is not None else None


async def save_tier_config(store, config: TierConfig) -> None:
    """Name the cluster's object store (never its secrets: those stay in a file or the environment)."""
    await store.put(TIER_CONFIG_KEY, json.dumps(config.to_dict(), sort_keys=True).encode())


async def object_store_of(client) -> ObjectStore | None:
    cfg = await load_tier_config(client.cluster.store)
    return ObjectStore(cfg) if cfg is not None else None


# ------------------------------------------------------------------------------------ the job
def wanted(meta: LedgerMeta) -> bool:
    """Whether a run can do anything for this stream, judged from its meta record alone (a
    scheduler's choice: ``scroll standalone`` offloads only these): its policy does not parse (the
    run reports it), or remote storage is on and it has a sealed fragment (one before the last, or
    a closed stream's last)."""
    if is_data_ledger(meta.name):
        return False
    try:
        policy = TierPolicy.from_dict(meta.retention)
    except tierpolicy.InvalidTierPolicy:
        return True
    return policy.remote_storage_enable and (meta.last_fragment_index > meta.first_fragment_index
                                             or meta.status == LedgerStatus.CLOSED)


async def run_tier(client, stream: str | None = None, dry_run: bool = False, *, objects: ObjectStore | None = None,
                   now_ms: int | None = None, grace_s: float = GRACE_S, intent_ttl_s: float = INTENT_TTL_S,
                   metas: list[LedgerMeta] | None = None, names: set[str] | None = None,
                   sweep_objects: bool = True, _fault=None) -> TierReport:
    """Offload and release what the streams' tier policies ask for (or only ``stream``'s), then
    sweep unreferenced objects. ``objects``: the object store (default: the cluster's, from its
    metadata). ``sweep_objects``: also list the store and delete unreferenced objects (a whole-cluster
    run only; a LIST of every object, so schedulers do it less often). ``metas``: every ledger record as
    the caller knows them (else listed here); ``names``: offload only these streams (a scheduler's
    choice, see ``wanted``). ``_fault(step, fragment)`` is a test hook called at each step ("intent", "putting" (just
    before the PUT), "put", "offloaded", "released", "trimmed"); it may raise, or block, to simulate a
    crash there."""
    objects = objects or await object_store_of(client)
    targets, metas = await job_targets(client, stream, metas, names)
    if objects is None:
        asked = [m.name for m in targets if TierPolicy.from_dict(_safe(m.retention)).remote_storage_enable]
        if asked:
            log.warning("remote storage is on for %d stream(s) (%s) but the cluster has no object store "
                        "configured: nothing offloaded", len(asked), ", ".join(asked[:5]))
        return TierReport([], dry_run, configured=False)
    reports = []
    for m in targets:
        try:
            policy = TierPolicy.from_dict(m.retention)
        except tierpolicy.InvalidTierPolicy as exc:
            reports.append(StreamTier(m.name, m.ledger_id, dry_run, skipped=f"invalid policy: {exc}"))
            continue
        if not policy.remote_storage_enable:
            continue
        try:
            rep = await tier_stream(client, objects, m.name, policy, dry_run=dry_run, now_ms=now_ms,
                                    intent_ttl_s=intent_ttl_s, _fault=_fault)
        except NoSuchLedger:
            continue
        except (MetadataError, ScrollError, BookieError, TierIncomplete, ObjectStoreError,
                CompactionIncomplete) as exc:
            if stream is not None and not isinstance(exc, (TierIncomplete, ObjectStoreError)):
                raise
            log.warning("stream=%s offload stopped (bookie copies kept; retried next run): %s", m.name, exc)
            rep = StreamTier(m.name, m.ledger_id, dry_run, skipped=str(exc))
        reports.append(rep)
    swept: list[str] = []
    if stream is None and not dry_run and sweep_objects:
        try:
            swept = await sweep(client, objects, metas, grace_s=grace_s, now_ms=now_ms)
        except (ObjectStoreError, MetadataError) as exc:
            log.warning("tier sweep stopped (retried next run): %s", exc)
    return TierReport(reports, dry_run, swept)


def _safe(retention: dict) -> dict:
    try:
        TierPolicy.from_dict(retention)
        return retention
    except tierpolicy.InvalidTierPolicy:
        return {}


async def tier_stream(client, objects: ObjectStore, name: str, policy: TierPolicy | None = None, *,
                      dry_run: bool = False, now_ms: int | None = None, intent_ttl_s: float = INTENT_TTL_S,
                      _fault=None) -> StreamTier:
    started = time.monotonic()
    ledgers: LedgerStore = client.cluster.ledgers
    meta, _ = await ledgers.get_ledger(name)
    policy = policy or TierPolicy.from_dict(meta.retention)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rep = StreamTier(name, meta.ledger_id, dry_run)
    frags = await ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
    reader = await _reader(client, meta, frags)
    frags = await _with_offsets(reader, frags)
    try:
        total = RetentionPolicy.from_dict(meta.retention)
    except InvalidPolicy:
        total = RetentionPolicy()
    stamps = await _stamps(reader, frags, policy, total, now)
    offload = tierpolicy.to_offload(frags, policy, now, stamps)
    rep.to_offload = [f.index for f in offload]
    # fragments already offloaded whose release a crash interrupted: trim them first
    for f in frags:
        if tierpolicy.remote_only(f) and f.tier.get("trimmed") is False and not dry_run:
            await _trim_released(client, meta.ledger_id, f, _fault)
    if not dry_run:
        for f in offload:
            done = await offload_fragment(client, objects, meta, f, reader, now=now, intent_ttl_s=intent_ttl_s,
                                          _fault=_fault)
            if done is None:
                break  # in order: a fragment another offloader holds stops this run here
            kind, size = done
            (rep.adopted if kind == "adopted" else rep.offloaded).append(f.index)
            rep.bytes_offloaded += size
        try:
            meta, _ = await ledgers.get_ledger(meta.ledger_id)
        except NoSuchLedger:
            rep.skipped = "the stream was deleted during the run"
            return rep
        frags = await _with_offsets(reader, await ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                                    meta.last_fragment_index))
        stamps = await _stamps(reader, frags, policy, total, now)
    release = tierpolicy.to_release(frags, policy, total, now, stamps)
    rep.to_release = [f.index for f in release]
    if not dry_run:
        for f in release:
            if await release_fragment(client, meta.ledger_id, f, _fault):
                rep.released.append(f.index)
                rep.bytes_released += f.size_bytes or 0
    rep.seconds = time.monotonic() - started
    return rep


async def _stamps(reader: Consumer, frags: list[Fragment], policy: TierPolicy, total: RetentionPolicy,
                  now: int) -> dict[int, int | None]:
    """Newest record timestamps of the fragments the policy's ages need: an offloaded fragment's
    comes from its record (the object's footer), the others' from their last batch, read only up
    to the first one too young to offload."""
    out: dict[int, int | None] = {}
    local_age = policy.local_limits(total)[0] is not None
    need_lag = bool(policy.offload_lag_ms)
    for f in frags:
        if tierpolicy.offloaded(f):
            if local_age:
                ts = f.tier.get("max_timestamp")
                out[f.index] = ts if ts is not None and ts >= 0 else None
            continue
        if not need_lag or not f.sealed:
            break
        ts = await _last_batch_timestamp(reader, f)
        out[f.index] = ts
        if ts is None or ts > now - policy.offload_lag_ms:
            break
    return out


async def _reader(client, meta: LedgerMeta, frags: list[Fragment]) -> Consumer:
    await client.cluster.refresh_bookies(max_age_s=1.0)
    reader = Consumer(client.cluster, meta, read_ahead=False)
    reader.fragments = list(frags)
    return reader


# ------------------------------------------------------------------------------ one fragment
async def _edit_fragment(ledgers: LedgerStore, ledger_id: int, index: int, edit) -> Fragment | None:
    """CAS one fragment record: ``edit(fragment)`` returns its new record, or None to leave it (then
    None is returned). A fragment retention removed is ``NoSuchFragment``-free: None too."""
    for _attempt in range(_CAS_ATTEMPTS):
        try:
            meta, version = await ledgers.get_ledger(ledger_id)
        except NoSuchLedger:  # the stream was deleted
            return None
        if index < meta.first_fragment_index or index > meta.last_fragment_index:
            return None
        cur = await ledgers.get_fragment(ledger_id, index)
        new = edit(cur)
        if new is None:
            return None
        if await ledgers.cas_ledger(meta, (new,), version) is not None:
            return new
    raise TierIncomplete(f"ledger {ledger_id}: the record kept changing; retried next run")


async def offload_fragment(client, objects: ObjectStore, meta: LedgerMeta, f: Fragment, reader: Consumer, *,
                           now: int, intent_ttl_s: float = INTENT_TTL_S, _fault=None) -> tuple[str, int] | None:
    """Steps 1-3 for one sealed fragment: ("offloaded" | "adopted", object bytes), or None when another
    offloader's unexpired intent holds it (or it is gone)."""
    ledgers: LedgerStore = client.cluster.ledgers
    lid = meta.ledger_id
    cfg = objects.config
    # an earlier attempt's intent: leave it to its owner while it lives, else adopt or undo it
    if tierpolicy.state(f) == UPLOADING:
        if f.tier.get("until_ms", 0) > now:
            return None
        old_key = f.tier["key"]
        adopted = await _adopt(objects, lid, f, old_key)
        if adopted is not None:
            return await _switch(client, objects, lid, f, old_key, adopted, "adopted", _fault)
        await objects.delete(old_key)  # a cut or damaged attempt: undo it
    uid = uuid.uuid4().hex[:12]
    key = cfg.key(tierpolicy.object_name(lid, f.index, uid))
    intent = {"state": UPLOADING, "key": key, "uid": uid, "started_ms": now,
              "until_ms": int(now + intent_ttl_s * 1000)}
    def mark(cur: Fragment) -> Fragment | None:  # unchanged since listed (by tier state and extent)
        same = (cur.tier == f.tier and cur.sealed and cur.last_entry_id == f.last_entry_id
                and cur.data_ledger == f.data_ledger)
        return cur.with_(tier=intent) if same else None

    marked = await _edit_fragment(ledgers, lid, f.index, mark)
    if marked is None:
        return None
    try:
        if _fault:
            await _hook(_fault, "intent", f)
        body, footer = await _build(reader, f)
        if _fault:
            await _hook(_fault, "putting", f)
        try:
            await objects.put_if_absent(key, body)
        except ObjectExists:  # a retried PUT whose first try landed (the key is this attempt's own): checked next
            log.info("stream ledger=%d fragment %d: %s already there; checking it", lid, f.index, key)
        if _fault:
            await _hook(_fault, "put", f)
        try:
            await _check_uploaded(objects, key, body, footer)
        except ObjectMissing:  # deleted under us: by retention removing the fragment, or the stream's deletion?
            cur = await _edit_fragment(ledgers, lid, f.index, lambda c: c if (c.tier or {}).get("key") == key else None)
            if cur is None:
                return None
            raise TierIncomplete(f"object {key} vanished right after its upload") from None
    except (ObjectStoreError, TierIncomplete, BookieError, ScrollError) as exc:
        # the upload failed (store down, wrong credentials, a bookie gone): withdraw the intent so the
        # next run retries at once; an object a timed-out PUT may have left is the sweep's
        with contextlib.suppress(Exception):
            await _edit_fragment(ledgers, lid, f.index,
                                 lambda c: c.with_(tier=f.tier) if (c.tier or {}).get("key") == key else None)
        raise exc from None
    return await _switch(client, objects, lid, marked, key, footer, "offloaded", _fault)


async def _build(reader: Consumer, f: Fragment):
    sb = SegmentBuilder(f.first_entry_id, f.created_term)
    at = f.first_entry_id
    while at <= f.last_entry_id:
        got = await reader.read_raw(at, min(f.last_entry_id, at + _READ_CHUNK - 1))
        if not got:
            raise TierIncomplete(f"stream {reader.name!r}: no replica served entry {at} of fragment {f.index}")
        for e in got:
            sb.add(e.entry_id, e.data)
        at = got[-1].entry_id + 1
    body, footer = sb.finish(first_offset_hint=f.first_offset)
    if f.first_offset is not None and footer.points and footer.first_offset != f.first_offset:
        raise TierIncomplete(f"fragment {f.index}: first batch at offset {footer.first_offset}, the record says "
                             f"{f.first_offset}")
    return body, footer


async def _check_uploaded(objects: ObjectStore, key: str, body: bytes, footer) -> None:
    """A HEAD (the size) and the tail read back (footer and index equal to what was sent)."""
    size, _etag = await objects.head(key)
    if size != len(body):
        raise TierIncomplete(f"object {key}: {size} bytes stored, {len(body)} sent")
    tail_len = footer.meta_len + FOOTER_BYTES
    tail = await objects.get_range(key, size - tail_len, size)
    if bytes(tail) != body[len(body) - tail_len:]:
        raise TierIncomplete(f"object {key}: its index read back differs from what was sent")


async def _adopt(objects: ObjectStore, lid: int, f: Fragment, key: str):
    """The footer of an interrupted attempt's object if it is whole, valid and this fragment's; None
    if it is missing or not usable."""
    try:
        data = await objects.get(key)
    except ObjectMissing:
        return None
    try:
        footer = verify(data, key)
    except SegmentFormatError as exc:
        log.warning("stream ledger=%d fragment %d: interrupted upload %s unusable (%s): redone", lid, f.index, key, exc)
        return None
    if (footer.first_entry, footer.last_entry, footer.created_term) != (f.first_entry_id, f.last_entry_id,
                                                                        f.created_term):
        return None
    return footer


async def _switch(client, objects: ObjectStore, lid: int, marked: Fragment, key: str, footer, kind: str,
                  fault) -> tuple[str, int] | None:
    done = {"state": OFFLOADED, "key": key, "size": footer.size, "crc": footer.body_crc,
            "first_offset": footer.first_offset, "end_offset": footer.end_offset,
            "max_timestamp": footer.max_timestamp, "offloaded_ms": int(time.time() * 1000), "local": True}

    adopted_by_other = []

    def switch(cur: Fragment) -> Fragment | None:
        t = cur.tier or {}
        if t.get("state") == OFFLOADED and t.get("key") == key:
            adopted_by_other.append(True)  # another run found this upload whole and switched it in
            return None
        if t.get("state") != UPLOADING or t.get("key") != key:
            return None
        return cur.with_(tier=done)

    new = await _edit_fragment(client.cluster.ledgers, lid, marked.index, switch)
    if adopted_by_other:
        return None
    if new is None:  # the fragment is gone or another attempt took it over: this object is nobody's
        await objects.delete(key)
        log.info("stream ledger=%d fragment %d: upload %s no longer wanted; object deleted", lid, marked.index, key)
        return None
    if fault:
        await _hook(fault, "offloaded", marked)
    return kind, footer.size


async def release_fragment(client, lid: int, f: Fragment, fault=None) -> bool:
    """Step 4: readers switch to the object (CAS), then the bookie copies go."""
    def release(cur: Fragment) -> Fragment | None:
        if not tierpolicy.offloaded(cur) or cur.tier.get("local") is False or cur.tier.get("key") != f.tier["key"]:
            return None
        return cur.with_(tier={**cur.tier, "local": False, "trimmed": False, "released_ms": int(time.time() * 1000)})

    new = await _edit_fragment(client.cluster.ledgers, lid, f.index, release)
    if new is None:
        return False
    if fault:
        await _hook(fault, "released", f)
    await _trim_released(client, lid, new, fault)
    return True


async def _trim_released(client, lid: int, f: Fragment, fault=None) -> None:
    try:
        if f.data_ledger is not None:
            await delete_data_ledger(client, f.data_ledger, f.ensemble)
        else:
            await _trim(client, lid, f.first_entry_id, f.last_entry_id, f.ensemble)
    except (BookieError, CompactionIncomplete) as exc:
        log.warning("stream ledger=%d fragment %d: bookie copies not trimmed yet (retried next run): %s", lid,
                    f.index, exc)
        return
    if fault:
        await _hook(fault, "trimmed", f)

    def trimmed(cur: Fragment) -> Fragment | None:
        if not tierpolicy.remote_only(cur) or "trimmed" not in cur.tier:
            return None
        t = dict(cur.tier)
        del t["trimmed"]
        return cur.with_(tier=t)

    await _edit_fragment(client.cluster.ledgers, lid, f.index, trimmed)


async def _hook(fault, step: str, f: Fragment) -> None:
    r = fault(step, f)
    if asyncio.iscoroutine(r):
        await r


# ------------------------------------------------------------------------------------ sweep
async def sweep(client, objects: ObjectStore, metas: list[LedgerMeta] | None = None, *, grace_s: float = GRACE_S,
                now_ms: int | None = None) -> list[str]:
    """Delete objects no fragment record references (as offloaded or as its current intent), once
    older than ``grace_s``."""
    ledgers: LedgerStore = client.cluster.ledgers
    metas = await ledgers.list_ledgers() if metas is None else metas
    by_id = {m.ledger_id: m for m in metas}
    now = int(time.time() * 1000) if now_ms is None else now_ms
    listed = await objects.list(objects.config.key(""))
    referenced: dict[int, set[str]] = {}
    removed = []
    for key, _size, modified_ms in listed:
        parsed = tierpolicy.parse_object_name(key)
        if parsed is None or now - modified_ms < grace_s * 1000:
            continue
        lid = parsed[0]
        owner = by_id.get(lid)
        if owner is not None:
            if lid not in referenced:
                try:
                    frags = await ledgers.fragments(lid, owner.first_fragment_index, owner.last_fragment_index)
                except (NoSuchLedger, MetadataError):
                    continue
                referenced[lid] = {f.tier["key"] for f in frags if f.tier and f.tier.get("key")}
            if key in referenced[lid]:
                continue
        elif await _exists(ledgers, lid):  # created after the listing: not ours to judge
            continue
        await objects.delete(key)
        removed.append(key)
        log.info("tier sweep: deleted unreferenced object %s", key)
    return removed


async def _exists(ledgers: LedgerStore, lid: int) -> bool:
    try:
        await ledgers.get_ledger(lid)
        return True
    except NoSuchLedger:
        return False


async def delete_objects(objects: ObjectStore, keys) -> list[str]:
    """Delete objects (idempotent); the keys that could not be deleted."""
    failed = []
    results = await asyncio.gather(*(objects.delete(k) for k in keys), return_exceptions=True)
    for k, r in zip(keys, results):
        if isinstance(r, Exception):
            failed.append(f"{k}: {r}")
    return failed


async def tier_status(client, stream: str | None = None) -> list[dict]:
    """Per stream: how many fragments (and bytes) are where."""
    ledgers: LedgerStore = client.cluster.ledgers
    if stream is not None:
        try:
            metas = [(await ledgers.get_ledger(stream))[0]]
        except NoSuchLedger:
            raise NoSuchStream(f"no stream named {stream!r}") from None
    else:
        metas = [m for m in await ledgers.list_ledgers() if not is_data_ledger(m.name)]
    out = []
    for m in metas:
        frags = await ledgers.fragments(m.ledger_id, m.first_fragment_index, m.last_fragment_index)
        row = {"stream": m.name, "remote_storage_enable": TierPolicy.from_dict(_safe(m.retention)).remote_storage_enable,
               "local_only": 0, "offloaded_local": 0, "remote_only": 0, "uploading": 0, "bytes_local": 0,
               "bytes_remote": 0}
        for f in frags:
            size = f.size_bytes or 0
            if tierpolicy.remote_only(f):
                row["remote_only"] += 1
            elif tierpolicy.offloaded(f):
                row["offloaded_local"] += 1
            else:
                row["local_only"] += 1
                if tierpolicy.state(f) == UPLOADING:
                    row["uploading"] += 1
            if tierpolicy.local(f):
                row["bytes_local"] += size
            if tierpolicy.offloaded(f):
                row["bytes_remote"] += int(f.tier.get("size") or 0)
        out.append(row)
    return out
