"""The metadata model: one record per ledger plus one record per fragment.

A ledger (a stream) is an unbounded chain of fragments. Each fragment is a contiguous run of entry
ids stored on one ensemble of bookies. A fragment also records the record offset of its first
record when its writer knew it (entries are record batches; see ``streams/batches.py``), so the
earliest offset and retention need no data reads. Only the ledger record and the tail fragment change while a
stream is written, so metadata stays small however long a stream lives: a writer never needs the
whole fragment list, only the last fragment.

Records are immutable dataclasses with a JSON form; versions belong to the metadata store (every
write is a compare-and-set on the version the writer last read).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, replace


class LedgerStatus(enum.StrEnum):
    OPEN = "OPEN"
    IN_RECOVERY = "IN_RECOVERY"
    CLOSED = "CLOSED"


class InvalidConfig(ValueError):
    """A ledger configuration that breaks E >= WQ >= AQ >= 1 or a cap that is not positive."""


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    ensemble_size: int = 3
    write_quorum: int = 3
    ack_quorum: int = 2
    fragment_bytes_max: int = 64 * 1024 * 1024
    fragment_entries_max: int = 1_000_000
    # Roll the open fragment over once its first entry (appended by the current writer) is this
    # old, even if it is not full (Kafka's segment.ms; for a compacted topic also
    # max.compaction.lag.ms, KIP-354). None: no age limit. A fragment with no entry never rolls.
    fragment_age_max_ms: int | None = None

    def __post_init__(self) -> None:
        e, wq, aq = self.ensemble_size, self.write_quorum, self.ack_quorum
        if not (isinstance(e, int) and isinstance(wq, int) and isinstance(aq, int)):
            raise InvalidConfig("ensemble_size, write_quorum and ack_quorum must be integers")
        if not (e >= wq >= aq >= 1):
            raise InvalidConfig(
                f"need ensemble_size >= write_quorum >= ack_quorum >= 1, got E={e} WQ={wq} AQ={aq}"
            )
        if self.fragment_bytes_max < 1 or self.fragment_entries_max < 1:
            raise InvalidConfig("fragment caps must be positive")
        age = self.fragment_age_max_ms
        if age is not None and (not isinstance(age, int) or isinstance(age, bool) or age < 1):
            raise InvalidConfig(f"fragment_age_max_ms must be None or an integer >= 1, got {age!r}")

    def same_quorums(self, other: LedgerConfig) -> bool:
        """Whether ``other`` differs from this config at most in the rollover caps (which may change
        while a writer is live; the ensemble and quorums may not)."""
        return (self.ensemble_size, self.write_quorum, self.ack_quorum) == (
            other.ensemble_size, other.write_quorum, other.ack_quorum)

    def with_caps(self, other: LedgerConfig) -> LedgerConfig:
        """This config with ``other``'s rollover caps."""
        return replace(self, fragment_bytes_max=other.fragment_bytes_max,
                       fragment_entries_max=other.fragment_entries_max,
                       fragment_age_max_ms=other.fragment_age_max_ms)


@dataclass(frozen=True, slots=True)
class Fragment:
    """A contiguous run of entries on one ensemble.

    ``created_term`` is the term of the writer that created the fragment. Every legitimate copy of
    an entry of this fragment was written in a term >= created_term; an older copy found on one of
    its bookies is a leftover of an earlier term (a "ghost") and is never served.
    """

    index: int
    first_entry_id: int
    ensemble: tuple[str, ...]
    created_term: int
    last_entry_id: int | None = None  # set when sealed
    size_bytes: int | None = None  # payload bytes written by the sealing term, when known
    first_offset: int | None = None  # record offset of its first record (None: not known when created)
    # Where the entries live when not in this ledger: a compacted fragment's entries were rewritten
    # into a ledger of their own (``data_ledger``), entry ``first_entry_id + k`` of this fragment
    # being entry ``data_first_entry + k`` there, on this fragment's ensemble (see
    # streams/tools/compaction.py). None: the entries are this ledger's own.
    data_ledger: int | None = None
    data_first_entry: int = 0
    compacted_ms: int | None = None  # when the compaction that wrote it switched it in
    # Tiered storage: the fragment's object-store state (see fragments/tier.py); None: bookies only.
    tier: dict | None = field(default=None, hash=False)

    @property
    def sealed(self) -> bool:
        return self.last_entry_id is not None

    def contains(self, entry_id: int) -> bool:
        if entry_id < self.first_entry_id:
            return False
        return self.last_entry_id is None or entry_id <= self.last_entry_id

    def to_json(self) -> str:
        d = asdict(self)
        d["ensemble"] = list(self.ensemble)
        if self.data_ledger is None:  # a fragment of its own entries: the record stays as it was
            del d["data_ledger"], d["data_first_entry"], d["compacted_ms"]
        if self.tier is None:
            del d["tier"]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Fragment:
        d = json.loads(raw)
        d["ensemble"] = tuple(d["ensemble"])
        return cls(**d)

    def with_(self, **changes) -> Fragment:
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class LedgerMeta:
    ledger_id: int
    name: str
    status: LedgerStatus
    term: int
    config: LedgerConfig
    first_fragment_index: int = 0  # grows as retention removes fragments
    last_fragment_index: int = 0
    last_entry_id: int | None = None  # set when CLOSED
    retention: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # owned by layers above (kafka offsets, spark ids)

    def with_(self, **changes) -> LedgerMeta:
        return replace(self, **changes)

    def to_json(self) -> str:
        d = asdict(self)
        d["status"] = self.status.value
        if d["config"].get("fragment_age_max_ms") is None:  # no age cap: the record stays as it was
            d["config"].pop("fragment_age_max_ms", None)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> LedgerMeta:
        d = json.loads(raw)
        d["status"] = LedgerStatus(d["status"])
        d["config"] = LedgerConfig(**d["config"])
        return cls(**d)


def fragment_for(fragments: list[Fragment] | tuple[Fragment, ...], entry_id: int) -> Fragment | None:
    """The fragment holding ``entry_id`` (fragments sorted by first_entry_id), or None."""
    lo, hi = 0, len(fragments) - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fragments[mid].first_entry_id <= entry_id:
            found = fragments[mid]
            lo = mid + 1
        else:
            hi = mid - 1
    if found is None or not found.contains(entry_id):
        return None
    return found
