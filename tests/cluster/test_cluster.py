"""Scroll as a multi-host deployment, hosts being network namespaces (see topology.py).

3 etcd members (one per rack), 5 bookies on 5 hosts in 3 racks, 2 Kafka listeners on 2 hosts, a
client host. While a Python producer, an idempotent Kafka producer and a two-member Kafka consumer
group run on the client host:

1. a host holding a bookie and an etcd member is partitioned away (its link down), then healed;
2. an etcd member is SIGKILLed, then restarted on its data;
3. a Kafka listener's process is SIGKILLed;
4. a third listener joins, and partitions move onto it.

After each fault the test waits until every producer has made progress again (new acknowledgements
counted, no sleeps). Afterwards: every acknowledged record is read exactly once and in order per
partition, through the streams API and through a Kafka consumer; records that were not
acknowledged appear at most once; the group's last acknowledged commits are what the listeners
return; every fragment spans three racks; ``scroll check --fix`` leaves nothing under its write
quorum. The Spark test then runs examples/pipeline.py on a standalone cluster (a master and two
workers on their own hosts, the driver on the client host) and checks its totals.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from .topology import ScrollCluster, have_netns

pytestmark = [pytest.mark.cluster, pytest.mark.process]

WHY_NOT = have_netns()
TOPIC, STREAM, PARTITIONS = "events", "orders", 6
CONSUMERS = ("kconsume-1", "kconsume-2")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if WHY_NOT:
        pytest.skip(f"network namespaces unavailable: {WHY_NOT}")
    c = ScrollCluster(tmp_path_factory.mktemp("cluster"), prefix=f"sct{os.getpid() % 10000}", spark_workers=2)
    try:
        t0 = time.monotonic()
        c.start()
        log(f"topology up in {time.monotonic() - t0:.1f} s: etcd {c.metadata_url}, kafka {c.bootstrap()}")
        yield c
    finally:
        c.stop()


class Workloads:
    def __init__(self, c: ScrollCluster, out: Path):
        self.c, self.out = c, out
        out.mkdir(parents=True, exist_ok=True)

    def start(self, what: str, name: str, *args: str):
        cmd = [self.c.python, "-m", "tests.cluster.workloads", what, "--out", str(self.out), "--name", name, *args]
        return self.c.spawn(name, "c1", cmd)

    def acked(self, name: str) -> list[str]:
        try:
            return (self.out / f"{name}.acked").read_text().splitlines()
        except FileNotFoundError:
            return []

    def failed(self, name: str) -> set[int]:
        try:
            return {int(line.split()[0]) for line in (self.out / f"{name}.failed").read_text().splitlines()}
        except FileNotFoundError:
            return set()

    def counts(self, name: str) -> Counter:
        """Acknowledgements so far, per partition for the producers (per member for the group)."""
        lines = self.acked(name)
        if name == "kproduce":
            return Counter(line.split()[1] for line in lines)
        return Counter({name: len(lines)})

    def wait_progress(self, names: tuple[str, ...], n: int, what: str, timeout_s: float = 120.0) -> None:
        """Wait until each of ``names`` has ``n`` more acknowledgements than now - the Kafka
        producer ``n / PARTITIONS`` more on every partition, so that none is left stalled."""
        base = {name: self.counts(name) for name in names}
        t0 = time.monotonic()
        while True:
            got = {}
            for name in names:
                now = self.counts(name)
                keys = [str(p) for p in range(PARTITIONS)] if name == "kproduce" else [name]
                got[name] = min(now[k] - base[name][k] for k in keys) * (PARTITIONS if name == "kproduce" else 1)
            if all(v >= n for v in got.values()):
                log(f"{what}: progress {got} in {time.monotonic() - t0:.1f} s")
                return
            for name in names:
                p = self.c.procs[name]
                assert p.alive, f"{name} exited: {p.output()[-3000:]}"
            assert time.monotonic() - t0 < timeout_s, f"{what}: no progress in {timeout_s} s: {got}"
            time.sleep(0.1)


def _check_exactly_once(name: str, acked: set[int], maybe: set[int], read: list[tuple[int, str]], prefix: str):
    seqs = [int(v.removeprefix(prefix)) for _, v in read]
    offsets = [o for o, _ in read]
    dup = [s for s, k in Counter(seqs).items() if k > 1]
    assert not dup, f"{name}: records read twice: {dup[:20]}"
    missing = sorted(acked - set(seqs))
    assert not missing, f"{name}: acknowledged records missing: {missing[:20]} (of {len(missing)})"
    extra = sorted(set(seqs) - acked - maybe)
    assert not extra, f"{name}: records nobody wrote: {extra[:20]}"
    assert seqs == sorted(seqs), f"{name}: out of order"
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets), f"{name}: offsets not increasing"


def test_faults_lose_nothing_and_duplicate_nothing(cluster: ScrollCluster, tmp_path):
    c = cluster
    w = Workloads(c, tmp_path / "work")
    c.scroll("topic", "create", TOPIC, "--partitions", str(PARTITIONS))
    w.start("pyproduce", "pyproduce", "--metadata", c.metadata_url, "--stream", STREAM, "--rate", "150")
    w.start("kproduce", "kproduce", "--bootstrap", c.bootstrap(), "--topic", TOPIC,
            "--partitions", str(PARTITIONS), "--rate", "150")
    for name in CONSUMERS:
        w.start("kconsume", name, "--bootstrap", c.bootstrap(), "--topic", TOPIC, "--group", "g1")
    producers = ("pyproduce", "kproduce")
    w.wait_progress(producers, 100, "start")
    w.wait_progress(CONSUMERS, 2, "group commits")

    # b3 holds a bookie and an etcd member: the bookie's registration lapses and writers replace it,
    # etcd goes on with two members; after healing, the member catches up and the bookie registers again
    log("partition host b3 (a bookie and an etcd member) away")
    c.net.cut("b3")
    t0, first = time.monotonic(), None
    while True:  # every writer that had bookie-b3 in its open fragment replaces it (ensemble change)
        last = json.loads(c.run("c1", [c.python, "-m", "tests.cluster.workloads", "ensembles", "--metadata",
                                       c.metadata_url, "--stream", STREAM, "--topic", TOPIC,
                                       "--partitions", str(PARTITIONS)]).stdout)
        first = first or last
        if not any("bookie-b3" in ens for ens in last.values()):
            break
        for name in producers:
            assert c.procs[name].alive, c.procs[name].output()[-3000:]
        assert time.monotonic() - t0 < 120, f"writers still on bookie-b3: {last}"
        time.sleep(0.5)
    log(f"b3 cut off: after {time.monotonic() - t0:.1f} s no open fragment is on bookie-b3 "
        f"({sum('bookie-b3' in e for e in first.values())} of {len(first)} were)")
    w.wait_progress(producers, 300, "b3 cut off")
    c.net.heal("b3")
    w.wait_progress(producers, 100, "b3 healed")
    c.wait_etcd_healthy()
    c.wait_bookies(len(c.bookie_hosts))

    victim = c.etcd_hosts[0]
    log(f"SIGKILL etcd member on {victim}")
    c.procs[f"etcd-{victim}"].signal(signal.SIGKILL)
    c.procs[f"etcd-{victim}"].popen.wait(10)
    w.wait_progress(producers, 600, f"etcd-{victim} dead")
    c.restart_etcd(victim)
    w.wait_progress(producers, 100, f"etcd-{victim} back")

    log("SIGKILL the Kafka listener on k1")
    c.procs["listener-k1"].signal(signal.SIGKILL)
    c.procs["listener-k1"].popen.wait(10)
    w.wait_progress(producers, 150, "listener k1 dead")

    log("a third listener joins on k3")
    c.add_listener(3)
    t0 = time.monotonic()
    while True:
        leaders = json.loads(c.run("c1", [c.python, "-m", "tests.cluster.workloads", "leaders", "--bootstrap",
                                          c.bootstrap().replace(c.ip("k1"), c.ip("k3")), "--topic", TOPIC]).stdout)
        if 3 in leaders.values():
            break
        assert time.monotonic() - t0 < 90, f"no partition moved onto the joining listener: {leaders}"
        time.sleep(0.5)
    log(f"partitions led by k3 after {time.monotonic() - t0:.1f} s: {leaders}")
    w.wait_progress(producers, 150, "after k3 joined")
    w.wait_progress(CONSUMERS, 2, "group commits at the end")

    (w.out / "stop").touch()
    for name in (*producers, *CONSUMERS):
        p = c.procs[name]
        rc = p.popen.wait(180)
        assert rc == 0, f"{name} exited {rc}: {p.output()[-3000:]}"

    bootstrap = c.bootstrap().replace(c.ip("k1"), c.ip("k3"))  # k1 is dead
    got = json.loads(c.run("c1", [c.python, "-m", "tests.cluster.workloads", "verify", "--metadata", c.metadata_url,
                                  "--bootstrap", bootstrap, "--stream", STREAM, "--topic", TOPIC,
                                  "--partitions", str(PARTITIONS)], timeout_s=300).stdout)
    # the Python producer's stream, through both readers
    acked = {int(line.split()[0]) for line in w.acked("pyproduce")}
    for via in ("streams", "kafka"):
        _check_exactly_once(f"{STREAM} via {via}", acked, w.failed("pyproduce"),
                            [tuple(r) for r in got[via][f"{STREAM}/0"]], "py-")
    assert got["streams"][f"{STREAM}/0"] == got["kafka"][f"{STREAM}/0"]
    # the idempotent Kafka producer's topic, per partition, through both readers
    kacked = [line.split() for line in w.acked("kproduce")]
    kmaybe = w.failed("kproduce")
    for p in range(PARTITIONS):
        part_acked = {int(s) for s, part, _ in kacked if int(part) == p}
        assert part_acked, f"partition {p} got nothing"
        for via in ("streams", "kafka"):
            _check_exactly_once(f"{TOPIC}/{p} via {via}", part_acked, kmaybe,
                                [tuple(r) for r in got[via][f"{TOPIC}/{p}"]], "k-")
        assert got["streams"][f"{TOPIC}/{p}"] == got["kafka"][f"{TOPIC}/{p}"]
        assert {int(s): int(o) for s, part, o in kacked if int(part) == p} == \
            {int(v.removeprefix("k-")): o for o, v in got["kafka"][f"{TOPIC}/{p}"] if int(v.removeprefix("k-")) in part_acked}
    log(f"verified {len(acked)} + {len(kacked)} acknowledged records "
        f"({len(w.failed('pyproduce'))} + {len(kmaybe)} unacknowledged)")

    # the group's acknowledged commits are what the listeners hold
    last: dict[int, int] = {}
    for name in CONSUMERS:
        for line in w.acked(name):
            for p, o in json.loads(line).items():
                last[int(p)] = max(last.get(int(p), -1), o)
    assert last, "the group committed nothing"
    desc = json.loads(c.run("c1", [c.python, "-m", "streams.tools.cli", "kafka", "groups", "describe", "g1",
                                   "--bootstrap-server", bootstrap, "--json"]).stdout)
    committed = {int(r["partition"]): r["committed"] for v in desc for r in v["partitions"] if r["topic"] == TOPIC}
    for p, o in last.items():
        assert committed.get(p) == o, f"group g1 partition {p}: committed {committed.get(p)}, last acknowledged {o}"

    moved = sum(1 for ens in got["ensembles"].values() for a, b in zip(ens, ens[1:], strict=False)
                if "bookie-b3" in a and "bookie-b3" not in b)
    log(f"{sum(map(len, got['ensembles'].values()))} fragments; {moved} ensemble changes away from bookie-b3")
    # rack-aware placement: every fragment's ensemble spans three racks
    for stream, ensembles in got["ensembles"].items():
        for ens in ensembles:
            assert len({got["racks"].get(b, b) for b in ens}) == min(3, len(ens)), (stream, ens, got["racks"])

    # nothing left under its write quorum
    fixed = json.loads(c.scroll("check", "--fix", "--json", check=False, timeout_s=300).stdout)
    log(f"scroll check --fix: {len(fixed['fragments'])} fragments acted on")
    after = json.loads(c.scroll("check", "--json", timeout_s=300).stdout)
    assert after["ok"] and not after["fragments"], after



def test_spark_pipeline_on_the_standalone_cluster(cluster: ScrollCluster, tmp_path):
    """examples/pipeline.py, the driver on the client host, executors on the two worker hosts: its
    output equals the input's totals per window and account, each window written once."""
    c = cluster
    t0 = time.monotonic()
    c.start_spark()
    log(f"Spark master {c.spark_master()} and {c.spark_workers} workers up in {time.monotonic() - t0:.1f} s")
    ip = c.ip("c1")
    out = tmp_path / "pipeline"
    env = c.env(PYSPARK_PYTHON=c.python, SPARK_LOCAL_IP=ip)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    t0 = time.monotonic()
    r = c.run("c1", [c.python, "examples/pipeline.py", "--demo", "--master", c.spark_master(),
                     "--metadata", c.metadata_url, "--out", str(out), "--source", "spark-events", "--sink", "spark-totals",
                     "--conf", f"spark.driver.host={ip}", "--conf", f"spark.driver.bindAddress={ip}",
                     "--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1",
                     "--conf", "spark.cores.max=2", "--conf", "spark.python.authenticate.socketTimeout=120s"],
              timeout_s=400, env=env, check=False)
    (tmp_path / "driver.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:  # the first causes, not the end of a JVM stack trace
        causes = [line for line in (r.stdout + r.stderr).splitlines()
                  if any(m in line for m in ("Error", "Exception", "Caused by", "Traceback", "WARN", "ERROR"))
                  and not line.lstrip().startswith("at ")]
        pytest.fail(f"pipeline exited {r.returncode}; driver log {tmp_path / 'driver.log'}; worker logs in "
                    f"{c.base / 'logs'}:\n" + "\n".join(causes[:40]) + "\n...\n" + r.stderr[-2000:])
    log(f"pipeline ran in {time.monotonic() - t0:.1f} s")
    totals = json.loads(c.run("c1", [c.python, "-m", "tests.cluster.workloads", "spark-totals", "--metadata",
                                     c.metadata_url, "--stream", "spark-events", "--topic", "spark-totals"]).stdout)
    assert totals["input_events"] == 600
    assert totals["got"] == totals["want"]  # every window once, with the input's count and sum
    import pyarrow.parquet as pq

    rows = pq.read_table(out / "totals").to_pylist()
    assert sorted((r["account"], r["events"], r["total"]) for r in rows) == \
        sorted((k.split("/")[1], n, s) for k, [[n, s]] in totals["want"].items())
    # it ran on the standalone executors, not in a local driver
    apps = [a for a in c.spark_state().get("completedapps", []) if a.get("name") == "scroll-pipeline"]
    assert len(apps) == 1, apps
    ran = [d for n in range(1, c.spark_workers + 1) for d in (c.base / f"s{n}" / "work").glob("app-*/*")]
    assert ran and {d.parent.name for d in ran} == {apps[0]["id"]}, ran
