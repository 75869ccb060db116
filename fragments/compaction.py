"""Compaction policy: Kafka's log-compaction settings of a stream, and which sealed prefix may be
compacted now. Pure: no IO.

A stream's policy lives in ``LedgerMeta.retention`` beside the retention policy
(``fragments/retention.py``), under these keys (Kafka's topic configs, in the same units)::

    {"cleanup_policy": "compact",          # "delete" (default) | "compact" | "compact,delete"
     "min_compaction_lag_ms": 0,           # a record younger than this is never compacted
     "max_compaction_lag_ms": None,        # a record may stay uncompacted at most this long (None: no bound)
     "min_cleanable_dirty_ratio": 0.5,     # compact when dirty bytes / (clean + dirty) exceeds this
     "delete_retention_ms": 86400000}      # tombstones live this long after their first compaction

The compaction job (``streams/tools/compaction.py``) keeps its bookkeeping there too, under
``compaction`` (see ``COMPACTION``). With ``cleanup_policy`` = ``compact`` alone the retention
limits by age and size do not remove anything (Kafka: ``retention.ms`` applies to ``delete``
topics); ``keep_from`` (DeleteRecords) always applies. ``compact,delete`` applies both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

COMPACTION = "compaction"  # the compaction job's state in LedgerMeta.retention
DATA_LEDGER_PREFIX = "__compacted/"  # ledgers holding compacted fragments' entries (not streams)
POLICY_KEYS = ("cleanup_policy", "min_compaction_lag_ms", "max_compaction_lag_ms", "min_cleanable_dirty_ratio",
               "delete_retention_ms")
CLEANUP_POLICIES = ("delete", "compact", "compact,delete")
DEFAULT_DELETE_RETENTION_MS = 86_400_000  # Kafka's delete.retention.ms (1 day)
DEFAULT_DIRTY_RATIO = 0.5  # Kafka's min.cleanable.dirty.ratio
KAFKA_LONG_MAX = 2**63 - 1  # Kafka's "no bound" for max.compaction.lag.ms


class InvalidCompactionPolicy(ValueError):
    """A compaction setting that is out of range or of the wrong type."""


def normalise_cleanup_policy(value: str) -> str:
    """'compact' / 'delete' / 'compact,delete' in any order and spacing -> the canonical form."""
    parts = {p.strip().lower() for p in str(value).split(",") if p.strip()}
    if not parts or not parts <= {"compact", "delete"}:
        raise InvalidCompactionPolicy(
            f"cleanup.policy {value!r}: one of 'delete', 'compact' or 'compact,delete'")
    return ",".join(sorted(parts))


@dataclass(frozen=True, slots=True)
class CompactionPolicy:
    cleanup_policy: str = "delete"
    min_compaction_lag_ms: int = 0
    max_compaction_lag_ms: int | None = None
    min_cleanable_dirty_ratio: float = DEFAULT_DIRTY_RATIO
    delete_retention_ms: int = DEFAULT_DELETE_RETENTION_MS

    def __post_init__(self) -> None:
        object.__setattr__(self, "cleanup_policy", normalise_cleanup_policy(self.cleanup_policy))
        for name in ("min_compaction_lag_ms", "delete_retention_ms"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidCompactionPolicy(f"{name} must be an integer >= 0, got {v!r}")
        v = self.max_compaction_lag_ms
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InvalidCompactionPolicy(f"max_compaction_lag_ms must be an integer >= 1, got {v!r}")
        r = self.min_cleanable_dirty_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or not 0 <= r <= 1:
            raise InvalidCompactionPolicy(f"min_cleanable_dirty_ratio must be in [0, 1], got {r!r}")

    @property
    def compact(self) -> bool:
        return "compact" in self.cleanup_policy.split(",")

    @property
    def delete(self) -> bool:
        return "delete" in self.cleanup_policy.split(",")

    @classmethod
    def from_dict(cls, d: Mapping | None) -> CompactionPolicy:
        d = d or {}
        max_lag = d.get("max_compaction_lag_ms")
        if max_lag is not None and max_lag >= KAFKA_LONG_MAX:
            max_lag = None
        return cls(
            cleanup_policy=d.get("cleanup_policy", "delete"),
            min_compaction_lag_ms=d.get("min_compaction_lag_ms", 0),
            max_compaction_lag_ms=max_lag,
            min_cleanable_dirty_ratio=d.get("min_cleanable_dirty_ratio", DEFAULT_DIRTY_RATIO),
            delete_retention_ms=d.get("delete_retention_ms", DEFAULT_DELETE_RETENTION_MS),
        )

    def to_dict(self) -> dict:
        """Only what differs from the defaults (a stream without compaction stores nothing)."""
        out: dict = {}
        default = CompactionPolicy()
        for k in POLICY_KEYS:
            v = getattr(self, k)
            if v != getattr(default, k):
                out[k] = v
        return out
