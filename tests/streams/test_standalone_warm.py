"""``scroll standalone`` pays its jobs' imports before its ready line (issue 26): the first
retention run, 10 s after start, used to import the retention floors' entry points (compat_kafka's
group coordinator, kio's schemas: ~0.7 s of CPU) in the middle of the first traffic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from streams.tools.standalone import Standalone
Standalone.warm_jobs()
before = set(sys.modules)
from streams.tools.retention import load_floors
floors = load_floors()
from streams.tools.compaction import run_compaction, wanted
from streams.tools.tier import TierReport, load_tier_config, run_tier, wanted
from streams.tier.objstore import ObjectStore
new = sorted(set(sys.modules) - before)
print("floors", len(floors))
print("new", new)
"""


def test_the_first_job_runs_import_nothing_after_the_warm_up():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert int(lines["floors"]) >= 1  # compat_kafka's group floor is registered (the costly import)
    assert lines["new"] == "[]", f"imported by the first job runs despite the warm-up: {lines['new']}"
