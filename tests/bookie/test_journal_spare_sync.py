"""A journal spare's zero fill never queues more than ``journal_spare_sync_bytes`` on the disk ahead of
the group commits (issue 26: 64 MiB written at once, then one fsync, stalled the commits of every bookie
on the disk for 0.3-0.5 s at the first half-full journal file; docs/benchmarks.md)."""

from __future__ import annotations

import os

from bookie import journal

MiB = 1 << 20


def _fill(tmp_path, monkeypatch, sync_bytes: int) -> tuple[list[int], bytes]:
    """Make an 8 MiB spare; the file's size at each of its syncs, and its content."""
    sizes: list[int] = []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def fdatasync(fd):
        sizes.append(os.fstat(fd).st_size)
        real_fdatasync(fd)

    def fsync(fd):
        sizes.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(journal.os, "fdatasync", fdatasync)
    monkeypatch.setattr(journal.os, "fsync", fsync)
    path = journal._make_spare(tmp_path / "journal-spare-1.tmp", 8 * MiB, "zero", sync_bytes)
    return sizes, path.read_bytes()


def test_a_spare_fill_syncs_every_sync_bytes_and_is_complete(tmp_path, monkeypatch):
    sizes, data = _fill(tmp_path, monkeypatch, 1 * MiB)
    assert data == b"\0" * (8 * MiB)
    assert sizes[-1] == 8 * MiB
    # never more than 1 MiB written since the previous sync
    assert max(b - a for a, b in zip([0, *sizes], sizes)) <= 1 * MiB


def test_sync_bytes_zero_keeps_the_single_fsync(tmp_path, monkeypatch):
    sizes, data = _fill(tmp_path, monkeypatch, 0)
    assert data == b"\0" * (8 * MiB)
    assert sizes == [8 * MiB]
