"""Reader rules: what a tailing reader may read and from whom.

- Never read above the LAC. A reader learns the LAC from bookies (every read answer carries the
  bookie's LAC; a long-poll LAC read waits until it passes a given value), and keeps the max.
- Read entry ``i`` from a member of its write set in the fragment that holds it; on a miss, an
  error or a corrupt copy, try the next member. Rotating the starting member spreads load.
- A copy written in a term older than the fragment's ``created_term`` is a leftover of an earlier
  term, not this fragment's entry: treat it as missing.
- No-op entries (truncate points) keep their id but are never surfaced to users.
"""

from __future__ import annotations

from fragments.model import Fragment

from .quorum import write_set


def read_order(fragment: Fragment, entry_id: int, write_quorum: int, rotate: int = 0) -> tuple[str, ...]:
    """The bookies to try for ``entry_id``, in order."""
    ws = write_set(entry_id, fragment.ensemble, write_quorum)
    k = rotate % len(ws)
    return ws[k:] + ws[:k]


def copy_is_current(fragment: Fragment, entry_term: int) -> bool:
    return entry_term >= fragment.created_term


class TailPosition:
    """A reader's position and the highest LAC it has learnt."""

    def __init__(self, next_entry_id: int, lac: int = -1):
        self.next_entry_id = next_entry_id
        self.lac = lac

    def learn_lac(self, lac: int) -> None:
        if lac > self.lac:
            self.lac = lac

    def readable(self) -> bool:
        return self.next_entry_id <= self.lac

    def readable_range(self, max_entries: int) -> tuple[int, int] | None:
        """The ids [first, last] that may be read now, at most max_entries of them."""
        if not self.readable():
            return None
        return self.next_entry_id, min(self.lac, self.next_entry_id + max_entries - 1)

    def long_poll_after(self) -> int:
        """A long-poll LAC read should wait until the LAC is greater than this."""
        return self.next_entry_id - 1
