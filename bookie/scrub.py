"""Scrubbing: read every stored entry back from its entry log and verify it; drop bad copies.

How this works. A pass walks the index in key order, a chunk of locations at a time (a fresh
RocksDB iterator per chunk, see ``Index.locations_from``), reads each record from its entry log in
the scrub thread and checks it exactly as a read would: the entry-log frame CRC (over header,
digest and data, ``entrylog.decode``), that the record is the entry the index names, and for a
CRC32C entry the client's digest over the data. The pass is throttled to ``scrub_bytes_per_s`` (an
``asyncio.sleep`` between chunks when it runs ahead of that rate) and runs ``scrub_first_delay_s``
after start, then ``scrub_interval_s`` after the end of each pass (0: no periodic passes); the
Scrub RPC (``BookieClient.scrub``) starts one at once.

A bad copy is *not served*: reads already answer CORRUPT for a record that fails its checks, and
the scrubber removes the entry from the index (one synced batch on the disk thread, under the
flush lock, after reading the record once more), so reads answer NO_SUCH_ENTRY for it and readers
go to another replica. Removing it is also how the finding reaches the cluster tooling: ``scroll
check`` reports the copy missing and ``check --fix`` (or the autorecovery) copies it back from a
good replica; a recovery add then writes a fresh record. A copy a *read* found corrupt (before any
pass did) is reported here too (``report``) and handled the same way. Every finding is logged at
ERROR with ledger and entry, counted (``scroll_bookie_scrub_corrupt_entries``) and listed in the
bookie's Info (the last ``RECENT`` of them).

Progress is persisted (``SCRUB_KEY`` in the bookie's own RocksDB index, a key no flush batch
touches, written with an unsynced put: a crash loses at most ``SAVE_EVERY_S`` of progress): the
index key the pass continues from, when the pass started, and totals since the store was created
(passes, entries checked, bad copies found, copies repaired). A restarted bookie resumes an
interrupted pass where it was (``scrub_first_delay_s`` after start) instead of starting over, and
after a completed pass waits out the rest of ``scrub_interval_s``. A copy the scrubber removed
waits for its repair (``awaiting``, persisted too): once a good copy is stored again (``check
--fix`` or the autorecovery writes it with a recovery add) it counts as repaired.
``scroll bookie scrub`` starts a pass and shows all this (Info).

An index entry whose entry log is gone (a log compacted while it held a corrupt record: the
compaction cannot copy that record, see ``gc.py``) is a finding too. Entries still in the write
cache are not on disk yet and are not scrubbed; a copy the index no longer names when it is about
to be dropped (overwritten, truncated or moved since it was read) is left alone.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass

from . import digest as digests
from . import entrylog
from .errors import CorruptEntryError
from .flush import _Pending
from .index import Index, entry_key

log = logging.getLogger(__name__)

CHUNK_ENTRIES = 512
CHUNK_BYTES = 1 << 20
RECENT = 100
SCRUB_KEY = b"C"  # the persisted scrub state (JSON) in the bookie's index
SAVE_EVERY_S = 5.0  # how often a running pass saves its position
AWAITING_MAX = 10_000  # removed copies remembered until their repair


@dataclass(frozen=True)
class Finding:
    ledger_id: int
    entry_id: int
    location: tuple[int, int, int]  # log id, offset, record size
    reason: str
    found_by: str  # "scrub" or "read"
    at: float = 0.0
    removed: bool = True  # False: kept in the index, answered CORRUPT (above the bookie's LAC)

    def describe(self) -> str:
        log_id, offset, _size = self.location
        return f"ledger={self.ledger_id} entry={self.entry_id} log={log_id} offset={offset}: {self.reason}"


@dataclass
class PassResult:
    entries: int = 0
    bytes: int = 0
    corrupt: int = 0
    seconds: float = 0.0
    complete: bool = True


class Scrubber:
    """The engine's scrubber. ``scrub_chunk`` runs in the scrub thread, ``drop`` on the disk thread;
    ``run_pass``/``loop`` drive them from the event loop; ``scrub_now`` is the synchronous pass."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.metrics = engine.metrics
        # totals since the store was created (persisted under SCRUB_KEY)
        self.passes = 0
        self.entries = 0
        self.corrupt = 0
        self.repaired = 0  # removed copies stored again since (a recovery add from a good replica)
        self.last_pass_start = 0.0  # unix time the last complete pass started; 0: none yet
        self.last_pass_end = 0.0  # unix time; 0: no pass completed yet
        self.position: bytes | None = None  # index key an interrupted or running pass continues from
        self.pass_started = 0.0  # unix time the pass under way (or interrupted) started; 0: none
        self.pass_entries = 0  # entries the pass under way has checked so far
        self.awaiting: dict[tuple[int, int], float] = {}  # (ledger, entry) removed -> when, until repaired
        self.save_every_s = SAVE_EVERY_S
        self._loaded = False
        self._saved_at = 0.0
        self.running = False
        self.recent: collections.deque[Finding] = collections.deque(maxlen=RECENT)
        self._reported: collections.deque[Finding] = collections.deque()
        self._lock = threading.Lock()
        self._kept: set[tuple[int, int, tuple[int, int, int]]] = set()  # corrupt copies above the LAC, kept
        self._wake: asyncio.Event | None = None
        self._now = False  # a pass was asked for (``trigger``)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ checking (scrub thread)

    def scrub_chunk(self, start: bytes, max_bytes: int) -> tuple[bytes | None, int, int, list[Finding]]:
        """Verify the records of up to ``CHUNK_ENTRIES`` index entries (about ``max_bytes``) from
        index key ``start``. Returns (key to continue from or None, entries, bytes, findings)."""
        e = self.engine
        locs, nxt = e.index.locations_from(start, CHUNK_ENTRIES)
        n = nbytes = 0
        found: list[Finding] = []
        with entrylog.LogReader(e.flusher.log_dir) as reader:
            for lid, eid, loc in locs:
                if nbytes >= max_bytes:
                    return entry_key(lid, eid), n, nbytes, found
                why = self.check_record(reader, lid, eid, loc)
                n += 1
                nbytes += loc[2]
                if why is not None:
                    found.append(Finding(lid, eid, loc, why, "scrub", time.time()))
        return nxt, n, nbytes, found

    def check_record(self, reader: entrylog.LogReader, lid: int, eid: int, loc: tuple[int, int, int]) -> str | None:
        """Why the record at ``loc`` is not a good copy of (lid, eid), or None when it is (or when
        the index no longer names it there: compaction moved it)."""
        try:
            raw = reader.read(*loc)
        except FileNotFoundError:
            if self.engine.index.location(lid, eid) != loc:
                return None  # moved by a compaction meanwhile
            if (self.engine.flusher.log_dir / entrylog.log_name(loc[0])).exists():
                return None  # appeared again?  not ours to judge: the next pass looks again
            return f"entry log {loc[0]} is gone"
        try:
            _l, _e, entry = entrylog.decode(raw, lid, eid)
        except CorruptEntryError as exc:
            return str(exc)
        if entry[1] == digests.DIGEST_CRC32C and digests.crc32c_digest(lid, eid, entry[3]) != entry[2]:
            return "CRC32C digest mismatch"
        return None

    # ------------------------------------------------------------------ dropping (disk thread)

    def drop(self, findings: list[Finding]) -> list[Finding]:
        """Remove the copies that are still indexed where they were found and still fail their
        check, in one synced index batch with the live-byte accounting. Returns the findings to report
        (those removed, and those kept for being above the LAC, once).
        Called with the flush lock held (or from the synchronous API), on the disk thread."""
        e = self.engine
        flusher = e.flusher
        pending = _Pending(e.index.batch())
        dropped = []
        seen = set()
        with entrylog.LogReader(flusher.log_dir) as reader:
            for f in findings:
                if (f.ledger_id, f.entry_id) in seen:
                    continue  # found twice (by a read and by the pass): once is enough
                seen.add((f.ledger_id, f.entry_id))
                if e.index.location(f.ledger_id, f.entry_id) != f.location:
                    continue  # overwritten, deleted or moved since: that copy is not served any more
                if self.check_record(reader, f.ledger_id, f.entry_id, f.location) is None:
                    log.warning("%s: passes its checks when read again, kept", f.describe())
                    continue
                st = e.states.get(f.ledger_id)
                if st is None or f.entry_id > st.lac:
                    # Recovery reads entries above the LAC, and counts NO_SUCH_ENTRY answers to
                    # decide that an entry was never written: a removed copy of an acknowledged
                    # entry could be counted so. Kept, reads answer it CORRUPT (never "missing").
                    if (f.ledger_id, f.entry_id, f.location) not in self._kept:  # reported once
                        self._kept.add((f.ledger_id, f.entry_id, f.location))
                        dropped.append(dataclasses.replace(f, removed=False))
                    continue
                self._kept.discard((f.ledger_id, f.entry_id, f.location))  # the LAC has passed it since
                Index.delete_location(pending.batch, f.ledger_id, f.entry_id)
                if f.location[0] in flusher.log_stats:
                    pending.account(f.location[0], 0, -f.location[2])
                dropped.append(f)
        if any(f.removed for f in dropped):
            flusher.commit(pending)
        return dropped

    def _dropped(self, dropped: list[Finding]) -> None:
        """Bookkeeping on the event loop (or the synchronous caller's thread) after ``drop``."""
        for f in dropped:
            self.engine.read_cache.drop(f.ledger_id, f.entry_id, f.entry_id)
            if f.removed:
                self.awaiting[(f.ledger_id, f.entry_id)] = f.at
                log.error(
                    "corrupt copy %s (found by %s): removed from the index, reads answer NO_SUCH_ENTRY for it; "
                    "`scroll check --fix` copies it back from another replica", f.describe(), f.found_by,
                )
            else:
                log.error(
                    "corrupt copy %s (found by %s): above this bookie's LAC, kept in the index and answered "
                    "CORRUPT (never as missing, which ledger recovery could take for an entry never written)",
                    f.describe(), f.found_by,
                )
            self.recent.append(f)
            self.corrupt += 1
            self.metrics.scrub_corrupt.labels(f.found_by).inc()

    # ------------------------------------------------------------------ reports from reads (any thread)

    def report(self, ledger_id: int, entry_id: int, location: tuple[int, int, int], reason: str) -> None:
        """A read met a corrupt record: have it dropped soon (by the scrub task) rather than served
        CORRUPT to every reader until the next pass."""
        if (ledger_id, entry_id, location) in self._kept:
            return  # known, and answered CORRUPT on purpose
        with self._lock:
            if any(f.ledger_id == ledger_id and f.entry_id == entry_id for f in self._reported):
                return
            self._reported.append(Finding(ledger_id, entry_id, location, reason, "read", time.time()))
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop is closed: the bookie is stopping
                pass

    def trigger(self) -> None:
        """Start a pass now (an operator, a test), unless one is under way; on the event loop."""
        if self.running:
            return
        self._now = True
        if self._wake is not None:
            self._wake.set()

    def _take_reported(self) -> list[Finding]:
        with self._lock:
            out = list(self._reported)
            self._reported.clear()
        return out

    # ------------------------------------------------------------------ persisted state

    def load(self) -> None:
        """Read the persisted state (once, after the engine opened its index)."""
        if self._loaded:
            return
        self._loaded = True
        raw = self.engine.index.db.get(SCRUB_KEY)
        if raw is None:
            return
        try:
            d = json.loads(raw)
            self.passes, self.entries, self.corrupt, self.repaired = (
                int(d.get(k, 0)) for k in ("passes", "entries", "corrupt", "repaired"))
            self.last_pass_start = float(d.get("last_pass_start", 0.0))
            self.last_pass_end = float(d.get("last_pass_end", 0.0))
            self.position = bytes.fromhex(d["position"]) if d.get("position") else None
            self.pass_started = float(d.get("pass_started", 0.0)) if self.position else 0.0
            self.pass_entries = int(d.get("pass_entries", 0)) if self.position else 0
            self.awaiting = {(int(lid), int(eid)): float(at) for lid, eid, at in d.get("awaiting", [])}
        except (ValueError, TypeError, KeyError) as exc:  # never fatal: a fresh pass starts
            log.error("scrub state in the index is unreadable (%s): starting over", exc)
            return
        if self.last_pass_end:
            self.metrics.scrub_last_pass.set(self.last_pass_end)
        if self.position is not None:
            log.info("scrub: a pass started %s was interrupted at ledger=%s entry=%s; it resumes there",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.pass_started)), *self.position_ids())

    def state(self) -> dict:
        return {
            "passes": self.passes, "entries": self.entries, "corrupt": self.corrupt, "repaired": self.repaired,
            "last_pass_start": self.last_pass_start, "last_pass_end": self.last_pass_end,
            "position": self.position.hex() if self.position else None, "pass_started": self.pass_started,
            "pass_entries": self.pass_entries,
            "awaiting": [[lid, eid, at] for (lid, eid), at in list(self.awaiting.items())[-AWAITING_MAX:]],
        }

    def save(self) -> None:
        """Write the state to the index (any thread: one key of its own, never in a flush batch)."""
        index = self.engine.index
        if index is None or not self.engine._opened:
            return
        index.db.put(SCRUB_KEY, json.dumps(self.state()).encode())
        self._saved_at = time.monotonic()

    def position_ids(self) -> tuple[int | None, int | None]:
        """(ledger, entry) the pass continues from, or (None, None)."""
        if not self.position or len(self.position) != 17:
            return None, None
        return int.from_bytes(self.position[1:9], "big"), int.from_bytes(self.position[9:17], "big")

    def check_repaired(self) -> int:
        """Count the removed copies that are stored again (a recovery add wrote a good copy) or whose
        ledger is gone (not counted); returns how many were repaired now. On the event loop."""
        e = self.engine
        if not self.awaiting or e.index is None or not e._opened:
            return 0
        n = 0
        for key in list(self.awaiting):
            lid, eid = key
            if lid not in e.states:
                del self.awaiting[key]
                continue
            cached = e.write_cache.lookup(lid, eid)
            if isinstance(cached, tuple) or (cached is None and e.index.location(lid, eid) is not None):
                del self.awaiting[key]
                n += 1
        if n:
            self.repaired += n
            log.info("scrub: %d removed copies are stored again (repaired)", n)
        return n

    # ------------------------------------------------------------------ synchronous API (tests, tools)

    def scrub_now(self, max_chunks: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> PassResult:
        """One pass, unthrottled, in the caller's thread (the engine must not be started): from
        where an interrupted pass stopped, else from the start. ``max_chunks`` stops it early, as a
        bookie stopping mid-pass would (``complete`` False, the position saved)."""
        self.load()
        self.check_repaired()
        t0 = time.monotonic()
        res = PassResult()
        start = self._begin()
        found: list[Finding] = self._take_reported()
        chunks = 0
        while start is not None:
            if max_chunks is not None and chunks >= max_chunks:
                res.complete = False
                break
            start, n, nbytes, f = self.scrub_chunk(start, chunk_bytes)
            chunks += 1
            res.entries += n
            res.bytes += nbytes
            self._count(n, nbytes)
            self.position = start
            found += f
        dropped = self.drop(found) if found else []
        self._dropped(dropped)
        res.corrupt = len(dropped)
        res.seconds = time.monotonic() - t0
        if res.complete:
            self._pass_done(res)
        else:
            self.save()
        return res

    def _begin(self) -> bytes:
        """The key the pass starts from: an interrupted pass's position, or the first entry."""
        if self.position is None:
            self.pass_started = time.time()
            self.pass_entries = 0
            self.position = b"E"
            self.save()
        return self.position

    def _count(self, n: int, nbytes: int) -> None:
        self.entries += n
        self.pass_entries += n
        self.metrics.scrub_entries.inc(n)
        self.metrics.scrub_bytes.inc(nbytes)

    def _pass_done(self, res: PassResult) -> None:
        self.passes += 1
        self.last_pass_end = time.time()
        self.last_pass_start = self.pass_started or self.last_pass_end - res.seconds
        self.position = None
        self.pass_started = 0.0
        self.check_repaired()
        self.save()
        self.metrics.scrub_passes.inc()
        self.metrics.scrub_last_pass.set(self.last_pass_end)
        self.metrics.scrub_pass_seconds.set(res.seconds)
        log.info("scrub pass: %d entries, %d bytes verified in %.1f s, %d corrupt copies removed",
                 res.entries, res.bytes, res.seconds, res.corrupt)

    # ------------------------------------------------------------------ background operation

    async def _drop_async(self, findings: list[Finding]) -> int:
        e = self.engine
        async with e._flush_lock:
            if e._closing:
                return 0
            loop = asyncio.get_running_loop()
            dropped = await loop.run_in_executor(e._disk_pool, self.drop, findings)
        self._dropped(dropped)
        return len(dropped)

    async def run_pass(self, pool) -> PassResult:
        """One throttled pass; chunks are read in ``pool``, reported copies dropped as they come."""
        cfg = self.engine.config
        loop = asyncio.get_running_loop()
        rate = cfg.scrub_bytes_per_s
        chunk_bytes = max(1, min(CHUNK_BYTES, rate // 4))
        self.load()
        t0 = time.monotonic()
        res = PassResult()
        start: bytes | None = self._begin()
        self.running = True
        try:
            while start is not None:
                await self._handle_reported()
                nxt, n, nbytes, found = await loop.run_in_executor(pool, self.scrub_chunk, start, chunk_bytes)
                if found:
                    res.corrupt += await self._drop_async(found)
                    if self.engine._closing:  # not dropped: the next start checks this chunk again
                        raise asyncio.CancelledError
                res.entries += n
                res.bytes += nbytes
                self._count(n, nbytes)
                self.position = start = nxt  # the chunk is done (its findings handled)
                if start is not None and time.monotonic() - self._saved_at >= self.save_every_s:
                    self.save()
                ahead = res.bytes / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)  # the throttle: a rate, so a timer by design
        except asyncio.CancelledError:
            self.save()  # the bookie is stopping: the next start resumes from here
            raise
        finally:
            self.running = False
        res.seconds = time.monotonic() - t0
        self._pass_done(res)
        return res

    async def _handle_reported(self) -> None:
        reported = self._take_reported()
        if reported:
            await self._drop_async(reported)

    async def loop(self, pool) -> None:
        """Passes forever (first after ``scrub_first_delay_s``, then ``scrub_interval_s`` after each
        ends); copies reported by reads are dropped in between, as soon as they are reported."""
        cfg = self.engine.config
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self.load()
        if self._reported:
            self._wake.set()
        due = time.monotonic() + cfg.scrub_first_delay_s
        if self.position is None and self.last_pass_end > 0 and cfg.scrub_interval_s > 0:
            # a completed pass before a restart: the next one when its interval is up
            due = max(due, time.monotonic() + self.last_pass_end + cfg.scrub_interval_s - time.time())
        while True:
            timeout = due - time.monotonic() if cfg.scrub_interval_s > 0 else None
            if not self._now and (timeout is None or timeout > 0):
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                await self._handle_reported()
                if self._now or (cfg.scrub_interval_s > 0 and time.monotonic() >= due):
                    self._now = False
                    await self.run_pass(pool)
                    due = time.monotonic() + cfg.scrub_interval_s
            except asyncio.CancelledError:
                raise
            except Exception:  # a chore must not die; the next round retries
                log.exception("scrub failed")
                due = time.monotonic() + min(cfg.scrub_interval_s or 60.0, 60.0)
