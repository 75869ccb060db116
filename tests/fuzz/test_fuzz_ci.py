"""Bounded fuzzing runs of every target (CI), and the long ones of ``make soak``.

Each target runs in a process of its own (``python -m tests.fuzz.run``: libFuzzer exits the
process when it is done), for ``SECONDS[target]`` seconds (about 1.5 minutes for all four on a
loaded 2-core machine), or ``SCROLL_FUZZ_SECONDS`` each when that is set (``make soak``: 600).
A crash, a hang (an input over the target's time limit) or an RSS over the limit fails the test and
leaves the input in the run's directory: add it to ``tests/fuzz/regressions/TARGET/`` with the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = {"kafka_decode": 20, "kafka_dispatch": 20, "bookie_frames": 10, "bookie_storage": 15}
SOAK_SECONDS = float(os.environ.get("SCROLL_FUZZ_SECONDS", "0"))


def _seconds(target: str) -> float:
    return SOAK_SECONDS or SECONDS[target]


@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.timeout(_seconds(t) * 2 + 120))
                                    for t in sorted(SECONDS)])
def test_fuzz_target(target: str, tmp_path: Path) -> None:
    seconds = _seconds(target)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.run", target, "--seconds", str(seconds),
                           "--work", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=seconds * 2 + 120)
    found = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "slow-")))
    if proc.returncode != 0 or found:
        inputs = "\n".join(f"{name}: {(tmp_path / name).read_bytes().hex()}" for name in found)
        pytest.fail(f"{target}: exit {proc.returncode}, inputs {found} (kept in {tmp_path})\n{inputs}\n"
                    f"{proc.stderr[-6000:]}")
