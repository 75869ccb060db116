"""Scripted scenarios for the writer: take-over, truncation, in-order acks, ensemble change,
pinning, rollover, stale terms, back-pressure, aborted recoveries."""

from __future__ import annotations

import pytest

from fragments.model import LedgerConfig, LedgerStatus
from terms import entry
from terms.commands import Aborted, Opened, SendAdd, Withdraw
from terms.messages import AddOk
from terms.writer import Backpressure, NotWritable, Phase

from .harness import Cluster


def data(v: bytes) -> bytes:
    return entry.encode_data(v)


def test_first_take_over_writes_a_truncate_noop_and_opens():
    c = Cluster()
    w = c.open_writer()
    assert w.phase is Phase.OPEN and w.term == 1 and c.ledger.status is LedgerStatus.OPEN and c.ledger.term == 1
    opened = [x for x in c.log if isinstance(x, Opened)]
    assert opened == [Opened(1, 1, 0)]
    for b in ("b0", "b1", "b2"):  # the no-op went to the whole ensemble with the truncate flag
        assert entry.is_noop(c.bookies[b].entries[0][1])
        assert c.bookies[b].state.clean_term == 1
    assert c.append(w, b"hello") == 1 and c.acked[-1] == 1 and not w.pending


def test_acknowledgements_arrive_in_order():
    c = Cluster()
    w = c.open_writer()
    c.hold = {"b0", "b1", "b2"}
    e1 = c.append(w, b"one")
    e2 = c.append(w, b"two")
    sends = [x for x in c.log if isinstance(x, SendAdd) and x.request.entry_id in (e1, e2)]
    c.acked.clear()
    by = lambda b, e: next(s for s in sends if s.bookie == b and s.request.entry_id == e)  # noqa: E731
    for b in ("b0", "b1"):  # entry 2 reaches AQ first
        w.handle_add_answer(AddOk(b, 7, e2, 1), by(b, e2).send_id)
    assert not c.acked and w.lac == e1 - 1
    for b in ("b0", "b1"):
        c.run(w, w.handle_add_answer(AddOk(b, 7, e1, 1), by(b, e1).send_id))
    assert c.acked == [e2] and w.lac == e2 and w.lafr == e1 - 1  # pending until WQ
    assert set(w.pending) == {e1, e2}


def test_take_over_truncates_the_old_terms_dirty_entry():
    """Seed 002's counterexample: without the truncate no-op, b0 would keep the old entry 2 and a
    later LAC would make it readable next to a different entry 2 elsewhere."""
    c = Cluster()
    w1 = c.open_writer()
    c.append(w1, b"A")  # entry 1 on all three
    c.hold = {"b1", "b2"}
    c.append(w1, b"B")  # entry 2 only on b0: not committed
    assert c.bookies["b0"].entries[2][1] == data(b"B")
    c.hold = {"b0"}  # b0 unreachable during the take-over
    w2 = c.writer(seed=2)
    c.run(w2, w2.start())
    c.time_out_reads(w2, "b0")
    assert w2.truncate_entry_id == 2  # b1 and b2 miss entry 2: not committed
    assert w2.phase is Phase.RECOVERING  # the truncate no-op must reach all of the ensemble
    c.hold = set()
    # the no-op is still pending for b0: deliver it by failing b0 over to a new bookie
    c.fail = {"b0"}
    from terms.messages import WriteFailed

    c.run(w2, w2.handle_add_answer(WriteFailed("b0", 7, 2, 2), 10**9))
    assert w2.phase is Phase.OPEN
    assert "b0" not in c.fragments[c.ledger.last_fragment_index].ensemble
    e = c.append(w2, b"C")
    assert e == 3  # the no-op kept id 2
    last = c.fragments[c.ledger.last_fragment_index]
    for b in last.ensemble:
        assert entry.is_noop(c.bookies[b].entries[2][1])
    # the old writer is fenced: its next append fails with a stale-term withdrawal
    c.fail = set()
    eid, cmds = w1.append(b"late")
    c.run(w1, cmds)
    assert w1.phase is Phase.WITHDRAWN
    assert any(isinstance(x, Withdraw) and x.stale_term for x in c.log)
    with pytest.raises(NotWritable):
        w1.append(b"again")


def test_write_failure_changes_ensemble_at_lafr_plus_one_with_truncating_first_add():
    c = Cluster()
    w = c.open_writer()
    for i in range(3):
        c.append(w, b"x%d" % i)
    c.fail = {"b2"}
    e = c.append(w, b"y")
    assert c.ledger.last_fragment_index == 1
    old, new = c.fragments[0], c.fragments[1]
    assert old.last_entry_id == e - 1 and new.first_entry_id == e and "b2" not in new.ensemble
    newcomer = (set(new.ensemble) - set(old.ensemble)).pop()
    first_to_newcomer = next(x for x in c.log if isinstance(x, SendAdd) and x.bookie == newcomer)
    assert first_to_newcomer.request.truncate and first_to_newcomer.request.entry_id == e
    assert c.acked[-1] == e and not w.pending


