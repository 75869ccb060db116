"""The flush: one write-cache generation -> entry log + index, as one atomic checkpoint.

How this works. ``Flusher`` owns the disk side that only the background ("disk") thread touches:
the entry-log writer, the index writes and the per-log byte accounting used by GC. ``run(job)``
takes a frozen generation, the ledger states and the journal seq captured at the same instant
(``FlushJob``), and:
1. turns the generation's tombstones into index deletions (truncates, trims, whole ledgers);
2. appends the entries, sorted by (ledger, entry), to the current entry log and fsyncs it;
3. writes one synced RocksDB batch: deletions, new locations, ledger states, log accounting and the
   checkpoint mark (``job.seq``).
Only after step 3 may journal files up to the mark be deleted. If anything fails the entry log is
rolled back, nothing in memory changes, and the same job can be retried (the generation stays in
the write cache meanwhile, so reads are unaffected). Live-byte accounting is exact: deletions read
the old locations, and an add that overwrites an already flushed id (only possible at or below the
ledger's highest flushed id) looks its old location up.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

from terms.bookie_rules import LedgerState

from .cache import WriteGen
from .entrylog import HEADER_BYTES, EntryLogWriter, log_files, log_name
from .index import ENTRY_KEY, LOCATION, Index

log = logging.getLogger(__name__)

CHUNK_ENTRIES = 4096  # write a ledger's entries in runs of at most this many (bounded buffers)


@dataclass
class FlushJob:
    gen: WriteGen
    states: dict[int, LedgerState | None]  # None: the ledger was deleted
    seq: int  # checkpoint mark: every journal record <= seq is reflected in this job


@dataclass
class FlushResult:
    entries: int = 0
    bytes: int = 0
    deleted: int = 0


@dataclass
class _Pending:
    """Index and accounting changes of one flush or compaction, committed only on success."""

    batch: object
    delta: dict[int, list[int]] = field(default_factory=dict)  # log id -> [total delta, live delta]
    deleted: set[tuple[int, int]] = field(default_factory=set)

    def account(self, log_id: int, total: int, live: int) -> None:
        d = self.delta.setdefault(log_id, [0, 0])
        d[0] += total
        d[1] += live


class Flusher:
    def __init__(self, index: Index, log_dir: Path, entry_log_bytes_max: int) -> None:
        self.index = index
        self.log_dir = Path(log_dir)
        self.writer = EntryLogWriter(self.log_dir, entry_log_bytes_max)
        self.log_stats: dict[int, list[int]] = {}
        self._max_flushed: dict[int, int | None] = {}

    def open(self) -> None:
        """Load accounting, delete orphan logs (written by a flush that never committed)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_stats = self.index.load_log_stats()
        last = 0
        for log_id, path in log_files(self.log_dir):
            last = max(last, log_id)
            if log_id not in self.log_stats:
                log.info("entry log %d is not referenced by any checkpoint: deleted", log_id)
                path.unlink()
        self.writer.open(max([last, *self.log_stats]) if self.log_stats else last)

    def close(self) -> None:
        self.writer.sync_and_close()

    # --- the flush ---------------------------------------------------------------------------

    def run(self, job: FlushJob) -> FlushResult:
        pending = _Pending(self.index.batch())
        result = FlushResult()
        result.deleted = self._apply_tombstones(job.gen, pending)
        start = (self.writer.log_id, self.writer.offset) if self.writer.is_open else None
        try:
            result.entries, result.bytes = self._write_entries(job.gen, pending)
            for ledger_id, state in job.states.items():
                Index.put_state(pending.batch, ledger_id, state)
                if state is None:
                    self._max_flushed.pop(ledger_id, None)
            Index.put_checkpoint(pending.batch, job.seq)
            self.commit(pending)
        except OSError:
            if start is not None:
                self.writer.rollback(*start)
            raise
        return result

    def commit(self, pending: _Pending, dropped_logs: tuple[int, ...] = ()) -> None:
        """Sync the entry log, then write the index batch with the accounting it implies."""
        stats = {k: list(v) for k, v in self.log_stats.items()}
        for log_id, (dtotal, dlive) in pending.delta.items():
            s = stats.setdefault(log_id, [0, 0])
            s[0] += dtotal
            s[1] += dlive
        for log_id in dropped_logs:
            stats.pop(log_id, None)
            Index.put_log_stats(pending.batch, log_id, None)
        for log_id in pending.delta:
            if log_id in stats:
                Index.put_log_stats(pending.batch, log_id, stats[log_id])
        self.writer.sync()
        self.index.write(pending.batch)
        self.log_stats = stats

    def _apply_tombstones(self, gen: WriteGen, pending: _Pending) -> int:
        ranges = [(lid, start, None) for lid, start in gen.trunc_from.items()]
        ranges += [(lid, first, last) for lid, spans in gen.trims.items() for first, last in spans]
        for ledger_id, first, last in ranges:
            it = self.index.entries(ledger_id, first) if last is None else self.index.entries(ledger_id, first, last)
            for entry_id, loc in it:
                key = (ledger_id, entry_id)
                if key not in pending.deleted:
                    pending.deleted.add(key)
                    Index.delete_location(pending.batch, ledger_id, entry_id)
                    pending.account(loc[0], 0, -loc[2])
        return len(pending.deleted)

    def _write_entries(self, gen: WriteGen, pending: _Pending) -> tuple[int, int]:
        count = total = 0
        for ledger_id in sorted(gen.entries):
            led = gen.entries[ledger_id]
            ids = sorted(led)
            top = self._highest_flushed(ledger_id)
            if top is not None and ids[0] <= top:
                for entry_id in ids:
                    if entry_id > top:
                        break
                    self._forget_old_copy(ledger_id, entry_id, pending)
            self._max_flushed[ledger_id] = ids[-1] if top is None else max(top, ids[-1])
            for i in range(0, len(ids), CHUNK_ENTRIES):
                nbytes = self._append_ledger(ledger_id, ids[i : i + CHUNK_ENTRIES], led, pending)
                total += nbytes
            count += len(ids)
        return count, total

    def _append_ledger(self, ledger_id: int, ids: list[int], led: dict[int, tuple], pending: _Pending) -> int:
        """Append one ledger's entries (a bounded run) and index them. Returns bytes written.

        Per-entry work goes through map/zip/accumulate so that the loops run in C: this thread
        shares the GIL with the event loop, and its Python time is taken from the adds."""
        entries = list(map(led.__getitem__, ids))
        heads = [e[4] for e in entries]  # built when the add arrived
        datas = [e[3] for e in entries]
        sizes = list(map(operator.add, map(len, heads), map(len, datas)))
        ends = list(itertools.accumulate(sizes))
        room = self.writer.max_bytes - (self.writer.offset if self.writer.is_open else HEADER_BYTES)
        if ends[-1] > room and len(ids) > 1:  # will not fit: write what does, the rest in the next log
            cut = max(1, bisect.bisect_right(ends, room))
            return self._append_ledger(ledger_id, ids[:cut], led, pending) + self._append_ledger(ledger_id, ids[cut:], led, pending)
        nbytes = ends[-1]
        log_id, offset = self.writer.append_many(list(itertools.chain.from_iterable(zip(heads, datas))), nbytes)
        starts = itertools.accumulate(sizes[:-1], initial=offset)
        keys = map(ENTRY_KEY.pack, itertools.repeat(b"E"), itertools.repeat(ledger_id), ids)
        locs = map(LOCATION.pack, itertools.repeat(log_id), starts, sizes)
        collections.deque(map(pending.batch.put, keys, locs), maxlen=0)  # drive the puts in C
        pending.account(log_id, nbytes, nbytes)
        return nbytes

    def append_records(self, chunk: list[tuple[int, int, bytes]], pending: _Pending) -> None:
        """Append already encoded records (compaction), never splitting one across logs."""
        i = 0
        while i < len(chunk):
            room = self.writer.max_bytes - (self.writer.offset if self.writer.is_open else HEADER_BYTES)
            j, size = i, 0
            while j < len(chunk) and (j == i or size + len(chunk[j][2]) <= room):
                size += len(chunk[j][2])
                j += 1
            log_id, offset = self.writer.append_many([rec for _l, _e, rec in chunk[i:j]], size)
            for ledger_id, entry_id, rec in chunk[i:j]:
                Index.put_location(pending.batch, ledger_id, entry_id, (log_id, offset, len(rec)))
                offset += len(rec)
            pending.account(log_id, size, size)
            i = j

    def _highest_flushed(self, ledger_id: int) -> int | None:
        if ledger_id not in self._max_flushed:
            self._max_flushed[ledger_id] = self.index.max_entry(ledger_id)
        return self._max_flushed[ledger_id]

    def _forget_old_copy(self, ledger_id: int, entry_id: int, pending: _Pending) -> None:
        if (ledger_id, entry_id) in pending.deleted:
            return
        old = self.index.location(ledger_id, entry_id)
        if old is not None:
            pending.account(old[0], 0, -old[2])

    def log_path(self, log_id: int) -> Path:
        return self.log_dir / log_name(log_id)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for _i, p in log_files(self.log_dir))


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
