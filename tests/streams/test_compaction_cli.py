"""``scroll topic create --config`` / ``topic alter`` / ``topic describe`` with compaction configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.tools.cli"]


def scroll(cluster, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*SCROLL, *args, "--metadata", cluster.metadata_url], capture_output=True, text=True,
                          timeout=60)


def test_topic_create_alter_describe_with_compaction_configs(cluster):
    t = f"cli-compact-{os.getpid()}"
    r = scroll(cluster, "topic", "create", t, "--partitions", "2", "--config", "cleanup.policy=compact",
               "--config", "segment.ms=60000")
    assert r.returncode == 0, r.stderr
    d = json.loads(scroll(cluster, "topic", "describe", t, "--json").stdout)
    assert d["configs"] == {"cleanup.policy": "compact", "segment.ms": "60000"}
    assert d["stream_policy"]["compaction"]["cleanup_policy"] == "compact"
    assert d["stream_policy"]["fragment_age_max_ms"] == 60000
    r = scroll(cluster, "topic", "alter", t, "--config", "cleanup.policy=delete,compact", "--delete-config",
               "segment.ms", "--config", "min.compaction.lag.ms=100")
    assert r.returncode == 0, r.stderr
    d = json.loads(scroll(cluster, "topic", "describe", t, "--json").stdout)
    assert d["configs"] == {"cleanup.policy": "compact,delete", "min.compaction.lag.ms": "100"}
    assert d["stream_policy"]["compaction"]["min_compaction_lag_ms"] == 100
    assert d["stream_policy"]["fragment_age_max_ms"] is None
    r = scroll(cluster, "topic", "alter", t, "--config", "cleanup.policy=shred")
    assert r.returncode != 0 and "cleanup.policy" in (r.stderr + r.stdout)
    assert "compact" in scroll(cluster, "topic", "describe", t).stdout
