"""The engine memoises ``decide`` for adds without the truncate flag (see bookie/storage.py).

That is sound only while the decision for such an add depends on the ledger state and the add's
term, LAC, LAFR and recovery flag, and not on its entry id or payload. These properties pin that
contract to terms.bookie_rules, and check the engine's batch path against a plain loop over
``decide`` for random sequences of adds.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from bookie import digest
from bookie.errors import Status
from terms.bookie_rules import Accept, LedgerState, decide
from terms.messages import AddRequest

states = st.builds(
    LedgerState,
    term=st.integers(0, 4),
    lac=st.integers(-1, 6),
    lafr=st.integers(-1, 6),
    clean_term=st.integers(-1, 4),
) | st.none()

adds = st.builds(
    AddRequest,
    ledger_id=st.just(1),
    entry_id=st.integers(0, 8),
    term=st.integers(0, 4),
    lac=st.integers(-1, 6),
    lafr=st.integers(-1, 6),
    data=st.binary(max_size=4),
    truncate=st.just(False),
    recovery=st.booleans(),
)


@given(states, adds, st.integers(0, 100), st.binary(max_size=4))
def test_non_truncating_add_decision_ignores_entry_id_and_data(state, add, other_id, other_data) -> None:
    assert decide(state, add) == decide(state, replace(add, entry_id=other_id, data=other_data))


@given(states, adds)
def test_repeating_an_accepted_add_changes_nothing_more(state, add) -> None:
    first = decide(state, add)
    if isinstance(first, Accept):
        again = decide(first.state, add)
        assert isinstance(again, Accept) and again.state == first.state


@settings(max_examples=60, deadline=None)
@given(st.lists(st.builds(
    AddRequest,
    ledger_id=st.integers(1, 2),
    entry_id=st.integers(0, 6),
    term=st.integers(0, 3),
    lac=st.integers(-1, 4),
    lafr=st.integers(-1, 4),
    data=st.binary(min_size=1, max_size=3),
    truncate=st.booleans(),
    recovery=st.booleans(),
), min_size=1, max_size=25))
def test_engine_batch_decisions_match_decide(tmp_path_factory, reqs) -> None:
    from bookie.storage import Engine

    from .helpers import small_config

    engine = Engine(small_config(tmp_path_factory.mktemp("rules")))
    engine.open()
    try:
        cols = list(zip(*[(r.ledger_id, r.entry_id, r.term, r.lac, r.lafr, r.truncate, r.recovery, 0,
                           digest.crc32c_digest(r.ledger_id, r.entry_id, r.data), r.data) for r in reqs]))
        out = engine.add_batch(*[list(c) for c in cols])
        model: dict[int, LedgerState] = {}
        for i, r in enumerate(reqs):
            d = decide(model.get(r.ledger_id), r)
            got = Status.OK if out.statuses is None else out.statuses[i]
            if isinstance(d, Accept):
                model[r.ledger_id] = d.state
                assert got == Status.OK
            else:
                assert got == (Status.NOT_TRUNCATED if d.not_truncated else Status.INVALID_TERM)
                assert out.bookie_terms[i] == d.bookie_term
        assert engine.states == model
    finally:
        engine.close()
