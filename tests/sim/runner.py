"""Run one seed: a faulty stretch with invariants checked after every step, then a fault-free
stretch in which liveness must hold (a take-over completes and appends are acknowledged), then a
read of the whole log."""

from __future__ import annotations

from dataclasses import dataclass, field

from terms.commands import UnsafeSwitches
from terms.writer import Phase

from .checker import Checker
from .world import MS, SimOptions, Stats, World

LIVENESS_VALUES = 10


@dataclass
class Result:
    seed: int
    opts: SimOptions
    stats: Stats
    violations: list[str] = field(default_factory=list)
    step: int = -1  # the step of the first violation

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first_invariant(self) -> str | None:
        return self.violations[0].split(":", 1)[0] if self.violations else None


def run_seed(seed: int, unsafe: UnsafeSwitches | None = None, scale: float = 1.0) -> Result:
    opts = SimOptions.from_seed(seed, unsafe, scale)
    world = World(opts)
    checker = Checker(world)
    res = Result(seed, opts, world.stats)

    def step() -> bool:
        if not world.sim.step():
            return False
        world.stats.events += 1
        found = world.violations + checker.check()
        if found:
            res.violations = found
            res.step = world.stats.events
            return False
        return True

    while world.stats.events < opts.max_events:
        if not step():
            if res.violations:
                return res
            break
    # Fault-free stretch: one client takes over and must get appends acknowledged.
    world.heal()
    for c in world.clients:
        c.active = False
    hero = world.clients[0]
    hero.active, hero.want_takeover = True, True
    opts.takeover_p = 0.0
    world.values_left = LIVENESS_VALUES
    deadline = world.sim.now + 5.0
    while world.sim.now < deadline:
        w = hero.writer
        if w is not None and w.phase is Phase.OPEN and world.values_left == 0 and w.acked >= w.lap:
            break
        if not step():
            if res.violations:
                return res
            break
    else:
        w = hero.writer
        res.violations.append(
            f"Liveness: no take-over with all appends acknowledged within 5 s of fault-free time "
            f"(writer phase {w.phase.value if w else None}, acked {w.acked if w else None}, lap {w.lap if w else None}, "
            f"lafr {w.lafr if w else None}, failed {sorted(w.failed) if w else None}, cas {w.cas_reason if w else None}, "
            f"ensemble {w.fragment.ensemble if w else None})"
        )
        return res
    # let zombies' last messages settle, then read everything back
    end = world.sim.now + 200 * MS
    while world.sim.now < end and step():
        pass
    if res.violations:
        return res
    _, problems = checker.final_log()
    res.violations.extend(problems)
    return res


def run_one(args: tuple[int, str | None, float]) -> Result:
    """One seed of a sweep, ``(seed, broken switch or None, scale)``; importable by spawned workers
    (a function of ``__main__`` is not, under ``python -m tests.sim``)."""
    seed, broken, scale = args
    unsafe = UnsafeSwitches(**{broken: True}) if broken else None
    return run_seed(seed, unsafe, scale)
