"""``LedgerWriter.next_deadline``: when the writer next needs a Tick, so a driver arms one timer at
that time instead of ticking every few milliseconds, and an idle writer needs none."""

from __future__ import annotations

import random

import pytest

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


def test_eager_lac_push_is_due_at_once_when_no_add_is_in_flight_and_adds_carry_the_lac():
    """``lac_push_eager``: an acknowledged entry with nothing in flight behind it has its LAC
    pushed at the next Tick (not ``lac_push_idle_s`` later), to every member; an add sent to the
    whole ensemble carries the LAC, so no LAC write follows it."""
    c = Cluster(n=3)
    w = c.open_writer(lac_push_idle_s=5.0, lac_push_eager=True)
    assert w.next_deadline() is None
    w.advance_clock(w.now + 1.0)
    e = c.append(w, b"one")
    assert c.acked[-1] == e and w.lac == e > w.lac_pushed  # its own add carried the LAC before it
    assert w.next_deadline() == w.last_send_at <= w.now  # due now, not after 5 s of idleness
    cmds = w.handle(Tick(w.now))
    assert sorted(x.bookie for x in cmds if isinstance(x, SendLacWrite)) == sorted(w.fragment.ensemble)
    assert all(isinstance(x, SendLacWrite) and x.request.lac == e for x in cmds)
    assert w.lac_pushed == e and w.next_deadline() is None

    c.hold = set(w.fragment.ensemble)  # the next add is sent (carrying LAC e) but never answered
    e2 = c.append(w, b"two")
    assert w.lac == e and w.lac_pushed == e and e2 in w.pending
    assert w.next_deadline() is None  # nothing to push: the add told every member LAC e


def test_a_failed_bookie_without_a_replacement_is_retried_at_growing_intervals():
    c = Cluster(n=3)
    w = c.open_writer(ensemble_retry_s=0.002, ensemble_retry_max_s=0.016, rejoin_backoff_s=0.05)
    e = c.append(w, b"one")
    w.handle(Tick(w.last_send_at + w.config.lac_push_idle_s))  # push the LAC: idle
    assert w.next_deadline() is None and e not in w.pending

    w.placement.set_bookies([BookieInfo("b0"), BookieInfo("b1")])  # nowhere to place a replacement
    c.fail = {"b2"}
    failed_at = w.now
    c.append(w, b"two")
    assert w.failed == {"b2"} and c.ledger.last_fragment_index == 0
    gaps = []
    while w.now < failed_at + 0.04:  # b2 is not even a candidate before its back-off
        t = w.next_deadline()
        assert t is not None and t > w.last_tick_at
        gaps.append(round(t - w.last_tick_at, 6))
        c.run(w, w.handle(Tick(t)))
        assert w.failed == {"b2"} and c.ledger.last_fragment_index == 0
    # doubling up to the maximum: a handful of ticks, not one every 2 ms (20 in 40 ms)
    assert len(gaps) <= 7 and max(gaps) <= 0.016 and 0.016 in gaps, gaps

    w.placement.set_bookies([BookieInfo(b) for b in ("b0", "b1", "b2")])  # b2 back (a reconnect)
    c.fail = set()
    while w.failed:
        t = w.next_deadline()
        c.run(w, w.handle(Tick(t)))
        if w.failed:
            assert w.now < failed_at + w.config.rejoin_backoff_s  # placed again once its back-off is over
    assert w.now >= failed_at + w.config.rejoin_backoff_s
    assert c.ledger.last_fragment_index == 1 and not w.pending
    assert w.next_deadline() in (None, w.last_send_at + w.config.lac_push_idle_s)  # at most the LAC push is left


