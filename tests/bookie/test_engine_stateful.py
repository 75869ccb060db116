"""The storage engine against a dict model (Hypothesis RuleBasedStateMachine).

The model keeps, per ledger, the LedgerState and the entries ((ledger, entry) -> (entry_term,
data)), updated with ``terms.bookie_rules.decide`` (the rules are not under test here: storage
is). It also keeps a *durable* copy: a journal sync or a flush makes everything applied so far
durable. ``crash`` stops the engine as a power cut would (unsynced journal records lost, optionally
leaving a torn prefix of the next record on disk) and reopens it: the engine must then equal the
durable copy. After every step every (ledger, entry) of a small id space must read back exactly as
the model says, with the right entry_term, and the ledger states must match.

Small files (16 KiB entry logs, 64 KiB journal files, a 32 KiB write cache) make rotation, flush
during replay, and compaction happen within a few steps.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from bookie import digest
from bookie.config import BookieConfig
from bookie.errors import NoSuchLedgerError
from bookie.storage import Engine
from terms.bookie_rules import Accept, LedgerState, changes_state, decide
from terms.messages import AddRequest, FenceRequest, LacWriteRequest

LEDGERS = (1, 2, 3)
IDS = range(0, 12)

CONFIG = dict(
    max_entry_bytes=4096,
    max_batch_bytes=16 * 1024,
    max_batch_adds=64,
    journal_file_bytes=64 * 1024,
    journal_preallocate="none",
    write_cache_bytes=32 * 1024,
    entry_log_bytes_max=16 * 1024,
    read_cache_bytes=8 * 1024,
    min_free_bytes=0,
    gc_live_threshold=0.6,
)

payloads = st.one_of(st.binary(min_size=1, max_size=24), st.integers(500, 3000).map(lambda n: bytes([n % 251]) * n))
add_requests = st.builds(
    AddRequest,
    ledger_id=st.sampled_from(LEDGERS),
    entry_id=st.sampled_from(IDS),
    term=st.integers(0, 3),
    lac=st.integers(-1, 6),
    lafr=st.integers(-1, 6),
    data=payloads,
    truncate=st.booleans(),
    recovery=st.booleans(),
)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="bookie-sm-"))
        self.config = BookieConfig(data_dir=self.dir, **CONFIG)
        self.engine = self._open()
        self.states: dict[int, LedgerState] = {}
        self.entries: dict[tuple[int, int], tuple[int, bytes]] = {}
        self.durable = ({}, {})

    def _open(self) -> Engine:
        engine = Engine(self.config)
        engine.open()
        return engine

    def teardown(self) -> None:
        if self.engine._opened:
            self.engine.crash()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ model helpers

    def _apply_add(self, req: AddRequest) -> None:
        d = decide(self.states.get(req.ledger_id), req)
        if not isinstance(d, Accept):
            return
        if d.truncate_from is not None:
            for key in [k for k in self.entries if k[0] == req.ledger_id and k[1] >= d.truncate_from]:
                del self.entries[key]
        self.states[req.ledger_id] = d.state
        self.entries[(req.ledger_id, req.entry_id)] = (req.term, req.data)

    def _mark_durable(self) -> None:
        self.durable = (dict(self.states), dict(self.entries))

    # ------------------------------------------------------------ rules

    @rule(reqs=st.lists(add_requests, min_size=1, max_size=6))
    def add(self, reqs: list[AddRequest]) -> None:
        cols = [
            [r.ledger_id for r in reqs], [r.entry_id for r in reqs], [r.term for r in reqs],
            [r.lac for r in reqs], [r.lafr for r in reqs], [r.truncate for r in reqs],
            [r.recovery for r in reqs], [0] * len(reqs),
            [digest.crc32c_digest(r.ledger_id, r.entry_id, r.data) for r in reqs], [r.data for r in reqs],
        ]
        self.engine.add_batch(*cols)
        for r in reqs:
            self._apply_add(r)

    @rule(ledger=st.sampled_from(LEDGERS), term=st.integers(0, 4))
    def fence(self, ledger: int, term: int) -> None:
        self.engine.fence(ledger, term)
        d = decide(self.states.get(ledger), FenceRequest(ledger, term))
        if isinstance(d, Accept):
            self.states[ledger] = d.state

    @rule(ledger=st.sampled_from(LEDGERS), term=st.integers(0, 3), lac=st.integers(-1, 8))
    def write_lac(self, ledger: int, term: int, lac: int) -> None:
        req = LacWriteRequest(ledger, term, lac, lac)
        self.engine.write_lac(ledger, term, lac, lac)
        d = decide(self.states.get(ledger), req)
        if isinstance(d, Accept) and changes_state(self.states.get(ledger), d):
            self.states[ledger] = d.state

    @rule(ledger=st.sampled_from(LEDGERS), first=st.sampled_from(IDS), span=st.integers(0, 5))
    def trim(self, ledger: int, first: int, span: int) -> None:
        self.engine.trim(ledger, first, first + span)
        if ledger in self.states:
            for key in [k for k in self.entries if k[0] == ledger and first <= k[1] <= first + span]:
                del self.entries[key]

    @rule(ledger=st.sampled_from(LEDGERS))
    def delete_ledger(self, ledger: int) -> None:
        self.engine.delete_ledger(ledger)
        self.states.pop(ledger, None)
        for key in [k for k in self.entries if k[0] == ledger]:
            del self.entries[key]

    @rule()
    def sync(self) -> None:
        self.engine.journal.sync()
        self._mark_durable()

    @rule()
    def flush(self) -> None:
        self.engine.flush()
        self._mark_durable()

    @rule()
    def checkpoint(self) -> None:
        self.engine.checkpoint()
        self._mark_durable()

    @rule()
    def gc(self) -> None:
        self.engine.flush()  # GC sees what the index holds
        self._mark_durable()
        self.engine.gc()

    @rule(torn=st.sampled_from([0, 0, 5, 40, 400]))
    def crash_and_reopen(self, torn: int) -> None:
        self.engine.crash(torn_bytes=torn)
        self.states, self.entries = dict(self.durable[0]), dict(self.durable[1])
        self.engine = self._open()

    @rule()
    def clean_restart(self) -> None:
        self.engine.close()
        self._mark_durable()
        self.engine = self._open()

    # ------------------------------------------------------------ invariants

    @invariant()
    def states_match(self) -> None:
        assert self.engine.states == self.states

    @invariant()
    def every_entry_reads_back_exactly(self) -> None:
        for ledger in LEDGERS:
            for entry_id in IDS:
                want = self.entries.get((ledger, entry_id))
                try:
                    got = self.engine.read_entry(ledger, entry_id)
                except NoSuchLedgerError:
                    assert ledger not in self.states and want is None
                    continue
                if want is None:
                    assert got is None, f"ledger {ledger} entry {entry_id}: unexpected {got!r}"
                else:
                    assert got is not None, f"ledger {ledger} entry {entry_id} missing"
                    assert (got.entry_term, got.data) == want


EngineMachine.TestCase.settings = settings(
    max_examples=400 if os.environ.get("SCROLL_SOAK") else 40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestEngineAgainstModel = pytest.mark.timeout(240)(EngineMachine.TestCase)
