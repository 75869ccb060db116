"""A Hypothesis state machine over the same core and the same simulated world.

Hypothesis chooses every action (append, deliver the next message, drop it, crash or restart a
bookie, a take-over by some client, a writer tick); after each one every invariant is checked.
"""

from __future__ import annotations

import heapq
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from terms.messages import Tick
from terms.writer import Phase

from .checker import Checker
from .world import Network, SimOptions, World


class ProtocolMachine(RuleBasedStateMachine):
    @initialize(e=st.sampled_from([(3, 3, 2), (3, 2, 2), (4, 3, 2), (3, 3, 3), (5, 3, 2)]), cap=st.sampled_from([3, 1000]))
    def setup(self, e, cap):
        opts = SimOptions.from_seed(1)
        opts.ensemble, opts.write_quorum, opts.ack_quorum = e
        opts.bookies, opts.clients, opts.readers, opts.fragment_entries_max, opts.inflight = e[0] + 2, 2, 0, cap, 4
        opts.drop_p = opts.dup_p = opts.spike_p = 0.0
        self.world = World(opts, autonomous=False)
        self.checker = Checker(self.world)
        self.n = 0

    def _writer(self, i):
        return self.world.clients[i].writer

    @rule(i=st.integers(0, 1))
    def take_over(self, i):
        self.world.clients[i].take_over()

    @rule(i=st.integers(0, 1), k=st.integers(1, 3))
    def append(self, i, k):
        w = self._writer(i)
        for _ in range(k):
            if w is None or w.phase is not Phase.OPEN or not w.can_append(16):
                return
            self.world.clients[i].append_one(w)

    @rule(n=st.integers(1, 30))
    def deliver(self, n):
        for _ in range(n):
            self.world.sim.step()

    @rule()
    def settle(self):
        """Deliver everything in flight (bounded), checking invariants all the way."""
        for _ in range(400):
            if not self.world.sim.step():
                break
            self.protocol_invariants()

    @precondition(lambda self: bool(self.world.sim._heap))
    @rule()
    def drop_next_message(self):
        heap = self.world.sim._heap
        t, seq, fn, args = min(heap)
        if getattr(fn, "__func__", None) is Network._deliver:
            heap.remove((t, seq, fn, args))
            heapq.heapify(heap)

    @rule(b=st.integers(0, 6), restart=st.booleans())
    def crash(self, b, restart):
        names = list(self.world.bookies)
        bk = self.world.bookies[names[b % len(names)]]
        if restart:
            bk.restart()
        elif sum(x.up for x in self.world.bookies.values()) > self.world.opts.ensemble:
            bk.crash()

    @rule(i=st.integers(0, 1))
    def tick(self, i):
        c = self.world.clients[i]
        if c.writer is not None:
            self.world.sim.now += 0.01
            c.execute(c.writer, c.writer.handle(Tick(self.world.sim.now)))

    @invariant()
    def protocol_invariants(self):
        found = self.world.violations + self.checker.check()
        assert not found, found


ProtocolMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("SCROLL_HYPOTHESIS_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProtocol = ProtocolMachine.TestCase
