"""The journal: an append-only, preallocated, checksummed log with group commit.

How this works. Every change the bookie makes (a batch of adds, a ledger state change, a trim) is
first appended here as one *record*: ``[u32 length][u32 crc32c][u64 seq][u8 type][body]``; the
CRC covers seq, type and body. ``append`` only buffers the record in memory and returns its
sequence number; a committer (``JournalCommitter``, one asyncio task) takes the buffered records
as one group (bounded by ``group_bytes_max``, optionally after waiting ``group_wait_s`` for more),
writes and fdatasyncs them (a group of at most ``inline_bytes_max`` right on the event loop,
unless ``inline_ok`` says no, e.g. while the entry logs flush and an fsync may stall the loop; a
larger one in a dedicated thread), and then resolves every ``wait_synced`` future up to the group's
last seq. While one group is being synced the event loop keeps appending, which is
what makes the next group big. An add is acknowledged only after its record's group is synced.

Files: ``journal-<id>.jnl`` with a 64-byte header (magic, file id, first seq). A new file is taken
from a *spare*: writing into already allocated, already written blocks makes fdatasync a data-only
flush (measured 1.5-3x the fsync rate of a growing file). Once a checkpoint covers every record of a
file, the file is deleted, except that one covered file is *recycled* as the next spare (its blocks
are allocated and written already); only when none is available does a background thread fill a
new spare with zeros. Stale records in a recycled file are harmless: their seqs are at or below the
checkpoint, and replay skips those. A record never spans files.

A file gets its name only when it is complete: the new header (and a zeroed first frame slot) is
written and synced while the file still has its spare's temporary name, then it is renamed into
place and the directory synced. So a ``journal-<id>.jnl`` always carries its own header, and
``delete_covered`` (which decides that a file is covered by the *next* file's first seq) can never
read a recycled file's stale header. Every spare has a name of its own (``journal-spare-<n>.tmp``):
a covered file recycled while the writer is still renaming the spare it took never lands on that
name. A header whose file id is not its name's is treated as no header.

On a write error the records stay queued, the journal rotates to a fresh file (the failed tail may
be garbage) and retries later; waiters get a ``StorageError``.

Replay reads the files in id order and stops reading a file at the first frame whose length or CRC
is wrong (a torn write: never acknowledged, never served), then continues with the next file.
Records are deduplicated by seq, since a retried group may exist twice.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c

from .errors import StorageError
from .runtime import named_pool

log = logging.getLogger(__name__)

FRAME = struct.Struct("<II")  # length of the payload, crc32c of the payload
RECORD_HEAD = struct.Struct("<QB")  # seq, type
FILE_HEADER = struct.Struct("<8sQQ")  # magic, file id, first seq
MAGIC = b"SCRLJNL1"
HEADER_BYTES = 64
FILE_RE = re.compile(r"^journal-(\d{12})\.jnl$")
SPARE_RE = re.compile(r"^journal-(spare|spare-\d+|new-\d+)\.tmp$")
ZERO_CHUNK = b"\0" * (1 << 20)
IOV_MAX = 1024


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    rtype: int
    body: bytes


def record_head(seq: int, rtype: int, body: bytes) -> bytes:
    """Frame + record head of a record; the body follows it unchanged (never copied to frame it)."""
    head = RECORD_HEAD.pack(seq, rtype)
    return FRAME.pack(len(head) + len(body), crc32c.crc32c(body, crc32c.crc32c(head))) + head


def encode_record(seq: int, rtype: int, body: bytes) -> bytes:
    return record_head(seq, rtype, body) + body


def journal_files(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for path in directory.iterdir():
        m = FILE_RE.match(path.name)
        if m:
            out.append((int(m.group(1)), path))
    return sorted(out)


def file_name(file_id: int) -> str:
    return f"journal-{file_id:012d}.jnl"


def read_header(path: Path, file_id: int | None = None) -> tuple[int, int] | None:
    """(file id, first seq) from a journal file's header, or None when it is not one of ours (or,
    given ``file_id``, not that file's: a header must name the file it is in)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(FILE_HEADER.size)
    except OSError:
        return None
    if len(raw) < FILE_HEADER.size:
        return None
    magic, header_id, first_seq = FILE_HEADER.unpack(raw)
    if magic != MAGIC or (file_id is not None and header_id != file_id):
        return None
    return header_id, first_seq


