"""Journal: framing, replay, torn tails, rotation, deletion after a checkpoint, write failures."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest

from bookie.errors import StorageError
from bookie.journal import HEADER_BYTES, Journal, JournalCommitter, journal_files

from .helpers import run


def make(path: Path, file_bytes: int = 64 * 1024, preallocate: str = "zero") -> Journal:
    j = Journal(path, file_bytes=file_bytes, group_bytes_max=16 * 1024, max_record_bytes=32 * 1024, preallocate=preallocate)
    j.open(0)
    return j


def bodies(path: Path, after: int = 0) -> list[tuple[int, bytes]]:
    j = Journal(path, file_bytes=64 * 1024, group_bytes_max=16 * 1024, max_record_bytes=32 * 1024)
    return [(r.seq, r.body) for r in j.replay(after)]


@pytest.mark.parametrize("preallocate", ["zero", "fallocate", "none"])
def test_records_replay_in_order_across_rotations(tmp_path: Path, preallocate: str) -> None:
    j = make(tmp_path, preallocate=preallocate)
    written = [(j.append(1, os.urandom(1000 + i)), i) for i in range(200)]
    j.sync()
    j.close()
    assert len(journal_files(tmp_path)) > 2  # 200 KB through 64 KiB files
    got = bodies(tmp_path)
    assert [seq for seq, _b in got] == [seq for seq, _i in written]
    assert [len(b) for _s, b in got] == [1000 + i for i in range(200)]


def test_replay_skips_records_at_or_below_the_mark(tmp_path: Path) -> None:
    j = make(tmp_path)
    for i in range(10):
        j.append(1, b"r%d" % i)
    j.sync()
    j.close()
    assert [s for s, _b in bodies(tmp_path, after=6)] == [7, 8, 9, 10]


def test_a_torn_last_record_is_discarded_never_served(tmp_path: Path) -> None:
    j = make(tmp_path)
    for i in range(5):
        j.append(1, b"good-%d" % i)
    j.sync()
    j.append(1, b"x" * 5000)  # never synced: the crash leaves only a prefix on disk
    j.crash(torn_bytes=3000)
    got = bodies(tmp_path)
    assert [b for _s, b in got] == [b"good-%d" % i for i in range(5)]


def test_a_corrupt_record_ends_its_file_but_later_files_still_replay(tmp_path: Path) -> None:
    j = make(tmp_path)
    j.append(1, b"a" * 100)
    j.append(1, b"b" * 100)
    j.sync()
    first_file = journal_files(tmp_path)[-1][1]
    j.close()
    # flip one byte of the second record's body
    with open(first_file, "r+b") as fh:
        fh.seek(HEADER_BYTES + 8 + 9 + 100 + 8 + 9 + 50)
        fh.write(b"\xff")
    # a restart continues after the last replayed seq (1), always in a new file
    j2 = Journal(tmp_path, file_bytes=64 * 1024, group_bytes_max=16 * 1024, max_record_bytes=32 * 1024)
    j2.open(1)
    j2.append(1, b"c" * 100)
    j2.sync()
    j2.close()
    got = bodies(tmp_path)
    assert [b[:1] for _s, b in got] == [b"a", b"c"]


def test_files_covered_by_a_checkpoint_are_deleted(tmp_path: Path) -> None:
    j = make(tmp_path)
    seqs = [j.append(1, b"z" * 3000) for _ in range(100)]
    j.sync()
    before = len(journal_files(tmp_path))
    freed = j.delete_covered(seqs[50])
    after = journal_files(tmp_path)
    assert freed > 0 and len(after) < before
    j.close()
    # every record after the mark is still replayable
    assert [s for s, _b in bodies(tmp_path, after=seqs[50])] == seqs[51:]


def test_group_commit_resolves_waiters_only_after_the_sync(tmp_path: Path) -> None:
    async def scenario() -> None:
        j = make(tmp_path)
        synced: list[int] = []
        c = JournalCommitter(j, group_wait_s=0.0, retry_interval_s=0.05, on_error=lambda e: None,
                             observe=lambda s, b, n: synced.append(n))
        c.start()
        seqs = [j.append(1, b"p" * 100) for _ in range(50)]
        c.notify()
        futs = [c.wait_synced(s) for s in seqs]
        await asyncio.gather(*futs)
        assert j.synced_seq >= seqs[-1]
        assert sum(synced) == 50 and len(synced) < 50  # grouped
        assert c.wait_synced(seqs[-1]) is None  # already durable
        await c.close()
        j.close()

    run(scenario())


def test_small_groups_sync_on_the_loop_and_large_ones_in_the_writer_thread(tmp_path: Path) -> None:
    """Both paths make a group durable before its waiters wake; only where the fsync runs differs."""
    async def scenario() -> None:
        j = make(tmp_path)
        where: list[tuple[str, int]] = []
        real = j.write_group

        def watched(group):
            where.append((threading.current_thread().name, len(group)))
            return real(group)

        j.write_group = watched
        c = JournalCommitter(j, group_wait_s=0.0, retry_interval_s=0.05, on_error=lambda e: None, inline_bytes_max=4096)
        c.start()
        small = j.append(1, b"s" * 100)
        c.notify()
        await c.wait_synced(small)
        big = [j.append(1, b"b" * 3000) for _ in range(3)]
        c.notify()
        await c.wait_synced(big[-1])
        assert j.synced_seq >= big[-1]
        assert where[0] == (threading.main_thread().name, 1)
        assert where[1][0].startswith("journal-writer") and where[1][1] == 3
        await c.close()
        j.close()
        assert [s for s, _b in bodies(tmp_path)] == [small, *big]

    run(scenario())


def test_records_appended_under_a_hold_are_synced_at_its_release(tmp_path: Path) -> None:
    """A reader of frames holds the commit, appends, and releases: a small group is durable when
    ``release`` returns (no task switch); a large one, or one during a thread write, is left to
    the committer task."""
    async def scenario() -> None:
        j = make(tmp_path)
        c = JournalCommitter(j, group_wait_s=0.0, retry_interval_s=0.05, on_error=lambda e: None, inline_bytes_max=4096)
        c.start()
        c.hold()
        seqs = [j.append(1, b"h%d" % i) for i in range(3)]
        c.notify()
        assert j.synced_seq < seqs[-1]  # held: nothing written yet
        c.release()
        assert j.synced_seq >= seqs[-1]  # synced before release returned
        assert c.wait_synced(seqs[-1]) is None
        c.hold()
        big = j.append(1, b"b" * 8000)
        c.notify()
        c.release()
        assert j.synced_seq < big  # over the inline limit: the task's thread writes it
        await c.wait_synced(big)
        await c.close()
        j.close()
        assert [s for s, _b in bodies(tmp_path)] == [*seqs, big]

    run(scenario())


def test_a_release_during_a_thread_write_leaves_the_small_group_to_the_committer(tmp_path: Path) -> None:
    """The race: a large group is out in the writer thread when a reader of frames releases its
    hold on a small one. Writing the small group there and then would interleave with the thread's
    write; it must wait, and go out after, in order."""
    async def scenario() -> None:
        j = make(tmp_path)
        in_thread, let_go = threading.Event(), threading.Event()
        real = j.write_group
        written: list[list[int]] = []

        def paused(group):
            if threading.current_thread() is not threading.main_thread():
                in_thread.set()
                let_go.wait(10)
            written.append([seq for seq, *_ in group])
            return real(group)

        j.write_group = paused
        c = JournalCommitter(j, group_wait_s=0.0, retry_interval_s=0.05, on_error=lambda e: None, inline_bytes_max=4096)
        c.start()
        big = j.append(1, b"b" * 8000)
        c.notify()
        await asyncio.get_running_loop().run_in_executor(None, in_thread.wait, 10)  # the thread holds the big group
        c.hold()
        small = j.append(1, b"s")
        c.notify()
        c.release()
        assert written == [] and j.synced_seq < big  # nothing written on the loop meanwhile
        let_go.set()
        await c.wait_synced(small)
        assert written == [[big], [small]]
        await c.close()
        j.close()
        assert [s for s, _b in bodies(tmp_path)] == [big, small]

    run(scenario())


def test_a_failed_write_fails_waiters_keeps_records_and_retries_in_a_new_file(tmp_path: Path) -> None:
    async def scenario() -> None:
        j = make(tmp_path)
        errors: list[OSError] = []
        c = JournalCommitter(j, group_wait_s=0.0, retry_interval_s=30.0, on_error=errors.append)
        c.start()
        real = j.write_group
        fail = {"on": True}

        def flaky(group):
            if fail["on"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(group)

        j.write_group = flaky
        seq = j.append(1, b"keep me")
        c.notify()
        with pytest.raises(StorageError):
            await c.wait_synced(seq)
        assert errors and errors[0].errno == errno.ENOSPC
        fail["on"] = False
        fut = c.wait_synced(seq)  # waits for the retry, which now succeeds
        c.retry_now()
        await fut
        assert j.synced_seq >= seq
        await c.close()
        j.close()
        assert [b for _s, b in bodies(tmp_path)] == [b"keep me"]

    run(scenario())
