"""The bookie's term rules as a pure decision.

Bookies are dumb storage: per ledger they keep the entries (each stamped with the term that wrote
it), the highest term seen, the highest LAC and LAFR seen, and ``clean_term``: the highest term in
which they applied a truncate. ``decide`` looks at one request and the ledger's state and says
whether to serve it and what the new state is; the caller (the bookie server, or the simulator)
makes the state and any truncation durable before it answers.

Rules:
1. A request carrying a term lower than the bookie's is rejected with InvalidTerm and changes
   nothing; otherwise the bookie adopts the request's term.
2. Fences are accepted even for ledgers never seen (otherwise an old writer could write there later)
   and answered with the bookie's LAC and LAFR.
3. An add with the truncate flag deletes every stored id >= its id, then stores the entry, and
   marks the ledger clean for that term.
4. A normal add or LAC write of a term the bookie has not yet truncated in is refused
   (NotTruncated): its first add in this term was lost, so it may hold leftovers of older terms
   that a piggybacked LAC must never cover. Recovery write-backs are exempt.
5. Adds are idempotent overwrites; LAC and LAFR only grow.
"""

from __future__ import annotations

from dataclasses import dataclass

from .messages import AddRequest, FenceRequest, LacWriteRequest, RecoveryReadRequest, TermRequest


@dataclass(frozen=True, slots=True)
class LedgerState:
    term: int = 0
    lac: int = -1
    lafr: int = -1
    clean_term: int = -1


INITIAL = LedgerState()


@dataclass(frozen=True, slots=True)
class Accept:
    state: LedgerState
    truncate_from: int | None = None  # delete stored ids >= this before storing


@dataclass(frozen=True, slots=True)
class Reject:
    bookie_term: int
    not_truncated: bool = False  # rule 4 rather than rule 1


def decide(state: LedgerState | None, request: TermRequest) -> Accept | Reject:
    s = state or INITIAL
    if request.term < s.term:
        return Reject(s.term)
    if isinstance(request, AddRequest):
        if request.truncate:
            return Accept(
                LedgerState(request.term, max(s.lac, request.lac), max(s.lafr, request.lafr), request.term),
                truncate_from=request.entry_id,
            )
        if not request.recovery and s.clean_term < request.term:
            return Reject(s.term, not_truncated=True)
        return Accept(LedgerState(request.term, max(s.lac, request.lac), max(s.lafr, request.lafr), s.clean_term))
    if isinstance(request, LacWriteRequest):
        if s.clean_term < request.term:
            return Reject(s.term, not_truncated=True)
        return Accept(LedgerState(request.term, max(s.lac, request.lac), max(s.lafr, request.lafr), s.clean_term))
    if isinstance(request, (FenceRequest, RecoveryReadRequest)):
        if request.term == s.term:
            return Accept(s)
        return Accept(LedgerState(request.term, s.lac, s.lafr, s.clean_term))
    raise TypeError(f"not a term-carrying request: {request!r}")


def changes_state(before: LedgerState | None, decision: Accept) -> bool:
    """Whether the accepted request must be made durable before it is answered."""
    return decision.truncate_from is not None or decision.state != (before or INITIAL)
