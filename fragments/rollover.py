"""Rollover policy: when the current fragment is full, seal it and start the next one.

A full fragment is sealed only once every entry in it reached the write quorum (the writer drains
first), so every sealed fragment satisfies TailFragmentsReachWriteQuorum.
"""

from __future__ import annotations

from .model import LedgerConfig


def fragment_full(config: LedgerConfig, entries: int, size_bytes: int) -> bool:
    return entries >= config.fragment_entries_max or size_bytes >= config.fragment_bytes_max