def test_a_pinned_bookie_is_not_replaced_until_its_committed_entries_reach_wq():
    c = Cluster()
    w = c.open_writer()
    c.hold = {"b2"}
    e = c.append(w, b"committed")  # acked by b0, b1 (AQ) but not at WQ
    assert c.acked[-1] == e and e in w.pending
    from terms.messages import WriteFailed

    c.hold = set()
    c.fail = {"b0"}
    c.run(w, w.handle_add_answer(WriteFailed("b0", 7, e, 1), 10**9))
    assert c.ledger.last_fragment_index == 0  # b0 holds a committed entry below WQ: pinned
    # b2 is still outstanding, so the writer waits rather than giving up
    assert w.phase is Phase.OPEN


def test_rollover_seals_a_full_fragment_and_places_the_next():
    cfg = LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=4)
    c = Cluster(n=6, config=cfg)
    w = c.open_writer()
    for i in range(10):
        c.append(w, b"v%d" % i)
    frags = [c.fragments[i] for i in range(c.ledger.last_fragment_index + 1)]
    assert len(frags) >= 3
    for a, b in zip(frags, frags[1:]):
        assert a.sealed and a.last_entry_id + 1 == b.first_entry_id
        assert a.last_entry_id - a.first_entry_id + 1 <= 4
    assert c.acked[-1] == 10 and len({b for f in frags for b in f.ensemble}) > 3  # spread out


def test_a_foreign_change_of_the_record_is_rebased_over_not_taken_for_a_take_over():
    """Retention (first_fragment_index) or a layer above (extra) CAS the ledger record while the
    writer is open: its next rollover conflicts, rebases onto the new record and commits, keeping
    their change; the writer stays open and keeps acknowledging."""
    cfg = LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=4)
    c = Cluster(n=6, config=cfg)
    w = c.open_writer()
    for i in range(6):
        c.append(w, b"v%d" % i)
    assert c.ledger.last_fragment_index >= 1
    c.ledger = c.ledger.with_(extra={"spark": {"q": 3}}, first_fragment_index=1)  # someone else's CAS
    c.version += 1
    for i in range(6, 14):
        c.append(w, b"v%d" % i)
    assert w.phase is Phase.OPEN and c.acked[-1] == 14
    assert c.ledger.extra == {"spark": {"q": 3}} and c.ledger.first_fragment_index == 1
    assert c.ledger.last_fragment_index >= 3 and c.ledger.term == w.term


def test_a_conflict_that_changed_the_term_still_withdraws_the_writer():
    cfg = LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=4)
    c = Cluster(n=6, config=cfg)
    w = c.open_writer()
    for i in range(3):
        c.append(w, b"v%d" % i)
    c.ledger = c.ledger.with_(term=c.ledger.term + 1, extra={"x": 1})  # a take-over's CAS
    c.version += 1
    last = c.ledger.last_fragment_index
    with pytest.raises(NotWritable):
        for i in range(6):
            c.append(w, b"w%d" % i)
    assert any(isinstance(x, Withdraw) for x in c.log) and c.ledger.last_fragment_index == last


def test_backpressure_and_bounded_inflight():
    c = Cluster()
    w = c.open_writer(max_inflight_entries=2)
    c.hold = {"b0", "b1", "b2"}
    c.append(w, b"a")
    c.append(w, b"b")
    assert not w.can_append()
    with pytest.raises(Backpressure):
        w.append(b"c")


def test_inconclusive_recovery_read_aborts_and_conflicting_take_over_aborts():
    c = Cluster()
    c.open_writer()
    w2 = c.writer(seed=3)
    c.hold = {"b0", "b1", "b2"}
    c.run(w2, w2.start())
    from terms.messages import FenceFailed

    for b in ("b0", "b1"):
        c.run(w2, w2.handle(FenceFailed(b, 7, 2)))
    assert w2.phase is Phase.ABORTED and any(isinstance(x, Aborted) for x in c.log)
    c.hold = set()
    w3, w4 = c.writer(seed=4), c.writer(seed=5)  # both read the same metadata version
    c.run(w3, w3.start())
    c.run(w4, w4.start())
    assert w3.phase is Phase.OPEN and w4.phase is Phase.ABORTED


def test_new_fragments_record_the_first_record_offset_the_caller_gave():
    """Rollover and an ensemble change record the record offset of the new fragment's first entry
    (the caller formats entries and gives each one's offsets; the writer never parses payloads)."""
    cfg = LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=4)
    c = Cluster(n=6, config=cfg)
    w = c.open_writer()
    starts = {}
    offset = 0
    for i in range(10):
        count = i + 1  # entry i holds i + 1 records
        eid, cmds = w.append(b"v%d" % i, (offset, offset + count))
        c.run(w, cmds)
        starts[eid] = offset
        offset += count
    c.fail = {c.fragments[c.ledger.last_fragment_index].ensemble[0]}
    eid, cmds = w.append(b"after failure", (offset, offset + 1))
    c.run(w, cmds)
    starts[eid] = offset
    frags = [c.fragments[i] for i in range(c.ledger.last_fragment_index + 1)]
    assert len(frags) >= 4
    assert frags[0].first_offset is None  # the harness's first fragment predates offsets
    for f in frags[1:]:
        assert f.first_offset == starts[f.first_entry_id], f
