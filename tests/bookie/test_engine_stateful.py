"""The storage engine against a dict model (Hypothesis RuleBasedStateMachine).

The model keeps, per ledger, the LedgerState and the entries ((ledger, entry) -> (entry_term,
data)), updated with ``terms.bookie_rules.decide`` (the rules are not under test here: storage
is). It also keeps a *durable* copy: a journal sync or a flush makes everything applied so far
durable. ``crash`` stops the engine as a power cut would (unsynced journal records lost, optionally
leaving a torn prefix of the next record on disk) and reopens it: the engine must then equal the
durable copy. After every step every (ledger, entry) of a small id space must read back exactly as
the model says, with the right entry_term, and the ledger states must match.

Reads race flushes here as they do in a running bookie: every flush, checkpoint and pre-GC flush
runs while range reads of every ledger from every id (``Engine.range_steps``) have their first disk
part done (index scanned, entry logs read) and not yet checked against the write cache, and
``read_across_flushes`` also runs add batches (truncating ones too) in that window, as the event
loop does while a read thread works. Every entry answered must be a copy that id held at some
moment of the read; with no adds in between the answer must be exactly the model's. ``append_run``
sends what a writer sends (consecutive ids in the ledger's term, a take-over's truncating no-op in
the next term), which is what makes truncations of flushed entries common.

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

    @rule(
        ledger=st.sampled_from(LEDGERS), start=st.sampled_from(IDS), count=st.integers(1, 8),
        take_over=st.booleans(), data=payloads,
    )
    def append_run(self, ledger: int, start: int, count: int, take_over: bool, data: bytes) -> None:
        """What a writer sends: consecutive ids in the ledger's term; a take-over uses the next
        term (at most 4, the terms the other rules use) and starts with a truncating no-op."""
        st_ = self.states.get(ledger)
        term = st_.term if st_ is not None else 0
        if take_over:
            term = min(term + 1, 4)
        ids = [i for i in range(start, start + count) if i in IDS]
        reqs = [AddRequest(ledger, i, term, start - 1, start - 1, data + b"%d" % i, take_over and i == start, False)
                for i in ids]
        for at in range(0, len(reqs), 4):  # within max_batch_bytes
            self.add(reqs[at : at + 4])

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
        # every flush runs while range reads from every id have their disk part out, with a cold
        # read cache so that they do go to disk (see the module doc)
        self._reads_across(["flush"], None, cold=True)

    @rule()
    def checkpoint(self) -> None:
        self._reads_across(["checkpoint"], None, cold=True)

    @rule()
    def gc(self) -> None:
        self._reads_across(["flush"], None, cold=True)  # GC sees what the index holds
        self.engine.gc()

    @rule(
        first=st.one_of(st.none(), st.sampled_from(IDS)),  # None: from every id
        between=st.lists(
            st.one_of(st.just("flush"), st.just("checkpoint"), st.lists(add_requests, min_size=1, max_size=4)),
            min_size=1, max_size=4,
        ),
        cold=st.booleans(),
    )
    def read_across_flushes(self, first: int | None, between: list, cold: bool) -> None:
        self._reads_across(between, first, cold)

    def _reads_across(self, between: list, first: int | None, cold: bool) -> None:
        """Range reads of every ledger from ``first`` (None: one from every id), each with its first
        disk part done (index scanned, entry logs read) while ``between`` runs: flushes,
        checkpoints, add batches. Then the reads complete and are checked."""
        if cold:  # as after evictions: the reads go to disk for what the write cache does not hold
            self.engine.read_cache.clear()
        ledgers = [lid for lid in LEDGERS if lid in self.states]
        held = {(lid, eid): {self.entries.get((lid, eid))} for lid in ledgers for eid in IDS}
        reads: dict[tuple[int, int], tuple] = {}  # (ledger, start) -> (steps, disk result) or (None, ReadResult)
        for lid in ledgers:
            for start in IDS if first is None else [first]:
                steps = self.engine.range_steps(lid, start, IDS[-1])
                try:
                    args = next(steps)
                except StopIteration as done:  # served from memory
                    reads[(lid, start)] = (None, done.value)
                    continue
                reads[(lid, start)] = (steps, self.engine.read_disk(*args))
        for op in between:  # the event loop goes on while the read threads work
            if op == "flush":
                self.engine.flush()
                self._mark_durable()
            elif op == "checkpoint":
                self.engine.checkpoint()
                self._mark_durable()
            else:
                self.add(op)
            for key in held:
                held[key].add(self.entries.get(key))
        for (lid, start), (steps, found) in reads.items():
            res = found
            if steps is not None:
                try:
                    while True:
                        found = self.engine.read_disk(*steps.send(found))
                except StopIteration as done:
                    res = done.value
            got = [(eid, (entry[0], entry[3])) for eid, entry in res.entries]
            assert [eid for eid, _v in got] == list(range(start, start + len(got))), "a range read is one run"
            for eid, value in got:
                assert value in held[(lid, eid)], f"ledger {lid} entry {eid}: {value!r} was never its copy during the read"
            if not any(isinstance(op, list) for op in between):
                want = []
                for eid in range(start, IDS[-1] + 1):
                    if (lid, eid) not in self.entries:
                        break
                    want.append((eid, self.entries[(lid, eid)]))
                assert got == want, f"ledger {lid}: the read answered {got!r}"
        assert self.engine.write_cache.retired_count == 0, "with no read in flight no flushed generation is kept"

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
    max_examples=int(os.environ.get("SCROLL_SM_EXAMPLES", 400 if os.environ.get("SCROLL_SOAK") else 100)),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestEngineAgainstModel = pytest.mark.timeout(240)(EngineMachine.TestCase)
