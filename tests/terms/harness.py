"""A synchronous, in-memory harness for scripted protocol scenarios: bookies apply the real rules
and answer at once; a test can hold back or fail any send."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fragments.model import Fragment, LedgerConfig, LedgerMeta, LedgerStatus
from fragments.placement import BookieInfo, Placement
from terms.bookie_rules import Accept, decide
from terms.commands import Acknowledge, CasLedger, SendAdd, SendFence, SendLacWrite, SendRecoveryRead, WriterConfig
from terms.messages import (
    AddOk,
    AddRequest,
    CasConflict,
    CasOk,
    FenceOk,
    InvalidTerm,
    NotTruncated,
    ReadMissing,
    ReadOk,
    WriteFailed,
)
from terms.writer import LedgerWriter


@dataclass
class Bookie:
    name: str
    state: object = None
    entries: dict = field(default_factory=dict)  # id -> (term, data)

    def apply(self, req):
        d = decide(self.state, req)
        if not isinstance(d, Accept):
            return d
        if d.truncate_from is not None:
            for i in [i for i in self.entries if i >= d.truncate_from]:
                del self.entries[i]
        if isinstance(req, AddRequest):
            self.entries[req.entry_id] = (req.term, req.data)
        self.state = d.state
        return d


class Cluster:
    def __init__(self, n=5, config=None, ensemble=("b0", "b1", "b2")):
        self.bookies = {f"b{i}": Bookie(f"b{i}") for i in range(n)}
        self.config = config or LedgerConfig(ensemble_size=len(ensemble), write_quorum=len(ensemble), ack_quorum=2)
        self.ledger = LedgerMeta(7, "s", LedgerStatus.OPEN, 0, self.config)
        self.version = 1
        self.fragments = {0: Fragment(0, 0, tuple(ensemble), 0)}
        self.hold: set[str] = set()  # bookies whose sends are silently lost
        self.fail: set[str] = set()  # bookies whose writes fail (the driver reports WriteFailed)
        self.acked: list[int] = []
        self.log: list = []

    def writer(self, seed=1, **cfg) -> LedgerWriter:
        placement = Placement(random.Random(seed), [BookieInfo(b) for b in self.bookies])
        w = LedgerWriter(self.ledger, self.version, self.fragments[self.ledger.last_fragment_index], placement,
                         WriterConfig(**cfg))
        return w

    def run(self, w: LedgerWriter, cmds) -> None:
        queue = list(cmds)
        while queue:
            c = queue.pop(0)
            self.log.append(c)
            queue.extend(self._exec(w, c))

    def _exec(self, w, c):
        if isinstance(c, CasLedger):
            if c.expected_version != self.version:
                return w.handle(CasConflict(self.ledger, self.version))
            self.version += 1
            self.ledger = c.ledger
            for f in c.fragments:
                self.fragments[f.index] = f
            return w.handle(CasOk(self.version))
        if isinstance(c, Acknowledge):
            self.acked.append(c.last_entry_id)
            return []
        if isinstance(c, (SendAdd, SendFence, SendRecoveryRead, SendLacWrite)):
            if c.bookie in self.hold:
                return []
            if isinstance(c, SendAdd) and c.bookie in self.fail:
                r = c.request
                return w.handle_add_answer(WriteFailed(c.bookie, r.ledger_id, r.entry_id, r.term), c.send_id)
            b = self.bookies[c.bookie]
            req = c.request
            d = b.apply(req)
            if not isinstance(d, Accept):
                ev = (NotTruncated(c.bookie, 7, req.entry_id, req.term) if d.not_truncated
                      else InvalidTerm(c.bookie, 7, req.term, d.bookie_term))
                return w.handle_add_answer(ev, c.send_id) if isinstance(c, SendAdd) else w.handle(ev)
            if isinstance(c, SendAdd):
                return w.handle_add_answer(AddOk(c.bookie, 7, req.entry_id, req.term), c.send_id)
            if isinstance(c, SendFence):
                return w.handle(FenceOk(c.bookie, 7, req.term, d.state.lac, d.state.lafr))
            if isinstance(c, SendRecoveryRead):
                e = b.entries.get(req.entry_id)
                if e is None:
                    return w.handle(ReadMissing(c.bookie, 7, req.entry_id, req.term))
                return w.handle(ReadOk(c.bookie, 7, req.entry_id, req.term, e[0], e[1]))
            return []
        return []

    def open_writer(self, seed=1, **cfg) -> LedgerWriter:
        w = self.writer(seed, **cfg)
        self.run(w, w.start())
        return w

    def time_out_reads(self, w, bookie: str) -> None:
        """What the driver does when a recovery read gets no answer: report it failed."""
        from terms.messages import ReadFailed

        while any(bookie in rd.targets and bookie not in rd.answers for rd in w.reads.values()):
            rd = next(rd for rd in w.reads.values() if bookie in rd.targets and bookie not in rd.answers)
            self.run(w, w.handle(ReadFailed(bookie, 7, rd.entry_id, w.term)))

    def append(self, w, payload: bytes) -> int:
        eid, cmds = w.append(payload)
        self.run(w, cmds)
        return eid