def scan_file(path: Path, max_record_bytes: int) -> Iterator[Record]:
    """The valid records of one file, in order, stopping at the first torn or corrupt frame."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= HEADER_BYTES:
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            off = HEADER_BYTES
            while off + FRAME.size <= size:
                length, crc = FRAME.unpack_from(buf, off)
                if length == 0:
                    return  # preallocated zeros: the end of what was written
                end = off + FRAME.size + length
                if length < RECORD_HEAD.size or length > max_record_bytes or end > size:
                    log.warning("journal %s: torn frame at offset %d (length %d): discarded", path.name, off, length)
                    return
                payload = buf[off + FRAME.size : end]
                if crc32c.crc32c(payload) != crc:
                    log.warning("journal %s: bad checksum at offset %d: discarded from here", path.name, off)
                    return
                seq, rtype = RECORD_HEAD.unpack_from(payload)
                yield Record(seq, rtype, payload[RECORD_HEAD.size :])
                off = end


def replay(directory: Path, after_seq: int, max_record_bytes: int) -> Iterator[Record]:
    """Every valid record with seq > after_seq, in seq order, each seq once."""
    last = after_seq
    for file_id, path in journal_files(directory):
        if read_header(path, file_id) is None:
            log.warning("journal %s: bad header, skipped", path.name)
            continue
        for rec in scan_file(path, max_record_bytes):
            if rec.seq > last:
                last = rec.seq
                yield rec


class Journal:
    """The synchronous core: buffering, writing, syncing, rotating, replaying, deleting.

    ``append`` and ``take_group``/``requeue``/``mark_synced`` run on the owner's thread (the event
    loop); ``write_group`` runs in the writer thread, one call at a time.
    """

    def __init__(
        self,
        directory: Path,
        *,
        file_bytes: int,
        group_bytes_max: int,
        max_record_bytes: int,
        preallocate: str = "zero",
        spare_sync_bytes: int = 1 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.spare_sync_bytes = spare_sync_bytes
        self.file_bytes = file_bytes
        self.group_bytes_max = group_bytes_max
        self.max_record_bytes = max_record_bytes
        self.preallocate = preallocate
        self._pending: collections.deque[tuple[int, bytes, bytes]] = collections.deque()  # seq, head, body
        self.pending_bytes = 0
        self.next_seq = 1
        self.synced_seq = 0
        self._fd = -1
        self._file_id = 0
        self._offset = 0
        self._spare: concurrent.futures.Future | None = None  # resolves to the spare's path
        self._spare_lock = threading.Lock()  # the writer takes spares, the checkpoint recycles
        self._tmp_names = itertools.count(1)
        self._spare_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # --- opening -----------------------------------------------------------------------------

    def open(self, last_seq: int) -> None:
        """Start writing after ``last_seq`` in a fresh file (never append after a torn tail)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_spares()
        files = journal_files(self.directory)
        self._file_id = files[-1][0] if files else 0
        self.next_seq = last_seq + 1
        self.synced_seq = last_seq
        self._start_file(self.next_seq)

    def replay(self, after_seq: int) -> Iterator[Record]:
        return replay(self.directory, after_seq, self.max_record_bytes)

    def sync_existing(self) -> int:
        """fdatasync every journal file and the directory; returns the files synced.

        A replay may have read records that the previous incarnation wrote but never synced (it
        was killed between the write and the fdatasync: the page cache still had them). Answers
        after the restart build on them, so they must be durable before the first answer: a power
        cut now must not lose records that later, synced records depend on."""
        count = 0
        for _file_id, path in journal_files(self.directory):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            count += 1
        _fsync_dir(self.directory)
        return count

    # --- appending (owner thread) ----------------------------------------------------------

    def append(self, rtype: int, body: bytes) -> int:
        seq = self.next_seq
        self.next_seq = seq + 1
        head = record_head(seq, rtype, body)
        self._pending.append((seq, head, body))
        self.pending_bytes += len(head) + len(body)
        return seq

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_group(self) -> list[tuple[int, bytes, bytes]]:
        group: list[tuple[int, bytes, bytes]] = []
        size = 0
        pending = self._pending
        while pending and (not group or size + len(pending[0][1]) + len(pending[0][2]) <= self.group_bytes_max):
            item = pending.popleft()
            size += len(item[1]) + len(item[2])
            group.append(item)
        self.pending_bytes -= size
        return group

    def requeue(self, group: list[tuple[int, bytes, bytes]]) -> None:
        """Put a failed group back at the front, in order, for the next attempt."""
        for item in reversed(group):
            self._pending.appendleft(item)
            self.pending_bytes += len(item[1]) + len(item[2])

    def mark_synced(self, seq: int) -> None:
        self.synced_seq = max(self.synced_seq, seq)

    # --- writing (writer thread) -----------------------------------------------------------

    def write_group(self, group: list[tuple[int, bytes, bytes]]) -> int:
        """Write and fdatasync a group; returns bytes written. Raises OSError (then rotates)."""
        try:
            return self._write_group(group)
        except OSError:
            self._abandon_file()
            raise

    def _write_group(self, group: list[tuple[int, bytes, bytes]]) -> int:
        if self._fd < 0:
            self._start_file(group[0][0])
        chunk: list[bytes] = []
        chunk_bytes = 0
        written = 0
        for seq, head, body in group:
            size = len(head) + len(body)
            if self._offset + chunk_bytes + size > self.file_bytes:
                written += self._write_chunk(chunk, chunk_bytes)
                os.fdatasync(self._fd)
                self._rotate(seq)
                chunk, chunk_bytes = [], 0
            chunk.append(head)
            chunk.append(body)
            chunk_bytes += size
        written += self._write_chunk(chunk, chunk_bytes)
        os.fdatasync(self._fd)
        if self._offset > self.file_bytes // 2:
            self._prepare_spare()  # unless a recycled file is already waiting
        return written

    def _write_chunk(self, chunk: list[bytes], nbytes: int) -> int:
        """Gather-write the buffers at the current offset (no joining copy)."""
        done = 0
        for i in range(0, len(chunk), IOV_MAX):
            part = chunk[i : i + IOV_MAX]
            want = sum(map(len, part))
            got = os.pwritev(self._fd, part, self._offset + done)
            if got < want:  # a short write: finish the rest the slow way
                rest = memoryview(b"".join(part))[got:]
                while rest:
                    n = os.pwrite(self._fd, rest, self._offset + done + got)
                    rest, got = rest[n:], got + n
            done += want
        self._offset += nbytes
        return nbytes

    def _rotate(self, first_seq: int) -> None:
        self._close_fd()
        self._start_file(first_seq)

    def _start_file(self, first_seq: int) -> None:
        """Make the next file: a spare (or a new file) gets the header, is synced, and only then
        takes its name (see the module doc: a named file always carries its own header)."""
        file_id = self._file_id + 1
        path = self.directory / file_name(file_id)
        spare = self._take_spare()
        fresh = spare is None
        if fresh:
            spare = self.directory / f"journal-new-{next(self._tmp_names)}.tmp"
            fd = os.open(spare, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        else:
            fd = os.open(spare, os.O_RDWR)
        try:
            if fresh:
                _preallocate(fd, self.file_bytes, self.preallocate)
            header = FILE_HEADER.pack(MAGIC, file_id, first_seq).ljust(HEADER_BYTES, b"\0")
            # a recycled file still holds old records after the header: zero the first frame slot
            # so a replay of this file never starts on one (later stale frames have seqs below
            # the checkpoint, so replay skips them anyway)
            os.pwrite(fd, header + bytes(FRAME.size), 0)
            os.fdatasync(fd)
            os.rename(spare, path)
        except OSError:
            os.close(fd)
            spare.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)  # the new name must survive a crash too
        self._file_id = file_id
        self._fd, self._offset = fd, HEADER_BYTES

    def _abandon_file(self) -> None:
        """After an error: the current file's tail is unknown; the next write starts a new file."""
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            finally:
                self._fd = -1

    # --- spare files (a background thread fills the next file with zeros) -------------------

    def _spare_path(self) -> Path:
        return self.directory / f"journal-spare-{next(self._tmp_names)}.tmp"

    def _prepare_spare(self) -> None:
        with self._spare_lock:
            if self.preallocate == "none" or self._spare is not None:
                return
            if self._spare_pool is None:
                self._spare_pool = named_pool(1, "journal-spare")
            self._spare = self._spare_pool.submit(_make_spare, self._spare_path(), self.file_bytes, self.preallocate,
                                                  self.spare_sync_bytes)

    def _recycle(self, path: Path) -> bool:
        """Make a fully covered file the next spare: it is allocated and written already, so it
        costs no zero-filling (RocksDB's WAL recycling, BookKeeper's journal reuse)."""
        with self._spare_lock:
            if self.preallocate == "none" or self._spare is not None or path.stat().st_size != self.file_bytes:
                return False
            spare = self._spare_path()  # a name of its own: never the one the writer is renaming
            os.rename(path, spare)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(spare)
            self._spare = done
            return True

    def _take_spare(self) -> Path | None:
        with self._spare_lock:
            fut, self._spare = self._spare, None
        if fut is None:
            return None
        try:
            return fut.result()
        except OSError as exc:
            log.warning("journal: preparing a spare file failed: %s", exc)
            return None

    def _remove_spares(self) -> None:
        for path in self.directory.iterdir():
            if SPARE_RE.match(path.name):
                path.unlink(missing_ok=True)

    # --- checkpoints and shutdown ----------------------------------------------------------

    def delete_covered(self, checkpoint_seq: int) -> int:
        """Delete files whose every record has seq <= checkpoint_seq. Returns bytes freed."""
        files = journal_files(self.directory)
        freed = 0
        for (file_id, path), (next_id, next_path) in zip(files, files[1:]):
            if file_id >= self._file_id:
                break
            header = read_header(next_path, next_id)
            if header is None or header[1] > checkpoint_seq + 1:
                break
            try:
                size = path.stat().st_size
                if not self._recycle(path):
                    path.unlink()
                    freed += size
            except OSError as exc:
                log.warning("journal: cannot delete %s: %s", path.name, exc)
                break
        return freed

    def sync(self) -> None:
        """Write and sync everything buffered, synchronously (tests, shutdown)."""
        while self._pending:
            group = self.take_group()
            try:
                self.write_group(group)
            except OSError:
                self.requeue(group)
                raise
            self.mark_synced(group[-1][0])

    def crash(self, torn_bytes: int = 0) -> None:
        """Test hook: lose every unsynced record, optionally leaving a torn prefix of the next one.

        This models a power cut: records appended but not synced are gone, and a write in progress
        may have reached the disk only in part.
        """
        if torn_bytes and self._pending and self._fd >= 0:
            frame = self._pending[0][1] + self._pending[0][2]
            os.pwrite(self._fd, frame[: min(torn_bytes, len(frame) - 1)], self._offset)
        self._pending.clear()
        self.pending_bytes = 0
        self.close()

    def close(self) -> None:
        self._close_fd()
        if self._spare_pool is not None:
            self._spare_pool.shutdown(wait=True)
            self._spare_pool = None
        self._spare = None
        self._remove_spares()

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for _i, p in journal_files(self.directory))


