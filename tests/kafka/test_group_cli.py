"""The operators' view of consumer groups: the real ``scroll kafka groups`` command (subprocesses)
against the test listener with real confluent-kafka groups (members, assignments, committed offsets,
log end, lag; resets refused while the group is active, dry run, execute, earliest, an offset
clamped to the log, a time; delete), a KIP-848 group described through the same client, and the
group lag as Prometheus metrics of a ``scroll kafka --metrics-port`` process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from compat_kafka.cli.main import kafka_command
from compat_kafka.groups.group_admin import KafkaAdmin
from streams.tools.localcluster import free_port

from .shimproc import ShimProcess
from .test_groups import assignment, consumer, coordinator, create_topic, poll_until, produce

pytestmark = pytest.mark.process


def scroll(*args: str, check: bool = True, process: bool = False) -> subprocess.CompletedProcess:
    """``scroll kafka groups ARGS``: the real command in a subprocess (``process``), else the same
    click command in this process (1.3 s less per call)."""
    if process:
        r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "groups", *args], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    else:
        res = CliRunner().invoke(kafka_command, ["groups", *args], catch_exceptions=False)
        r = subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)
    if check and r.returncode != 0:
        raise AssertionError(f"scroll kafka groups {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def committed(bootstrap: str, group: str) -> dict[tuple[str, int], int]:
    async def main():
        async with KafkaAdmin(bootstrap) as a:
            return await a.committed(group)
    return asyncio.run(main())


def test_groups_list_describe_reset_and_delete_like_kafka_consumer_groups(shim, topic):
    b = shim.bootstrap
    create_topic(b, topic, 2)
    p = Producer({"bootstrap.servers": b, "linger.ms": 0})
    t0 = 1_700_000_000_000
    for i in range(15):  # one batch per record, with known timestamps: p0 and p1 get 15 each
        for part in (0, 1):
            p.produce(topic, value=f"v{i}".encode(), partition=part, timestamp=t0 + i * 1000)
        p.flush(10)
    group = f"g-{topic}"
    c = consumer(b, group, **{"client.id": "cli-member"})
    try:
        c.subscribe([topic])
        poll_until([c], lambda: len(assignment(c)) == 2)
        c.commit(offsets=[TopicPartition(topic, 0, 10), TopicPartition(topic, 1, 5)], asynchronous=False)

        listed = json.loads(scroll("list", "--bootstrap", b, "--json", process=True).stdout)
        mine = next(g for g in listed if g["group"] == group)
        assert (mine["type"], mine["state"], mine["protocol_type"]) == ("classic", "Stable", "consumer")

        [d] = json.loads(scroll("describe", group, "--bootstrap", b, "--json", process=True).stdout)
        assert d["state"] == "Stable" and [m["client_id"] for m in d["members"]] == ["cli-member"]
        rows = {r["partition"]: r for r in d["partitions"]}
        assert [(rows[i]["committed"], rows[i]["log_end"], rows[i]["lag"], rows[i]["client_id"]) for i in (0, 1)] \
            == [(10, 15, 5, "cli-member"), (5, 15, 10, "cli-member")]
        assert d["lag"] == 15 and {rows[i]["host"] for i in (0, 1)} == {"/127.0.0.1"}
        table = scroll("describe", group, "--bootstrap", b).stdout
        assert "LOG-END-OFFSET" in table and "total lag 15" in table

        refused = scroll("reset-offsets", group, "--bootstrap", b, "--topic", topic, "--to-earliest", "--execute",
                         check=False, process=True)
        assert refused.returncode == 1
        assert f"Assignments can only be reset if the group '{group}' is inactive" in refused.stderr
    finally:
        c.close()

    dry = json.loads(scroll("reset-offsets", group, "--bootstrap", b, "--topic", topic, "--to-earliest",
                            "--json").stdout)
    assert not dry["executed"] and [r["new_offset"] for r in dry["offsets"]] == [0, 0]
    assert committed(b, group) == {(topic, 0): 10, (topic, 1): 5}  # a dry run commits nothing

    scroll("reset-offsets", group, "--bootstrap", b, "--topic", f"{topic}:1", "--to-offset", "100", "--execute",
           process=True)
    assert committed(b, group) == {(topic, 0): 10, (topic, 1): 15}  # clamped to the log end
    scroll("reset-offsets", group, "--bootstrap", b, "--all-topics", "--to-datetime",
           "2023-11-14T22:13:24Z", "--execute")  # t0 + 4 s
    assert committed(b, group) == {(topic, 0): 4, (topic, 1): 4}
    out = scroll("reset-offsets", group, "--bootstrap", b, "--all-topics", "--shift-by", "-10").stdout
    assert out.split()[-4:] == [group, topic, "1", "0"]  # clamped to the log start
    scroll("reset-offsets", group, "--bootstrap", b, "--all-topics", "--by-duration", "PT1H", "--execute")
    assert committed(b, group) == {(topic, 0): 15, (topic, 1): 15}  # nothing that recent: the log end
    gone = json.loads(scroll("delete-offsets", group, "--bootstrap", b, "--topic", f"{topic}:0", "--json").stdout)
    assert gone == [{"topic": topic, "partition": 0, "error": None}]
    assert committed(b, group) == {(topic, 1): 15}
    usage = scroll("reset-offsets", group, "--bootstrap", b, "--all-topics", "--to-earliest", "--to-offset", "3",
                   check=False)
    assert usage.returncode == 2 and "exactly one of" in usage.stderr

    assert "Deleted consumer group" in scroll("delete", group, "--bootstrap", b).stdout
    again = scroll("delete", group, "--bootstrap", b, check=False)
    assert again.returncode == 1 and "does not exist" in again.stdout
    bad = scroll("describe", group, "--bootstrap", b, check=False)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_a_consumer_protocol_group_is_described_with_members_and_lag(shim, topic):
    b = shim.bootstrap
    create_topic(b, topic, 2)
    produce(b, topic, 20, 2)
    group = f"g-{topic}"
    c = Consumer({"bootstrap.servers": b, "group.id": group, "group.protocol": "consumer", "client.id": "new-member",
                  "enable.auto.commit": False})
    try:
        c.subscribe([topic])
        poll_until([c], lambda: len(assignment(c)) == 2)
        c.commit(offsets=[TopicPartition(topic, 0, 3), TopicPartition(topic, 1, 10)], asynchronous=False)

        async def main():
            async with KafkaAdmin(b) as a:
                return await a.describe(group), await a.list_groups()

        view, listed = asyncio.run(main())
        assert (view.group_type, view.state, view.assignor) == ("consumer", "Stable", "uniform")
        assert [(m.client_id, m.host) for m in view.members] == [("new-member", "/127.0.0.1")]
        assert [(r.partition, r.committed, r.log_end, r.lag) for r in view.partitions] == [(0, 3, 10, 7), (1, 10, 10, 0)]
        assert {(g.group, g.group_type) for g in listed} >= {(group, "consumer")}
    finally:
        c.close()


def test_listener_serves_group_lag_as_prometheus_metrics(kafka_cluster, shim, tmp_path, topic):
    create_topic(shim.bootstrap, topic, 2)
    produce(shim.bootstrap, topic, 12, 2)
    mport = free_port()
    proc = ShimProcess(kafka_cluster.metadata_url, tmp_path, "--metrics-port", str(mport)).start_and_wait()
    try:
        admin = AdminClient({"bootstrap.servers": proc.bootstrap})
        node = proc.node_id()
        deadline = time.monotonic() + 15
        while not any(b.port == proc.port for b in admin.list_topics(timeout=10).brokers.values()):
            assert time.monotonic() < deadline, "the new listener is not listed"
        group = next(g for g in (f"m{i}-{topic}" for i in range(64)) if coordinator(admin, g) == node)
        c = consumer(proc.bootstrap, group)
        c.assign([TopicPartition(topic, 0, 0), TopicPartition(topic, 1, 0)])
        c.commit(offsets=[TopicPartition(topic, 0, 2), TopicPartition(topic, 1, 6)], asynchronous=False)
        c.close()
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=20).read().decode()
        assert f'scroll_kafka_group_lag{{group="{group}",partition="0",topic="{topic}"}} 4.0' in text
        assert f'scroll_kafka_group_lag{{group="{group}",partition="1",topic="{topic}"}} 0.0' in text
        assert f'scroll_kafka_group_lag_sum{{group="{group}"}} 4.0' in text
        assert f'scroll_kafka_group_committed_offset{{group="{group}",partition="1",topic="{topic}"}} 6.0' in text
        assert "scroll_kafka_group_scrape_errors_total 0.0" in text
    finally:
        proc.stop()
