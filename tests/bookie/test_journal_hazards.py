"""Journal file hazards between the writer thread and the checkpoint's ``delete_covered``, and
records replayed at start that were never synced.

Each race test pauses the journal writer at the dangerous point of a rotation (a wrapper around
``os.rename`` that waits on an event when the journal renames a file into place), runs the other
side to completion in the test thread, releases the writer, and checks that every synced record
replays and that the journal keeps working.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from bookie import digest
from bookie.journal import FILE_HEADER, MAGIC, Journal, journal_files, read_header
from bookie.storage import Engine

from .helpers import small_config

FILE_BYTES = 64 * 1024
NAMED = re.compile(r"^journal-\d+\.jnl$")


def make(path: Path) -> Journal:
    j = Journal(path, file_bytes=FILE_BYTES, group_bytes_max=16 * 1024, max_record_bytes=32 * 1024, preallocate="zero")
    j.open(0)
    return j


def write_until_file(j: Journal, file_id: int, written: list[int]) -> None:
    """Append and sync 1 KB records one at a time until the journal writes into ``file_id``."""
    while j._file_id < file_id:
        written.append(j.append(1, b"%08d" % len(written) + b"r" * 1000))
        j.sync()


def replayed(path: Path) -> list[int]:
    j = Journal(path, file_bytes=FILE_BYTES, group_bytes_max=16 * 1024, max_record_bytes=32 * 1024)
    return [r.seq for r in j.replay(0)]


def first_seq(path: Path, file_id: int) -> int:
    raw = (path / f"journal-{file_id:012d}.jnl").read_bytes()[: FILE_HEADER.size]
    magic, header_id, first = FILE_HEADER.unpack(raw)
    assert (magic, header_id) == (MAGIC, file_id)
    return first


class PausedRename:
    """Pauses the journal writer at its rename of a file into place (``after``: once renamed)."""

    def __init__(self, monkeypatch, *, after: bool) -> None:
        self.after = after
        self.armed = False
        self.paused = threading.Event()
        self.release = threading.Event()
        real = os.rename

        def rename(src, dst, *args, **kwargs):
            pause = self.armed and NAMED.match(Path(dst).name) is not None
            if pause and not self.after:
                self._wait()
            real(src, dst, *args, **kwargs)
            if pause and self.after:
                self._wait()

        monkeypatch.setattr(os, "rename", rename)

    def _wait(self) -> None:
        self.armed = False
        self.paused.set()
        assert self.release.wait(30), "the test never released the writer"


def rotate_while_paused(j: Journal, pause: PausedRename, written: list[int], file_id: int, meanwhile) -> None:
    """Write in a thread until the journal rotates into ``file_id``, pausing at the rename; run
    ``meanwhile`` in this thread while it is paused; release; the writer must finish cleanly."""
    pause.armed = True
    failure: list[BaseException] = []

    def writer() -> None:
        try:
            write_until_file(j, file_id, written)
        except BaseException as exc:  # reported below
            failure.append(exc)
            pause.paused.set()

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert pause.paused.wait(30), "the writer never reached the rename"
        meanwhile()
    finally:
        pause.release.set()
        t.join(30)
    assert not failure, failure


def test_a_file_renamed_into_place_already_carries_its_own_header(tmp_path: Path, monkeypatch) -> None:
    """The window between naming a new file and writing its header: a recycled spare still carries
    the old header (a small first seq), and a delete_covered running then took the file just closed
    for covered, deleting acknowledged records."""
    j = make(tmp_path)
    written: list[int] = []
    write_until_file(j, 2, written)
    covered = first_seq(tmp_path, 2) - 1  # a checkpoint covering file 1 only
    assert j.delete_covered(covered) == 0  # file 1 is recycled as the next spare, not deleted
    pause = PausedRename(monkeypatch, after=True)
    # the same checkpoint while the writer is paused: nothing of file 2 is covered
    rotate_while_paused(j, pause, written, 3, lambda: j.delete_covered(covered))
    j.crash()
    assert replayed(tmp_path) == [s for s in written if s > covered], "a synced record was lost"
    assert (tmp_path / "journal-000000000002.jnl").exists()


def test_a_covered_file_recycled_while_the_writer_renames_its_spare_lands_elsewhere(tmp_path: Path, monkeypatch) -> None:
    """The writer took the spare and is about to rename it into place; a checkpoint recycles a
    covered file as the next spare meanwhile. It must not land on the name being renamed (the
    next rotation then found no spare file and the bookie went read-only)."""
    j = make(tmp_path)
    written: list[int] = []
    write_until_file(j, 2, written)
    covered = first_seq(tmp_path, 2) - 1
    pause = PausedRename(monkeypatch, after=False)
    # file 1 is covered: recycled as the next spare while the writer is paused
    rotate_while_paused(j, pause, written, 3, lambda: j.delete_covered(covered))
    write_until_file(j, 5, written)  # the next rotations find their spares
    j.close()
    assert replayed(tmp_path) == [s for s in written if s > covered]


def test_records_replayed_at_start_are_synced_before_the_engine_serves(tmp_path: Path, monkeypatch) -> None:
    """A bookie killed between writing a journal group and its fdatasync leaves records that only
    the page cache holds; the next incarnation replays them and builds on them (states, LAC, the
    next seq), so they must be made durable before it answers anything. A power cut cannot be
    staged in a test process, so this checks the act itself: every journal file holding records
    after the checkpoint, and the directory, are synced during open."""
    cfg = small_config(tmp_path, journal_preallocate="none", journal_file_bytes=128 * 1024, max_batch_bytes=16 * 1024,
                       max_batch_adds=16, max_entry_bytes=4096)
    a = Engine(cfg)
    a.open()
    a.fence(7, 1)
    for i in range(240):  # about 2 files of records after the checkpoint
        data = b"x" * 1000
        out = a.add_batch([7], [i], [1], [i - 1], [i - 1], [i == 0], [False], [0], [digest.crc32c_digest(7, i, data)], [data])
        assert out.statuses is None
    a.journal.sync()
    a.crash()
    holding = {os.stat(p).st_ino for _i, p in journal_files(cfg.journal_path)}
    assert len(holding) >= 2
    synced: set[int] = set()
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def record(real):
        def sync(fd):
            synced.add(os.fstat(fd).st_ino)
            return real(fd)
        return sync

    monkeypatch.setattr(os, "fdatasync", record(real_fdatasync))
    monkeypatch.setattr(os, "fsync", record(real_fsync))
    b = Engine(cfg)
    b.open()
    try:
        assert holding <= synced, "a replayed journal file was not synced before serving"
        assert os.stat(cfg.journal_path).st_ino in synced, "the journal directory was not synced"
        assert b.read_entry(7, 239).data == b"x" * 1000
    finally:
        b.close()


@pytest.mark.parametrize("wrong", ["id", "magic"])
def test_a_header_naming_another_file_counts_as_no_header(tmp_path: Path, wrong: str) -> None:
    j = make(tmp_path)
    written: list[int] = []
    write_until_file(j, 3, written)
    path = tmp_path / "journal-000000000002.jnl"
    with open(path, "r+b") as fh:
        if wrong == "id":
            fh.seek(8)
            fh.write((1).to_bytes(8, "little"))  # file 2 claims to be file 1
        else:
            fh.write(b"NOTAJNL!")
    assert read_header(path, 2) is None
    j.delete_covered(10**9)  # file 1 is covered only if file 2's header says so
    assert (tmp_path / "journal-000000000001.jnl").exists(), "file 1 was judged covered through a bad header"
    j.close()