def _preallocate(fd: int, size: int, mode: str, sync_bytes: int = 0) -> None:
    """Allocate ``size`` bytes of ``fd``. ``sync_bytes`` (zero mode): fdatasync every that many
    bytes, so the disk never has more than that of the fill queued ahead of the journal's own
    fdatasyncs (a spare's 64 MiB written at once, then one fsync, stalled the group commits of every
    bookie on the disk for 0.3-0.5 s: issue 26, docs/benchmarks.md)."""
    if mode == "zero":
        written = 0
        synced = 0
        while written < size:
            written += os.write(fd, ZERO_CHUNK[: min(len(ZERO_CHUNK), size - written)])
            if sync_bytes and written - synced >= sync_bytes:
                os.fdatasync(fd)
                synced = written
        os.fsync(fd)
    elif mode == "fallocate":
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)


def _make_spare(path: Path, size: int, mode: str, sync_bytes: int = 0) -> Path:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _preallocate(fd, size, mode, sync_bytes)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JournalCommitter:
    """Group commit on the event loop: batch records, sync them in a thread, wake the waiters."""

    def __init__(
        self,
        journal: Journal,
        *,
        group_wait_s: float,
        retry_interval_s: float,
        on_error: Callable[[OSError], None],
        observe: Callable[[float, int, int], None] | None = None,
        inline_bytes_max: int = 0,
        inline_ok: Callable[[], bool] | None = None,
    ) -> None:
        self.journal = journal
        self.group_wait_s = group_wait_s
        self.inline_bytes_max = inline_bytes_max
        self.inline_ok = inline_ok  # e.g. not while the entry logs flush: an fsync may stall then
        self.retry_interval_s = retry_interval_s
        self.on_error = on_error
        self.observe = observe
        self.broken: OSError | None = None
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._wake = asyncio.Event()
        self._retry = asyncio.Event()
        self._closing = False
        self._writer = named_pool(1, "journal-writer")
        self._task: asyncio.Task | None = None
        self._holds = 0  # callers between hold() and release(): appends wait for release
        self._held_notify = False
        self._writing = False  # a group is out in the writer thread

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="journal-committer")

    def notify(self) -> None:
        """Called after appends: there is something to commit."""
        if self._holds:
            self._held_notify = True
            return
        self._wake.set()

    def hold(self) -> None:
        """A caller about to append several records in this loop turn (a read of frames) asks
        for the commit to happen once, at ``release``, instead of waking the committer task."""
        self._holds += 1

    def release(self) -> None:
        """End of a ``hold``: a small group is written and synced right now, synchronously (no
        task switch, no future per waiter needed: ``synced_seq`` tells the caller); otherwise the
        committer task is woken as usual."""
        self._holds -= 1
        if self._holds or not self._held_notify:
            return
        self._held_notify = False
        if not self._sync_inline():
            self._wake.set()

    def _sync_inline(self) -> bool:
        """Write and sync the buffered records here if that is allowed now; whether it was done."""
        j = self.journal
        # a group out in the writer thread must finish first: two writers would interleave frames
        if self._writing or self.broken is not None or self.group_wait_s > 0 or not j.has_pending() or not self._small():
            return False
        group = j.take_group()
        start = time.perf_counter()
        try:
            nbytes = j.write_group(group)
        except OSError:
            j.requeue(group)
            return False  # the committer task retries, reports and fails the waiters
        self._synced(group, start, nbytes)
        return not j.has_pending()

    def retry_now(self) -> None:
        self._retry.set()

    def wait_synced(self, seq: int) -> asyncio.Future | None:
        """A future resolved once ``seq`` is durable; None when it already is. While the journal
        is broken the future waits for the next attempt: it fails if that fails too."""
        if seq <= self.journal.synced_seq:
            return None
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        self._wake.set()
        return fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        j = self.journal
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not j.has_pending():
                if self._closing:
                    return
                continue
            if self.group_wait_s > 0 and j.pending_bytes < j.group_bytes_max:
                await asyncio.sleep(self.group_wait_s)  # the bounded group wait (a timer by design)
            inline = self._small()
            group = j.take_group()
            start = time.perf_counter()
            try:
                if inline:
                    # A small group is written and synced right here on the event loop: the
                    # hand-off to the writer thread and back (a futex wake, then a wake of the
                    # loop through its self-pipe) cost more CPU than the write itself, once per
                    # add at moderate rates. The loop waits for the fsync (~0.2 ms); adds that
                    # arrive meanwhile form the next group.
                    nbytes = j.write_group(group)
                else:
                    self._writing = True
                    try:
                        nbytes = await loop.run_in_executor(self._writer, j.write_group, group)
                    finally:
                        self._writing = False
            except OSError as exc:
                j.requeue(group)
                await self._failed(exc)
                continue
            self._synced(group, start, nbytes)
            if j.has_pending():
                self._wake.set()

    def _small(self) -> bool:
        """Whether what is buffered may be written and synced on the event loop now."""
        return self.journal.pending_bytes <= self.inline_bytes_max and (self.inline_ok is None or self.inline_ok())

    def _synced(self, group, start: float, nbytes: int) -> None:
        j = self.journal
        j.mark_synced(group[-1][0])
        if self.broken is not None:
            log.info("journal: writes work again")
            self.broken = None
        if self.observe is not None:
            self.observe(time.perf_counter() - start, nbytes, len(group))
        self._resolve(j.synced_seq)

    def _resolve(self, synced: int) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= synced:
            fut = waiters.popleft()[1]
            if not fut.done():
                fut.set_result(None)

    async def _failed(self, exc: OSError) -> None:
        log.error("journal: write failed (%s); records kept for retry", exc)
        self.broken = exc
        err = StorageError(f"journal write failed: {exc}")
        while self._waiters:
            fut = self._waiters.popleft()[1]
            if not fut.done():
                fut.set_exception(err)
        self.on_error(exc)
        self._retry.clear()
        try:
            await asyncio.wait_for(self._retry.wait(), self.retry_interval_s)
        except TimeoutError:
            pass
        self._wake.set()

    async def drain(self) -> None:
        """Sync everything appended so far (used at shutdown)."""
        fut = self.wait_synced(self.journal.last_seq)
        if fut is not None:
            await fut

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 10.0)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        self._writer.shutdown(wait=True)
