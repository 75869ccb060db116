"""Admin operations behind ``scroll ledger show``, ``scroll read``, ``scroll simpletest``,
``scroll check`` and ``scroll bookie decommission`` (modelled on BookKeeper's shell).

How re-replication works (``check --fix`` and ``decommission``). Only **sealed** fragments are
repaired or moved here: their range and contents are final, and no writer touches their record
again. For each entry of the fragment whose write set includes the slot being filled, the copy with
the highest term stamp (and not older than the fragment's ``created_term``, i.e. not a ghost) is
read from another member of the write set, and written to the target bookie as a *recovery add*
(``recovery=True``, no truncate, LAC/LAFR -1) at the ledger's current term — exactly what a
take-over's recovery write-backs are: rule 4 of ``terms.bookie_rules`` lets recovery adds in
without a truncate, and a term equal to the ledger's never fences its writer. The copy is stamped
with that term, which is >= the fragment's created term, so readers accept it. Only once every
entry is on the target is the fragment record changed (decommission: the new ensemble, same slot
index so write sets do not move), by one transaction that compares the fragment record's version
and the ledger record's version: if the writer rolled over or retention marked the fragment for
deletion meanwhile, the transaction fails and the fragment is looked at again. The ledger record
itself is not written, so an active writer is not disturbed.

A fragment offloaded to the object store whose bookie copies were released (``remote_only``,
``fragments/tier.py``) has no bookie copies by design: ``check`` reports it as "offloaded" (and
whether its object is there, by a HEAD), never as under-replicated; ``--fix`` and ``decommission``
leave it alone (nothing on bookies to copy, and its ensemble names no bookie that holds it).

The **open** last fragment belongs to its writer. ``check`` only reports it. ``decommission`` of a
bookie that is already out of the live set (stopped) takes the stream over (opens a producer and
closes it, as a failover would): the take-over's no-op goes to the whole ensemble, fails on the
stopped bookie, and the writer's ensemble change replaces it; whatever part of the fragment was
written before becomes a sealed fragment and is moved like the others. An active producer of such a
stream in another process gets ``StaleTermError`` and must reopen. A bookie that is still live is
never taken out of an open fragment (stop it, then run decommission again); ``--no-takeover``
leaves open fragments alone. Pending retention marks that name the bookie drop it from their list
of bookies to trim (its data goes away with it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from bookie.client import Entry
from bookie.errors import BookieError, NoSuchEntryError, NoSuchLedgerError
from fragments.ledgers import NoSuchLedger, fragment_key, meta_key
from fragments.model import Fragment, LedgerMeta, LedgerStatus, fragment_for
from fragments.placement import BookieInfo, NotEnoughBookies, Placement
from fragments.retention import DELETING
from fragments.tier import remote_only
from terms import entry as entry_codec
from terms.messages import AddRequest
from terms.quorum import write_set, write_set_indexes
from terms.reader import copy_is_current

from ..batches import RecordFormatError, records_of, stored_batch
from ..driver import WriterDriver
from ..errors import InvalidArgument, NoSuchStream, ScrollError

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (what, done, total)
Throttle = Callable[[int], Awaitable[None]]  # called with the bytes about to be copied; may sleep
_READ_BATCH = 1000


class AdminError(ScrollError):
    pass


async def _meta(client, name: str) -> tuple[LedgerMeta, int]:
    try:
        return await client.cluster.ledgers.get_ledger(name)
    except NoSuchLedger:
        raise NoSuchStream(f"no stream named {name!r}") from None


async def _visible(client, meta: LedgerMeta) -> list[Fragment]:
    """The stream's fragments; a CLOSED ledger's last fragment is final, so it is shown sealed at
    the ledger's last entry (its record may still say open)."""
    frags = await client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
    if frags and meta.status is LedgerStatus.CLOSED and not frags[-1].sealed and meta.last_entry_id is not None:
        frags[-1] = dataclasses.replace(frags[-1], last_entry_id=meta.last_entry_id)
    return frags


