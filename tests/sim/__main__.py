"""Sweep simulator seeds: ``python -m tests.sim --seeds 1000``.

Prints a summary (seeds/s, steps, take-overs, truncations, ensemble changes, rollovers) and, for
a failing seed, the exact command that replays it. ``--broken NAME`` turns on one of the test-only
unsafe switches to show the checker catching it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from dataclasses import asdict

from .runner import Result
from .runner import run_one as _one

BROKEN = ("skip_truncate", "recovery_writes_at_ack_quorum", "skip_fencing")


def sweep(first: int, count: int, broken: str | None = None, scale: float = 1.0, jobs: int | None = None,
          stop_at_first: bool = False) -> list[Result]:
    seeds = [(s, broken, scale) for s in range(first, first + count)]
    jobs = jobs or min(os.cpu_count() or 1, 4)
    results: list[Result] = []
    if jobs == 1:
        for a in seeds:
            results.append(_one(a))
            if stop_at_first and not results[-1].ok:
                break
        return results
    # spawn, not fork: the caller (pytest) may already hold gRPC or librdkafka threads
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for r in pool.imap(_one, seeds, chunksize=4):
            results.append(r)
            if stop_at_first and not r.ok:
                pool.terminate()
                break
    return results


def replay_command(r: Result, broken: str | None, scale: float) -> str:
    extra = f" --broken {broken}" if broken else ""
    extra += f" --scale {scale}" if scale != 1.0 else ""
    return f".venv/bin/python -m tests.sim --sim-seed={r.seed}{extra} -v"


def summarize(results: list[Result], elapsed: float) -> dict:
    total = {k: 0 for k in asdict(results[0].stats)} if results else {}
    for r in results:
        for k, v in asdict(r.stats).items():
            total[k] += v
    n = max(len(results), 1)
    return {
        "seeds": len(results),
        "failed": sum(1 for r in results if not r.ok),
        "seconds": round(elapsed, 1),
        "seeds_per_s": round(len(results) / elapsed, 1) if elapsed else 0.0,
        "steps_per_seed": round(total.get("events", 0) / n),
        "takeovers_per_seed": round(total.get("takeovers_done", 0) / n, 1),
        **{k: v for k, v in total.items()},
    }


def run_cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    ap.add_argument("--seeds", type=int, default=200, help="how many seeds")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--sim-seed", type=int, help="replay one seed")
    ap.add_argument("--broken", choices=BROKEN, help="turn on a test-only unsafe switch")
    ap.add_argument("--scale", type=float, default=1.0, help="longer runs (a soak): more values and steps")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.sim_seed is not None:
        a.first_seed, a.seeds, a.jobs = a.sim_seed, 1, 1
    t0 = time.monotonic()
    results = sweep(a.first_seed, a.seeds, a.broken, a.scale, a.jobs)
    s = summarize(results, time.monotonic() - t0)
    print(
        f"{s['seeds']} seeds in {s['seconds']} s ({s['seeds_per_s']} seeds/s): {s['failed']} failed; "
        f"{s['events']} steps ({s['steps_per_seed']}/seed), take-overs {s['takeovers_done']} "
        f"({s['takeovers_per_seed']}/seed; {s['takeovers_started']} started, {s['aborted']} aborted), "
        f"truncations {s['truncations']}, withdrawals {s['withdrawn']}, ensemble changes {s['ensemble_changes']}, "
        f"rollovers {s['rollovers']}, acknowledged {s['acked']}, reads {s['reads']}, crashes {s['crashes']}, "
        f"partitions {s['partitions']}, dropped messages {s['dropped']}"
    )
    for r in results:
        if a.verbose and r.ok:
            print(f"seed {r.seed}: ok {r.opts} {r.stats}")
        if not r.ok:
            print(f"seed {r.seed} FAILED at step {r.step}: {r.violations[0]}")
            if a.verbose:
                for v in r.violations[1:10]:
                    print(f"    {v}")
                print(f"    options: {r.opts}")
            print(f"    replay: {replay_command(r, a.broken, a.scale)}")
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(run_cli())
