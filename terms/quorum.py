"""Quorum arithmetic.

Entry ``i`` of a fragment with ensemble size E and write quorum WQ is striped round-robin: it goes to
the WQ ensemble members starting at index ``i mod E``. Quorum coverage of a cohort of n bookies is
``n - AQ + 1``: enough members that no ack quorum of the cohort is left out. Fencing needs coverage
of the ensemble; a recovery read needs coverage of the entry's write set to call the entry missing.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def write_set_indexes(entry_id: int, ensemble_size: int, write_quorum: int) -> tuple[int, ...]:
    start = entry_id % ensemble_size
    return tuple((start + k) % ensemble_size for k in range(write_quorum))


def write_set(entry_id: int, ensemble: tuple[str, ...], write_quorum: int) -> tuple[str, ...]:
    return tuple(ensemble[i] for i in write_set_indexes(entry_id % len(ensemble), len(ensemble), write_quorum))


def coverage(cohort_size: int, ack_quorum: int) -> int:
    return cohort_size - ack_quorum + 1


def has_coverage(count: int, cohort_size: int, ack_quorum: int) -> bool:
    return count >= coverage(cohort_size, ack_quorum)
