"""The scroll CLI against the real cluster, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process
SCROLL = [sys.executable, "-m", "streams.tools.cli"]


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
    # record offsets from 0 (a take-over's no-op takes none); each produce is one batch (one entry)
    out = run(cluster, "produce", stream_name, "--json", input=b"one\ntwo\n")
    assert json.loads(out.stdout) == {"stream": stream_name, "offsets": [0, 1]}
    out = run(cluster, "produce", stream_name, input=b"three\nfour\n")
    assert b"appended 2 records" in out.stderr and b"at offsets 2..3" in out.stderr
    assert run(cluster, "consume", stream_name).stdout == b"one\ntwo\nthree\nfour\n"
    recs = [json.loads(x) for x in run(cluster, "consume", stream_name, "--from", "2", "--json").stdout.splitlines()]
    assert [(r["offset"], r["partition"], r["value"]) for r in recs] == [(2, 0, "three"), (3, 0, "four")]
    assert run(cluster, "consume", stream_name, "--from", "4").stdout == b""  # the end: nothing yet
    past = run(cluster, "consume", stream_name, "--from", "9", check=False)  # past the end: said, as Kafka does
    assert past.returncode != 0 and b"offset 9 is past the end" in past.stderr
    assert b"next record will be at offset 4" in past.stderr
    # entries 0 (no-op), 1 (batch 0..1), 2 (no-op of the second take-over) | 3 (batch 2..3)
    frags = json.loads(run(cluster, "fragments", stream_name, "--json").stdout)
    assert frags["term"] == 2 and frags["status"] == "OPEN" and frags["end_offset"] == 4
    assert [(f["first_entry_id"], f["first_offset"]) for f in frags["fragments"]] == [(0, 0), (3, 2)]
    table = run(cluster, "fragments", stream_name).stdout.decode()
    assert "ensemble" in table and "(open)" in table and "first offset" in table
    live = json.loads(run(cluster, "bookies", "--json").stdout)
    assert len(live) == 4 and all(b["address"].startswith("127.0.0.1:") for b in live)
    described = json.loads(run(cluster, "stream", "describe", stream_name, "--json").stdout)
    assert described["end_offset"] == 4 and described["earliest_offset"] == 0 and described["records"] == 4
    assert described["config"]["write_quorum"] == 2


def test_produce_keys_and_headers_consume_as_json(cluster, stream_name):
    run(cluster, "stream", "create", stream_name)
    run(cluster, "produce", stream_name, "--key", "k1", "--header", "source=cli", "--header", "n=1", input=b"a\nb\n")
    recs = [json.loads(x) for x in run(cluster, "consume", stream_name, "--json").stdout.splitlines()]
    assert [(r["offset"], r["key"], r["value"], r["headers"]) for r in recs] == [
        (0, "k1", "a", {"source": "cli", "n": "1"}), (1, "k1", "b", {"source": "cli", "n": "1"})]
    assert all(r["timestamp_ms"] > 0 for r in recs)
    bad = run(cluster, "produce", stream_name, "--header", "novalue", input=b"x\n", check=False)
    assert bad.returncode == 2 and b"KEY=VALUE" in bad.stderr


def test_topic_create_list_describe_produce_by_key_consume_delete(cluster, stream_name):
    from streams.topics import partition_for

    t = stream_name.replace("_", "-")
    made = json.loads(run(cluster, "topic", "create", t, "--partitions", "3", "--config", "retention.ms=-1",
                          "--json").stdout)
    assert made["partitions"] == 3 and made["streams"] == [t, f"{t}:1", f"{t}:2"]
    assert made["configs"] == {"retention.ms": "-1"}
    again = run(cluster, "topic", "create", t, "--partitions", "2", check=False)
    assert again.returncode != 0 and b"already exists" in again.stderr
    run(cluster, "stream", "create", t + "-alone")
    listed = {x["name"]: x["partitions"] for x in json.loads(run(cluster, "topic", "list", "--json").stdout)}
    assert listed[t] == 3 and listed[t + "-alone"] == 1  # a stream created alone is a one-partition topic
    # by key: Kafka's default partitioner (murmur2), so Kafka clients put the key in the same partition
    k = partition_for(b"user-7", 3)
    out = json.loads(run(cluster, "produce", t, "--key", "user-7", "--json", input=b"a\nb\nc\n").stdout)
    assert out["partitions"] == [k, k, k] and out["offsets"] == [0, 1, 2]
    out = json.loads(run(cluster, "produce", t, "--key", "user-7", "--json", input=b"d\n").stdout)
    assert out["partitions"] == [k] and out["offsets"] == [3]
    other = (k + 1) % 3
    out = json.loads(run(cluster, "produce", t, "--partition", str(other), "--json", input=b"x\ny\n").stdout)
    assert out == {"stream": f"{t}:{other}" if other else t, "offsets": [0, 1]}
    recs = [json.loads(x) for x in run(cluster, "consume", t, "--partition", str(k), "--from", "1",
                                        "--json").stdout.splitlines()]
    assert [(r["partition"], r["offset"], r["value"], r["key"]) for r in recs] == [
        (k, 1, "b", "user-7"), (k, 2, "c", "user-7"), (k, 3, "d", "user-7")]
    every = sorted(run(cluster, "consume", t).stdout.splitlines())  # every partition
    assert every == [b"a", b"b", b"c", b"d", b"x", b"y"]
    need_p = run(cluster, "consume", t, "--from", "1", check=False)
    assert need_p.returncode == 2 and b"--partition" in need_p.stderr
    d = json.loads(run(cluster, "topic", "describe", t, "--json").stdout)
    ends = {p["partition"]: (p["earliest_offset"], p["end_offset"]) for p in d["partition_info"]}
    assert ends == {k: (0, 4), other: (0, 2), 3 - k - other: (0, 0)}
    human = run(cluster, "topic", "describe", t).stdout.decode()
    assert "partition" in human and f"{t}:1" in human
    run(cluster, "topic", "delete", t)
    gone = run(cluster, "topic", "describe", t, check=False)
    assert gone.returncode != 0 and b"no topic named" in gone.stderr
    assert not [s for s in json.loads(run(cluster, "stream", "list", "--json").stdout) if s["name"].startswith(t + ":")]


def test_clear_errors(cluster):
    p = run(cluster, "consume", "no-such-stream", check=False)
    assert p.returncode != 0 and b"no stream or topic named 'no-such-stream'" in p.stderr
    p = run(cluster, "consume", "no-such-stream", "--partition", "0", check=False)
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


def test_consume_follow_waits_for_records_written_later(cluster, stream_name):
    t = stream_name.replace("_", "-")
    run(cluster, "topic", "create", t, "--partitions", "2")
    env = dict(os.environ, SCROLL_METADATA=cluster.metadata_url)
    one = None
    follower = subprocess.Popen([*SCROLL, "consume", t, "--follow", "--max", "3", "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
    try:
        # past the end with --follow: waits for the offset instead of failing
        one = subprocess.Popen([*SCROLL, "consume", t, "--partition", "1", "--from", "1", "--follow", "--max", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        run(cluster, "produce", t, "--partition", "1", input=b"p1-a\np1-b\n")
        run(cluster, "produce", t, "--partition", "0", input=b"p0-a\n")
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err.decode()
        got = sorted((r["partition"], r["offset"], r["value"]) for r in map(json.loads, out.splitlines()))
        assert got == [(0, 0, "p0-a"), (1, 0, "p1-a"), (1, 1, "p1-b")]
        out, err = one.communicate(timeout=60)
        assert one.returncode == 0 and out == b"p1-b\n", err.decode()
    finally:
        for p in (follower, one):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_a_stream_command_does_not_load_the_servers():
    """``scroll stream ...`` starts without importing the bookie server or the Kafka listener (their
    commands load when named), and every command is still listed and runs its own --help."""
    probe = (
        "import sys\n"
        "from streams.tools.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('bookie.server', 'bookie.storage', 'compat_kafka', 'spark_stream', 'grpc.aio')\n"
        "print(sorted({m.split('.')[0] + '.' + m.split('.')[1] if '.' in m else m\n"
        "              for m in sys.modules if m.startswith(heavy)}))\n"
    )

    def loaded(*args: str) -> tuple[str, list[str]]:
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
        *text, mods = out.stdout.strip().splitlines()
        return "\n".join(text), eval(mods)  # noqa: S307 - our own probe's repr of a list of names

    text, mods = loaded("stream", "--help")
    assert "create" in text and mods == [], mods
    text, mods = loaded("--help")
    for name in ("bookie", "kafka", "standalone", "stream", "topic", "consume"):
        assert f"  {name} " in text, text
    text, mods = loaded("kafka", "--help")
    assert "--port" in text or "PORT" in text, text
    assert any(m.startswith("compat_kafka") for m in mods), mods
    text, mods = loaded("bookie", "decommission", "--help")
    assert "BOOKIE_ID" in text and "bookie.server" in mods, (text, mods)
