"""``scroll console``'s options: bad ones are refused with a clear message before anything starts."""

from __future__ import annotations

from click.testing import CliRunner

from compat_kafka.console.cli import console_command


def refused(*args: str) -> str:
    r = CliRunner().invoke(console_command, ["--metadata", "etcd://127.0.0.1:1", *args])
    assert r.exit_code == 2, r.output
    return r.output


def test_without_secure_only_loopback_is_served():
    assert "without --secure the console serves loopback only, not 0.0.0.0" in refused("--host", "0.0.0.0")


def test_secure_needs_a_certificate_and_metrics_sources_are_checked():
    assert "--secure needs --ssl-cert and --ssl-key" in refused("--secure")
    assert "NAME=http://host:port/metrics" in refused("--metrics", "bookie-0")
