"""The scroll CLI against the real cluster, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.cli"]


def run(cluster, *args, input: bytes | None = None, check=True):
    env = dict(os.environ, SCROLL_METADATA=cluster.metadata_url)
    p = subprocess.run([*SCROLL, *args], input=input, capture_output=True, env=env, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"scroll {' '.join(args)} failed ({p.returncode}): {p.stderr.decode()}")
    # every call, channel and task is closed cleanly: nothing reported at exit
    for noise in (b"Task was destroyed", b"Traceback", b"was never awaited"):
        assert noise not in p.stderr, f"scroll {' '.join(args)} printed {p.stderr.decode()}"
    return p


def test_stream_produce_consume_fragments_bookies(cluster, stream_name):
    run(cluster, "stream", "create", stream_name, "-e", "3", "-w", "2", "-a", "2", "--fragment-entries", "3")
    listed = json.loads(run(cluster, "stream", "list", "--json").stdout)
    assert stream_name in [s["name"] for s in listed]
    run(cluster, "stream", "create", stream_name + "-x")
    for _ in range(3):  # the stray-task report at exit ("Task was destroyed") was intermittent
        run(cluster, "produce", stream_name + "-x", input=b"x\n")
    out = run(cluster, "produce", stream_name, "--json", input=b"one\ntwo\nthree\nfour\n")
    assert json.loads(out.stdout)["positions"] == [1, 2, 3, 4]
    assert run(cluster, "consume", stream_name).stdout == b"one\ntwo\nthree\nfour\n"
    recs = [json.loads(x) for x in run(cluster, "consume", stream_name, "--from", "3", "--json").stdout.splitlines()]
    assert [(r["position"], r["value"]) for r in recs] == [(3, "three"), (4, "four")]
    assert run(cluster, "consume", stream_name, "--from", "5").stdout == b""  # the end: nothing yet
    past = run(cluster, "consume", stream_name, "--from", "9", check=False)  # past the end: said, as Kafka does
    assert past.returncode != 0 and b"position 9 is past the end" in past.stderr and b"next record will be at 5" in past.stderr
    frags = json.loads(run(cluster, "fragments", stream_name, "--json").stdout)
    assert frags["term"] == 1 and frags["status"] == "OPEN" and len(frags["fragments"]) >= 2
    table = run(cluster, "fragments", stream_name).stdout.decode()
    assert "ensemble" in table and "(open)" in table
    live = json.loads(run(cluster, "bookies", "--json").stdout)
    assert len(live) == 4 and all(b["address"].startswith("127.0.0.1:") for b in live)
    described = json.loads(run(cluster, "stream", "describe", stream_name, "--json").stdout)
    assert described["end_position"] == 5 and described["config"]["write_quorum"] == 2


def test_clear_errors(cluster):
    p = run(cluster, "consume", "no-such-stream", check=False)
    assert p.returncode != 0 and b"no stream named 'no-such-stream'" in p.stderr
    p = run(cluster, "stream", "create", "bad-quorum", "-e", "2", "-w", "3", check=False)
    assert p.returncode != 0 and b"write_quorum" in p.stderr
    env = dict(os.environ, SCROLL_METADATA="etcd://127.0.0.1:1")
    p = subprocess.run([*SCROLL, "stream", "list"], capture_output=True, env=env, timeout=60)
    assert p.returncode != 0 and b"127.0.0.1:1" in p.stderr and b"Traceback" not in p.stderr


def test_consume_reads_a_stream_longer_than_one_batch(cluster, stream_name):
    run(cluster, "stream", "create", stream_name)
    lines = b"".join(b"line-%d\n" % i for i in range(1300))
    run(cluster, "produce", stream_name, input=lines)
    assert run(cluster, "consume", stream_name).stdout == lines
    assert run(cluster, "consume", stream_name, "--max", "700").stdout.count(b"\n") == 700
