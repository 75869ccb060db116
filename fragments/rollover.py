"""Rollover policy: when the current fragment is full, seal it and start the next one.

A full fragment is sealed only once every entry in it reached the write quorum (the writer drains
first), so every sealed fragment satisfies TailFragmentsReachWriteQuorum.
"""

from __future__ import annotations

from .model import LedgerConfig


def fragment_full(config: LedgerConfig, entries: int, size_bytes: int) -> bool:
    return entries >= config.fragment_entries_max or size_bytes >= config.fragment_bytes_max


def fragment_too_old(config: LedgerConfig, first_entry_at: float | None, now: float) -> bool:
    """Whether the open fragment is past its age cap (``fragment_age_max_ms``): its first entry was
    released at ``first_entry_at`` (seconds, the writer's clock; None: it holds no entry yet, and a
    fragment with no entry is never rolled over for its age)."""
    cap = config.fragment_age_max_ms
    return cap is not None and first_entry_at is not None and now >= first_entry_at + cap / 1000


def age_deadline(config: LedgerConfig, first_entry_at: float | None) -> float | None:
    """When the open fragment reaches its age cap (None: never)."""
    cap = config.fragment_age_max_ms
    return None if cap is None or first_entry_at is None else first_entry_at + cap / 1000
