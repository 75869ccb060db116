"""The ledger writer: take-over, recovery, pipelined appends, ensemble change, rollover, close.

How this works. A ``LedgerWriter`` is a plain object fed events (answers from bookies and the
metadata store, ``Tick``s) that returns commands. Every writer starts with a take-over, because a
stream may be written by any client over its life but by one at a time:

1. CAS the ledger record to ``term + 1`` / IN_RECOVERY (a lost CAS means someone else acts: abort).
2. Fence the last fragment's ensemble with the new term until ``E - AQ + 1`` answered. The highest
   LAC and LAFR seen are frozen for the rest of recovery.
3. Read entries from LAFR + 1 (a bounded window in flight, from one entry doubling with each entry
   found; decided in id order) on the write set of
   the recovery ensemble (the last fragment as it was when recovery started), carrying the new
   term. A current copy means the entry exists: write back the copy with the highest stamp. ``WQ - AQ + 1`` misses make it the truncate point. Anything else:
   abort. A copy written in a term older than the "floor" counts as a miss: it is a leftover of an
   earlier term. The floor starts at the term that created the fragment and rises to the creating
   term of any no-op read on the way (an earlier take-over truncated there, perhaps not everywhere).
4. Write back every recovered entry, then a no-op with the truncate flag at the truncate point to
   *every* member of the current ensemble. Write-backs finish at WQ (guaranteed write quorum).
   Ensemble changes made now stay local.
5. CAS the ledger to OPEN with any changed fragments. Appends continue after the truncate point.

Appends are pipelined. An entry is acknowledged (in order) once it and every entry before it
reached AQ (the LAC), and stays pending, kept for resend, until it and its prefix reached WQ (the
LAFR). A failed write replaces the bookie: the new fragment starts at LAFR + 1 and every pending
entry is resent to the newcomer, whose first add carries the truncate flag (it may hold leftovers
of earlier terms). A bookie that acked a committed entry not yet fully replicated is pinned: it is
not replaced until that entry reached WQ. A full fragment is drained (everything at WQ), sealed and
followed by a fragment on a freshly placed ensemble. Any InvalidTerm answer withdraws the writer.

Age rollover. With ``LedgerConfig.fragment_age_max_ms`` set (Kafka's segment.ms, and a compacted
topic's max.compaction.lag.ms), the open fragment also counts as full once the first entry this
writer released into it is that old (the writer's clock: ``advance_clock`` / ``Tick``; entries an
earlier term left in it do not count, nor does the take-over no-op): sends are held, the fragment
drains and rolls over as a full one does. A fragment holding no entry of ours never rolls over for
its age, so an idle stream does not churn fragments. ``next_deadline`` includes the moment the age
cap is reached. A rollover that cannot place a new ensemble is retried ``ensemble_retry_max_s``
later, appends going on in the old fragment meanwhile.

Caps may change under a live writer (a topic's segment.* configs altered): ``update_caps`` takes
the new ``fragment_*`` caps at once (the driver reads the ledger record now and then), and a CAS
that conflicts with a change of the caps alone is rebased like a change of retention or extra.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from fragments.model import Fragment, LedgerConfig, LedgerMeta, LedgerStatus
from fragments.placement import NotEnoughBookies, Placement
from fragments.rollover import age_deadline, fragment_full, fragment_too_old

from . import entry as entry_codec
from .commands import (
    Aborted,
    Acknowledge,
    CasLedger,
    Closed,
    Command,
    Opened,
    SendAdd,
    SendFence,
    SendLacWrite,
    SendRecoveryRead,
    Withdraw,
    WriterConfig,
)
from .messages import (
    AddOk,
    AddRequest,
    CasConflict,
    CasOk,
    FenceFailed,
    FenceOk,
    FenceRequest,
    InvalidTerm,
    LacWriteRequest,
    NotTruncated,
    ReadFailed,
    ReadMissing,
    ReadOk,
    ReadRequest,
    RecoveryReadRequest,
    Tick,
    WriteFailed,
)
from .quorum import coverage, write_set

log = logging.getLogger(__name__)


# CAS reasons a foreign (non-writer) change of the ledger record can be rebased over.
REBASEABLE = frozenset({"open", "ensemble change", "rollover", "close"})


class Phase(enum.Enum):
    TAKING_OVER = "taking-over"  # term CAS in flight
    FENCING = "fencing"
    RECOVERING = "recovering"  # recovery reads and write-backs
    OPENING = "opening"  # final CAS to OPEN in flight
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    WITHDRAWN = "withdrawn"
    ABORTED = "aborted"


TERMINAL = {Phase.CLOSED, Phase.WITHDRAWN, Phase.ABORTED}


class WriterError(Exception):
    retriable = False


class NotWritable(WriterError):
    """append() while the writer is not OPEN."""


class Backpressure(WriterError):
    """The in-flight limits are reached: wait for acknowledgements and try again."""

    retriable = True


class LedgerClosed(WriterError):
    """The ledger is CLOSED: it cannot be taken over or written."""


@dataclass(slots=True)
class _Pending:
    data: bytes
    recovery: bool = False
    truncate: bool = False  # the recovery no-op: goes to the whole ensemble, done when all acked
    first_offset: int | None = None  # record offset of the entry's first record (given by the caller)
    acks: set[str] = field(default_factory=set)
    sent_to: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Read:
    entry_id: int
    targets: tuple[str, ...]
    answers: dict[str, object] = field(default_factory=dict)  # bookie -> (stamp, data) | "missing" | "failed"


class LedgerWriter:
    def __init__(
        self,
        ledger: LedgerMeta,
        version: int,
        last_fragment: Fragment,
        placement: Placement,
        config: WriterConfig | None = None,
        now: float = 0.0,
    ):
        if ledger.status is LedgerStatus.CLOSED:
            raise LedgerClosed(f"ledger {ledger.ledger_id} is closed")
        self.config = config or WriterConfig()
        self.placement = placement
        self.ledger = ledger
        self.version = version
        self.term = ledger.term + 1
        self.fragment = last_fragment
        self.recovery_fragment = last_fragment
        self.wq = ledger.config.write_quorum
        self.aq = ledger.config.ack_quorum
        self.phase = Phase.TAKING_OVER
        self.lap = -1  # last entry id assigned
        self.sent_upto = -1  # last entry id released to the pipeline (appends wait while a fragment drains)
        self.resend_needed = False
        self.frozen_lafr = -1
        self.lac = -1
        self.lafr = -1
        self.pending: dict[int, _Pending] = {}
        self.inflight_bytes = 0
        self.failed: set[str] = set()  # members of the current ensemble whose writes failed
        self.failed_at: dict[str, float] = {}  # when each bookie last failed a write of ours
        # A bookie whose write failed is placed again (its own slot or another) only after a back-off
        # that doubles per failure without an ack in between: with every bookie refusing (disks full,
        # all down but still registered) the writer would otherwise re-place, CAS and resend in a loop.
        self.strikes: dict[str, int] = {}
        self.rejoin_at: dict[str, float] = {}
        self.fail_reasons: dict[str, str] = {}  # what each bookie's last failed write said
        self.place_retry_s = self.config.ensemble_retry_s  # doubles per failed placement, reset on success
        self.stalled: str | None = None  # why the last placement failed (logged once per stall)
        self.cas_reason: str | None = None
        self._cas_target: LedgerMeta = ledger
        self.dirty_sent: tuple[Fragment, ...] = ()
        self.dirty: dict[int, Fragment] = {}  # fragments changed locally, not yet in metadata
        self.fragment_bytes = 0
        self.fragment_first_at: float | None = None  # when our first entry went into the open fragment
        self.age_retry_at = 0.0  # an age rollover that could not place waits until then
        self.next_send_id = 1
        self.join_send_id: dict[str, int] = {}  # answers to sends older than a bookie's join are stale
        self.needs_truncate: set[str] = set()  # newcomers whose first add must carry the truncate flag
        self.fenced: set[str] = set()
        self.fence_failed: set[str] = set()
        self.frozen_lac = -1
        self.reads: dict[int, _Read] = {}  # recovery reads in flight, by entry id
        self.next_decide = self.next_read = 0
        self.read_window = 1  # recovery reads in flight: doubles per entry found, up to the config's
        self.read_floor = last_fragment.created_term  # copies older than this are leftovers
        self.truncate_entry_id: int | None = None
        self.noop_entry_id: int | None = None  # the truncate no-op this take-over wrote (it holds no data)
        self.open_entry_id: int | None = None  # first id appended by this term
        self.acked = -1  # highest id acknowledged to callers
        self.lac_pushed = -1
        self.last_send_at = now
        self.last_tick_at = now
        self.now = now
        self.close_requested = False
        # The record offset the next appended entry starts at, as the caller (which formats entries)
        # says; None until it says. Only used to record fragments' first offsets in metadata.
        self.next_offset: int | None = None
        self._out: list[Command] = []

    # ------------------------------------------------------------------ public API
    def start(self) -> list[Command]:
        """Begin the take-over: raise the term in metadata."""
        meta = self.ledger.with_(term=self.term, status=LedgerStatus.IN_RECOVERY)
        self._cas(meta, (), "take-over")
        return self._drain()

    def append(self, payload: bytes, offsets: tuple[int, int] | None = None) -> tuple[int, list[Command]]:
        """Queue one entry; returns its entry id. Acknowledgement comes later as Acknowledge.

        ``offsets``: (first record offset of this entry, first offset after it). The writer does
        not read payloads; it keeps these only to record each new fragment's first offset."""
        if self.phase is not Phase.OPEN or self.close_requested:
            raise NotWritable(f"ledger {self.ledger.ledger_id} writer is {self.phase.value}")
        if not self.can_append(len(payload)):
            raise Backpressure("in-flight limit reached")
        entry_id = self._new_pending(entry_codec.encode_data(payload))
        if offsets is not None:
            self.pending[entry_id].first_offset = offsets[0]
            self.next_offset = offsets[1]
        self._pump()
        return entry_id, self._drain()

    def can_append(self, nbytes: int = 0) -> bool:
        return len(self.pending) < self.config.max_inflight_entries and (
            self.inflight_bytes + nbytes <= self.config.max_inflight_bytes or not self.pending
        )

    def push_lac(self, force: bool = False) -> list[Command]:
        """Push the LAC to the ensemble now (a producer that stops must leave its last entries
        visible to readers, not wait for an idle tick that will never come). ``force``: even if
        this LAC was pushed before (that push may have been lost; the driver retries these)."""
        if self.phase is Phase.OPEN and (self.lac > self.lac_pushed or force) and self.cas_reason is None:
            self._push_lac()
        return self._drain()

    def close(self) -> list[Command]:
        """Close the ledger once everything appended is fully replicated."""
        if self.phase is Phase.OPEN:
            self.close_requested = True
            self._maybe_close()
        return self._drain()

    def handle(self, event) -> list[Command]:
        if self.phase in TERMINAL:
            return []
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unexpected event {event!r}")
        handler(self, event)
        return self._drain()

    @property
    def engaged(self) -> bool:
        return self.phase not in TERMINAL

    def advance_clock(self, now: float) -> None:
        """Tell the writer the time without acting on it (a ``Tick`` also acts). Sends are stamped
        with it, so a driver that ticks only at ``next_deadline`` calls this before appends and
        answers: the idle LAC push then counts from the real time of the last send."""
        if now > self.now:
            self.now = now

    def update_caps(self, config: LedgerConfig) -> list[Command]:
        """The ledger's rollover caps changed in metadata (``config`` as read from the store): use
        them from the next rollover decision on. Ensemble and quorum changes are not taken (they
        cannot change under a writer). The record's version is not taken either: the next CAS
        conflicts and is rebased over the change (see ``_foreign_change``)."""
        cur = self.ledger.config
        if self.phase in TERMINAL or not cur.same_quorums(config) or cur.with_caps(config) == cur:
            return []
        self.ledger = self.ledger.with_(config=cur.with_caps(config))
        self._cas_target = self._cas_target.with_(config=self._cas_target.config.with_caps(config))
        log.info("ledger=%s term=%s fragment caps now bytes=%s entries=%s age_ms=%s", self.ledger.ledger_id,
                 self.term, config.fragment_bytes_max, config.fragment_entries_max, config.fragment_age_max_ms)
        if self.phase is Phase.OPEN and self.cas_reason is None:
            self._pump()  # a lower cap may make the open fragment full now
        return self._drain()

    def next_deadline(self) -> float | None:
        """The earliest time at which a ``Tick`` would do something, or None when nothing is
        time-driven (an idle writer whose LAC is pushed, a metadata change in flight, a finished
        writer): the driver then needs no timer until the next append or answer. A deadline may
        be in the past (tick at once). A Tick earlier than the deadline does nothing, except that
        any Tick retries a pending ensemble change (a driver ticks after refreshing the placement).

        Mirrors ``_on_tick``: a failed bookie waiting for a replacement (placement may have failed,
        or a pinned bookie waits to be unpinned) is retried every ``ensemble_retry_s`` counted from
        the last tick (doubling per failed placement up to ``ensemble_retry_max_s``, and no later than
        the moment a backed-off bookie may be placed again); the LAC is pushed ``lac_push_idle_s``
        after the last send."""
        if self.cas_reason is not None or self.phase in TERMINAL:
            return None  # a CAS answer is an event; both timed actions wait for it
        deadline = None
        if self.failed and self.phase in (Phase.OPEN, Phase.RECOVERING):
            deadline = self.last_tick_at + self.place_retry_s
            cooling = [t for t in self.rejoin_at.values() if t > self.now]
            if cooling:
                deadline = min(deadline, max(min(cooling), self.last_tick_at + self.config.ensemble_retry_s))
        push_at = self._lac_push_at()
        if push_at is not None and (deadline is None or push_at < deadline):
            deadline = push_at
        age_at = self._age_roll_at()
        if age_at is not None and (deadline is None or age_at < deadline):
            deadline = age_at
        return deadline

    def _lac_push_at(self) -> float | None:
        """When the LAC is pushed explicitly: ``lac_push_idle_s`` after the last send, or, with
        ``lac_push_eager``, at once when every add sent has reached AQ (no add in flight will be
        answered and make the next send carry the LAC). None: nothing to push (an add to the whole
        ensemble carried the LAC: see ``_pump``), or a metadata change is in flight."""
        if self.phase is not Phase.OPEN or self.lac <= self.lac_pushed or self.cas_reason is not None:
            return None
        if self.config.lac_push_eager and self.sent_upto <= self.lac:
            return self.last_send_at
        return self.last_send_at + self.config.lac_push_idle_s

    def _age_roll_at(self) -> float | None:
        """When a Tick would roll the open fragment over for its age (None: not time-driven now).
        Once due, the rollover waits for the fragment to drain (the last ack rolls it over, not a
        Tick), so a past deadline is only given when the rollover can be tried at once."""
        if self.phase is not Phase.OPEN or self.failed or self.close_requested:
            return None
        due = age_deadline(self.ledger.config, self.fragment_first_at)
        if due is None:
            return None
        due = max(due, self.age_retry_at)
        if due <= self.now and self.lafr != self.sent_upto:
            return None
        return due

    # ------------------------------------------------------------------ metadata answers
    def _on_cas_ok(self, ev: CasOk) -> None:
        reason, self.cas_reason = self.cas_reason, None
        self.version = ev.version
        self.ledger = self._cas_target
        for f in self.dirty_sent:
            if self.dirty.get(f.index) == f:
                del self.dirty[f.index]
        if reason == "take-over":
            self._begin_fencing()
        elif reason == "open":
            self._opened()
        elif reason == "close":
            self.phase = Phase.CLOSED
            self._out.append(Closed(self.lac))
        else:  # ensemble change or rollover committed: release the held sends
            self._after_fragment_commit()

    def _on_cas_conflict(self, ev: CasConflict) -> None:
        if self._foreign_change(ev):
            # Someone other than a writer changed the record (retention moved the first fragment,
            # a layer above updated ``extra``): the term is still ours, so nobody took over.
            # Rebase the pending change onto what the store holds and send it again.
            cur = ev.current
            keep = dict(first_fragment_index=cur.first_fragment_index, retention=cur.retention, extra=cur.extra,
                        config=self.ledger.config.with_caps(cur.config))
            self.ledger = self.ledger.with_(**keep)
            self._cas_target = self._cas_target.with_(**keep)
            self.version = ev.version
            self._out.append(CasLedger(self.version, self._cas_target, self.dirty_sent, self.cas_reason))
            return
        reason, self.cas_reason = self.cas_reason, None
        if self.phase in (Phase.TAKING_OVER, Phase.OPENING, Phase.FENCING, Phase.RECOVERING):
            self._abort(f"metadata changed under us during {reason}: someone else is taking over")
        else:
            self._withdraw(f"metadata changed under us during {reason}: the ledger was taken over", True)

    def _foreign_change(self, ev: CasConflict) -> bool:
        """Whether the conflicting write kept every field a writer owns (term, status, fragment
        range, closing entry, ensemble size and quorums) as we last wrote or read them, so only fields
        owned by others (first_fragment_index, retention, extra, the rollover caps) moved. A take-over always raises the term."""
        cur, mine = ev.current, self.ledger
        if cur is None or ev.version is None or self.cas_reason not in REBASEABLE:
            return False
        return (cur.ledger_id == mine.ledger_id and cur.term == self.term == mine.term and cur.status == mine.status
                and cur.last_fragment_index == mine.last_fragment_index and cur.last_entry_id == mine.last_entry_id
                and cur.config.same_quorums(mine.config)
                and all(cur.first_fragment_index <= f.index for f in self.dirty_sent))

    # ------------------------------------------------------------------ fencing
    def _begin_fencing(self) -> None:
        self.phase = Phase.FENCING
        first = self.recovery_fragment.first_entry_id
        self.lafr = self.lac = self.lap = first - 1
        if self.config.unsafe.skip_fencing:
            self._begin_reading()
            return
        req = FenceRequest(self.ledger.ledger_id, self.term)
        for b in self.recovery_fragment.ensemble:
            self._out.append(SendFence(b, req))

    def _on_fence_ok(self, ev: FenceOk) -> None:
        if ev.term != self.term or self.phase is not Phase.FENCING:
            return
        self.fenced.add(ev.bookie)
        self.frozen_lac = max(self.frozen_lac, ev.lac)
        self.lafr = max(self.lafr, ev.lafr)
        if len(self.fenced) >= coverage(len(self.recovery_fragment.ensemble), self.aq):
            self._begin_reading()

    def _on_fence_failed(self, ev: FenceFailed) -> None:
        if ev.term != self.term or self.phase is not Phase.FENCING:
            return
        self.fence_failed.add(ev.bookie)
        e = len(self.recovery_fragment.ensemble)
        if e - len(self.fence_failed) < coverage(e, self.aq):
            self._abort(f"fencing cannot reach coverage: {sorted(self.fence_failed)} failed")

    # ------------------------------------------------------------------ recovery reads
    def _begin_reading(self) -> None:
        self.phase = Phase.RECOVERING
        self.lac = max(self.frozen_lac, self.lafr)
        self.lap = self.sent_upto = self.frozen_lafr = self.lafr
        log.info(
            "ledger=%s term=%s recovery reads from %s (frozen lac=%s lafr=%s)",
            self.ledger.ledger_id, self.term, self.lafr + 1, self.lac, self.lafr,
        )
        self.next_decide = self.next_read = self.lafr + 1
        self._send_reads()

    def _send_reads(self) -> None:
        """Keep a bounded window of recovery reads in flight (decisions are still made in id order;
        reads past the truncate point are simply discarded). The window starts at one entry and
        doubles with every entry found, up to ``recovery_read_window``: most take-overs find
        nothing or a few entries past the LAFR (a new stream: none), and reads past the truncate
        point would cost the bookies and us a call each for nothing."""
        while self.truncate_entry_id is None and self.next_read < self.next_decide + self.read_window:
            entry_id = self.next_read
            self.next_read += 1
            targets = write_set(entry_id, self.recovery_fragment.ensemble, self.wq)
            self.reads[entry_id] = _Read(entry_id, targets)
            req = RecoveryReadRequest(self.ledger.ledger_id, entry_id, self.term)
            if self.config.unsafe.skip_fencing:
                # Recovery reads carry the new term, so they fence the write sets they touch: the unsafe
                # "skip fencing" switch turns off both halves, fence requests and term-raising reads.
                req = ReadRequest(self.ledger.ledger_id, entry_id)  # type: ignore[assignment]
            for b in targets:
                self._out.append(SendRecoveryRead(b, req))

    def _on_read_answer(self, ev: ReadOk | ReadMissing | ReadFailed) -> None:
        rd = self.reads.get(ev.entry_id)
        if ev.term != self.term or rd is None or ev.bookie not in rd.targets or self.phase is not Phase.RECOVERING:
            return
        if isinstance(ev, ReadOk):
            rd.answers[ev.bookie] = (ev.entry_term, ev.data)
        elif ev.bookie not in rd.answers:
            rd.answers[ev.bookie] = "failed" if isinstance(ev, ReadFailed) else "missing"
        self._decide_reads()

    def _decide_reads(self) -> None:
        """Decide entries in id order. An entry exists if any current copy was read: we wait for the
        whole write set and take the copy with the highest stamp, so that two aborted take-overs
        that left different values do not get mixed. ``WQ - AQ + 1`` misses (a copy older than the
        floor counts as a miss) make it the truncate point; anything else aborts."""
        while self.phase is Phase.RECOVERING and (rd := self.reads.get(self.next_decide)) is not None:
            copies = [a for a in rd.answers.values() if isinstance(a, tuple) and a[0] >= self.read_floor]
            misses = sum(1 for a in rd.answers.values() if a == "missing" or (isinstance(a, tuple) and a[0] < self.read_floor))
            if not copies and misses >= coverage(self.wq, self.aq):
                self.reads.clear()
                self._truncate_at(rd.entry_id)
                return
            if len(rd.answers) < len(rd.targets):
                return  # wait for the rest of the write set
            if not copies:
                self._abort(f"recovery read of entry {rd.entry_id} inconclusive: {rd.answers}")
                return
            del self.reads[rd.entry_id]
            stamp, data = max(copies, key=lambda c: c[0])
            if entry_codec.is_noop(data):
                self.read_floor = max(self.read_floor, entry_codec.noop_term(data))
            self.next_decide += 1
            self.read_window = min(2 * self.read_window, self.config.recovery_read_window)
            self._recovered(rd.entry_id, data)
        self._send_reads()

    def _recovered(self, entry_id: int, data: bytes) -> None:
        assert entry_id == self.lap + 1, (entry_id, self.lap)
        self._new_pending(data, recovery=True)
        self._pump()

    def _truncate_at(self, entry_id: int) -> None:
        self.truncate_entry_id = entry_id
        log.info("ledger=%s term=%s truncate point %s", self.ledger.ledger_id, self.term, entry_id)
        if not self.config.unsafe.skip_truncate:
            self.noop_entry_id = self._new_pending(entry_codec.noop(self.term), recovery=True, truncate=True)
            self._pump()
        self._maybe_finish_recovery()

    def _maybe_finish_recovery(self) -> None:
        if (
            self.phase is Phase.RECOVERING
            and self.truncate_entry_id is not None
            and not self.pending
            and not self.failed
            and self.cas_reason is None
        ):
            self.phase = Phase.OPENING
            meta = self.ledger.with_(status=LedgerStatus.OPEN, last_fragment_index=self.fragment.index)
            self._cas(meta, tuple(self.dirty.values()), "open")

    def _opened(self) -> None:
        self.phase = Phase.OPEN
        self.lac = self.lap
        self.acked = self.lap
        self.open_entry_id = self.lap + 1
        log.info("ledger=%s term=%s open; appends start at %s", self.ledger.ledger_id, self.term, self.lap + 1)
        self._out.append(Opened(self.term, self.lap + 1, self.truncate_entry_id))
        if self.truncate_entry_id is not None and self.truncate_entry_id == self.frozen_lafr + 1 \
                and self.frozen_lac <= self.frozen_lafr:
            # Nothing was recovered: every entry below the no-op was fully replicated before, and
            # the no-op, sent to the whole ensemble, carried the LAC readers could already see.
            # Pushing the no-op's own id as LAC would show readers nothing (they skip no-ops) and
            # cost each bookie a journal write: a take-over of a new stream, or of one whose
            # writer stopped cleanly, is the common case (a listener opens hundreds at once).
            self.lac_pushed = self.lac
        else:
            self._push_lac()

    # ------------------------------------------------------------------ adds
    def _new_pending(self, data: bytes, recovery: bool = False, truncate: bool = False) -> int:
        self.lap += 1
        self.pending[self.lap] = _Pending(data, recovery=recovery, truncate=truncate)
        self.inflight_bytes += len(data)
        return self.lap

    def _targets(self, entry_id: int, p: _Pending) -> tuple[str, ...]:
        if p.truncate:
            return self.fragment.ensemble
        return write_set(entry_id, self.fragment.ensemble, self.wq)

    def _pump(self) -> None:
        """Send what can be sent: resends after an ensemble change, then entries not yet released."""
        if self.cas_reason is not None and self.phase in (Phase.OPEN, Phase.CLOSING):
            return  # the new fragment is not in metadata yet: hold
        if self.resend_needed:
            self.resend_needed = False
            for entry_id, p in self.pending.items():  # insertion order = entry id order
                if entry_id > self.sent_upto:
                    break
                self._send_missing(entry_id, p)
        while self.sent_upto < self.lap:
            if self.phase in (Phase.OPEN, Phase.CLOSING) and self._fragment_is_full():
                break  # drain, then roll over
            if self.phase is Phase.RECOVERING and self.lafr < self.sent_upto:
                # Write-backs go one at a time: a lost write-back followed by a later one that
                # arrives (a reconnect) would leave a bookie holding two take-overs' lineages.
                break
            self.sent_upto += 1
            p = self.pending[self.sent_upto]
            self.fragment_bytes += len(p.data)
            if self.fragment_first_at is None and not p.recovery:
                self.fragment_first_at = self.now
            self._send_missing(self.sent_upto, p)
            if self.phase is Phase.OPEN and not self.failed and not p.recovery \
                    and len(self.fragment.ensemble) == self.wq:
                self.lac_pushed = max(self.lac_pushed, self.lac)  # that add told every member the LAC
        self._maybe_roll_over()

    def _send_missing(self, entry_id: int, p: _Pending) -> None:
        for b in self._targets(entry_id, p):
            if b not in p.sent_to and b not in self.failed:
                self._send_add(b, entry_id, p)

    def _send_add(self, bookie: str, entry_id: int, p: _Pending) -> None:
        truncate = p.truncate or (bookie in self.needs_truncate and not p.recovery)
        self.needs_truncate.discard(bookie)
        # During recovery the piggybacked LAC/LAFR stay frozen: our own LAFR counts copies on a
        # local (uncommitted) ensemble, and a later take-over would trust it to skip entries.
        lafr = self.lafr if self.phase in (Phase.OPEN, Phase.CLOSING) else self.frozen_lafr
        req = AddRequest(
            self.ledger.ledger_id, entry_id, self.term, self.lac, lafr, p.data, truncate=truncate, recovery=p.recovery
        )
        p.sent_to.add(bookie)
        self._out.append(SendAdd(bookie, req, self.next_send_id))
        self.next_send_id += 1
        self.last_send_at = self.now

    def _stale(self, bookie: str, send_id: int) -> bool:
        return bookie not in self.fragment.ensemble or send_id < self.join_send_id.get(bookie, 0)

    def _on_add_ok(self, ev: AddOk, send_id: int = 0) -> None:
        if ev.term != self.term or ev.bookie in self.failed or self._stale(ev.bookie, send_id):
            return
        p = self.pending.get(ev.entry_id)
        if p is None or ev.bookie not in self._targets(ev.entry_id, p):
            return
        p.acks.add(ev.bookie)
        if self.strikes and ev.bookie in self.strikes:  # it accepts again: its next failure backs off from the start
            del self.strikes[ev.bookie]
            self.rejoin_at.pop(ev.bookie, None)
            if self.stalled is not None:
                log.warning("ledger=%s term=%s %s accepts writes again: appends go on", self.ledger.ledger_id,
                            self.term, ev.bookie)
                self.stalled = None
        self._advance()

    def _advance(self) -> None:
        recovering = self.phase in (Phase.RECOVERING, Phase.FENCING)
        while (p := self.pending.get(self.lac + 1)) is not None and len(p.acks) >= self.aq and not recovering:
            self.lac += 1
        while (p := self.pending.get(self.lafr + 1)) is not None and self._fully_replicated(self.lafr + 1, p):
            self.lafr += 1
            self.inflight_bytes -= len(p.data)
            del self.pending[self.lafr]
        if self.phase in (Phase.OPEN, Phase.CLOSING) and self.lac > self.acked:
            self.acked = self.lac
            self._out.append(Acknowledge(self.lac))
        if recovering:
            self._pump()
            self._maybe_finish_recovery()
        else:
            self._pump()
            self._maybe_close()

    def _fully_replicated(self, entry_id: int, p: _Pending) -> bool:
        if p.recovery and self.config.unsafe.recovery_writes_at_ack_quorum:
            return len(p.acks) >= self.aq
        if p.truncate:
            return p.acks >= set(self.fragment.ensemble)
        return len(p.acks) >= self.wq

    # ------------------------------------------------------------------ failures, ensemble change
    def _on_invalid_term(self, ev: InvalidTerm) -> None:
        if ev.term != self.term:
            return
        if self.phase in (Phase.TAKING_OVER, Phase.FENCING, Phase.RECOVERING, Phase.OPENING):
            self._abort(f"bookie {ev.bookie} has term {ev.bookie_term} > ours ({self.term}): someone took over")
        else:
            self._withdraw(f"bookie {ev.bookie} has term {ev.bookie_term} > ours ({self.term}): taken over", True)

    def _on_write_failed(self, ev: WriteFailed | NotTruncated, send_id: int = 0) -> None:
        if ev.term != self.term or self._stale(ev.bookie, send_id) or ev.bookie in self.failed:
            return
        why = getattr(ev, "reason", "") or type(ev).__name__
        log.info("ledger=%s term=%s write to %s failed (entry %s): %s", self.ledger.ledger_id, self.term, ev.bookie,
                 ev.entry_id, why)
        self.fail_reasons[ev.bookie] = why
        self.failed.add(ev.bookie)
        self.failed_at[ev.bookie] = self.now
        k = self.strikes[ev.bookie] = self.strikes.get(ev.bookie, 0) + 1
        c = self.config
        self.rejoin_at[ev.bookie] = self.now + min(c.rejoin_backoff_max_s, c.rejoin_backoff_s * 2 ** min(k - 1, 30))
        self._change_ensemble()

    def _pinned(self, bookie: str, first_entry_id: int) -> bool:
        return any(
            bookie in p.acks for e, p in self.pending.items() if first_entry_id <= e <= self.lac
        )

    def _change_ensemble(self) -> None:
        if self.cas_reason is not None or not self.failed or self.phase in TERMINAL:
            return
        first = self.lafr + 1
        replace = {b for b in self.failed if not self._pinned(b, first)}
        if not replace:
            if not self._outstanding_to_live():
                self._give_up(f"pinned bookies {sorted(self.failed)} failed holding committed entries below WQ")
            return  # wait for the other acks: they unpin the bookie
        ens = self.fragment.ensemble
        keep = {i: b for i, b in enumerate(ens) if b not in replace}
        new_ens = self._place(len(ens), keep, avoid=set(ens))
        if new_ens is None:
            self.place_retry_s = min(self.config.ensemble_retry_max_s, self.place_retry_s * 2)
            return  # retried on Tick (see next_deadline)
        self.place_retry_s = self.config.ensemble_retry_s
        newcomers = {b for i, b in enumerate(new_ens) if i not in keep}
        if first == self.fragment.first_entry_id:
            frag = self.fragment.with_(ensemble=new_ens)
        else:
            sealed = Fragment(
                self.fragment.index, self.fragment.first_entry_id, ens, self.fragment.created_term,
                last_entry_id=first - 1, size_bytes=None, first_offset=self.fragment.first_offset,
            )
            self.dirty[sealed.index] = sealed
            frag = Fragment(self.fragment.index + 1, first, new_ens, self.term,
                            first_offset=self._offset_at(first))
            self.fragment_bytes = 0
            # the entries resent into the new fragment make its age from now on
            self.fragment_first_at = self.now if first <= self.sent_upto else None
        self.dirty[frag.index] = frag
        self.fragment = frag
        self.failed -= replace
        for p in self.pending.values():
            p.acks -= replace
            p.sent_to -= replace
        self._joined(newcomers)
        self.resend_needed = True
        log.info(
            "ledger=%s term=%s ensemble change at %s: %s -> %s", self.ledger.ledger_id, self.term, first, ens, new_ens
        )
        if self.phase is Phase.OPEN or self.phase is Phase.CLOSING:
            meta = self.ledger.with_(last_fragment_index=frag.index)
            self._cas(meta, tuple(self.dirty.values()), "ensemble change")
        else:
            self._pump()  # recovery: local until the final CAS
            self._change_ensemble()

    def _offset_at(self, entry_id: int) -> int | None:
        """The record offset entry ``entry_id`` starts at, if the caller told us (None otherwise:
        readers then learn a fragment's first offset from its first batch)."""
        p = self.pending.get(entry_id)
        if p is not None:
            return p.first_offset
        if entry_id == self.lap + 1 and self.phase is Phase.OPEN:
            return self.next_offset
        return None

    def _place(self, size: int, keep: dict[int, str], avoid: set[str]) -> tuple[str, ...] | None:
        """Fresh bookies first (none that failed us within ``failed_memory_s``: a bookie that failed
        once, e.g. a connection broken by its restart, is not shunned for the writer's whole life, which
        would pile every later fragment onto the others); then ones that failed us lately; last, a
        failed member may rejoin its own slot as a newcomer (a reconnect: everything from LAFR + 1 is
        resent to it)."""
        kept = set(keep.values())
        cooling = {b for b, t in self.rejoin_at.items() if t > self.now} - kept if self.rejoin_at else set()
        memory = self.config.failed_memory_s
        lately = {b for b, t in self.failed_at.items() if self.now - t < memory} if self.failed_at else set()
        for exclude in (avoid | lately, avoid, kept):
            try:
                return self.placement.choose(size, exclude=exclude | cooling, keep=keep)
            except NotEnoughBookies as exc:
                err = exc
        reason = str(err)
        if cooling:
            said = ", ".join(f"{b} ({self.fail_reasons.get(b, 'failed')})" for b in sorted(cooling))
            reason += f"; {said} failed lately and are retried after a back-off"
        if self.failed:  # (a rollover that cannot place yet holds nothing up: its fragment just grows)
            if self.stalled is None:
                log.warning("ledger=%s term=%s cannot replace %s: %s; appends wait", self.ledger.ledger_id,
                            self.term, sorted(self.failed), reason)
            self.stalled = reason
        return None

    def _outstanding_to_live(self) -> bool:
        for e, p in self.pending.items():
            for b in self._targets(e, p):
                if b in p.sent_to and b not in p.acks and b not in self.failed:
                    return True
        return False

    def _give_up(self, reason: str) -> None:
        if self.phase in (Phase.FENCING, Phase.RECOVERING):
            self._abort(reason)
        else:
            self._withdraw(reason + "; a new take-over will repair the tail", False)

    def _after_fragment_commit(self) -> None:
        self._pump()
        self._change_ensemble()
        self._maybe_close()

    # ------------------------------------------------------------------ rollover
    def _fragment_is_full(self) -> bool:
        entries = self.sent_upto - self.fragment.first_entry_id + 1
        if fragment_full(self.ledger.config, entries, self.fragment_bytes):
            return True
        return self.now >= self.age_retry_at and fragment_too_old(self.ledger.config, self.fragment_first_at,
                                                                  self.now)

    def _maybe_roll_over(self) -> None:
        if self.phase is not Phase.OPEN or self.cas_reason is not None or self.failed:
            return
        last = self.sent_upto
        if not self._fragment_is_full() or self.lafr != last:
            return
        if last < self.fragment.first_entry_id:
            return  # nothing in it yet
        new_ens = self._place(len(self.fragment.ensemble), {}, avoid=set())
        if new_ens is None:
            # appends go on in this fragment (an age rollover stops holding them) until a retry
            self.age_retry_at = self.now + self.config.ensemble_retry_max_s
            return
        sealed = Fragment(
            self.fragment.index, self.fragment.first_entry_id, self.fragment.ensemble, self.fragment.created_term,
            last_entry_id=last, size_bytes=self.fragment_bytes, first_offset=self.fragment.first_offset,
        )
        frag = Fragment(self.fragment.index + 1, last + 1, new_ens, self.term, first_offset=self._offset_at(last + 1))
        self.dirty[sealed.index] = sealed
        self.dirty[frag.index] = frag
        self.fragment = frag
        self.fragment_bytes = 0
        self.fragment_first_at = None
        self.age_retry_at = 0.0
        self._joined(new_ens)
        log.info("ledger=%s term=%s rollover at %s onto %s", self.ledger.ledger_id, self.term, last + 1, new_ens)
        self._cas(self.ledger.with_(last_fragment_index=frag.index), (sealed, frag), "rollover")

    # ------------------------------------------------------------------ idle LAC push, close
    def _on_tick(self, ev: Tick) -> None:
        self.now = ev.now
        self.last_tick_at = ev.now
        if self.phase in (Phase.OPEN, Phase.RECOVERING) and self.failed and self.cas_reason is None:
            self._change_ensemble()
        if self.phase is Phase.OPEN and self.cas_reason is None and not self.failed \
                and self.fragment_first_at is not None and self.ledger.config.fragment_age_max_ms is not None:
            self._pump()  # the open fragment may have reached its age: drain and roll over
        push_at = self._lac_push_at()  # as next_deadline computes it
        if push_at is not None and ev.now >= push_at:
            self._push_lac()

    def _push_lac(self) -> None:
        req = LacWriteRequest(self.ledger.ledger_id, self.term, self.lac, self.lafr)
        for b in self.fragment.ensemble:
            if b not in self.failed and b not in self.needs_truncate:
                self._out.append(SendLacWrite(b, req))
        self.lac_pushed = self.lac
        self.last_send_at = self.now

    def _maybe_close(self) -> None:
        if self.close_requested and self.phase is Phase.OPEN and not self.pending and self.cas_reason is None:
            self.phase = Phase.CLOSING
            meta = self.ledger.with_(status=LedgerStatus.CLOSED, last_entry_id=self.lac)
            self._cas(meta, tuple(self.dirty.values()), "close")

    # ------------------------------------------------------------------ helpers
    def _joined(self, bookies) -> None:
        """Bookies new to the current fragment: answers to older sends no longer count, and their
        first add carries the truncate flag (they may hold leftovers of earlier terms)."""
        for b in bookies:
            self.join_send_id[b] = self.next_send_id
            self.needs_truncate.add(b)

    def _cas(self, meta: LedgerMeta, fragments: tuple[Fragment, ...], reason: str) -> None:
        assert self.cas_reason is None, (self.cas_reason, reason)
        self.cas_reason = reason
        self._cas_target = meta
        self.dirty_sent = fragments
        self._out.append(CasLedger(self.version, meta, fragments, reason))

    def _abort(self, reason: str) -> None:
        log.info("ledger=%s term=%s take-over aborted: %s", self.ledger.ledger_id, self.term, reason)
        self.phase = Phase.ABORTED
        self._out.append(Aborted(reason))

    def _withdraw(self, reason: str, stale_term: bool) -> None:
        log.info("ledger=%s term=%s withdraws: %s", self.ledger.ledger_id, self.term, reason)
        self.phase = Phase.WITHDRAWN
        self._out.append(Withdraw(reason, stale_term))

    def _drain(self) -> list[Command]:
        out, self._out = self._out, []
        return out

    _handlers = {
        CasOk: _on_cas_ok,
        CasConflict: _on_cas_conflict,
        FenceOk: _on_fence_ok,
        FenceFailed: _on_fence_failed,
        ReadOk: _on_read_answer,
        ReadMissing: _on_read_answer,
        ReadFailed: _on_read_answer,
        InvalidTerm: _on_invalid_term,
        Tick: _on_tick,
    }

    def handle_add_answer(self, event: AddOk | WriteFailed | NotTruncated | InvalidTerm, send_id: int) -> list[Command]:
        """Answers to a SendAdd, with the send_id of that command echoed by the driver."""
        if self.phase in TERMINAL:
            return []
        if isinstance(event, AddOk):
            self._on_add_ok(event, send_id)
        elif isinstance(event, InvalidTerm):
            self._on_invalid_term(event)
        else:
            self._on_write_failed(event, send_id)
        return self._drain()
