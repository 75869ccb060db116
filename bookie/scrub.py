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

An index entry whose entry log is gone (a log compacted while it held a corrupt record: the
compaction cannot copy that record, see ``gc.py``) is a finding too. Entries still in the write
cache are not on disk yet and are not scrubbed; a copy the index no longer names when it is about
to be dropped (overwritten, truncated or moved since it was read) is left alone.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
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
        self.passes = 0
        self.entries = 0
        self.corrupt = 0
        self.last_pass_end = 0.0  # unix time; 0: no pass completed yet
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

    # ------------------------------------------------------------------ synchronous API (tests, tools)

    def scrub_now(self) -> PassResult:
        """One whole pass, unthrottled, in the caller's thread (the engine must not be started)."""
        t0 = time.monotonic()
        res = PassResult()
        start: bytes | None = b"E"
        found: list[Finding] = self._take_reported()
        while start is not None:
            start, n, nbytes, f = self.scrub_chunk(start, CHUNK_BYTES)
            res.entries += n
            res.bytes += nbytes
            found += f
        dropped = self.drop(found) if found else []
        self._dropped(dropped)
        res.corrupt = len(dropped)
        res.seconds = time.monotonic() - t0
        self._pass_done(res)
        return res

    def _count(self, n: int, nbytes: int) -> None:
        self.entries += n
        self.metrics.scrub_entries.inc(n)
        self.metrics.scrub_bytes.inc(nbytes)

    def _pass_done(self, res: PassResult) -> None:
        self.passes += 1
        self.last_pass_end = time.time()
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
        t0 = time.monotonic()
        res = PassResult()
        start: bytes | None = b"E"
        self.running = True
        try:
            while start is not None:
                await self._handle_reported()
                start, n, nbytes, found = await loop.run_in_executor(pool, self.scrub_chunk, start, chunk_bytes)
                res.entries += n
                res.bytes += nbytes
                self._count(n, nbytes)
                if found:
                    res.corrupt += await self._drop_async(found)
                ahead = res.bytes / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)  # the throttle: a rate, so a timer by design
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
        if self._reported:
            self._wake.set()
        due = time.monotonic() + cfg.scrub_first_delay_s
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
