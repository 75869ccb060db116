"""Entry logs: append-only files shared by all ledgers, written by the flush in sorted batches.

How this works. A flush sorts the write cache by (ledger, entry) and appends each entry as one
record ``[u32 length][u32 crc32c][u64 ledger][i64 entry][i64 entry_term][u8 digest type]
[u8 digest length][digest][data]`` to the *current* log, then fsyncs it; the index maps
(ledger, entry) to (log id, offset, record size). Sorting keeps a ledger's entries next to each
other, so a range read is one sequential read. The current log rotates at ``entry_log_bytes_max``;
a restart always starts a new log (never appends after a possibly torn tail). The CRC is the
bookie's own storage checksum: it guards every read, whatever digest type the client used.
Readers open logs by path per read; compaction may delete a log under a reader, who then looks the
entry up again (an open file descriptor keeps the old data readable until it is closed).
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import crc32c

from .errors import CorruptEntryError

log = logging.getLogger(__name__)

FRAME = struct.Struct("<II")
ENTRY_HEAD = struct.Struct("<QqqBB")  # ledger, entry, entry_term, digest type, digest length
FILE_HEADER = struct.Struct("<8sI")
MAGIC = b"SCRLELG1"
IOV_MAX = 1024
HEADER_BYTES = 64
FILE_RE = re.compile(r"^entrylog-(\d{10})\.log$")


class StoredEntry(NamedTuple):
    """One entry as the bookie holds it. The hot add path stores plain tuples that begin with the
    same four fields and carry the entry-log record head fifth (a NamedTuple call costs several
    times a tuple display), so internal code indexes, never names."""

    entry_term: int
    digest_type: int
    digest: bytes
    data: bytes


ENTRY_OVERHEAD = 64  # bytes accounted per cached entry besides digest and data


def entry_size(entry: tuple) -> int:
    return len(entry[3]) + len(entry[2]) + ENTRY_OVERHEAD


def log_name(log_id: int) -> str:
    return f"entrylog-{log_id:010d}.log"


def log_files(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for path in directory.iterdir():
        m = FILE_RE.match(path.name)
        if m:
            out.append((int(m.group(1)), path))
    return sorted(out)


def record_head(ledger_id: int, entry_id: int, term: int, dtype: int, digest: bytes, data: bytes) -> bytes:
    """Everything of a record but its data: frame (with the CRC over header, digest and data),
    header, digest. Built once when the add arrives; the journal and the flush reuse it, and the
    data follows it unchanged (never copied to frame it)."""
    head = ENTRY_HEAD.pack(ledger_id, entry_id, term, dtype, len(digest)) + digest
    return FRAME.pack(len(head) + len(data), crc32c.crc32c(data, crc32c.crc32c(head))) + head


def split_head(head: bytes) -> tuple[int, int, int, int, bytes, int]:
    """(ledger, entry, term, digest type, digest, data length) from a record head."""
    length, _crc = FRAME.unpack_from(head, 0)
    lid, eid, term, dtype, dlen = ENTRY_HEAD.unpack_from(head, FRAME.size)
    start = FRAME.size + ENTRY_HEAD.size
    return lid, eid, term, dtype, head[start : start + dlen], length - (len(head) - FRAME.size)


def encode(ledger_id: int, entry_id: int, entry: tuple) -> bytes:
    """A whole record for an entry tuple (term, digest type, digest, data)."""
    return record_head(ledger_id, entry_id, *entry[:4]) + entry[3]


def decode(raw, ledger_id: int | None = None, entry_id: int | None = None) -> tuple[int, int, tuple]:
    """Parse and check one record (bytes or a memoryview); returns (ledger, entry, (entry_term,
    digest type, digest, data)). Raises CorruptEntryError on any mismatch."""
    if len(raw) < FRAME.size + ENTRY_HEAD.size:
        raise CorruptEntryError(f"short entry-log record ({len(raw)} bytes)")
    length, crc = FRAME.unpack_from(raw, 0)
    payload = memoryview(raw)[FRAME.size :]
    if length != len(payload) or crc32c.crc32c(payload) != crc:
        raise CorruptEntryError(f"entry-log checksum mismatch for ledger {ledger_id} entry {entry_id}")
    lid, eid, term, dtype, dlen = ENTRY_HEAD.unpack_from(payload, 0)
    if (ledger_id is not None and lid != ledger_id) or (entry_id is not None and eid != entry_id):
        raise CorruptEntryError(f"entry-log record holds {lid}/{eid}, index said {ledger_id}/{entry_id}")
    start = ENTRY_HEAD.size
    digest = bytes(payload[start : start + dlen])
    data = bytes(payload[start + dlen :])
    return lid, eid, (term, dtype, digest, data)


class EntryLogWriter:
    """Appends to the current log. Used only by the flush/GC thread."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.log_id = 0
        self.offset = 0
        self._fd = -1

    def open(self, last_log_id: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_id = last_log_id
        self._fd = -1

    def ensure_room(self, nbytes: int) -> None:
        """Start a new log when the current one is absent or would overflow."""
        if self._fd >= 0 and self.offset + nbytes <= self.max_bytes:
            return
        self.sync_and_close()
        self.log_id += 1
        path = self.directory / log_name(self.log_id)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, FILE_HEADER.pack(MAGIC, self.log_id).ljust(HEADER_BYTES, b"\0"), 0)
        self.offset = HEADER_BYTES
        _fsync_dir(self.directory)

    def append_many(self, buffers: list[bytes], nbytes: int) -> tuple[int, int]:
        """Gather-write buffers contiguously into the current log (rotating first if they would
        not fit); returns (log id, first offset)."""
        self.ensure_room(nbytes)
        start = self.offset
        done = 0
        for i in range(0, len(buffers), IOV_MAX):
            part = buffers[i : i + IOV_MAX]
            want = sum(map(len, part))
            got = os.pwritev(self._fd, part, start + done)
            if got < want:  # short write: finish it the slow way
                rest = memoryview(b"".join(part))[got:]
                while rest:
                    n = os.pwrite(self._fd, rest, start + done + got)
                    rest, got = rest[n:], got + n
            done += want
        self.offset += nbytes
        return self.log_id, start

    def rollback(self, log_id: int, offset: int) -> None:
        """Forget a partly written tail after an error (the index never pointed there)."""
        if log_id == self.log_id and self._fd >= 0:
            try:
                os.ftruncate(self._fd, offset)
                self.offset = offset
            except OSError as exc:
                log.warning("entry log %d: cannot truncate after an error: %s", log_id, exc)
                self.sync_and_close()

    def sync(self) -> None:
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def rotate(self) -> None:
        """Close the current log; the next append starts a new one."""
        self.sync_and_close()

    def sync_and_close(self) -> None:
        if self._fd >= 0:
            try:
                os.fdatasync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    @property
    def is_open(self) -> bool:
        return self._fd >= 0


