"""The scrubber (bookie/scrub.py) in one engine: a flipped byte in an entry log is found by a pass
(or by a read), the copy leaves the index (reads answer NO_SUCH_ENTRY, never the bad bytes), the
live-byte accounting follows, a later pass is clean, and a compaction of a log holding a bad record
keeps the records after it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bookie.config import BookieConfig, ConfigError
from bookie.entrylog import log_files
from bookie.errors import CorruptEntryError, Status
from bookie.storage import Engine

from .helpers import run
from .test_storage import add, start


def flip(data_dir: Path, needle: bytes) -> None:
    """Flip one byte of ``needle`` (an entry's payload) where it lies in an entry log."""
    for _id, path in log_files(data_dir / "entrylogs"):
        raw = bytearray(path.read_bytes())
        at = raw.find(needle)
        if at >= 0:
            raw[at + len(needle) // 2] ^= 0x20
            path.write_bytes(bytes(raw))
            return
    raise AssertionError(f"{needle!r} is in no entry log")


def payload(i: int) -> bytes:
    return b"payload-%04d|" % i * 20


def written(make_engine, n: int = 40) -> Engine:
    e = make_engine()
    start(e, 7)
    add(e, 7, range(1, n + 1), data=payload, lac=0)
    add(e, 7, [n + 1], data=payload, lac=n)  # entries 1..n are under the LAC, n + 1 is not
    e.checkpoint()
    return e


def test_a_pass_finds_a_flipped_byte_and_the_copy_is_no_longer_served(make_engine) -> None:
    e = written(make_engine)
    assert e.scrub().corrupt == 0 and e.scrubber.passes == 1
    live_before = sum(live for _t, live in e.flusher.log_stats.values())
    flip(e.config.data_dir, payload(13))
    res = e.scrub()
    assert (res.entries, res.corrupt) == (42, 1)
    assert [(f.ledger_id, f.entry_id, f.found_by) for f in e.scrubber.recent] == [(7, 13, "scrub")]
    assert e.index.location(7, 13) is None
    assert sum(live for _t, live in e.flusher.log_stats.values()) < live_before
    assert e.read_entry(7, 13) is None
    r = e.read_range(7, 10, 20)
    assert [i for i, _x in r.entries] == [10, 11, 12] and r.stop == Status.NO_SUCH_ENTRY
    assert e.read_entry(7, 14).data == payload(14)
    assert e.metrics.scrub_corrupt.labels("scrub")._value.get() == 1
    assert e.scrub().corrupt == 0 and e.scrubber.corrupt == 1 and e.scrubber.passes == 3
    # a recovery add (what `check --fix` does) puts a good copy back; the next pass is clean
    assert add(e, 7, [13], data=payload, recovery=True, lac=40).statuses is None
    e.checkpoint()
    assert e.read_entry(7, 13).data == payload(13)
    assert e.scrub().corrupt == 0


def test_a_corrupt_record_a_read_meets_is_reported_and_dropped(make_engine) -> None:
    e = written(make_engine)
    flip(e.config.data_dir, payload(5))
    with pytest.raises(CorruptEntryError):
        e.read_entry(7, 5)
    assert [(f.entry_id, f.found_by) for f in e.scrubber._reported] == [(5, "read")]
    assert e.scrub().corrupt == 1
    assert [(f.entry_id, f.found_by) for f in e.scrubber.recent] == [(5, "read")]
    assert e.read_entry(7, 5) is None


def test_a_corrupt_copy_above_the_lac_is_kept_and_answered_corrupt_never_missing(make_engine) -> None:
    """Ledger recovery reads above the LAC and takes NO_SUCH_ENTRY answers for "never written":
    such a copy must stay unreadable (CORRUPT), not vanish."""
    e = written(make_engine)
    flip(e.config.data_dir, payload(41))
    assert e.scrub().corrupt == 1 and not e.scrubber.recent[-1].removed
    assert e.index.location(7, 41) is not None
    with pytest.raises(CorruptEntryError):
        e.read_entry(7, 41)
    assert e.scrub().corrupt == 0 and e.scrubber.corrupt == 1  # reported once
    add(e, 7, [42], data=payload, lac=41)  # the LAC passes it: the next pass removes it
    e.checkpoint()
    assert e.scrub().corrupt == 1 and e.scrubber.recent[-1].removed and e.read_entry(7, 41) is None


def test_a_record_that_reads_fine_again_is_kept(make_engine) -> None:
    e = written(make_engine)
    e.scrubber.report(7, 3, e.index.location(7, 3), "a transient error")
    assert e.scrub().corrupt == 0 and e.read_entry(7, 3).data == payload(3)


def test_compaction_keeps_the_records_after_a_bad_one(make_engine) -> None:
    e = written(make_engine)
    flip(e.config.data_dir, payload(2))
    add(e, 8, [0], truncate=True)  # another ledger, then most of ledger 7 trimmed: its log is compacted
    e.trim(7, 3, 30)
    e.checkpoint()
    assert e.gc().logs_compacted >= 1
    for i in range(31, 41):
        assert e.read_entry(7, i).data == payload(i)
    # the bad record could not be copied: its index entry names a log that is gone, a finding
    res = e.scrub()
    assert res.corrupt == 1 and "gone" in e.scrubber.recent[-1].reason and e.read_entry(7, 2) is None


def test_config_checks() -> None:
    d = Path("/nonexistent")
    assert BookieConfig(data_dir=d).scrub_interval_s == 86_400.0
    BookieConfig(data_dir=d, scrub_interval_s=0)  # off
    for bad in (dict(scrub_bytes_per_s=0), dict(scrub_interval_s=-1), dict(scrub_first_delay_s=-1)):
        with pytest.raises(ConfigError):
            BookieConfig(data_dir=d, **bad)


def test_background_passes_are_throttled_and_find_corruption(make_engine) -> None:
    rate = 64 * 1024
    e = written(make_engine, n=60)  # ~16 KiB of records per pass at 64 KiB/s: a pass takes ~0.25 s
    e.close()
    flip(e.config.data_dir, payload(21))
    e = make_engine(scrub_interval_s=0.05, scrub_first_delay_s=0, scrub_bytes_per_s=rate)

    async def scenario():
        await e.start()
        t0 = time.monotonic()
        deadline = t0 + 30
        while e.scrubber.passes < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)  # polling a condition
        took = time.monotonic() - t0
        entries_bytes = e.metrics.scrub_bytes._value.get()
        assert took >= entries_bytes / rate * 0.8 - 0.05 * 2, (took, entries_bytes)
        assert e.scrubber.corrupt == 1 and e.scrubber.recent[0].entry_id == 21
        assert (await e.aread_range(7, 21, 21)).stop == Status.NO_SUCH_ENTRY
        await e.aclose()

    run(scenario())


def test_a_read_of_a_started_engine_has_the_copy_dropped_without_waiting_for_a_pass(make_engine) -> None:
    e = written(make_engine)
    e.close()
    flip(e.config.data_dir, payload(9))
    e = make_engine(scrub_interval_s=0)  # no passes at all

    async def scenario():
        await e.start()
        assert (await e.aread_range(7, 9, 9)).stop == Status.CORRUPT
        deadline = time.monotonic() + 30
        while e.scrubber.corrupt < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)  # polling a condition
        assert (await e.aread_range(7, 9, 9)).stop == Status.NO_SUCH_ENTRY
        assert e.scrubber.passes == 0
        await e.aclose()

    run(scenario())


