"""Quorum arithmetic, the bookie's term rules, placement and the metadata model."""

from __future__ import annotations

import random

import pytest

from fragments.model import Fragment, InvalidConfig, LedgerConfig, LedgerMeta, LedgerStatus, fragment_for
from fragments.placement import BookieInfo, NotEnoughBookies, Placement
from terms import entry
from terms.bookie_rules import Accept, LedgerState, Reject, changes_state, decide
from terms.messages import AddRequest, FenceRequest, LacWriteRequest, RecoveryReadRequest
from terms.quorum import coverage, write_set


def test_write_sets_stripe_round_robin():
    ens = ("a", "b", "c", "d", "e")
    assert write_set(0, ens, 3) == ("a", "b", "c")
    assert write_set(3, ens, 3) == ("d", "e", "a")
    assert write_set(7, ens, 3) == ("c", "d", "e")
    assert write_set(4, ("a", "b", "c"), 3) == ("b", "c", "a")
    assert coverage(5, 2) == 4 and coverage(3, 3) == 1


def add(term, eid=0, truncate=False, recovery=False, lac=-1):
    return AddRequest(1, eid, term, lac, -1, b"x", truncate=truncate, recovery=recovery)


def test_stale_terms_are_rejected_and_change_nothing():
    s = LedgerState(term=5, lac=3, lafr=2, clean_term=5)
    for req in (add(4), FenceRequest(1, 4), RecoveryReadRequest(1, 0, 4), LacWriteRequest(1, 4, 9, 9)):
        assert decide(s, req) == Reject(5)


def test_fence_is_accepted_for_unknown_ledgers_and_adopts_the_term():
    d = decide(None, FenceRequest(1, 3))
    assert isinstance(d, Accept) and d.state.term == 3 and changes_state(None, d)
    same = decide(d.state, FenceRequest(1, 3))
    assert not changes_state(d.state, same)


def test_truncate_flag_truncates_and_marks_the_term_clean():
    d = decide(LedgerState(term=2), add(3, eid=9, truncate=True, lac=4))
    assert d.truncate_from == 9 and d.state == LedgerState(3, 4, -1, 3)


def test_normal_adds_need_a_truncate_in_their_term_but_recovery_adds_do_not():
    s = LedgerState(term=3, clean_term=2)
    assert decide(s, add(3)) == Reject(3, not_truncated=True)
    assert decide(s, LacWriteRequest(1, 3, 5, 5)) == Reject(3, not_truncated=True)
    assert isinstance(decide(s, add(3, recovery=True)), Accept)
    ok = decide(LedgerState(term=3, lac=7, clean_term=3), add(3, lac=5))
    assert isinstance(ok, Accept) and ok.state.lac == 7  # LAC only grows


def test_noop_envelope_keeps_its_creating_term():
    n = entry.noop(12)
    assert entry.is_noop(n) and entry.noop_term(n) == 12
    d = entry.encode_data(b"\x01abc")
    assert not entry.is_noop(d) and entry.payload_of(d) == b"\x01abc"
    with pytest.raises(ValueError):
        entry.payload_of(n)


def test_placement_keeps_indexes_excludes_and_spreads():
    p = Placement(random.Random(1), [BookieInfo(f"b{i}", rack=f"r{i % 3}") for i in range(9)])
    ens = p.choose(3, exclude={"b0"}, keep={1: "b5"})
    assert ens[1] == "b5" and "b0" not in ens and len(set(ens)) == 3
    counts: dict[str, int] = {}
    for _ in range(300):
        for b in p.choose(3):
            counts[b] = counts.get(b, 0) + 1
    assert len(counts) == 9 and max(counts.values()) - min(counts.values()) <= 3
    with pytest.raises(NotEnoughBookies):
        p.choose(3, exclude={f"b{i}" for i in range(8)})


def test_config_validation_and_json_round_trip():
    with pytest.raises(InvalidConfig):
        LedgerConfig(ensemble_size=2, write_quorum=3, ack_quorum=2)
    with pytest.raises(InvalidConfig):
        LedgerConfig(ensemble_size=3, write_quorum=3, ack_quorum=0)
    m = LedgerMeta(4, "orders", LedgerStatus.IN_RECOVERY, 7, LedgerConfig(5, 3, 2, 1024, 10), retention={"max_age_s": 60})
    assert LedgerMeta.from_json(m.to_json()) == m
    f = Fragment(2, 100, ("a", "b", "c"), 4, last_entry_id=199, size_bytes=5000)
    assert Fragment.from_json(f.to_json()) == f


def test_fragment_lookup():
    frags = [Fragment(0, 0, ("a",), 0, 9), Fragment(1, 10, ("b",), 1, 19), Fragment(2, 20, ("c",), 2)]
    assert fragment_for(frags, 0).index == 0 and fragment_for(frags, 19).index == 1
    assert fragment_for(frags, 10**9).index == 2 and fragment_for(frags, -1) is None
