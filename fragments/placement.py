"""Ensemble placement: pure and seeded.

Chooses bookies for a new fragment or to replace failed members of the current one. Failed or
excluded bookies are never chosen; kept members stay at their index (so write sets of carried
entries do not move).

Rack-aware, as BookKeeper's RackawareEnsemblePlacementPolicy: each pick goes to a rack that holds
the fewest members of the ensemble so far (kept members included), so an ensemble spans
min(size, racks) racks whenever the live bookies allow it, and losing a whole rack loses at most
ceil(size / racks) copies of any entry. When racks cannot be spread (fewer racks than members, or
every bookie of the other racks excluded or down) placement still succeeds, doubling up racks - a
fragment on one rack beats no fragment (BookKeeper's ``enforceMinNumRacksPerWriteQuorum=false``).
Bookies with no rack label count as racks of their own. Within the preferred racks we take the
least-used bookies (usage counts what this placer has handed out, plus any load the caller
reports), with the seeded rng breaking ties so that a growing stream spreads over the cluster.
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
        in_rack: dict[str, int] = {}  # members of this ensemble per rack so far
        for b in taken:
            if b in self.bookies and self.bookies[b].rack:
                in_rack[self.bookies[b].rack] = in_rack.get(self.bookies[b].rack, 0) + 1
        picks: list[str] = []
        pool = list(candidates)
        for _ in range(need):
            pool.sort(
                key=lambda b: (
                    in_rack.get(b.rack, 0) if b.rack else 0,
                    self.usage.get(b.bookie_id, 0) + b.load,
                    self.rng.random(),
                )
            )
            best = pool.pop(0)
            picks.append(best.bookie_id)
            if best.rack:
                in_rack[best.rack] = in_rack.get(best.rack, 0) + 1
        it = iter(picks)
        ensemble = tuple(b if b is not None else next(it) for b in chosen)
        for b in picks:
            self.usage[b] = self.usage.get(b, 0) + 1
        return ensemble
