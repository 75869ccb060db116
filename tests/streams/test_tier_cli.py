"""The tier policy from the command line: ``scroll stream create --remote-storage ...``,
``scroll retention set`` with the same flags, ``scroll topic create/alter --config
remote.storage.enable=true``, and what ``stream describe`` / ``topic describe`` / ``retention show``
say of it. One process per command, as a user runs them."""

from __future__ import annotations

import json
import os

import pytest

from .test_compaction_cli import scroll

pytestmark = pytest.mark.process


def test_stream_flags_retention_set_and_describe(cluster):
    s = f"cli-tier-{os.getpid()}"
    r = scroll(cluster, "stream", "create", s, "--retention-max-age", "604800", "--remote-storage",
               "--local-retention", "1h", "--local-retention-bytes", "1GiB", "--offload-lag", "10m")
    assert r.returncode == 0, r.stderr
    d = json.loads(scroll(cluster, "stream", "describe", s, "--json").stdout)
    assert d["tier"] == {"remote_storage_enable": True, "local_retention_ms": 3_600_000,
                         "local_retention_bytes": 1 << 30, "offload_lag_ms": 600_000}
    assert d["retention"]["offload_lag_ms"] == 600_000
    # retention set changes the tier settings given, keeps the others
    r = scroll(cluster, "retention", "set", s, "--local-retention", "-2", "--offload-lag", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tier"] == {"remote_storage_enable": True, "local_retention_ms": -2,
                                            "local_retention_bytes": 1 << 30, "offload_lag_ms": 0}
    shown = json.loads(scroll(cluster, "retention", "show", s, "--json").stdout)
    assert shown["tier"]["local_retention_ms"] == -2 and shown["retention"]["max_age_s"] == 604800
    # refusals: turning it off, a local limit above the total one, a bad duration
    for args, text in ((["--no-remote-storage"], "disabling remote storage is not supported"),
                       (["--local-retention", "8d"], "must not be more than retention.ms"),
                       (["--local-retention", "soon"], "not a duration")):
        r = scroll(cluster, "retention", "set", s, *args)
        assert r.returncode != 0 and text in r.stderr + r.stdout, (args, r.stderr)
    r = scroll(cluster, "stream", "create", f"{s}-c", "--remote-storage", "--local-retention", "-1",
               "--retention-max-age", "60")
    assert r.returncode != 0 and "must not be -1" in r.stderr + r.stdout
    # the total limits are checked against the local ones too
    r = scroll(cluster, "retention", "set", s, "--max-bytes", "1MiB")
    assert r.returncode != 0 and "local.retention.bytes" in r.stderr + r.stdout
    r = scroll(cluster, "retention", "set", s, "--max-age", "1d", "--max-bytes", "2GiB")
    assert r.returncode == 0, r.stderr


def test_topic_configs_and_describe(cluster):
    t = f"cli-tier-topic-{os.getpid()}"
    r = scroll(cluster, "topic", "create", t, "--partitions", "2", "--config", "remote.storage.enable=true",
               "--config", "retention.ms=86400000", "--config", "local.retention.ms=3600000")
    assert r.returncode == 0, r.stderr
    d = json.loads(scroll(cluster, "topic", "describe", t, "--json").stdout)
    assert d["stream_policy"]["tier"] == {"remote_storage_enable": True, "local_retention_ms": 3_600_000,
                                          "local_retention_bytes": -2, "offload_lag_ms": 0}
    assert "tier " in scroll(cluster, "topic", "describe", t).stdout
    r = scroll(cluster, "topic", "alter", t, "--config", "local.retention.bytes=1048576")
    assert r.returncode == 0, r.stderr
    d = json.loads(scroll(cluster, "topic", "describe", t, "--json").stdout)
    assert d["stream_policy"]["tier"]["local_retention_bytes"] == 1 << 20
    r = scroll(cluster, "topic", "alter", t, "--delete-config", "remote.storage.enable")
    assert r.returncode != 0 and "disabling remote storage" in r.stderr + r.stdout
    r = scroll(cluster, "topic", "create", f"{t}-c", "--config", "remote.storage.enable=true",
               "--config", "cleanup.policy=compact")
    assert r.returncode != 0 and "compacted" in r.stderr + r.stdout