# ------------------------------------------------------------------------------------ ledger show
async def ledger_show(client, name: str) -> dict:
    """The ledger record and its fragments. Record offsets (earliest, end, each fragment's first
    offset and record count) are what users see; entry ids and the LAC are the protocol's."""
    meta, version = await _meta(client, name)
    frags = await _visible(client, meta)
    c = await client.consumer(name, start="latest")
    end = c.position
    d = asdict(meta)
    d["status"] = meta.status.value
    d["version"] = version
    d["earliest_offset"] = await c.earliest_offset()
    d["end_offset"] = end
    d["earliest_entry"] = frags[0].first_entry_id if frags else 0
    d["lac"] = c.lac
    firsts = [await c.first_offset_of(f) for f in frags]
    d["fragments"] = [
        {"index": f.index, "first_entry_id": f.first_entry_id, "last_entry_id": f.last_entry_id,
         "sealed": f.sealed, "ensemble": list(f.ensemble), "size_bytes": f.size_bytes, "created_term": f.created_term,
         "entries": (f.last_entry_id - f.first_entry_id + 1) if f.sealed else max(0, c.lac + 1 - f.first_entry_id),
         "first_offset": firsts[i], "first_offset_recorded": f.first_offset is not None,
         "records": (firsts[i + 1] if i + 1 < len(frags) else end) - firsts[i],
         **({"tier": f.tier} if f.tier else {})}
        for i, f in enumerate(frags)
    ]
    return d


# ------------------------------------------------------------------------------------ reading replicas
async def _read_ids(bc, ledger_id: int, ids: list[int]) -> dict[int, Entry | str]:
    """Each id's copy on one bookie (an ``Entry``), or "missing" / "error: ..."."""
    out: dict[int, Entry | str] = {}
    todo = sorted(set(ids))
    i = 0
    while i < len(todo):
        first = todo[i]
        last = todo[min(len(todo) - 1, i + _READ_BATCH - 1)]
        try:
            r = await bc.read(ledger_id, first, last)
        except (NoSuchEntryError, NoSuchLedgerError):
            out[first] = "missing"
            i += 1
            continue
        except BookieError as exc:
            for eid in todo[i:]:
                out[eid] = f"error: {exc}"
            return out
        got = {e.entry_id: e for e in r.entries}
        while i < len(todo) and todo[i] in got:
            out[todo[i]] = got[todo[i]]
            i += 1
        if i < len(todo) and todo[i] <= r.entries[-1].entry_id:
            out[todo[i]] = "missing"  # a gap inside the run: not on this bookie (striping)
            i += 1
    return out


async def _home(cluster, meta: LedgerMeta, f: Fragment) -> tuple[int, int, int]:
    """Where ``f``'s entries live: (ledger id, shift from the stream's entry ids to that ledger's,
    term for recovery adds there). A compacted fragment's entries are in its data ledger
    (``Fragment.data_ledger``, see streams/tools/compaction.py), one to one from ``data_first_entry``."""
    if f.data_ledger is None:
        return meta.ledger_id, 0, meta.term
    dmeta, _ = await cluster.ledgers.get_ledger(f.data_ledger)
    return f.data_ledger, f.data_first_entry - f.first_entry_id, dmeta.term


async def _copies(cluster, meta: LedgerMeta, f: Fragment, first: int, last: int) -> dict[int, dict[str, Entry | str]]:
    """entry id -> {bookie of its write set -> its copy or why not}, for ids first..last of f (the
    stream's entry ids, wherever the copies live)."""
    wq = meta.config.write_quorum
    need: dict[str, list[int]] = {}
    for eid in range(first, last + 1):
        for b in write_set(eid, f.ensemble, wq):
            need.setdefault(b, []).append(eid)
    live = {r.bookie_id for r in await cluster.refresh_bookies(max_age_s=1.0)}
    ledger_id, shift, _term = await _home(cluster, meta, f)

    async def one(b: str, ids: list[int]):
        bc = cluster.client(b)
        if bc is None or b not in live:
            return b, {eid: "bookie not registered" for eid in ids}
        got = await _read_ids(bc, ledger_id, [eid + shift for eid in ids])
        return b, {eid - shift: (dataclasses.replace(c, entry_id=eid - shift) if isinstance(c, Entry) else c)
                   for eid, c in got.items()}

    answers = dict(await asyncio.gather(*(one(b, ids) for b, ids in need.items())))
    out: dict[int, dict[str, Entry | str]] = {}
    for eid in range(first, last + 1):
        per = {}
        for b in write_set(eid, f.ensemble, wq):
            c = answers[b].get(eid, "missing")
            if isinstance(c, Entry) and not copy_is_current(f, c.entry_term):
                c = f"stale copy (term {c.entry_term} < fragment term {f.created_term})"
            per[b] = c
        out[eid] = per
    return out