class LogReader:
    """Reads several records, keeping each log open for the duration of one request."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fds: dict[int, int] = {}

    def read(self, log_id: int, offset: int, size: int) -> bytes:
        fd = self._fds.get(log_id)
        if fd is None:
            fd = os.open(self.directory / log_name(log_id), os.O_RDONLY)
            self._fds[log_id] = fd
        return os.pread(fd, size, offset)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scan(buf, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(ledger, entry, offset, size) of each intact record in ``buf[:end]`` (an mmap of a log).

    A record that fails its CRC is skipped by its length and the scan goes on (a flipped bit in
    one record must not hide the records after it from compaction); a length that points past the
    end, or into bytes that do not frame a record, ends the scan."""
    end = min(end, len(buf))
    off = HEADER_BYTES
    while off + FRAME.size + ENTRY_HEAD.size <= end:
        length, crc = FRAME.unpack_from(buf, off)
        stop = off + FRAME.size + length
        if length < ENTRY_HEAD.size or stop > end:
            if off < end:
                log.warning("entry log: no record frame at offset %d, scan stops", off)
            return
        if crc32c.crc32c(buf[off + FRAME.size : stop]) != crc:
            log.warning("entry log: bad record at offset %d (%d bytes): skipped", off, stop - off)
            off = stop
            continue
        lid, eid = struct.unpack_from("<Qq", buf, off + FRAME.size)
        yield lid, eid, off, stop - off
        off = stop


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
