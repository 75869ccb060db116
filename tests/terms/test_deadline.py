"""``LedgerWriter.next_deadline``: when the writer next needs a Tick, so a driver arms one timer at
that time instead of ticking every few milliseconds, and an idle writer needs none."""

from __future__ import annotations

import random

from fragments.placement import BookieInfo
from terms.commands import CasLedger, SendLacWrite, WriterConfig
from terms.messages import Tick, WriteFailed
from terms.writer import Phase

from .harness import Cluster


def test_idle_writer_has_no_deadline_and_an_ack_sets_the_idle_lac_push():
    c = Cluster()
    w = c.open_writer(lac_push_idle_s=0.005)
    assert w.phase is Phase.OPEN
    assert w.next_deadline() is None  # opening pushed the LAC: nothing is time-driven

    w.advance_clock(w.now + 1.0)
    e = c.append(w, b"one")
    assert c.acked[-1] == e and w.lac == e > w.lac_pushed
    assert w.next_deadline() == w.last_send_at + w.config.lac_push_idle_s
    assert w.last_send_at == w.now  # stamped with the clock the driver gave, not the last tick

    deadline = w.next_deadline()
    assert w.handle(Tick(deadline - w.config.lac_push_idle_s / 2)) == []  # too early: nothing to do
    assert w.next_deadline() == deadline
    cmds = w.handle(Tick(deadline))
    assert cmds and all(isinstance(x, SendLacWrite) and x.request.lac == e for x in cmds)
    assert w.lac_pushed == e and w.next_deadline() is None  # idle again


def test_a_failed_bookie_without_a_replacement_is_retried_every_ensemble_retry_s():
    c = Cluster(n=3)
    w = c.open_writer(ensemble_retry_s=0.002)
    e = c.append(w, b"one")
    w.handle(Tick(w.last_send_at + w.config.lac_push_idle_s))  # push the LAC: idle
    assert w.next_deadline() is None and e not in w.pending

    w.placement.set_bookies([BookieInfo("b0"), BookieInfo("b1")])  # nowhere to place a replacement
    c.fail = {"b2"}
    c.append(w, b"two")
    assert w.failed == {"b2"} and c.ledger.last_fragment_index == 0
    t = w.next_deadline()
    assert t is not None and t <= w.last_tick_at + w.config.ensemble_retry_s
    c.run(w, w.handle(Tick(t)))  # still nowhere: retried again one interval later
    assert w.failed == {"b2"} and w.next_deadline() == t + w.config.ensemble_retry_s

    w.placement.set_bookies([BookieInfo(b) for b in ("b0", "b1", "b2")])  # b2 back (a reconnect)
    c.fail = set()
    c.run(w, w.handle(Tick(w.next_deadline())))
    assert not w.failed and c.ledger.last_fragment_index == 1 and not w.pending
    assert w.next_deadline() == w.last_send_at + w.config.lac_push_idle_s  # only the LAC push is left


def test_no_deadline_while_a_metadata_change_is_in_flight_or_after_the_writer_finished():
    c = Cluster()
    w = c.open_writer()
    c.append(w, b"one")
    assert w.next_deadline() is not None
    cmds = w.close()
    assert any(isinstance(x, CasLedger) for x in cmds) and w.next_deadline() is None  # the CAS answer is an event
    c.run(w, cmds)
    assert w.phase is Phase.CLOSED and w.next_deadline() is None


def test_a_tick_before_the_deadline_never_does_anything():
    """Randomised: whatever the writer's state (lost sends, failed writes, placement that fails or
    recovers), a Tick with no deadline, or earlier than it, returns no command and changes nothing
    a later step depends on; so a driver that only ticks at the deadline misses nothing a periodic
    ticker would have done. (The one exception by design: while a bookie waits for a replacement,
    any Tick retries placing one, e.g. the one a driver feeds right after refreshing the live
    bookies; ``ensemble_retry_s`` only spaces the retries the deadline asks for.)"""
    for seed in range(40):
        rng = random.Random(seed)
        c = Cluster(n=4)
        w = c.open_writer(seed=seed, lac_push_idle_s=0.005, ensemble_retry_s=0.002)
        now = 0.0
        for _ in range(60):
            if w.phase is not Phase.OPEN:
                break
            now += rng.choice((0.0005, 0.001, 0.003, 0.01))
            w.advance_clock(now)
            deadline = w.next_deadline()
            probe = now if deadline is None else min(now, deadline - 1e-6)
            if deadline is None or (probe < deadline and not w.failed):
                before = (w.phase, set(w.failed), w.fragment, w.lac_pushed, w.cas_reason)
                assert w.handle(Tick(probe)) == [], (seed, w.phase, w.failed, deadline, probe)
                assert (w.phase, set(w.failed), w.fragment, w.lac_pushed, w.cas_reason) == before
            op = rng.random()
            if op < 0.45 and w.can_append(8):
                c.append(w, b"v")
            elif op < 0.55:
                bookies = sorted(c.bookies)
                w.placement.set_bookies([BookieInfo(b) for b in rng.sample(bookies, rng.randint(2, 4))])
            elif op < 0.65:
                c.hold = {rng.choice(sorted(c.bookies))} if rng.random() < 0.5 else set()  # sends lost
            elif op < 0.7 and w.pending:
                e = next(iter(w.pending))
                b = rng.choice(w.fragment.ensemble)
                c.run(w, w.handle_add_answer(WriteFailed(b, 7, e, w.term), w.next_send_id))
            elif deadline is not None and deadline <= now:
                c.run(w, w.handle(Tick(now)))


def test_config_rejects_a_non_positive_retry_interval():
    import pytest

    with pytest.raises(ValueError):
        WriterConfig(ensemble_retry_s=0)
