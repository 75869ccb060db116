"""Age rollover (``LedgerConfig.fragment_age_max_ms``: Kafka's segment.ms): the open fragment rolls
over once the first entry the writer put in it is that old, on the simulated clock; an empty
fragment never rolls; a changed cap reaches a live writer (``update_caps``) and a CAS that conflicts
with a change of the caps alone is rebased, not a take-over."""

from __future__ import annotations

from fragments.model import LedgerConfig
from terms.commands import CasLedger
from terms.messages import AddOk, Tick
from terms.writer import Phase

from .harness import Cluster


def _aged(age_ms: int | None) -> LedgerConfig:
    return LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_age_max_ms=age_ms)


def _idle(c: Cluster, w) -> None:
    """Tick the idle LAC push (the deadline that is not the age cap's)."""
    while w.lac > w.lac_pushed:
        c.run(w, w.handle(Tick(w.last_send_at + w.config.lac_push_idle_s)))


def test_an_empty_fragment_never_rolls_and_has_no_age_deadline():
    c = Cluster(config=_aged(1000))
    w = c.open_writer(lac_push_idle_s=0.005)
    assert w.phase is Phase.OPEN
    assert w.fragment_first_at is None  # the take-over no-op does not count
    assert w.next_deadline() is None
    for t in (1.0, 10.0, 1000.0):
        c.run(w, w.handle(Tick(t)))
        assert c.ledger.last_fragment_index == 0 and w.next_deadline() is None


def test_the_open_fragment_rolls_over_once_its_first_entry_is_older_than_the_cap():
    c = Cluster(config=_aged(1000))
    w = c.open_writer(lac_push_idle_s=0.005)
    w.advance_clock(10.0)
    first = c.append(w, b"a")
    assert w.fragment_first_at == 10.0
    c.run(w, w.handle(Tick(10.005)))  # the idle LAC push
    assert w.next_deadline() == 11.0  # the age cap is the only thing left that is time-driven
    w.advance_clock(10.5)
    c.append(w, b"b")  # a younger entry does not move the deadline
    _idle(c, w)
    assert w.next_deadline() == 11.0
    c.run(w, w.handle(Tick(10.999)))
    assert c.ledger.last_fragment_index == 0
    c.run(w, w.handle(Tick(11.0)))
    assert c.ledger.last_fragment_index == 1
    sealed = c.fragments[0]
    assert sealed.first_entry_id == 0 and sealed.last_entry_id == first + 1
    assert c.fragments[1].first_entry_id == first + 2
    assert w.fragment_first_at is None
    _idle(c, w)
    assert w.next_deadline() is None  # the new fragment is empty: no timer, no churn
    for t in (20.0, 100.0):
        c.run(w, w.handle(Tick(t)))
    assert c.ledger.last_fragment_index == 1

    w.advance_clock(200.0)
    c.append(w, b"c")  # the next fragment's age counts from its own first entry
    _idle(c, w)
    assert w.next_deadline() == 201.0
    c.run(w, w.handle(Tick(201.0)))
    assert c.ledger.last_fragment_index == 2


def test_a_due_rollover_waits_for_the_fragment_to_drain_without_spinning():
    c = Cluster(config=_aged(1000))
    w = c.open_writer(lac_push_idle_s=0.005)
    w.advance_clock(1.0)
    c.append(w, b"a")
    c.hold = {"b2"}  # b2 never answers: entries reach AQ (acked) but not WQ
    w.advance_clock(1.5)
    held = c.append(w, b"b")
    assert c.acked[-1] == held and held in w.pending
    c.run(w, w.handle(Tick(2.0)))
    assert c.ledger.last_fragment_index == 0
    assert w.next_deadline() is None or w.next_deadline() > 2.0  # due, but a Tick cannot help: no spin
    w.advance_clock(2.1)
    late, cmds = w.append(b"c")  # held back: the fragment drains before it rolls over
    c.run(w, cmds)
    assert w.sent_upto == held
    c.hold = set()
    for eid in [e for e in sorted(w.pending) if e <= held]:  # b2 answers at last
        p = w.pending[eid]
        if "b2" not in p.acks and "b2" in p.sent_to:
            c.bookies["b2"].entries[eid] = (w.term, p.data)
            c.run(w, w.handle_add_answer(AddOk("b2", 7, eid, w.term), w.join_send_id.get("b2", 0)))
    assert c.ledger.last_fragment_index == 1  # the last ack rolled it over
    assert c.fragments[0].last_entry_id == held
    assert c.fragments[1].first_entry_id == late and w.sent_upto == late


def test_a_cap_set_under_a_live_writer_applies_at_its_next_decision():
    c = Cluster(config=_aged(None))
    w = c.open_writer(lac_push_idle_s=0.005)
    w.advance_clock(5.0)
    c.append(w, b"a")
    _idle(c, w)
    assert w.next_deadline() is None  # no age cap yet
    # an admin sets segment.ms: a CAS of the record's config alone (as compat_kafka's apply does)
    c.ledger = c.ledger.with_(config=_aged(2000))
    c.version += 1
    c.run(w, w.update_caps(c.ledger.config))
    assert w.ledger.config.fragment_age_max_ms == 2000
    assert w.next_deadline() == 7.0  # counted from the fragment's first entry
    c.run(w, w.handle(Tick(7.0)))
    assert c.ledger.last_fragment_index == 1  # the rollover CAS conflicted and was rebased
    assert w.phase is Phase.OPEN and c.ledger.config.fragment_age_max_ms == 2000
    assert any(isinstance(x, CasLedger) and x.reason == "rollover" for x in c.log)

    # a quorum change is never taken from outside
    assert w.update_caps(LedgerConfig(ensemble_size=3, write_quorum=2, ack_quorum=2)) == []
    assert w.ledger.config.write_quorum == 3


def test_a_caps_change_the_writer_has_not_seen_is_rebased_not_a_take_over():
    c = Cluster(config=LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=3))
    w = c.open_writer(lac_push_idle_s=0.005)
    # the admin lowers segment.bytes and sets segment.ms; the writer hears of it only by its CAS
    c.ledger = c.ledger.with_(config=LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2,
                                                  fragment_entries_max=3, fragment_bytes_max=100,
                                                  fragment_age_max_ms=500))
    c.version += 1
    for i in range(3):
        c.append(w, b"x%d" % i)
    assert w.phase is Phase.OPEN  # not withdrawn: the conflict was a foreign change of the caps
    assert c.ledger.last_fragment_index >= 1
    assert w.ledger.config.fragment_bytes_max == 100 and w.ledger.config.fragment_age_max_ms == 500
