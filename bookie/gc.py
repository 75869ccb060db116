"""Garbage collection: give back the space of deleted entries.

How this works. Deleting entries (trims, truncates, whole ledgers, overwrites) only removes index
keys at the next flush, and lowers the *live bytes* of the entry logs that held them (exact
accounting kept by ``Flusher``). ``collect`` then looks at every entry log except the one being
written: a log with no live bytes is deleted; a log whose live share is under the threshold is
*compacted*: its records that the index still points to are copied to the current log, the index
is repointed in one synced batch, and only then is the old file unlinked. If the current log itself
is mostly dead it is closed first so that it can be compacted too. A crash in between leaves
either the old log still referenced (nothing happened) or an orphan log that the next start
deletes. Runs on the same single disk thread as flushes, so the two never interleave.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

from .entrylog import HEADER_BYTES, scan
from .flush import Flusher, _Pending, fsync_dir

log = logging.getLogger(__name__)

COMPACT_CHUNK = 4 << 20


@dataclass
class GcResult:
    logs_deleted: int = 0
    logs_compacted: int = 0
    entries_moved: int = 0
    reclaimed_bytes: int = 0


def collect(flusher: Flusher, live_threshold: float) -> GcResult:
    result = GcResult()
    _retire_dead_current(flusher, live_threshold)
    current = flusher.writer.log_id if flusher.writer.is_open else None
    for log_id, (total, live) in sorted(flusher.log_stats.items()):
        if log_id == current or total <= 0 or live >= live_threshold * total:
            continue
        path = flusher.log_path(log_id)
        size = path.stat().st_size if path.exists() else 0
        if live > 0:
            result.entries_moved += _compact(flusher, log_id)
            result.logs_compacted += 1
        else:
            flusher.commit(_Pending(flusher.index.batch()), dropped_logs=(log_id,))
            result.logs_deleted += 1
        path.unlink(missing_ok=True)
        result.reclaimed_bytes += size
    if result.reclaimed_bytes:
        fsync_dir(flusher.log_dir)
        log.info(
            "gc: %d logs deleted, %d compacted (%d entries moved), %d bytes reclaimed",
            result.logs_deleted, result.logs_compacted, result.entries_moved, result.reclaimed_bytes,
        )
    return result


def _retire_dead_current(flusher: Flusher, live_threshold: float) -> None:
    writer = flusher.writer
    if not writer.is_open:
        return
    total, live = flusher.log_stats.get(writer.log_id, (0, 0))
    if total > 0 and live < live_threshold * total:
        writer.rotate()


def _compact(flusher: Flusher, log_id: int) -> int:
    """Copy the still-referenced records of one log to the current log; repoint the index."""
    pending = _Pending(flusher.index.batch())
    moved = 0
    path = flusher.log_path(log_id)
    total = flusher.log_stats[log_id][0]
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        chunk: list[tuple[int, int, bytes]] = []
        chunk_bytes = 0
        for ledger_id, entry_id, offset, size in scan(buf, HEADER_BYTES + total):
            if flusher.index.location(ledger_id, entry_id) != (log_id, offset, size):
                continue  # deleted or overwritten since: not live
            chunk.append((ledger_id, entry_id, bytes(buf[offset : offset + size])))
            chunk_bytes += size
            moved += 1
            if chunk_bytes >= COMPACT_CHUNK:
                flusher.append_records(chunk, pending)
                chunk, chunk_bytes = [], 0
        flusher.append_records(chunk, pending)
    flusher.commit(pending, dropped_logs=(log_id,))
    return moved