def _preview(data: bytes, n: int = 32) -> str:
    """An entry as a person wants to see it: a no-op as such, a batch by its first record's value."""
    if entry_codec.is_noop(data):
        return f"<no-op of term {entry_codec.noop_term(data)}>"
    payload = data[1:]
    try:
        b = stored_batch(-1, data)
        recs = records_of(b) if b is not None else []
        payload = (recs[0].value or b"") if recs else payload
    except (RecordFormatError, ValueError):
        pass
    try:
        text = payload[:n].decode("utf-8")
        if text.isprintable():
            return text + ("…" if len(payload) > n else "")
    except UnicodeDecodeError:
        pass
    return payload[:n // 2].hex() + ("…" if len(payload) > n // 2 else "")


def _offsets(data: bytes) -> tuple[int, int] | None:
    """(first record offset, record count) from a data entry's batch header; None for a no-op or
    an entry that is not a batch."""
    try:
        b = stored_batch(-1, data)
    except RecordFormatError:
        return None
    return (b.base_offset, b.offset_count) if b is not None else None


async def read_replicas(client, name: str, first: int, last: int) -> dict:
    """Entries first..last as each replica of their write set holds them."""
    if first < 0 or last < first:
        raise InvalidArgument(f"bad range {first}..{last}")
    if last - first + 1 > 10_000:
        raise InvalidArgument("read at most 10000 entries at a time")
    meta, _ = await _meta(client, name)
    frags = await _visible(client, meta)
    out = []
    eid = first
    while eid <= last:
        f = fragment_for(frags, eid)
        if f is None:
            earliest = frags[0].first_entry_id if frags else 0
            if eid < earliest:
                out.append({"entry_id": eid, "error": f"removed by retention (earliest is {earliest})"})
                eid = earliest
                continue
            break
        upto = min(last, f.last_entry_id) if f.sealed else last
        if remote_only(f):  # no bookie holds it: its object does
            out.extend({"entry_id": i, "fragment": f.index, "offloaded": f.tier.get("key")} for i in range(eid, upto + 1))
            eid = upto + 1
            continue
        copies = await _copies(client.cluster, meta, f, eid, upto)
        for i in range(eid, upto + 1):
            per = copies[i]
            held = {b: c for b, c in per.items() if isinstance(c, Entry)}
            if not held and not f.sealed:
                return _read_result(name, meta, out)  # past the end of the open fragment
            newest = max(held.values(), key=lambda c: c.entry_term) if held else None
            offs = _offsets(newest.data) if newest else None
            out.append({
                "entry_id": i, "fragment": f.index,
                "replicas": {b: ({"term": c.entry_term, "size": len(c.data)} if isinstance(c, Entry) else {"missing": c})
                             for b, c in per.items()},
                "have": sorted(held), "missing": sorted(set(per) - set(held)),
                "mismatch": len({c.data for c in held.values()}) > 1,
                "size": len(newest.data) if newest else None,
                "noop": bool(newest and entry_codec.is_noop(newest.data)),
                "first_offset": offs[0] if offs else None, "records": offs[1] if offs else 0,
                "preview": _preview(newest.data) if newest else None,
            })
        eid = upto + 1
    return _read_result(name, meta, out)


def _read_result(name: str, meta: LedgerMeta, out: list) -> dict:
    return {"stream": name, "ledger": meta.ledger_id, "term": meta.term, "write_quorum": meta.config.write_quorum,
            "entries": out}


async def force_recovery(client, name: str) -> dict:
    """Take the stream over (fence, recover, truncate no-op) and close the writer again. The
    stream itself, also when it is partition 0 of a topic of several (a topic's producer would
    take every partition over)."""
    meta, _ = await _meta(client, name)
    driver = WriterDriver(client.cluster, name)
    await driver.open()
    try:
        term, lac = driver.writer.term, driver.writer.lac
    finally:
        await driver.close()
    c = await client.consumer(name, start="latest")
    return {"stream": name, "previous_term": meta.term, "term": term, "lac": lac, "end_offset": c.position}


# ------------------------------------------------------------------------------------ simpletest
async def simpletest(client, records: int = 1000, ensemble: int = 3, write_quorum: int = 3, ack_quorum: int = 2,
                     size: int = 100) -> dict:
    """Create a temporary stream, append ``records`` records pipelined (the producer batches them
    into entries), read them back by offset and verify values and offsets, delete the stream."""
    if records < 1 or size < 0:
        raise InvalidArgument("records must be >= 1 and size >= 0")
    name = f"simpletest-{uuid.uuid4().hex[:12]}"
    await client.create_stream(name, ensemble=ensemble, write_quorum=write_quorum, ack_quorum=ack_quorum)
    try:
        values = [(b"%08d" % i + b"x" * size)[:max(size, 8)] for i in range(records)]
        lat: list[float] = []
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        p = await client.producer(name)
        t_open = time.perf_counter() - t0
        first_entry = p.lac + 1
        t1 = time.perf_counter()
        futs = []
        for v in values:
            sent = loop.time()
            fut = await p.append_future(v)
            fut.add_done_callback(lambda _f, s=sent: lat.append(loop.time() - s))
            futs.append(fut)
        offsets = await asyncio.gather(*futs)
        t_write = time.perf_counter() - t1
        entries = p.lac - first_entry + 1
        await p.close()
        t2 = time.perf_counter()
        c = await client.consumer(name, start=offsets[0])
        got = []
        while len(got) < records:
            batch = await c.read(1000, timeout_s=5.0)
            if not batch:
                break
            got.extend(batch)
        t_read = time.perf_counter() - t2
        ok = [r.value for r in got] == values and [r.offset for r in got] == list(offsets) \
            and list(offsets) == list(range(offsets[0], offsets[0] + records))
        lat.sort()
        info = await client.describe_stream(name)
        return {
            "stream": name, "records": records, "record_bytes": len(values[0]), "entries": entries,
            "ensemble": ensemble, "write_quorum": write_quorum, "ack_quorum": ack_quorum,
            "bookies": sorted({b for f in info.fragments for b in f.ensemble}),
            "open_s": t_open, "write_s": t_write, "read_s": t_read,
            "write_records_per_s": records / t_write if t_write else None,
            "read_records_per_s": len(got) / t_read if t_read else None,
            "latency_ms": {"p50": 1000 * lat[len(lat) // 2], "p99": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                           "max": 1000 * lat[-1]},
            "read_back": len(got), "first_offset": offsets[0], "verified": ok,
        }
    finally:
        await client.delete_stream(name)


# ------------------------------------------------------------------------------------ re-replication
async def _sources(cluster, meta: LedgerMeta, f: Fragment, ids: list[int], exclude: set[str]) -> dict[int, Entry]:
    """The best current copy of each id from the members of its write set (not ``exclude``)."""
    copies = await _copies(cluster, meta, f, ids[0], ids[-1]) if ids else {}
    out = {}
    for eid in ids:
        best = None
        for b, c in copies[eid].items():
            if b in exclude or not isinstance(c, Entry):
                continue
            if best is None or c.entry_term > best.entry_term:
                best = c
        if best is not None:
            out[eid] = best
    return out


async def _write_copies(cluster, meta: LedgerMeta, f: Fragment, target: str, entries: list[Entry],
                        throttle: Throttle | None = None) -> None:
    """Recovery adds of ``entries`` (of ``f``) to ``target`` at the term of the ledger they live in
    (see the module docstring). ``throttle`` is awaited with each batch's bytes before it is sent."""
    bc = cluster.client(target)
    if bc is None:
        raise AdminError(f"bookie {target} is not reachable")
    ledger_id, shift, term = await _home(cluster, meta, f)
    for i in range(0, len(entries), _READ_BATCH):
        chunk = entries[i:i + _READ_BATCH]
        reqs = [AddRequest(ledger_id, e.entry_id + shift, term, -1, -1, e.data, False, True) for e in chunk]
        if throttle is not None:
            await throttle(sum(len(e.data) for e in chunk))
        res = await bc.submit(reqs)
        if not res.all_ok:
            bad = [(r.entry_id, res.status(j)) for j, r in enumerate(reqs) if res.status(j) != 0]
            raise AdminError(f"bookie {target} refused {len(bad)} copies of ledger {ledger_id} "
                             f"(first: entry {bad[0][0]} status {bad[0][1]}; {res.error})")


def _slot_ids(f: Fragment, slot: int, wq: int) -> list[int]:
    n = len(f.ensemble)
    return [e for e in range(f.first_entry_id, f.last_entry_id + 1) if slot in write_set_indexes(e % n, n, wq)]


async def _refill(cluster, meta: LedgerMeta, f: Fragment, slot: int, target: str, ids: list[int],
                  throttle: Throttle | None = None) -> int:
    """Copy ``ids`` (entries of ``slot`` in sealed ``f``) onto ``target``; returns how many."""
    if not ids:
        return 0
    copied = 0
    for i in range(0, len(ids), _READ_BATCH):
        chunk = ids[i:i + _READ_BATCH]
        src = await _sources(cluster, meta, f, chunk, exclude={target} if target != f.ensemble[slot] else set())
        lost = [e for e in chunk if e not in src]
        if lost:
            raise AdminError(f"stream {meta.name!r} fragment {f.index}: no replica holds entries {lost[:5]}"
                             f"{'…' if len(lost) > 5 else ''}")
        await _write_copies(cluster, meta, f, target, [src[e] for e in chunk], throttle)
        copied += len(chunk)
    return copied


async def _replace_in_record(client, meta: LedgerMeta, f: Fragment, new: Fragment) -> bool:
    """Write the fragment record with a new ensemble if neither it nor the ledger changed."""
    store = client.cluster.store
    cur_meta = await store.get(meta_key(meta.ledger_id))
    cur_frag = await store.get(fragment_key(meta.ledger_id, f.index))
    if cur_meta is None or cur_frag is None:
        return False
    stored, m = Fragment.from_json(cur_frag.value), LedgerMeta.from_json(cur_meta.value)
    closed_last = m.status is LedgerStatus.CLOSED and f.index == m.last_fragment_index
    if dataclasses.replace(stored, last_entry_id=f.last_entry_id) != f or (stored.last_entry_id is None and not closed_last):
        return False
    if not (m.first_fragment_index <= f.index < m.last_fragment_index or closed_last):
        return False
    new = dataclasses.replace(new, last_entry_id=stored.last_entry_id)  # keep the record as its writer left it
    res = await store.txn({meta_key(meta.ledger_id): cur_meta.version, fragment_key(meta.ledger_id, f.index): cur_frag.version},
                          {fragment_key(meta.ledger_id, f.index): new.to_json().encode()})
    return res.succeeded


def _placement(cluster) -> Placement:
    return Placement(random.Random(), [BookieInfo(r.bookie_id, r.rack) for r in cluster.live()])


@dataclass
class FragmentReport:
    stream: str
    fragment: int
    first_entry_id: int
    last_entry_id: int | None
    ensemble: list[str]
    sealed: bool
    under_replicated: int = 0  # entries with fewer than WQ current copies
    missing: dict = field(default_factory=dict)  # bookie -> entries it lacks
    gone: list[str] = field(default_factory=list)  # members not in the registry
    action: str = ""  # what was (or would be) done
    new_ensemble: list[str] | None = None
    copied: int = 0
    error: str | None = None
    object: str | None = None  # an offloaded fragment's object key

    def to_dict(self) -> dict:
        return asdict(self)


async def check(client, fix: bool = False, stream: str | None = None, progress: Progress | None = None) -> list[dict]:
    """Find fragments whose entries are under the write quorum; with ``fix`` re-replicate sealed
    ones (to the same bookie if it is live, else to a replacement that takes its slot)."""
    cluster = client.cluster
    names = [stream] if stream else [m.name for m in await client.list_streams()]
    out: list[FragmentReport] = []
    for n_i, name in enumerate(names):
        if progress:
            progress(name, n_i, len(names))
        try:
            meta, _ = await _meta(client, name)
        except NoSuchStream:
            if stream:
                raise
            continue
        frags = await _visible(client, meta)
        c = await client.consumer(name, start="latest")
        lac = c.lac
        live = {r.bookie_id for r in await cluster.refresh_bookies()}
        for f in frags:
            last = f.last_entry_id if f.sealed else lac
            if last < f.first_entry_id:
                continue
            rep = FragmentReport(name, f.index, f.first_entry_id, f.last_entry_id, list(f.ensemble), f.sealed)
            if remote_only(f):  # bookie copies released by design: its object is the copy
                rep.action, rep.object = "offloaded", f.tier.get("key")
                rep.error = await _object_problem(cluster, f)
                out.append(rep)
                continue
            missing = await inspect_fragment(cluster, meta, f, last, live, rep)
            if not rep.under_replicated:
                continue
            if not f.sealed:
                rep.action = "open fragment: left to its writer (an ensemble change or a take-over repairs it)"
            elif not fix:
                rep.action = "would re-replicate"
            else:
                try:
                    await fix_fragment(client, meta, f, missing, live, rep)
                except (AdminError, BookieError, NotEnoughBookies) as exc:
                    rep.error = str(exc)
            out.append(rep)
    if progress:
        progress("", len(names), len(names))
    return [r.to_dict() for r in out]


async def inspect_fragment(cluster, meta: LedgerMeta, f: Fragment, last: int, live: set[str],
                           rep: FragmentReport) -> dict[str, list[int]]:
    """Fill ``rep`` (gone members, entries under the write quorum, missing copies per bookie) for
    entries ``f.first_entry_id..last`` of ``f``; returns bookie -> the entry ids it lacks."""
    rep.gone = sorted(b for b in set(f.ensemble) if b not in live)
    copies = await _copies(cluster, meta, f, f.first_entry_id, last)
    missing: dict[str, list[int]] = {}
    for eid, per in copies.items():
        have = [b for b, cp in per.items() if isinstance(cp, Entry)]
        if len(have) < meta.config.write_quorum:
            rep.under_replicated += 1
        for b, cp in per.items():
            if not isinstance(cp, Entry):
                missing.setdefault(b, []).append(eid)
    rep.missing = {b: len(ids) for b, ids in missing.items()}
    return missing


async def _object_problem(cluster, f: Fragment) -> str | None:
    """What is wrong with a released fragment's object (a HEAD: there, of the recorded size), or None."""
    from ..tier.objstore import ObjectMissing, ObjectStoreError

    key, size = f.tier.get("key"), f.tier.get("size")
    tier = await cluster.tier_reader()
    if tier is None:
        return f"object {key!r} not checked: this cluster has no object store configured"
    try:
        got, _etag = await tier.store.head(key)
    except ObjectMissing:
        return f"object {key!r} is missing: the fragment's records cannot be read (data lost)"
    except ObjectStoreError as exc:
        return f"object {key!r} not checked: {exc}"
    if size is not None and got != size:
        return f"object {key!r} is {got} bytes, the fragment record says {size}"
    return None


async def fix_fragment(client, meta, f: Fragment, missing: dict[str, list[int]], live: set[str], rep, *,
                       throttle: Throttle | None = None,
                       before_commit: Callable[[Fragment, Fragment], Awaitable[None]] | None = None) -> None:
    """Re-replicate sealed ``f`` (``missing`` and ``live`` as ``inspect_fragment`` found them): a
    live member's missing copies are refilled in place; a gone member's slot goes to a replacement
    placed to keep the racks spread, committed by ``_replace_in_record`` (a CAS: nothing changes if
    the fragment or ledger record moved meanwhile). ``before_commit(old, new)`` runs after the
    copies and before that CAS (a test hook)."""
    cluster = client.cluster
    ens = list(f.ensemble)
    replaced = {}
    for b, ids in missing.items():
        slot = ens.index(b)
        if b in live:
            rep.copied += await _refill(cluster, meta, f, slot, b, ids, throttle)
        else:
            keep = {i: x for i, x in enumerate(ens) if i != slot}
            new_ens = _placement(cluster).choose(len(ens), exclude=set(f.ensemble) | set(replaced.values()), keep=keep)
            target = new_ens[slot]
            rep.copied += await _refill(cluster, meta, f, slot, target, _slot_ids(f, slot, meta.config.write_quorum),
                                        throttle)
            replaced[slot] = target
            ens[slot] = target
    if replaced:
        new = f.with_(ensemble=tuple(ens))
        if before_commit is not None:
            await before_commit(f, new)
        if not await _replace_in_record(client, meta, f, new):
            raise AdminError("the fragment or ledger changed while copying; run check again")
        rep.new_ensemble = list(ens)
    rep.action = "re-replicated" + (f" (replaced {sorted(f.ensemble[s] for s in replaced)})" if replaced else "")


async def decommission(client, bookie_id: str, *, takeover: bool = True, progress: Progress | None = None) -> dict:
    """Move every fragment that names ``bookie_id`` to other bookies (see the module docstring)."""
    cluster = client.cluster
    alive = bookie_id in {r.bookie_id for r in await cluster.refresh_bookies()}
    moved, left, errors, takeovers, marks = [], [], [], [], []
    metas = await client.list_streams()
    for n_i, m in enumerate(metas):
        if progress:
            progress(m.name, n_i, len(metas))
        try:
            meta, _ = await _meta(client, m.name)
        except NoSuchStream:
            continue
        frags = await _visible(client, meta)
        last = frags[-1] if frags else None
        if last is not None and not last.sealed and bookie_id in last.ensemble:
            if alive or not takeover:
                left.append({"stream": meta.name, "fragment": last.index,
                             "reason": "open fragment on a live bookie: stop the bookie, then run decommission again"
                             if alive else "open fragment (--no-takeover)"})
            else:
                try:
                    takeovers.append(await force_recovery(client, meta.name))
                except ScrollError as exc:
                    errors.append({"stream": meta.name, "fragment": last.index, "error": f"take-over failed: {exc}"})
                meta, _ = await _meta(client, m.name)
                frags = await _visible(client, meta)
                last = frags[-1] if frags else None
                if last is not None and not last.sealed and bookie_id in last.ensemble:
                    left.append({"stream": meta.name, "fragment": last.index,
                                 "reason": "the take-over kept the bookie in the open fragment"})
        for f in frags:
            if not f.sealed or bookie_id not in f.ensemble or remote_only(f):  # released: nothing on bookies
                continue
            try:
                moved.append(await _move(client, meta, f, bookie_id))
            except (AdminError, BookieError, NotEnoughBookies) as exc:
                errors.append({"stream": meta.name, "fragment": f.index, "error": str(exc)})
        mark = meta.retention.get(DELETING)
        if mark and bookie_id in mark.get("bookies", []):
            await _forget_in_mark(client, meta.name, bookie_id)
            marks.append(meta.name)
    if progress:
        progress("", len(metas), len(metas))
    return {"bookie": bookie_id, "was_live": alive, "moved": moved, "left": left, "errors": errors,
            "takeovers": takeovers, "retention_marks_updated": marks,
            "done": not left and not errors}


async def _move(client, meta: LedgerMeta, f: Fragment, bookie_id: str) -> dict:
    cluster = client.cluster
    for _attempt in range(5):
        slot = f.ensemble.index(bookie_id)
        keep = {i: b for i, b in enumerate(f.ensemble) if i != slot}
        new_ens = _placement(cluster).choose(len(f.ensemble), exclude=set(f.ensemble), keep=keep)
        target = new_ens[slot]
        ids = _slot_ids(f, slot, meta.config.write_quorum)
        copied = await _refill(cluster, meta, f, slot, target, ids)
        new = f.with_(ensemble=new_ens)
        if await _replace_in_record(client, meta, f, new):
            return {"stream": meta.name, "fragment": f.index, "from": bookie_id, "to": target, "entries": copied}
        # the ledger moved on (rollover, retention): look at the fragment again
        bc = cluster.client(target)
        if bc is not None and ids:
            try:
                ledger_id, shift, _term = await _home(cluster, meta, f)
                await bc.trim(ledger_id, ids[0] + shift, ids[-1] + shift)  # do not leave the copies behind
            except BookieError:
                pass
        meta, _ = await _meta(client, meta.name)
        try:
            cur = await cluster.ledgers.get_fragment(meta.ledger_id, f.index)
        except NoSuchLedger:
            cur = None
        if cur is None or f.index < meta.first_fragment_index or bookie_id not in cur.ensemble:
            return {"stream": meta.name, "fragment": f.index, "from": bookie_id, "to": None, "entries": 0,
                    "note": "no longer needed (removed by retention or already moved)"}
        f = cur
    raise AdminError(f"stream {meta.name!r} fragment {f.index}: the ledger kept changing")


async def _forget_in_mark(client, name: str, bookie_id: str) -> None:
    ledgers = client.cluster.ledgers
    for _attempt in range(20):
        meta, version = await ledgers.get_ledger(name)
        mark = meta.retention.get(DELETING)
        if not mark or bookie_id not in mark.get("bookies", []):
            return
        bc = client.cluster.client(bookie_id)
        if bc is not None and mark.get("below_entry", 0) > 0:
            try:
                await bc.trim(meta.ledger_id, 0, int(mark["below_entry"]) - 1)
            except BookieError:
                pass
        retention = dict(meta.retention)
        retention[DELETING] = {**mark, "bookies": [b for b in mark["bookies"] if b != bookie_id]}
        if await ledgers.cas_ledger(meta.with_(retention=retention), (), version) is not None:
            return
    raise AdminError(f"stream {name!r}: could not update its retention mark")