def test_bookies_that_all_refuse_writes_are_retried_with_a_back_off_not_in_a_loop():
    """Every bookie refuses writes (disks full: READ_ONLY) and the placement has no other: the
    writer re-places the refusing bookies only after a back-off that doubles per refusal, so over a
    simulated minute it changes its ensemble (a metadata write each) a few dozen times, not once per
    answer; the entry is written once a bookie accepts again, and nothing is lost."""
    c = Cluster(n=3)
    w = c.open_writer(ensemble_retry_s=0.002, rejoin_backoff_s=0.01, rejoin_backoff_max_s=4.0)
    c.append(w, b"one")
    c.fail = {"b0", "b1", "b2"}
    start, version = w.now, c.version
    e = c.append(w, b"two")
    ticks = 0
    while w.now < start + 60:
        t = w.next_deadline()
        assert t is not None and t >= w.last_tick_at + w.config.ensemble_retry_s - 1e-9
        c.run(w, w.handle(Tick(t)))
        ticks += 1
    changes = c.version - version
    assert e in w.pending and e not in c.acked and w.phase is Phase.OPEN
    assert 3 <= changes <= 3 * (60 / 4 + 10), changes  # each bookie: 10 ms, 20 ms, ... then every 4 s
    assert ticks <= 60 / 0.5 * 2 + 3 * (60 / 4 + 10), ticks  # no 2 ms ticking for a minute
    c.fail = set()
    while e not in c.acked:
        c.run(w, w.handle(Tick(w.next_deadline())))
    assert w.now <= start + 60 + 4.0 + 1e-6 and not w.failed
    assert [c.bookies[b].entries[e][1].endswith(b"two") for b in w.fragment.ensemble] == [True] * 3


def test_no_deadline_while_a_metadata_change_is_in_flight_or_after_the_writer_finished():
    c = Cluster()
    w = c.open_writer()
    c.append(w, b"one")
    assert w.next_deadline() is not None
    cmds = w.close()
    assert any(isinstance(x, CasLedger) for x in cmds) and w.next_deadline() is None  # the CAS answer is an event
    c.run(w, cmds)
    assert w.phase is Phase.CLOSED and w.next_deadline() is None


@pytest.mark.parametrize("eager", [False, True])
def test_a_tick_before_the_deadline_never_does_anything(eager):
    """Randomised: whatever the writer's state (lost sends, failed writes, placement that fails or
    recovers), a Tick with no deadline, or earlier than it, returns no command and changes nothing
    a later step depends on; so a driver that only ticks at the deadline misses nothing a periodic
    ticker would have done. (The one exception by design: while a bookie waits for a replacement,
    any Tick retries placing one, e.g. the one a driver feeds right after refreshing the live
    bookies; ``ensemble_retry_s`` only spaces the retries the deadline asks for.)"""
    for seed in range(40):
        rng = random.Random(seed)
        c = Cluster(n=4)
        w = c.open_writer(seed=seed, lac_push_idle_s=0.005, ensemble_retry_s=0.002, lac_push_eager=eager)
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
    with pytest.raises(ValueError):
        WriterConfig(ensemble_retry_s=1.0, ensemble_retry_max_s=0.5)
    with pytest.raises(ValueError):
        WriterConfig(rejoin_backoff_s=5.0, rejoin_backoff_max_s=4.0)


def test_a_bookie_that_failed_once_is_placed_again_once_the_writer_forgets_the_failure():
    """One failed write (e.g. a connection broken by the bookie's restart) keeps a bookie out of new
    fragments only for ``failed_memory_s``: a long-lived writer does not pile every later fragment
    onto the other bookies (the CI run that found it: 48 fragments, one of them on bookie-1)."""
    from fragments.model import LedgerConfig

    c = Cluster(n=4, config=LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=2, fragment_entries_max=1))
    w = c.open_writer(failed_memory_s=60.0, rejoin_backoff_s=0.01, rejoin_backoff_max_s=0.01)
    c.fail = {"b0"}
    c.append(w, b"x")  # b0 fails and is replaced
    c.fail = set()
    assert "b0" not in w.fragment.ensemble

    def ensembles(n: int) -> list[tuple[str, ...]]:
        out = []
        for _ in range(n):
            c.append(w, b"y")  # one entry per fragment: every append rolls over
            w.advance_clock(w.now + 1.0)
            out.append(c.fragments[c.ledger.last_fragment_index].ensemble)
        return out

    assert not any("b0" in e for e in ensembles(20))  # remembered: the other three bookies take them
    w.advance_clock(w.now + 60.0)
    placed = ensembles(20)
    assert sum("b0" in e for e in placed) >= 5, placed  # forgotten: b0 takes its share again
