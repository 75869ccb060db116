"""Requests to bookies and the answers that come back (the events the core consumes).

Field names follow the protocol: term, LAC, LAFR, truncate. ``bookie`` on an answer names who sent
it. Answers carry the request's term so a writer can drop answers from an earlier term of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- requests -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    ledger_id: int
    entry_id: int
    term: int
    lac: int
    lafr: int
    data: bytes
    truncate: bool = False  # delete every stored id >= entry_id first
    recovery: bool = False  # a take-over write-back (exempt from the "truncated in this term" rule)


@dataclass(frozen=True, slots=True)
class FenceRequest:
    ledger_id: int
    term: int


@dataclass(frozen=True, slots=True)
class RecoveryReadRequest:
    ledger_id: int
    entry_id: int
    term: int


@dataclass(frozen=True, slots=True)
class LacWriteRequest:
    ledger_id: int
    term: int
    lac: int
    lafr: int


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A regular (tailing) read: no term."""

    ledger_id: int
    entry_id: int


TermRequest = AddRequest | FenceRequest | RecoveryReadRequest | LacWriteRequest

# --- answers (events) -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddOk:
    bookie: str
    ledger_id: int
    entry_id: int
    term: int


@dataclass(frozen=True, slots=True)
class InvalidTerm:
    """The bookie holds a higher term: the sender has been taken over and must withdraw."""

    bookie: str
    ledger_id: int
    term: int
    bookie_term: int


@dataclass(frozen=True, slots=True)
class NotTruncated:
    """A normal add or LAC write reached a bookie that has not yet applied a truncate of this
    term (its first add was lost). The writer treats it as a write failure of that bookie."""

    bookie: str
    ledger_id: int
    entry_id: int
    term: int


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """The driver's verdict: a write to this bookie timed out, its connection broke, or the bookie
    refused it (``reason``: what it said, e.g. READ_ONLY)."""

    bookie: str
    ledger_id: int
    entry_id: int
    term: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FenceOk:
    bookie: str
    ledger_id: int
    term: int
    lac: int
    lafr: int


@dataclass(frozen=True, slots=True)
class FenceFailed:
    bookie: str
    ledger_id: int
    term: int


@dataclass(frozen=True, slots=True)
class ReadOk:
    """A recovery read found the entry. ``entry_term`` is the term that wrote this copy."""

    bookie: str
    ledger_id: int
    entry_id: int
    term: int
    entry_term: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ReadMissing:
    bookie: str
    ledger_id: int
    entry_id: int
    term: int


@dataclass(frozen=True, slots=True)
class ReadFailed:
    bookie: str
    ledger_id: int
    entry_id: int
    term: int


@dataclass(frozen=True, slots=True)
class CasOk:
    version: int


@dataclass(frozen=True, slots=True)
class CasConflict:
    """The ledger record was not at the expected version. ``current``/``version`` are what the
    store holds now when the driver could read it (None: unknown, or the ledger is gone)."""

    current: object | None = None  # LedgerMeta (typed loosely: messages stay model-agnostic)
    version: int | None = None


@dataclass(frozen=True, slots=True)
class Tick:
    now: float
