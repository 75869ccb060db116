"""The invariants of PROTOCOL.md (names from the TLA+ spec), checked after every simulator step.

Checks are incremental but exact: an invariant about entry id ``i`` depends only on the bookies'
copies of ``i``, their LACs, the fragment holding ``i`` and the highest acknowledged LAC, so after a
step only ids at or above the lowest id anything touched (a bookie's ``dirty_from``, a metadata
change, a new acknowledgement) need looking at again.

Payloads are distinct (client/term/counter), never derived from the entry id, so divergence shows.
"""

from __future__ import annotations

import bisect

from fragments.model import LedgerStatus, fragment_for
from terms import entry as entry_codec
from terms.quorum import write_set
from terms.reader import copy_is_current
from terms.writer import Phase

from .world import World

CLEAN = 1 << 60  # a bookie's dirty_from when nothing changed since the last check


class Checker:
    def __init__(self, world: World):
        self.w = world
        self.max_lac = -1
        self.acked_ids: list[int] = []

    def engaged_lacs(self):
        for _, wr in self.w.writers:
            if wr.phase in (Phase.OPEN, Phase.CLOSING, Phase.CLOSED):
                yield wr

    def check(self) -> list[str]:
        w = self.w
        out: list[str] = []
        frags = w.meta.current_fragments()
        wq, aq = w.opts.write_quorum, w.opts.ack_quorum
        new_max = max([self.max_lac] + [wr.lac for wr in self.engaged_lacs()])
        dirty = min(b.dirty_from for b in w.bookies.values())
        start = min(dirty, self.max_lac + 1)
        # NoDirtyReads depends only on the bookies' LACs and entries and on the fragments: a step
        # that changed none of them (most steps: an answer reaching a client, a timer) cannot break it.
        bookies_changed = dirty != CLEAN or w.meta.changed
        if w.meta.changed:
            start = 0
            w.meta.changed = False
        for b in w.bookies.values():
            b.dirty_from = CLEAN
        self.max_lac = new_max
        for i in range(start, new_max + 1):
            f = fragment_for(frags, i)
            if f is None:
                continue
            ws = write_set(i, f.ensemble, wq)
            self._no_log_divergence(i, ws, out)
            if not any(i in w.bookies[b].entries for b in f.ensemble):
                out.append(f"AllCommittedIdsAreReadable: entry {i} (<= LAC {new_max}) is on no bookie of {f.ensemble}")
        self._acked_values_readable(frags, start, out)
        if bookies_changed:
            self._no_dirty_reads(frags, wq, aq, out)
        self._tail_fragments(frags, wq, start, out)
        self._closed(out)
        return out

    def _no_log_divergence(self, i: int, ws, out: list[str]) -> None:
        seen: dict[bytes, str] = {}
        for b in ws:
            bk = self.w.bookies[b]
            e = bk.entries.get(i)
            if e is not None and bk.lac >= i:
                seen.setdefault(e[1], b)
        if len(seen) > 1:
            out.append(f"NoLogDivergence: entry {i} differs across write set {ws}: " + ", ".join(
                f"{b}={v!r}" for v, b in seen.items()))

    def _acked_values_readable(self, frags, start: int, out: list[str]) -> None:
        w = self.w
        if len(self.acked_ids) != len(w.acked):
            self.acked_ids = sorted(w.acked)
            start = 0
        for i in self.acked_ids[bisect.bisect_left(self.acked_ids, start):]:
            a = w.acked[i]
            f = fragment_for(frags, i)
            want = entry_codec.encode_data(a.value)
            if f is None or not any(w.bookies[b].entries.get(i, (0, b""))[1] == want for b in f.ensemble):
                out.append(f"AllAckedValuesAreReadable: acknowledged {a.value!r} at entry {i} is on no bookie")

    def _no_dirty_reads(self, frags, wq: int, aq: int, out: list[str]) -> None:
        w = self.w
        for name, bk in w.bookies.items():
            lac = bk.lac
            if lac < 0:
                continue
            f = fragment_for(frags, lac)
            if f is None or name not in f.ensemble:
                continue
            ws = write_set(lac, f.ensemble, wq)
            holders = sum(1 for b in ws if lac in w.bookies[b].entries)
            if holders < aq:
                out.append(f"NoDirtyReads: {name} has LAC {lac} but only {holders} of {ws} hold it (AQ={aq})")

    def _tail_fragments(self, frags, wq: int, start: int, out: list[str]) -> None:
        w = self.w
        for f in frags[:-1]:
            if f.last_entry_id is None or f.last_entry_id < start:
                continue
            for i in range(max(start, f.first_entry_id), f.last_entry_id + 1):
                ws = write_set(i, f.ensemble, wq)
                n = sum(1 for b in ws if i in w.bookies[b].entries)
                if n < wq:
                    out.append(f"TailFragmentsReachWriteQuorum: entry {i} of sealed fragment {f.index} on {n} < WQ")

    def _closed(self, out: list[str]) -> None:
        m = self.w.meta.ledger
        if m.status is not LedgerStatus.CLOSED:
            return
        for wr in self.engaged_lacs():
            if wr.lac > (m.last_entry_id if m.last_entry_id is not None else -1):
                out.append(f"NoDivergenceBetweenClientAndMetaData: writer term {wr.term} LAC {wr.lac} > closed end {m.last_entry_id}")

    # ---------------------------------------------------------------- end of run
    def final_log(self) -> tuple[list[tuple[int, bytes | None]], list[str]]:
        """Read the whole log below the final LAC the way a reader would, and check it."""
        w = self.w
        out: list[str] = []
        frags = w.meta.current_fragments()
        log: dict[int, bytes | None] = {}  # entry id -> payload (None for a no-op)
        for i in range(0, self.max_lac + 1):
            f = fragment_for(frags, i)
            copies = {
                w.bookies[b].entries[i][1]
                for b in write_set(i, f.ensemble, w.opts.write_quorum)
                if i in w.bookies[b].entries and copy_is_current(f, w.bookies[b].entries[i][0])
            }
            if len(copies) != 1:
                out.append(f"FinalLog: entry {i} has {len(copies)} distinct current copies")
                continue
            data = copies.pop()
            log[i] = None if entry_codec.is_noop(data) else entry_codec.payload_of(data)
        by_value = {v: i for i, v in log.items() if v is not None}
        for i, a in w.acked.items():
            if by_value.get(a.value) != i:
                out.append(f"FinalLog: acknowledged {a.value!r} (entry {i}) is not in the final log at its id")
        if len(by_value) != sum(1 for v in log.values() if v is not None):
            out.append("FinalLog: a value appears twice")
        # No dirty entry of an old term survives: of each writer's appends, the log keeps a prefix.
        per_writer: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
        for v, (client, term, eid) in w.sent_values.items():
            per_writer.setdefault((client, term), []).append((eid, v))
        for key, appends in per_writer.items():
            appends.sort()
            kept = [log.get(eid) == v for eid, v in appends]
            if any(kept[j] and not kept[j - 1] for j in range(1, len(kept))):
                out.append(f"NoGhosts: of writer {key}'s appends {[e for e, _ in appends]} the log kept "
                           f"{[e for (e, _), k in zip(appends, kept) if k]}: not a prefix")
        return log, out
