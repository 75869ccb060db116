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


def test_compaction_run_from_the_command_line(cluster):
    """``scroll compaction run`` in a process of its own: --dry-run changes nothing, a run compacts."""
    import asyncio

    from streams.client import connect

    s = f"cli-compaction-run-{os.getpid()}"

    async def make():
        c = await connect(cluster.metadata_url)
        try:
            await c.create_stream(s, fragment_entries_max=6, retention={"cleanup_policy": "compact"})
            p = await c.producer(s)
            for i in range(30):
                await p.append_many([(f"v{i}".encode(), f"k{i % 3}".encode(), None, None)])
            await p.close()
        finally:
            await c.close()

    asyncio.run(make())
    dry = json.loads(scroll(cluster, "compaction", "run", "--stream", s, "--dry-run", "--json").stdout)
    (rep,) = dry["streams"]
    assert dry["dry_run"] and rep["due"] and not rep["rewritten_fragments"] and rep["dirty_ratio"] == 1.0
    r = scroll(cluster, "compaction", "run", "--stream", s, "--json")
    assert r.returncode == 0, r.stderr
    (rep,) = json.loads(r.stdout)["streams"]
    assert rep["rewritten_fragments"] and rep["records_out"] < rep["records_in"] and rep["bytes_reclaimed"] > 0
    again = json.loads(scroll(cluster, "compaction", "run", "--stream", s, "--json").stdout)["streams"][0]
    assert not again["due"] and again["why"] == "nothing dirty in the cleanable range"
    r = scroll(cluster, "compaction", "run", "--stream", "no-such-stream")
    assert r.returncode != 0 and "no-such-stream" in (r.stderr + r.stdout)
    table = scroll(cluster, "compaction", "run")
    assert table.returncode == 0 and "reclaimed" in table.stdout
