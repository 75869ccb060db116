"""The storage engine: the term rules, the journal, the caches, the flush, the index and reads.

How this works. Every term-carrying request goes through ``terms.bookie_rules.decide``; the engine
applies an ``Accept`` to memory (ledger state, write cache, truncation) and appends the journal
record in the same synchronous call, so nothing can interleave between deciding and journaling.
The call returns the journal seq the answer must wait for; the caller (the gRPC server, or a test)
waits until that seq is synced (``wait_durable``) before answering. Per ledger the engine keeps the
``LedgerState`` (term, LAC, LAFR, clean term); the seq of the last record that touched the ledger
(answers that change nothing still wait for it, so no answer reveals a term that is not durable);
and a mutation epoch bumped by truncates and deletes (a disk read that raced one must not fill the
read cache).

Adds are processed a batch at a time in columns. ``decide`` is pure, and for an add without the
truncate flag its answer depends on the ledger state and the add's term, LAC, LAFR and recovery flag
only (tests/bookie/test_rules_contract.py pins this), so the engine remembers the last decision per
ledger and reuses it while the state object and those fields are unchanged: one real ``decide`` per
run of similar adds instead of one per add. A truncating add always calls ``decide`` itself.

Writes: journal -> write cache (``cache.py``) -> background flush (``flush.py``) -> entry logs +
RocksDB index, with a checkpoint mark (the journal seq covered). Reads: write cache -> read cache ->
index -> entry log; a disk part runs in a read thread and is checked on return against the write
cache including the generations flushed while it ran (``range_steps``; ``cache.py`` explains why).
Restart: load states and the mark from the index, replay the journal after the mark (re-deciding
each add, so the result is the same as before the crash), then fdatasync the journal files
replayed (a killed process may have left records only in the page cache). A full disk (ENOSPC,
EIO on a write, or free space under ``min_free_bytes``) makes the engine read-only; ``check_disk``
lifts it once space is back and the journal writes again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import itertools
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import crc32c

from terms.bookie_rules import Accept, LedgerState, Reject, changes_state, decide
from terms.messages import AddRequest, FenceRequest, LacWriteRequest, RecoveryReadRequest

from . import digest as digests
from . import entrylog
from .cache import DELETED, ReadCache, WriteCache
from .config import BookieConfig
from .entrylog import ENTRY_HEAD, ENTRY_OVERHEAD, FRAME
from .errors import (
    BadRequestError,
    BookieError,
    CorruptEntryError,
    NoSuchLedgerError,
    ReadOnlyError,
    ShuttingDownError,
    Status,
    StorageError,
    TooBusyError,
    TooLargeError,
)
from .flush import Flusher, FlushJob
from .gc import GcResult, collect
from .index import Index
from .journal import Journal, JournalCommitter
from .metrics import BookieMetrics
from .runtime import named_pool
from .scrub import PassResult, Scrubber

log = logging.getLogger(__name__)

REC_ADDS, REC_STATE, REC_TRIM = 1, 2, 3
# An ADDS record: u32 count, then per add REPLAY + the entry-log record head + the data. The head
# carries ledger, entry, term, digest type and digest; REPLAY the rest of the add that replay
# needs to run ``decide`` again.
REPLAY = struct.Struct("<qqBBH")  # lac, lafr, truncate, recovery, head length
STATE_BODY = struct.Struct("<Qqqqq")  # ledger, term, lac, lafr, clean_term
TRIM_BODY = struct.Struct("<QqqB")  # ledger, first, last, whole ledger
COUNT = struct.Struct("<I")
MAX_ID = (1 << 63) - 1
_CRC_SIZE = digests.DIGEST_SIZE[digests.DIGEST_CRC32C]
_MAC_SIZE = digests.DIGEST_SIZE[digests.DIGEST_MAC]
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


@dataclass(frozen=True, slots=True)
class AddOutcome:
    statuses: list[int] | None  # one Status per add; None when every add is OK
    bookie_terms: list[int] | None  # the bookie's term per add (for INVALID_TERM / NOT_TRUNCATED)
    seq: int  # wait until this journal seq is durable before answering (0: nothing to wait for)


@dataclass(frozen=True, slots=True)
class ReadResult:
    lac: int
    lafr: int
    entries: list[tuple[int, tuple]]  # (entry id, (entry_term, digest_type, digest, data, ...)), contiguous
    stop: Status  # why the run ended: OK (range or limit reached), NO_SUCH_ENTRY, CORRUPT


class _ReadPlan:
    """One range read in progress: collects entries and enforces the limits."""

    def __init__(self, first: int, last: int, max_entries: int, max_bytes: int) -> None:
        self.next = first
        self.last = last
        self.max_entries = max_entries
        self.bytes_left = max_bytes
        self.entries: list[tuple[int, tuple]] = []
        self.stop: Status | None = None

    @property
    def done(self) -> bool:
        return self.stop is not None or self.next > self.last or len(self.entries) >= self.max_entries

    def room(self) -> int:
        return min(self.max_entries - len(self.entries), self.last - self.next + 1)

    def take(self, entry_id: int, entry: tuple) -> bool:
        size = len(entry[3])
        if size > self.bytes_left and self.entries:
            self.stop = Status.OK  # byte limit: the caller asks again from here
            return False
        self.bytes_left -= size
        self.entries.append((entry_id, entry))
        self.next = entry_id + 1
        return True


class Engine:
    def __init__(self, config: BookieConfig, metrics: BookieMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or BookieMetrics()
        self.states: dict[int, LedgerState] = {}
        self.write_cache = WriteCache()
        self.read_cache = ReadCache(config.read_cache_bytes)
        self.journal = Journal(
            config.journal_path,
            file_bytes=config.journal_file_bytes,
            group_bytes_max=config.journal_group_bytes_max,
            max_record_bytes=config.max_journal_record_bytes,
            preallocate=config.journal_preallocate,
            spare_sync_bytes=config.journal_spare_sync_bytes,
        )
        self.index: Index | None = None
        self.flusher: Flusher | None = None
        self.committer: JournalCommitter | None = None
        self.applied_seq = 0  # seq of the last record applied to memory (the next checkpoint mark)
        self.min_free_bytes = config.min_free_bytes
        self._memo: dict[int, tuple] = {}
        self._dirty: set[int] = set()
        self._last_seq: dict[int, int] = {}
        self._epoch: dict[int, int] = {}
        self._lac_waiters: dict[int, list[tuple[int, asyncio.Future, object]]] = {}
        self._n_lac_waiters = 0
        self._floor_reason: str | None = None
        self._io_error: str | None = None
        self._flush_trigger = config.write_cache_bytes // 2
        self._lock_fd = -1
        self._opened = False
        self._closing = False
        # async machinery (start())
        self._tasks: list[asyncio.Task] = []
        self._disk_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._scrub_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.scrubber = Scrubber(self)
        self._flush_wanted: asyncio.Event | None = None
        self._space: asyncio.Event | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._retry_job: FlushJob | None = None
        self.metrics.write_cache_bytes.set_function(lambda: self.write_cache.bytes)
        self.metrics.write_cache_retired_bytes.set_function(lambda: self.write_cache.retired_bytes)

    # ================================================================ life cycle

    def open(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        cfg.journal_path.mkdir(parents=True, exist_ok=True)
        self._lock_dir(cfg.data_dir)
        self.index = Index(cfg.data_dir / "index")
        self.flusher = Flusher(self.index, cfg.data_dir / "entrylogs", cfg.entry_log_bytes_max)
        self.flusher.open()
        self.states = self.index.load_states()
        mark = self.index.checkpoint_seq()
        self.applied_seq = mark
        replayed = self._replay(mark)
        # what replay read may be only in the page cache (a kill between a group's write and its
        # fdatasync): make it durable before anything is answered or numbered after it
        self.journal.sync_existing()
        self.journal.open(self.applied_seq)
        self._opened = True
        self.check_disk()
        log.info(
            "storage open: %d ledgers, checkpoint seq %d, %d journal records replayed, next seq %d",
            len(self.states), mark, replayed, self.journal.next_seq,
        )

    def _lock_dir(self, data_dir: Path) -> None:
        fd = os.open(data_dir / "bookie.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"data dir {data_dir} is in use by another bookie") from exc
        self._lock_fd = fd

    def close(self) -> None:
        """Synchronous clean close: sync the journal, checkpoint, release everything."""
        if not self._opened:
            return
        self.journal.sync()
        self.checkpoint()
        self._release()

    def crash(self, torn_bytes: int = 0) -> None:
        """Test hook: stop as a power cut would. Unsynced journal records are lost (optionally
        leaving a torn prefix of the next one); nothing is flushed."""
        self.journal.crash(torn_bytes)
        self._release()

    def _release(self) -> None:
        self._opened = False
        if self._scrub_pool is not None:  # its thread reads the index: done before the index closes
            self._scrub_pool.shutdown(wait=True)
        self.journal.close()
        if self.flusher is not None:
            self.flusher.close()
        if self.index is not None:
            self.index.close()
        for pool in (self._disk_pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ================================================================ replay

    def _replay(self, mark: int) -> int:
        count = 0
        for rec in self.journal.replay(mark):
            if rec.rtype == REC_ADDS:
                self._replay_adds(rec.body)
            elif rec.rtype == REC_STATE:
                ledger_id, term, lac, lafr, clean = STATE_BODY.unpack(rec.body)
                self._install(ledger_id, LedgerState(term, lac, lafr, clean))
            elif rec.rtype == REC_TRIM:
                ledger_id, first, last, whole = TRIM_BODY.unpack(rec.body)
                self._apply_trim(ledger_id, first, last, bool(whole))
            else:
                log.warning("journal record %d has unknown type %d: skipped", rec.seq, rec.rtype)
            self.applied_seq = rec.seq
            count += 1
            if self.write_cache.active.bytes >= self._flush_trigger:
                self.flush()  # bound memory while replaying a long journal
        return count

    def _replay_adds(self, body: bytes) -> None:
        (count,) = COUNT.unpack_from(body, 0)
        off = COUNT.size
        for _ in range(count):
            lac, lafr, trunc, rec, hlen = REPLAY.unpack_from(body, off)
            off += REPLAY.size
            head = body[off : off + hlen]
            ledger_id, entry_id, term, dtype, digest, size = entrylog.split_head(head)
            data = body[off + hlen : off + hlen + size]
            off += hlen + size
            before = self.states.get(ledger_id)
            decision = decide(before, AddRequest(ledger_id, entry_id, term, lac, lafr, data, bool(trunc), bool(rec)))
            if isinstance(decision, Reject):
                log.warning("replay: add ledger=%d entry=%d term=%d now rejected: skipped", ledger_id, entry_id, term)
                continue
            if decision.truncate_from is not None:
                self._truncate(ledger_id, decision.truncate_from)
            if decision.state != before:
                self._install(ledger_id, decision.state)
            self.write_cache.active.put(ledger_id, entry_id, (term, dtype, digest, data, head))

    # ================================================================ adds

    def add_batch(self, ledger_ids, entry_ids, terms, lacs, lafrs, truncates=(), recoveries=(), dtypes=(), digest_col=(), datas=()) -> AddOutcome:
        """Decide, apply and journal a batch of adds (columns of equal length; the three flag
        columns may be empty, meaning all false / CRC32C). Never awaits."""
        self._check_open()
        n = len(ledger_ids)
        self._check_batch(n, entry_ids, terms, lacs, lafrs, truncates, recoveries, dtypes, digest_col, datas)
        if self.read_only_reason is not None:
            return AddOutcome([Status.READ_ONLY] * n, [-1] * n, 0)
        return self._add_columns(
            n, ledger_ids, entry_ids, terms, lacs, lafrs,
            truncates or itertools.repeat(False, n), recoveries or itertools.repeat(False, n),
            dtypes or itertools.repeat(0, n), digest_col, datas,
        )

    def _check_batch(self, n, *columns) -> None:
        cfg = self.config
        if n > cfg.max_batch_adds:
            raise TooLargeError(f"batch of {n} adds exceeds max_batch_adds={cfg.max_batch_adds}")
        for i, col in enumerate(columns):
            if len(col) != n and not (len(col) == 0 and i in (4, 5, 6)):  # the optional flag columns
                raise BadRequestError(f"add batch columns differ in length ({len(col)} != {n})")
        if sum(map(len, columns[-1])) > cfg.max_batch_bytes:
            raise TooLargeError(f"batch payload exceeds max_batch_bytes={cfg.max_batch_bytes}")

    def _add_columns(self, n, ledger_ids, entry_ids, terms, lacs, lafrs, truncates, recoveries, dtypes, digest_col, datas) -> AddOutcome:
        # The hot loop: locals for everything, the write cache dict written inline, and one
        # journal record for the whole batch. Per accepted add it builds the entry-log record
        # head (with the storage CRC) that the flush will write unchanged.
        statuses: list[int] | None = None
        bterms: list[int] | None = None
        states, memo, dirty, last_seq = self.states, self._memo, self._dirty, self._last_seq
        gen = self.write_cache.active
        cached = gen.entries
        read_cache = self.read_cache
        read_cached = read_cache.ids_by_ledger
        eh_pack, fr_pack, rp_pack, crc = ENTRY_HEAD.pack, FRAME.pack, REPLAY.pack, crc32c.crc32c
        max_entry = self.config.max_entry_bytes
        verify = self.config.verify_digest_on_add
        check_crc = digests.crc32c_digest
        parts: list[bytes] = [b""]
        touched: list[int] = []
        lac_up: list[int] = []
        wait = accepted = nbytes = added = 0
        prev = led = None
        rows = zip(ledger_ids, entry_ids, terms, lacs, lafrs, truncates, recoveries, dtypes, digest_col, datas)
        for i, (lid, eid, term, lac, lafr, trunc, rec, dtype, dig, data) in enumerate(rows):
            # --- validation: a bad add gets its own status, the rest of the batch proceeds
            if lid < 0 or eid < 0 or term < 0 or lac < -1 or lafr < -1 or lid > MAX_ID:
                code = Status.BAD_REQUEST
            elif len(data) > max_entry:
                code = Status.TOO_LARGE
            elif dtype == 0:
                code = Status.BAD_REQUEST if len(dig) != _CRC_SIZE else (
                    Status.BAD_DIGEST if verify and check_crc(lid, eid, data) != dig else 0)
            else:
                code = 0 if dtype == 1 and len(dig) == _MAC_SIZE else Status.BAD_REQUEST
            if code:
                statuses = statuses or [0] * n
                bterms = bterms or [-1] * n
                statuses[i] = code
                continue
            # --- the term rules (see the module doc for the per-ledger memo)
            before = states.get(lid)
            if trunc:
                decision = decide(before, AddRequest(lid, eid, term, lac, lafr, data, True, rec))
                new = decision.state if decision.__class__ is Accept else None
            else:
                m = memo.get(lid)
                if m is not None and m[0] is before and m[1] == term and m[2] == lac and m[3] == lafr and m[4] == rec:
                    decision, new = m[5], m[6]
                else:
                    decision = decide(before, AddRequest(lid, eid, term, lac, lafr, data, False, rec))
                    new = None if decision.__class__ is Reject else (
                        before if before is not None and decision.state == before else decision.state)
                    memo[lid] = (before, term, lac, lafr, rec, decision, new)
            if new is None:
                statuses = statuses or [0] * n
                bterms = bterms or [-1] * n
                statuses[i] = Status.NOT_TRUNCATED if decision.not_truncated else Status.INVALID_TERM
                bterms[i] = decision.bookie_term
                wait = max(wait, last_seq.get(lid, 0))
                continue
            # --- apply: truncate first (ids are reused), then state, then the entry
            if trunc:
                self._truncate(lid, decision.truncate_from)
                prev = None  # the truncate may have replaced the ledger's dict
            if new is not before:
                states[lid] = new
                dirty.add(lid)
                if before is None or new.lac > before.lac:
                    lac_up.append(lid)
            h = eh_pack(lid, eid, term, dtype, len(dig)) + dig
            head = fr_pack(len(h) + len(data), crc(data, crc(h))) + h
            if lid != prev:
                led = cached.get(lid)
                if led is None:
                    led = cached[lid] = {}
                stale = read_cached.get(lid)
                prev = lid
                touched.append(lid)
            led[eid] = (term, dtype, dig, data, head)
            if stale and eid in stale:
                read_cache.drop(lid, eid, eid)  # an overwrite: the old copy must not outlive the flush
            parts.append(rp_pack(lac, lafr, trunc, rec, len(head)))
            parts.append(head)
            parts.append(data)
            accepted += 1
            nbytes += len(data)
            added += len(data) + len(dig) + ENTRY_OVERHEAD
        if accepted:
            gen.bytes += added  # an overwrite counts twice until the flush: safe (flushes earlier)
            parts[0] = COUNT.pack(accepted)
            seq = self._append(REC_ADDS, b"".join(parts))
            for lid in touched:
                last_seq[lid] = seq
            wait = max(wait, seq)
            self.metrics.adds.inc(accepted)
            self.metrics.add_bytes.inc(nbytes)
        for lid in lac_up:
            self._notify_lac(lid)
        if statuses is not None:
            self._count_rejects(statuses)
        self._maybe_want_flush()
        return AddOutcome(statuses, bterms, wait)

    def _count_rejects(self, statuses: list[int]) -> None:
        for code in set(statuses) - {0}:
            self.metrics.add_rejects.labels(Status(code).name).inc(statuses.count(code))

    # ================================================================ fence, recovery read, LAC write

    def fence(self, ledger_id: int, term: int) -> tuple[Accept | Reject, int]:
        """Adopt the term (fences are accepted even for ledgers never seen). Returns the decision
        and the seq to wait for before answering with the state's LAC and LAFR."""
        self._check_ids(ledger_id, 0, term)
        return self._decide_state(FenceRequest(ledger_id, term))

    def recovery_read_decide(self, ledger_id: int, entry_id: int, term: int) -> tuple[Accept | Reject, int]:
        """The term part of a recovery read; the entry is read after the returned seq is durable."""
        self._check_ids(ledger_id, entry_id, term)
        return self._decide_state(RecoveryReadRequest(ledger_id, entry_id, term))

    def write_lac(self, ledger_id: int, term: int, lac: int, lafr: int) -> tuple[Accept | Reject, int]:
        self._check_ids(ledger_id, 0, term)
        if lac < -1 or lafr < -1:
            raise BadRequestError("lac and lafr must be >= -1")
        return self._decide_state(LacWriteRequest(ledger_id, term, lac, lafr))

    def _decide_state(self, request) -> tuple[Accept | Reject, int]:
        self._check_open()
        lid = request.ledger_id
        before = self.states.get(lid)
        decision = decide(before, request)
        # A fence or recovery read creates a never-seen ledger even when its state equals the
        # initial one (term 0): journal that too, so the ledger exists across restarts.
        if isinstance(decision, Reject) or (before is not None and not changes_state(before, decision)):
            return decision, self._last_seq.get(lid, 0)
        if self.read_only_reason is not None:
            raise ReadOnlyError(f"bookie is read-only: {self.read_only_reason}")
        self._install(lid, decision.state)
        st = decision.state
        if isinstance(request, LacWriteRequest) and before is not None and st.term == before.term \
                and st.clean_term == before.clean_term:
            # Only the LAC/LAFR hint moved: not journaled (no record, no fsync before the answer).
            # Adds carry the LAC too and are journaled, the next checkpoint stores this state, and
            # a take-over re-derives the tail by recovery reads: a restart that forgets it shows
            # readers a lower LAC for a while, never an entry above the writer's (PROTOCOL.md, rule 5).
            self._notify_lac(lid)
            return decision, self._last_seq.get(lid, 0)
        seq = self._append(REC_STATE, STATE_BODY.pack(lid, st.term, st.lac, st.lafr, st.clean_term))
        self._last_seq[lid] = seq
        if before is None or st.lac > before.lac:
            self._notify_lac(lid)
        log.info("ledger=%d term=%d: %s adopted (lac=%d lafr=%d)", lid, st.term, type(request).__name__, st.lac, st.lafr)
        return decision, seq

    # ================================================================ trims and deletes

    def trim(self, ledger_id: int, first: int, last: int) -> int:
        """Delete ids in [first, last] (retention). Returns the seq to wait for."""
        self._check_open()
        if first < 0 or last < first:
            raise BadRequestError(f"bad trim range [{first}, {last}]")
        if ledger_id not in self.states:
            return 0  # nothing here: trims are idempotent
        self._apply_trim(ledger_id, first, last, False)
        return self._journal_trim(ledger_id, first, last, False)

    def delete_ledger(self, ledger_id: int) -> int:
        """Delete every entry and the ledger's state."""
        self._check_open()
        if ledger_id not in self.states:
            return 0
        self._apply_trim(ledger_id, 0, MAX_ID, True)
        return self._journal_trim(ledger_id, 0, MAX_ID, True)

    def _journal_trim(self, ledger_id: int, first: int, last: int, whole: bool) -> int:
        seq = self._append(REC_TRIM, TRIM_BODY.pack(ledger_id, first, last, whole))
        self._last_seq[ledger_id] = seq
        log.info("ledger=%d: %s [%d, %d]", ledger_id, "deleted" if whole else "trimmed", first, last)
        return seq

    def _apply_trim(self, ledger_id: int, first: int, last: int, whole: bool) -> None:
        if whole:
            self._truncate(ledger_id, 0)
            self.states.pop(ledger_id, None)
            self._memo.pop(ledger_id, None)
            self._dirty.add(ledger_id)
            return
        self.write_cache.active.trim(ledger_id, first, last)
        self.read_cache.drop(ledger_id, first, last)
        self._epoch[ledger_id] = self._epoch.get(ledger_id, 0) + 1

    # ================================================================ shared helpers

    def _truncate(self, ledger_id: int, start: int) -> None:
        self.write_cache.active.truncate(ledger_id, start)
        self.read_cache.drop(ledger_id, start)
        self._epoch[ledger_id] = self._epoch.get(ledger_id, 0) + 1

    def _install(self, ledger_id: int, state: LedgerState) -> None:
        self.states[ledger_id] = state
        self._dirty.add(ledger_id)

    def _append(self, rtype: int, body: bytes) -> int:
        seq = self.journal.append(rtype, body)
        self.applied_seq = seq
        if self.committer is not None:
            self.committer.notify()
        return seq

    def _check_open(self) -> None:
        if self._closing:
            raise ShuttingDownError("bookie is shutting down")
        if not self._opened:
            raise ShuttingDownError("storage is not open")

    def _check_ids(self, ledger_id: int, entry_id: int, term: int) -> None:
        if ledger_id < 0 or ledger_id > MAX_ID or entry_id < 0 or term < 0:
            raise BadRequestError("ledger id, entry id and term must be >= 0")

    def state(self, ledger_id: int) -> LedgerState | None:
        return self.states.get(ledger_id)

    # ================================================================ reads

    def read_range(self, ledger_id: int, first: int, last: int, max_entries: int = 0, max_bytes: int = 0) -> ReadResult:
        """Synchronous range read (tests, tools): memory, then disk, in order."""
        steps = self.range_steps(ledger_id, first, last, max_entries, max_bytes)
        try:
            args = next(steps)
            while True:
                try:
                    found = self.read_disk(*args)
                except BaseException as exc:
                    steps.throw(exc)  # unpins, then raises exc again
                    raise
                args = steps.send(found)
        except StopIteration as done:
            return done.value

    async def aread_range(self, ledger_id: int, first: int, last: int, max_entries: int = 0, max_bytes: int = 0) -> ReadResult:
        """The same, with the disk parts in the read threads."""
        steps = self.range_steps(ledger_id, first, last, max_entries, max_bytes)
        try:
            args = next(steps)
        except StopIteration as done:
            return done.value
        return await self.finish_range(steps, args)

    async def finish_range(self, steps, args) -> ReadResult:
        """Drive a started ``range_steps`` read whose next disk part is ``args`` to its result,
        the disk parts in the read threads (a caller that served the memory part synchronously
        continues here)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    found = await loop.run_in_executor(self._read_pool, self.read_disk, *args)
                except BaseException as exc:  # cancelled, or the disk failed: unpin on the way out
                    steps.throw(exc)
                    raise
                args = steps.send(found)
        except StopIteration as done:
            return done.value

    def range_steps(self, ledger_id: int, first: int, last: int, max_entries: int = 0, max_bytes: int = 0):
        """A range read as a generator: it yields the arguments of each disk part (``read_disk``),
        is sent that part's result, and returns the ReadResult. Whoever drives it may let the
        event loop run (adds, truncates, flushes) while a disk part is out.

        A disk part is checked against the write cache as it is when the result comes back, with
        the write cache pinned (``WriteCache.pin``) from before the disk part started: a newer
        copy or a tombstone in a generation flushed meanwhile still wins over the older copy the
        index named when it was scanned. The read cache is filled only from disk copies no
        generation knows of, and only when no truncate or trim of the ledger (its epoch) ran."""
        plan = self._read_plan(ledger_id, first, last, max_entries, max_bytes)
        wc = self.write_cache
        while not plan.done:
            self._read_memory(ledger_id, plan)
            if plan.done:
                break
            epoch = self._epoch.get(ledger_id, 0)
            mark = wc.pin()
            try:
                found, stop = yield (ledger_id, plan.next, plan.room(), plan.bytes_left)
                fill = epoch == self._epoch.get(ledger_id, 0)
                self._take_disk(ledger_id, plan, found, stop, mark, fill)
            finally:
                wc.unpin(mark)
        return self._read_result(ledger_id, plan)

    def read_entry(self, ledger_id: int, entry_id: int) -> entrylog.StoredEntry | None:
        """One entry or None. Raises CorruptEntryError."""
        res = self.read_range(ledger_id, entry_id, entry_id, 1)
        return self._single(res)

    async def aread_entry(self, ledger_id: int, entry_id: int) -> entrylog.StoredEntry | None:
        res = await self.aread_range(ledger_id, entry_id, entry_id, 1)
        return self._single(res)

    @staticmethod
    def _single(res: ReadResult) -> entrylog.StoredEntry | None:
        if res.entries:
            return entrylog.StoredEntry(*res.entries[0][1][:4])
        if res.stop == Status.CORRUPT:
            raise CorruptEntryError("stored entry fails its checksum")
        return None

    def _read_plan(self, ledger_id: int, first: int, last: int, max_entries: int, max_bytes: int) -> _ReadPlan:
        self._check_open()
        cfg = self.config
        if first < 0:
            raise BadRequestError("first entry id must be >= 0")
        if ledger_id not in self.states:
            raise NoSuchLedgerError(f"ledger {ledger_id} is not on this bookie")
        max_entries = min(max_entries or cfg.max_read_entries, cfg.max_read_entries)
        max_bytes = min(max_bytes or cfg.max_read_bytes, cfg.max_read_bytes)
        return _ReadPlan(first, max(first, last), max_entries, max_bytes)

    def _read_memory(self, ledger_id: int, plan: _ReadPlan) -> None:
        """Serve ids from the caches while they hit; stop at the first id that needs the disk."""
        wc, rc = self.write_cache, self.read_cache
        hits = {"write": 0, "read": 0}
        misses = {"write": 0, "read": 0}
        while not plan.done:
            eid = plan.next
            found = wc.lookup(ledger_id, eid)
            if found is DELETED:
                plan.stop = Status.NO_SUCH_ENTRY
                break
            if found is None:
                misses["write"] += 1
                found = rc.get(ledger_id, eid)
                if found is None:
                    misses["read"] += 1
                    break
                hits["read"] += 1
            else:
                hits["write"] += 1
            if not self._verified(ledger_id, eid, found):
                plan.stop = Status.CORRUPT
                break
            if not plan.take(eid, found):
                break
        for cache in ("write", "read"):
            self.metrics.cache_lookup(cache, hits[cache], misses[cache])

    def read_disk(self, ledger_id: int, first: int, count: int, max_bytes: int) -> tuple[list[tuple[int, tuple]], Status]:
        """Index + entry log, for up to ``count`` contiguous ids from ``first`` and about
        ``max_bytes`` of data. One index scan; one pread per run of records that lie back to
        back in one log (a flush writes a ledger's entries that way). Thread-safe."""
        locs = self._locate_run(ledger_id, first, count, max_bytes)
        if not locs:
            return [], Status.NO_SUCH_ENTRY
        out: list[tuple[int, tuple]] = []
        with entrylog.LogReader(self.flusher.log_dir) as reader:
            for span in _spans(locs):
                got, corrupt = self._read_span(reader, ledger_id, span)
                out += got
                if corrupt:
                    return out, Status.CORRUPT
                if len(got) < len(span):
                    return out, Status.NO_SUCH_ENTRY
        return out, (Status.OK if len(locs) == count else Status.NO_SUCH_ENTRY)

    def _locate_run(self, ledger_id: int, first: int, count: int, max_bytes: int) -> list[tuple[int, tuple]]:
        locs: list[tuple[int, tuple]] = []
        budget = max_bytes
        for eid, loc in self.index.entries(ledger_id, first, first + count - 1):
            if eid != first + len(locs) or budget <= 0:
                break
            locs.append((eid, loc))
            budget -= loc[2]
        return locs

    def _read_span(self, reader: entrylog.LogReader, ledger_id: int, span: list[tuple[int, tuple]]) -> tuple[list, bool]:
        """The span's entries up to the first corrupt one; and whether one was corrupt."""
        log_id, start, _size = span[0][1]
        end = span[-1][1][1] + span[-1][1][2]
        out: list[tuple[int, tuple]] = []
        try:
            raw = reader.read(log_id, start, end - start)
            view = memoryview(raw)
            for eid, (_log, off, size) in span:
                _lid, _eid, entry = entrylog.decode(view[off - start : off - start + size], ledger_id, eid)
                out.append((eid, entry))
        except FileNotFoundError:
            return self._read_one_by_one(reader, ledger_id, span)
        except CorruptEntryError as exc:
            eid, loc = span[len(out)]
            log.error("ledger=%d entry=%d: %s", ledger_id, eid, exc)
            self.scrubber.report(ledger_id, eid, loc, str(exc))
            return out, True
        return out, False

    def _read_one_by_one(self, reader: entrylog.LogReader, ledger_id: int, span: list[tuple[int, tuple]]) -> tuple[list, bool]:
        """Compaction moved these entries and deleted their log: look each up again."""
        out: list[tuple[int, tuple]] = []
        for eid, _loc in span:
            raw = None
            for _attempt in range(3):
                loc = self.index.location(ledger_id, eid)
                if loc is None:
                    return out, False
                try:
                    raw = reader.read(*loc)
                    break
                except FileNotFoundError:
                    continue
            try:
                if raw is None:
                    raise CorruptEntryError("its entry log keeps disappearing")
                out.append((eid, entrylog.decode(raw, ledger_id, eid)[2]))
            except CorruptEntryError as exc:
                log.error("ledger=%d entry=%d: %s", ledger_id, eid, exc)
                if loc is not None:
                    self.scrubber.report(ledger_id, eid, loc, str(exc))
                return out, True
        return out, False

    def _take_disk(self, ledger_id: int, plan: _ReadPlan, found: list, stop: Status, mark: int, fill_cache: bool) -> None:
        wc, rc = self.write_cache, self.read_cache
        for eid, entry in found:
            # a newer copy or a deletion may have arrived, or been flushed, since the index was read
            newer = wc.lookup_since(ledger_id, eid, mark)
            if newer is DELETED:
                plan.stop = Status.NO_SUCH_ENTRY
                return
            if newer is not None:
                entry = newer
            elif fill_cache:
                rc.put(ledger_id, eid, entry)
            if not self._verified(ledger_id, eid, entry):
                plan.stop = Status.CORRUPT
                return
            if not plan.take(eid, entry):
                return
        if not found:
            plan.stop = Status.NO_SUCH_ENTRY if stop == Status.OK else stop
        elif stop == Status.CORRUPT:
            plan.stop = stop
        # NO_SUCH_ENTRY after some entries: the next ids may still be in the write cache

    @staticmethod
    def _verified(ledger_id: int, entry_id: int, entry: tuple) -> bool:
        if entry[1] == digests.DIGEST_CRC32C:
            return digests.crc32c_digest(ledger_id, entry_id, entry[3]) == entry[2]
        return True  # a MAC: the storage CRC was checked on the way from disk; the client checks the MAC

    def _read_result(self, ledger_id: int, plan: _ReadPlan) -> ReadResult:
        st = self.states.get(ledger_id) or LedgerState()
        self.metrics.reads.inc(len(plan.entries))
        return ReadResult(st.lac, st.lafr, plan.entries, plan.stop or Status.OK)

    # ================================================================ LAC long poll

    def lac_waiter(self, ledger_id: int, after_lac: int, on_ready=None) -> asyncio.Future | None:
        """A future resolved when the ledger's LAC exceeds ``after_lac``; None if it already does.
        ``on_ready()``, if given, is called synchronously at that moment (from the add or LAC write
        that moved the LAC, before its journal commit), so a parked tail read is answered without
        waiting for the fsync of the add that carried the LAC or for a loop turn."""
        st = self.states.get(ledger_id)
        if st is not None and st.lac > after_lac:
            return None
        if self._n_lac_waiters >= self.config.max_lac_waiters:
            raise TooBusyError("too many long-poll LAC readers")
        fut = asyncio.get_running_loop().create_future()
        self._lac_waiters.setdefault(ledger_id, []).append((after_lac, fut, on_ready))
        self._n_lac_waiters += 1
        return fut

    def forget_lac_waiter(self, ledger_id: int, fut: asyncio.Future) -> None:
        waiters = self._lac_waiters.get(ledger_id)
        if waiters is None:
            return
        kept = [w for w in waiters if w[1] is not fut]
        self._n_lac_waiters -= len(waiters) - len(kept)
        if kept:
            self._lac_waiters[ledger_id] = kept
        else:
            del self._lac_waiters[ledger_id]

    def _notify_lac(self, ledger_id: int) -> None:
        waiters = self._lac_waiters.get(ledger_id)
        if not waiters:
            return
        lac = self.states[ledger_id].lac
        kept = []
        ready = []
        for w in waiters:
            after, fut, on_ready = w
            if lac > after:
                if not fut.done():
                    fut.set_result(lac)
                    if on_ready is not None:
                        ready.append(on_ready)
            elif not fut.done():
                kept.append(w)
        self._n_lac_waiters -= len(waiters) - len(kept)
        if kept:
            self._lac_waiters[ledger_id] = kept
        else:
            del self._lac_waiters[ledger_id]
        for on_ready in ready:
            try:
                on_ready()
            except Exception:  # noqa: BLE001 - a reader's answer must never fail the add that woke it
                log.exception("ledger=%d: answering a long poll failed", ledger_id)

    # ================================================================ flush, checkpoint, GC

    def begin_flush(self) -> FlushJob | None:
        """Freeze the active generation with the states and the journal seq of this instant."""
        if self.write_cache.flushing is not None:
            return None
        gen = self.write_cache.active
        if not (gen.entries or gen.trunc_from or gen.trims or self._dirty) and self.applied_seq == self.index.checkpoint_seq():
            return None
        self.write_cache.swap()
        states = {lid: self.states.get(lid) for lid in self._dirty}
        self._dirty = set()
        return FlushJob(gen, states, self.applied_seq)

    def flush(self) -> None:
        """Synchronous flush of everything applied so far (tests, replay, close)."""
        job = self._retry_job or self.begin_flush()
        if job is None:
            return
        self._retry_job = job
        self.flusher.run(job)
        self._retry_job = None
        self.write_cache.flushed()
        self.metrics.flushes.inc()

    def checkpoint(self) -> None:
        """Flush, then delete the journal files the checkpoint covers."""
        self.flush()
        freed = self.journal.delete_covered(self.index.checkpoint_seq())
        self.metrics.journal_reclaimed_bytes.inc(freed)

    def gc(self) -> GcResult:
        result = collect(self.flusher, self.config.gc_live_threshold)
        self.metrics.gc_reclaimed_bytes.inc(result.reclaimed_bytes)
        return result

    def scrub(self) -> PassResult:
        """Synchronous scrub pass (tests, tools; the started engine scrubs in the background)."""
        self._check_open()
        return self.scrubber.scrub_now()

    def _maybe_want_flush(self) -> None:
        if self._flush_wanted is not None and self.write_cache.active.bytes >= self._flush_trigger:
            self._flush_wanted.set()

    # ================================================================ disk space

    @property
    def read_only_reason(self) -> str | None:
        return self._floor_reason or self._io_error

    def set_min_free_bytes(self, value: int) -> None:
        """Change the free-space floor at run time (operators, tests) and re-check at once."""
        if value < 0:
            raise BadRequestError("min_free_bytes must be >= 0")
        self.min_free_bytes = value
        self.check_disk()

    def free_bytes(self) -> int:
        paths = {self.config.data_dir, self.config.journal_path}
        return min(_free(p) for p in paths)

    def used_bytes(self) -> int:
        total = 0
        for root in {self.config.data_dir, self.config.journal_path}:
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    try:
                        total += os.stat(os.path.join(dirpath, name)).st_size
                    except OSError:
                        pass
        return total

    def check_disk(self) -> None:
        free = self.free_bytes()
        was = self._read_only_kind()
        if free < self.min_free_bytes:
            self._floor_reason = f"free space {free} bytes is under the floor of {self.min_free_bytes} bytes"
        else:
            self._floor_reason = None
            if self._io_error is not None:
                if self.committer is not None and self.committer.broken is not None:
                    self.committer.retry_now()
                elif self._retry_job is None:
                    self._io_error = None
        now = self.read_only_reason
        if self._read_only_kind() != was:  # not on every check: the free byte count in the reason moves
            if now:
                log.error("bookie is read-only: %s", now)
                if self._space is not None:
                    self._space.set()
            else:
                log.info("bookie is writable again")
        self.metrics.read_only.set(1 if now else 0)

    def _read_only_kind(self) -> tuple[bool, str | None]:
        return self._floor_reason is not None, self._io_error

    def io_failure(self, exc: Exception) -> None:
        """A journal or flush write failed: read-only until space comes back and writes work."""
        if getattr(exc, "errno", None) in (*_DISK_ERRNOS, None):
            self._io_error = f"disk write failed: {exc}"
        else:
            self._io_error = f"storage error: {exc}"
        self.metrics.read_only.set(1)
        log.error("bookie is read-only: %s", self._io_error)
        if self._space is not None:
            self._space.set()  # release adds held by back-pressure: they get READ_ONLY

    # ================================================================ async operation

    async def start(self) -> None:
        """Start group commit and the background flush, GC and disk-check loops."""
        cfg = self.config
        self._disk_pool = named_pool(1, "bookie-disk")
        self._read_pool = named_pool(cfg.read_threads, "bookie-read")
        self._scrub_pool = named_pool(1, "bookie-scrub")
        self._flush_wanted = asyncio.Event()
        self._space = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self.committer = JournalCommitter(
            self.journal,
            group_wait_s=cfg.journal_group_wait_s,
            retry_interval_s=cfg.journal_retry_interval_s,
            on_error=self.io_failure,
            observe=self.metrics.journal_group,
            inline_bytes_max=cfg.journal_inline_sync_bytes,
            inline_ok=lambda: not self._flush_lock.locked(),
        )
        self.committer.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._flush_loop(), name="bookie-flush"),
            loop.create_task(self._every(cfg.gc_interval_s, self.gc_async), name="bookie-gc"),
            loop.create_task(self._every(cfg.disk_check_interval_s, self._check_disk_async), name="bookie-disk-check"),
            loop.create_task(self.scrubber.loop(self._scrub_pool), name="bookie-scrub"),
        ]

    async def wait_durable(self, seq: int) -> None:
        if seq <= 0 or self.committer is None:
            return
        fut = self.committer.wait_synced(seq)
        if fut is not None:
            await fut

    def adds_must_wait(self) -> bool:
        """Back-pressure: the write cache is full (a read-only or closing bookie answers at once
        instead of holding its clients)."""
        return (self.write_cache.bytes >= self.config.write_cache_bytes and not self._closing
                and self.read_only_reason is None)

    async def wait_for_space(self) -> None:
        """Hold new adds while ``adds_must_wait``, until a flush frees the write cache."""
        while self.adds_must_wait():
            self._space.clear()
            self._flush_wanted.set()
            await self._space.wait()

    async def flush_async(self) -> None:
        async with self._flush_lock:
            job = self._retry_job or self.begin_flush()
            if job is None:
                return
            self._retry_job = job
            loop = asyncio.get_running_loop()
            try:
                with self.metrics.flush_seconds.time():
                    await loop.run_in_executor(self._disk_pool, self.flusher.run, job)
            except Exception as exc:  # OSError, or RocksDB's own error type: retried either way
                log.error("flush failed (%s): kept in memory, retried later", exc)
                self.io_failure(exc)
                return
            self._retry_job = None
            self.write_cache.flushed()
            self._space.set()
            self.metrics.flushes.inc()
            freed = await loop.run_in_executor(self._disk_pool, self.journal.delete_covered, job.seq)
            self.metrics.journal_reclaimed_bytes.inc(freed)

    async def gc_async(self) -> GcResult:
        async with self._flush_lock:
            loop = asyncio.get_running_loop()
            try:
                result = await loop.run_in_executor(self._disk_pool, collect, self.flusher, self.config.gc_live_threshold)
            except OSError as exc:
                log.error("gc failed: %s", exc)
                return GcResult()
        self.metrics.gc_reclaimed_bytes.inc(result.reclaimed_bytes)
        return result

    async def _check_disk_async(self) -> None:
        self.check_disk()

    async def _flush_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._flush_wanted.wait(), self.config.flush_interval_s)
            except TimeoutError:
                pass
            self._flush_wanted.clear()
            try:
                await self.flush_async()
            except BookieError as exc:
                log.error("flush failed: %s", exc)

    async def _every(self, interval: float, action) -> None:
        while True:
            await asyncio.sleep(interval)  # a periodic chore: a timer by design
            try:
                await action()
            except Exception:  # a chore must not die; the next round retries
                log.exception("background task %s failed", getattr(action, "__name__", action))

    async def aclose(self) -> None:
        """Graceful stop: sync the journal, checkpoint, release files."""
        if not self._opened:
            return
        if self._flush_lock is None:  # never started: nothing runs in the background
            self.close()
            return
        self._closing = True
        if self._space is not None:
            self._space.set()
        async with self._flush_lock:  # never cancel a flush or GC half way
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiters in self._lac_waiters.values():
            for _after, fut, _on_ready in waiters:
                if not fut.done():
                    fut.set_exception(ShuttingDownError("bookie is shutting down"))
        self._lac_waiters.clear()
        if self.committer is not None:
            try:
                await asyncio.wait_for(self.committer.drain(), 10.0)
            except (TimeoutError, BookieError) as exc:
                log.error("journal drain at shutdown failed: %s", exc)
            await self.committer.close()
        try:
            await self.flush_async()
            freed = self.journal.delete_covered(self.index.checkpoint_seq())
            self.metrics.journal_reclaimed_bytes.inc(freed)
        except (OSError, BookieError) as exc:
            log.error("final checkpoint failed (the journal still holds everything): %s", exc)
        self._release()


def _spans(locs: list[tuple[int, tuple]]) -> list[list[tuple[int, tuple]]]:
    """Split located entries into runs that lie back to back in one log (at most 4 MiB each)."""
    spans: list[list[tuple[int, tuple]]] = []
    for item in locs:
        log_id, off, size = item[1]
        if spans:
            last_log, last_off, last_size = spans[-1][-1][1]
            first_off = spans[-1][0][1][1]
            if last_log == log_id and last_off + last_size == off and off + size - first_off <= 4 << 20:
                spans[-1].append(item)
                continue
        spans.append([item])
    return spans


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
