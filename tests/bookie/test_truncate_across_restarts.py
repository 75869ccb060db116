"""A take-over's truncating no-op must win over an older term's unacknowledged entry at the same id,
whatever was flushed, checkpointed or still in flight when the bookie crashed, across incarnations:

* incarnation A journals term 11's no-op at entry 50 (never acknowledged) and crashes;
* incarnation B replays it, is fenced to term 12 and journals term 12's truncating no-op at 50
  (acknowledged: the journal is synced), sometimes while the generation holding term 11's copy is
  being flushed, sometimes followed by enough entries to rotate journal files; it crashes;
* incarnation C must read term 12's no-op at 50.

Written after `test_kill` failed once this way under heavy load (seed 707698132, not reproduced);
these storage interleavings all passed; the failure was a read racing the first flush after the
restart (tests/bookie/test_read_flush_race.py; docs/bookie.md, "What the test_kill failure ... was").
"""

from __future__ import annotations

import itertools

import pytest

from bookie import digest
from bookie.storage import Engine

from .helpers import small_config

L = 11


def _add(e: Engine, eid: int, term: int, data: bytes, truncate: bool = False, lac: int = -1) -> None:
    out = e.add_batch([L], [eid], [term], [lac], [lac], [truncate], [False], [0],
                      [digest.crc32c_digest(L, eid, data)], [data])
    assert out.statuses is None, out  # None: every add OK


def _open(cfg) -> Engine:
    e = Engine(cfg)
    e.open()
    return e


CASES = [(fa, False, ab, mf, more) for fa, ab, mf, more in
         itertools.product((False, True), ("none", "checkpoint"), (False, True), (0, 150))]
CASES += [(True, True, "flush", True, 0), (False, True, "flush", False, 150)]


@pytest.mark.parametrize("flush_a,flush_b_first,after_b,mid_flush,more", CASES)
def test_truncating_noop_of_the_newer_term_survives_crashes(tmp_path, flush_a, flush_b_first, after_b, mid_flush, more):
    cfg = small_config(tmp_path, journal_preallocate="none", max_entry_bytes=4096, max_batch_bytes=64 * 1024,
                       max_batch_adds=64, journal_file_bytes=128 * 1024)  # B rotates journal files
    a = _open(cfg)
    a.fence(L, 10)
    _add(a, 0, 10, b"noop-10", truncate=True)
    for i in range(1, 50):
        _add(a, i, 10, b"x" * 3000, lac=i - 1)
    a.journal.sync()
    if flush_a:
        a.flush()
    a.fence(L, 11)
    _add(a, 50, 11, b"noop-11", truncate=True, lac=49)
    a.journal.sync()
    a.crash()

    b = _open(cfg)
    if flush_b_first:
        b.flush()
    job = b.begin_flush() if mid_flush else None  # term 11's copy may be in the generation being flushed
    b.fence(L, 12)
    _add(b, 50, 12, b"noop-12", truncate=True, lac=49)
    for i in range(51, 51 + more):
        _add(b, i, 12, b"y" * 3000, lac=i - 1)
    b.journal.sync()  # acknowledged from here on
    if job is not None:
        b.flusher.run(job)
        b.write_cache.flushed()
    if after_b == "flush":
        b.flush()
    elif after_b == "checkpoint":
        b.checkpoint()
    got = b.read_entry(L, 50)
    assert (got.entry_term, got.data) == (12, b"noop-12")
    b.crash()

    c = _open(cfg)
    try:
        got = c.read_entry(L, 50)
        assert got is not None and (got.entry_term, got.data) == (12, b"noop-12")
        if more:
            last = c.read_entry(L, 50 + more)
            assert last is not None and last.entry_term == 12
    finally:
        c.crash()
