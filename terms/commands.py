"""What the protocol core asks its driver to do (imperatives), plus the writer's configuration.

A driver executes commands (gRPC calls, metadata CAS, resolving callers' futures) and feeds the
answers back as events from ``terms.messages``. Every send carries a ``send_id`` the driver echoes in
the answer, so the writer can tell an answer to an old send from one to a new send.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fragments.model import Fragment, LedgerMeta

from .messages import AddRequest, FenceRequest, LacWriteRequest, RecoveryReadRequest


@dataclass(frozen=True, slots=True)
class SendAdd:
    bookie: str
    request: AddRequest
    send_id: int


@dataclass(frozen=True, slots=True)
class SendFence:
    bookie: str
    request: FenceRequest


@dataclass(frozen=True, slots=True)
class SendRecoveryRead:
    bookie: str
    request: RecoveryReadRequest


@dataclass(frozen=True, slots=True)
class SendLacWrite:
    bookie: str
    request: LacWriteRequest


@dataclass(frozen=True, slots=True)
class CasLedger:
    """Atomically: if the ledger record is still at ``expected_version``, put ``ledger`` and every
    fragment record in ``fragments``. Answer with CasOk(new_version) or CasConflict."""

    expected_version: int
    ledger: LedgerMeta
    fragments: tuple[Fragment, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """Every appended entry with id <= last_entry_id is acknowledged (reached AQ, in order)."""

    last_entry_id: int


@dataclass(frozen=True, slots=True)
class Opened:
    """The take-over finished: the ledger is OPEN in our term and appends start at next_entry_id."""

    term: int
    next_entry_id: int
    truncate_entry_id: int


@dataclass(frozen=True, slots=True)
class Withdraw:
    """We lost the ledger (a higher term exists) or cannot go on: every unacknowledged append fails."""

    reason: str
    stale_term: bool


@dataclass(frozen=True, slots=True)
class Aborted:
    """The take-over could not finish; it is safe to try again with a new take-over."""

    reason: str


@dataclass(frozen=True, slots=True)
class Closed:
    last_entry_id: int


Command = (
    SendAdd | SendFence | SendRecoveryRead | SendLacWrite | CasLedger | Acknowledge | Opened | Withdraw | Aborted | Closed
)


@dataclass(frozen=True, slots=True)
class UnsafeSwitches:
    """Test-only switches that break the protocol on purpose, so the simulator can prove that its
    invariant checker catches each mistake. Never set in production code."""

    skip_truncate: bool = False  # no truncate no-op at the end of recovery
    recovery_writes_at_ack_quorum: bool = False  # recovery write-backs finish at AQ, not WQ
    skip_fencing: bool = False  # no fence requests, and recovery reads that do not raise the term

    @property
    def any(self) -> bool:
        return self.skip_truncate or self.recovery_writes_at_ack_quorum or self.skip_fencing


@dataclass(frozen=True, slots=True)
class WriterConfig:
    max_inflight_entries: int = 10_000  # appended but not yet fully replicated
    max_inflight_bytes: int = 64 * 1024 * 1024
    lac_push_idle_s: float = 0.005  # push the LAC explicitly after this long without a send
    # ... or at once (the next Tick) when the LAC advanced and no add is in flight to carry it, so
    # a tailing reader sees an entry without waiting for the next append or the idle push
    lac_push_eager: bool = False
    ensemble_retry_s: float = 0.002  # while a failed bookie waits for a replacement, retry this often ...
    ensemble_retry_max_s: float = 0.5  # ... doubling per failed placement up to this
    rejoin_backoff_s: float = 0.01  # a bookie whose write failed is placed again only after this ...
    rejoin_backoff_max_s: float = 4.0  # ... doubling per failure without an ack in between, up to this
    failed_memory_s: float = 300.0  # new fragments prefer bookies that have not failed us for this long
    recovery_read_window: int = 16  # recovery reads in flight at once
    unsafe: UnsafeSwitches = field(default_factory=UnsafeSwitches)

    def __post_init__(self) -> None:
        if self.max_inflight_entries < 1 or self.max_inflight_bytes < 1 or self.recovery_read_window < 1:
            raise ValueError("in-flight limits must be positive")
        if self.lac_push_idle_s < 0 or self.ensemble_retry_s <= 0:
            raise ValueError("lac_push_idle_s must be >= 0 and ensemble_retry_s > 0")
        if self.ensemble_retry_max_s < self.ensemble_retry_s or not 0 <= self.rejoin_backoff_s <= self.rejoin_backoff_max_s:
            raise ValueError("retry and back-off maxima must not be under their starting values")
