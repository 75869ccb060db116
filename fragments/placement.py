"""Ensemble placement: pure and seeded.

Chooses bookies for a new fragment or to replace failed members of the current one. Failed or
excluded bookies are never chosen; kept members stay at their index (so write sets of carried
entries do not move); among candidates we prefer the least-used bookies (usage counts what this
placer has handed out, plus any load the caller reports), then distinct racks, with the seeded rng
breaking ties so that a growing stream spreads over the whole cluster.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


class NotEnoughBookies(RuntimeError):
    retriable = True


@dataclass(frozen=True, slots=True)
class BookieInfo:
    bookie_id: str
    rack: str = ""
    load: float = 0.0  # e.g. fragments hosted, or used-space fraction


class Placement:
    def __init__(self, rng: random.Random, bookies: list[BookieInfo] | None = None):
        self.rng = rng
        self.bookies: dict[str, BookieInfo] = {}
        self.usage: dict[str, int] = {}
        self.set_bookies(bookies or [])

    def set_bookies(self, bookies: list[BookieInfo]) -> None:
        self.bookies = {b.bookie_id: b for b in bookies}

    def choose(
        self,
        size: int,
        exclude: set[str] | frozenset[str] = frozenset(),
        keep: dict[int, str] | None = None,
    ) -> tuple[str, ...]:
        """An ensemble of ``size``: ``keep`` maps index -> bookie that must stay in place."""
        keep = dict(keep or {})
        chosen: list[str | None] = [keep.get(i) for i in range(size)]
        taken = {b for b in chosen if b is not None}
        candidates = [b for b in self.bookies.values() if b.bookie_id not in exclude and b.bookie_id not in taken]
        need = chosen.count(None)
        if len(candidates) < need:
            raise NotEnoughBookies(
                f"need {need} more bookies, only {len(candidates)} available "
                f"(excluded {sorted(exclude)}, kept {sorted(taken)})"
            )
        racks = {self.bookies[b].rack for b in taken if b in self.bookies}
        picks: list[str] = []
        pool = list(candidates)
        for _ in range(need):
            pool.sort(
                key=lambda b: (
                    self.usage.get(b.bookie_id, 0) + b.load,
                    b.rack in racks and bool(b.rack),
                    self.rng.random(),
                )
            )
            best = pool.pop(0)
            picks.append(best.bookie_id)
            racks.add(best.rack)
        it = iter(picks)
        ensemble = tuple(b if b is not None else next(it) for b in chosen)
        for b in picks:
            self.usage[b] = self.usage.get(b, 0) + 1
        return ensemble