def test_a_pass_cut_short_resumes_after_a_restart_and_the_counters_persist(make_engine) -> None:
    e = written(make_engine)
    total = e.scrub().entries  # a first whole pass: the counters start
    flip(e.config.data_dir, payload(30))
    part = e.scrubber.scrub_now(max_chunks=2, chunk_bytes=2000)  # the bookie stops mid-pass
    assert not part.complete and 0 < part.entries < 29 and part.corrupt == 0
    pos = e.scrubber.position_ids()
    assert pos[0] == 7 and pos[1] > 1 and e.scrubber.pass_started > 0
    e.close()

    e = make_engine()  # restarted: the pass resumes where it stopped, not from the first entry
    sc = e.scrubber
    sc.load()
    assert sc.position_ids() == pos and (sc.passes, sc.entries) == (1, total + part.entries)
    rest = e.scrub()
    assert rest.complete and rest.entries == total - part.entries and rest.corrupt == 1
    assert (sc.passes, sc.entries, sc.corrupt, sc.repaired) == (2, 2 * total, 1, 0)
    assert sc.position is None and 0 < sc.last_pass_start <= sc.last_pass_end and list(sc.awaiting) == [(7, 30)]
    # a good copy written back (what `check --fix` does) counts as repaired, once
    add(e, 7, [30], data=payload, recovery=True, lac=40)
    assert sc.check_repaired() == 1 and sc.check_repaired() == 0 and not sc.awaiting
    e.checkpoint()
    sc.save()
    e.close()

    e = make_engine()
    e.scrubber.load()
    assert (e.scrubber.passes, e.scrubber.corrupt, e.scrubber.repaired, e.scrubber.position) == (2, 1, 1, None)
    assert e.scrub().entries == total  # the next pass is a whole one again


def test_a_bookie_stopped_mid_pass_resumes_that_pass_when_started_again(make_engine) -> None:
    e = written(make_engine, n=60)
    total = len(e.index.locations_from(b"E", 10_000)[0])  # no pass yet: the first is due at start
    e.close()
    # ~260 B a record at 2 KiB/s: a pass takes seconds, and chunks of 512 B hold about 2 records
    e = make_engine(scrub_interval_s=3600, scrub_first_delay_s=0, scrub_bytes_per_s=2048)
    e.scrubber.save_every_s = 0

    async def stop_mid_pass():
        await e.start()
        deadline = time.monotonic() + 30
        while not (e.scrubber.running and e.scrubber.pass_entries >= 6):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)  # polling a condition
        await e.aclose()  # the scrub task is cancelled: its position is saved

    run(stop_mid_pass())
    done = e.scrubber.pass_entries
    assert 6 <= done < total and e.scrubber.passes == 0 and e.scrubber.position is not None
    e = make_engine(scrub_interval_s=3600, scrub_first_delay_s=0)
    sc = e.scrubber

    async def resumed():
        await e.start()
        deadline = time.monotonic() + 30
        while sc.passes < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)  # polling a condition
        await e.aclose()

    run(resumed())
    # the resumed pass checked only what was left; the totals count the whole pass once
    assert sc.entries == total and sc.position is None and sc.last_pass_start < sc.last_pass_end
