"""Log compaction's acceptance tests with real tools from PyPI, against a real Scroll listener:

- a Faust (faust-streaming) word count with a Table: its changelog topic is created compacted (by
  Faust, CreateTopics), the app is stopped, its local state deleted, and on restart the table is
  rebuilt from the changelog alone and goes on counting;
- the ``_schemas`` / Kafka Connect config-topic pattern with confluent-kafka: one compacted
  partition, keyed overwrites and tombstones read back into a map (and, once the compaction job
  exists, the same map after compaction, from fewer records at unchanged offsets);
- confluent-kafka, kafka-python and aiokafka admin clients creating, describing and altering
  compacted topics.

Faust runs in a venv of its own (``.venv-faust``, made by ``scripts/setup.sh`` from
``tests/kafka/faust_app/requirements.txt``): faust-streaming pins ``click<8.4``, below what ours
has, and it is a separate process anyway. ``SCROLL_FAUST_PYTHON`` names another interpreter.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
    ResourceType,
)

from streams.client import connect
from streams.tools import compaction
from streams.topics import partition_stream

from .conftest import kafka_python_admin

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
FAUST_APP = Path(__file__).resolve().parent / "faust_app" / "wordcount.py"
DYNAMIC_TOPIC = ConfigSource.DYNAMIC_TOPIC_CONFIG.value
DEFAULT = ConfigSource.DEFAULT_CONFIG.value


def until(pred, timeout_s: float, what: str, step_s: float = 0.1):
    """pred()'s first truthy value, polled until ``timeout_s``; else fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(step_s)


@pytest.fixture()
def admin(shim):
    return AdminClient({"bootstrap.servers": shim.bootstrap})


def error_name(fut) -> str:
    with pytest.raises(KafkaException) as ei:
        fut.result(timeout=20)
    return ei.value.args[0].name()


def describe(admin, topic: str) -> dict:
    res = ConfigResource(ResourceType.TOPIC, topic)
    return admin.describe_configs([res])[res].result(timeout=20)


class Reader:
    """A plain consumer of one partition from offset 0 that keeps every record it has seen."""

    def __init__(self, bootstrap: str, topic: str, **conf):
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": "real-tools-reader",
                           "enable.auto.commit": False, **conf})
        self.c.assign([TopicPartition(topic, 0, 0)])
        self.records: list[tuple[int, bytes | None, bytes | None]] = []

    def poll(self) -> None:
        for m in self.c.consume(100, 0.2):
            if m.error() is None:
                self.records.append((m.offset(), m.key(), m.value()))

    def wait(self, pred, timeout_s: float, what: str):
        def go():
            self.poll()
            return pred(self.records)
        return until(go, timeout_s, what, step_s=0)

    def close(self) -> None:
        self.c.close()


def read_all(bootstrap: str, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:
    """Every record of partition 0 from the start to the current end."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "real-tools-read-all", "enable.auto.commit": False})
    try:
        _, end = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=20)
        r = Reader.__new__(Reader)
        r.c, r.records = c, []
        c.assign([TopicPartition(topic, 0, 0)])
        # to the end by position, not by the last record's offset: a transaction's marker takes the last
        # offset of a partition, and no consumer is handed it
        r.wait(lambda recs: c.position([TopicPartition(topic, 0)])[0].offset >= end, 30, f"{topic} read to {end}")
        return r.records
    finally:
        c.close()


def as_map(records) -> dict:
    """Records folded as a config topic's reader does: a later value wins, a null value deletes."""
    out = {}
    for _, k, v in records:
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def produce(bootstrap: str, topic: str, records) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0})
    for k, v in records:
        p.produce(topic, key=k, value=v, partition=0)
    assert p.flush(30) == 0


# ------------------------------------------------------------------------------------------ Faust

def faust_python() -> str:
    py = os.environ.get("SCROLL_FAUST_PYTHON") or str(ROOT / ".venv-faust" / "bin" / "python")
    if not os.path.exists(py):
        pytest.fail(f"no Faust venv at {py}: scripts/setup.sh (make setup) makes .venv-faust")
    return py


class FaustApp:
    """tests/kafka/faust_app/wordcount.py as its own process (see that module for its settings)."""

    def __init__(self, tmp: Path, bootstrap: str, app_id: str, guarantee: str):
        self.tmp, self.datadir = tmp, tmp / f"{app_id}-data"
        self.env = {**os.environ, "FAUST_BROKER": bootstrap, "FAUST_APP_ID": app_id,
                    "FAUST_DATADIR": str(self.datadir), "FAUST_INPUT": f"{app_id}-words",
                    "FAUST_OUTPUT": f"{app_id}-counts", "FAUST_GUARANTEE": guarantee}
        self.env.pop("PYTHONPATH", None)
        self.p: subprocess.Popen | None = None
        self.runs = 0

    def start(self) -> None:
        self.runs += 1
        self.log = self.tmp / f"faust-{self.runs}.log"
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen([faust_python(), str(FAUST_APP), "worker", "-l", "info"], env=self.env,
                                      stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60) -> None:
        def ready():
            if self.p.poll() is not None:
                raise AssertionError(f"faust exited with {self.p.returncode}:\n{self.text()[-4000:]}")
            return "Worker ready" in self.text()
        try:
            until(ready, timeout_s, "the Faust worker to be ready", step_s=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.text()[-4000:]}") from None

    def stop(self, timeout_s: float = 30) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            raise AssertionError(f"faust did not stop in {timeout_s}s on SIGTERM:\n{self.text()[-4000:]}") from None


def dumps(records) -> list[dict]:
    return [json.loads(v) for _, k, v in records if k == b"?dump"]


def counts(records) -> dict[str, int]:
    return {k.decode(): int(v) for _, k, v in records if k != b"?dump"}


def test_faust_table_is_rebuilt_from_its_compacted_changelog(shim, admin, tmp_path):
    """A Faust Table (memory store, at_least_once) survives the loss of its local state: its changelog,
    created compacted by Faust itself, is all it needs.

    at_least_once, not exactly_once: Faust's exactly_once processes and commits through our
    transactions, but its table recovery is broken for it whatever the broker: it takes the changelog's
    high watermark from aiokafka's ``last_stable_offset``, unknown (None -> -1) before the first fetch, so
    it restores nothing; and a changelog written in transactions ends with a commit marker, an offset no
    consumer is handed, which an at_least_once recovery then waits for forever (faust-streaming #47)."""
    app = FaustApp(tmp_path, shim.bootstrap, f"wc{time.monotonic_ns() % 10**9}", "at_least_once")
    words, output = app.env["FAUST_INPUT"], app.env["FAUST_OUTPUT"]
    changelog = f"{app.env['FAUST_APP_ID']}-counts-changelog"
    admin.create_topics([NewTopic(words, 1, 1)])[words].result(timeout=20)
    out = None
    try:
        app.start()
        app.wait_ready()
        # Faust made its changelog with CreateTopics (v1+), cleanup.policy=compact
        cfg = describe(admin, changelog)
        assert (cfg["cleanup.policy"].value, cfg["cleanup.policy"].source) == ("compact", DYNAMIC_TOPIC)

        first = [b"a", b"b", b"a", b"c", b"a", b"b"]
        produce(shim.bootstrap, words, [(None, w) for w in first] + [(None, b"?dump")])
        out = Reader(shim.bootstrap, output)
        expected = {"a": 3, "b": 2, "c": 1}
        out.wait(lambda r: dumps(r) == [expected], 60, f"the table to hold {expected}")
        assert counts(out.records) == expected
        # the changelog, read plainly, folds to the same table
        logged = {json.loads(k): json.loads(v) for k, v in as_map(read_all(shim.bootstrap, changelog)).items()}
        assert logged == expected

        app.stop()
        assert app.datadir.exists()
        shutil.rmtree(app.datadir)  # local state lost (a memory store keeps none anyway: rebuilt at each start)
        app.start()
        app.wait_ready()
        assert "Restoring state from changelog topics" in app.text()
        produce(shim.bootstrap, words, [(None, b"?dump"), (None, b"a"), (None, b"d"), (None, b"?dump")])
        after = {"a": 4, "b": 2, "c": 1, "d": 1}
        out.wait(lambda r: len(dumps(r)) == 3, 60, "two more table dumps")
        assert dumps(out.records) == [expected, expected, after]
        assert counts(out.records) == after
    finally:
        app.stop()
        if out is not None:
            out.close()


def test_faust_exactly_once_counts_through_transactions(shim, admin, tmp_path):
    """Faust's exactly_once (transactional producer, offsets committed in the transaction): the
    counts come out, read_committed, and the compacted changelog holds them."""
    app = FaustApp(tmp_path, shim.bootstrap, f"eos{time.monotonic_ns() % 10**9}", "exactly_once")
    words, output = app.env["FAUST_INPUT"], app.env["FAUST_OUTPUT"]
    admin.create_topics([NewTopic(words, 1, 1)])[words].result(timeout=20)
    out = None
    try:
        app.start()
        app.wait_ready()
        assert "transactional producer" in app.text()
        produce(shim.bootstrap, words, [(None, w) for w in (b"x", b"y", b"x", b"?dump")])
        out = Reader(shim.bootstrap, output, **{"isolation.level": "read_committed"})
        out.wait(lambda r: dumps(r), 60, "the table dump")
        assert dumps(out.records) == [{"x": 2, "y": 1}] and counts(out.records) == {"x": 2, "y": 1}
        changelog = f"{app.env['FAUST_APP_ID']}-counts-changelog"
        assert describe(admin, changelog)["cleanup.policy"].value == "compact"
        logged = as_map(read_all(shim.bootstrap, changelog))
        assert {json.loads(k): json.loads(v) for k, v in logged.items()} == {"x": 2, "y": 1}
    finally:
        app.stop()
        if out is not None:
            out.close()


# --------------------------------------------------------------------- the config-topic pattern

def run_compaction(cluster, stream: str):
    async def go():
        client = await connect(cluster.metadata_url)
        try:
            return await compaction.run_compaction(client, stream=stream)
        finally:
            await client.close()

    return asyncio.run(go())


def test_schemas_topic_pattern_compact_overwrites_and_tombstones(admin, shim, kafka_cluster, topic):
    """A `_schemas` / Connect-configs style topic: one partition, compacted, keyed overwrites and
    tombstones; a reader from the beginning folds it into the expected map, before and after
    compaction."""
    configs = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.01", "segment.ms": "100",
               "delete.retention.ms": "100", "min.compaction.lag.ms": "0"}
    admin.create_topics([NewTopic(topic, 1, 1, config=configs)])[topic].result(timeout=20)
    cfg = describe(admin, topic)
    assert cfg["cleanup.policy"].value == "compact"
    for name, value in configs.items():
        assert (cfg[name].value, cfg[name].source) == (value, DYNAMIC_TOPIC), name

    def key(i):
        return f"schema-{i}".encode()

    records = []
    for round_ in range(4):  # every key written 4 times, each time a new value
        records += [(key(i), f"v{round_}-{i}".encode()) for i in range(10)]
    records += [(key(i), None) for i in (1, 3, 5)]  # tombstones
    records += [(key(3), b"back")]  # written again after its tombstone
    produce(shim.bootstrap, topic, records[:25])
    produce(shim.bootstrap, topic, records[25:])
    expected = {key(i): f"v3-{i}".encode() for i in range(10) if i not in (1, 5)} | {key(3): b"back"}
    before = read_all(shim.bootstrap, topic)
    assert [o for o, _, _ in before] == list(range(len(records)))
    assert as_map(before) == expected

    # segment.ms=100: the fragment holding these records rolls over at the next append after 100 ms;
    # the active (open) fragment is never compacted, as Kafka's active segment
    time.sleep(0.2)
    produce(shim.bootstrap, topic, [(b"roll", b"1")])
    expected[b"roll"] = b"1"
    by_offset = {o: (k, v) for o, k, v in read_all(shim.bootstrap, topic)}

    def compacted():
        run_compaction(kafka_cluster, partition_stream(topic, 0))
        after = read_all(shim.bootstrap, topic)
        return after if len(after) < len(by_offset) else None

    after = until(compacted, 60, "compaction to remove overwritten records", step_s=0.5)
    assert as_map(after) == expected
    for o, k, v in after:  # survivors keep their offsets (and their keys and values)
        assert by_offset[o] == (k, v), o
    latest = {k: o for o, (k, v) in by_offset.items()}
    assert {o for o, _, _ in after} >= {o for k, o in latest.items() if k in expected}


# ------------------------------------------------------------------------------ admin clients

def test_confluent_admin_creates_describes_and_alters_compacted_topics(admin, topic):
    a, b, c = f"{topic}-a", f"{topic}-b", f"{topic}-c"
    fs = admin.create_topics([
        NewTopic(a, 1, 1, config={"cleanup.policy": "compact"}),
        NewTopic(b, 2, 1, config={"cleanup.policy": "compact,delete", "min.compaction.lag.ms": "1000",
                                  "max.compaction.lag.ms": "60000", "min.cleanable.dirty.ratio": "0.1",
                                  "delete.retention.ms": "500", "segment.ms": "100", "retention.ms": "3600000"}),
        NewTopic(c, 1, 1)])
    for f in fs.values():
        f.result(timeout=20)

    cfg = describe(admin, a)
    assert (cfg["cleanup.policy"].value, cfg["cleanup.policy"].source) == ("compact", DYNAMIC_TOPIC)
    assert not cfg["cleanup.policy"].is_default
    # the other compaction settings: Kafka's defaults
    assert (cfg["min.compaction.lag.ms"].value, cfg["min.compaction.lag.ms"].source) == ("0", DEFAULT)
    assert (cfg["min.cleanable.dirty.ratio"].value, cfg["min.cleanable.dirty.ratio"].source) == ("0.5", DEFAULT)
    assert (cfg["delete.retention.ms"].value, cfg["delete.retention.ms"].source) == ("86400000", DEFAULT)
    assert (cfg["max.compaction.lag.ms"].value, cfg["max.compaction.lag.ms"].source) == (str(2**63 - 1), DEFAULT)

    cfg = describe(admin, b)
    for name, value in {"cleanup.policy": "compact,delete", "min.compaction.lag.ms": "1000",
                        "max.compaction.lag.ms": "60000", "min.cleanable.dirty.ratio": "0.1",
                        "delete.retention.ms": "500", "segment.ms": "100", "retention.ms": "3600000"}.items():
        assert (cfg[name].value, cfg[name].source) == (value, DYNAMIC_TOPIC), name

    cfg = describe(admin, c)
    assert (cfg["cleanup.policy"].value, cfg["cleanup.policy"].source) == ("delete", DEFAULT)
    assert cfg["cleanup.policy"].is_default

    # IncrementalAlterConfigs: delete -> compact, with a lag; then back to the default
    res = ConfigResource(ResourceType.TOPIC, c, incremental_configs=[
        ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("min.compaction.lag.ms", "2500", incremental_operation=AlterConfigOpType.SET)])
    admin.incremental_alter_configs([res])[res].result(timeout=20)
    cfg = describe(admin, c)
    assert (cfg["cleanup.policy"].value, cfg["cleanup.policy"].source) == ("compact", DYNAMIC_TOPIC)
    assert (cfg["min.compaction.lag.ms"].value, cfg["min.compaction.lag.ms"].source) == ("2500", DYNAMIC_TOPIC)
    res = ConfigResource(ResourceType.TOPIC, c, incremental_configs=[
        ConfigEntry("cleanup.policy", None, incremental_operation=AlterConfigOpType.DELETE)])
    admin.incremental_alter_configs([res])[res].result(timeout=20)
    cfg = describe(admin, c)
    assert (cfg["cleanup.policy"].value, cfg["cleanup.policy"].source) == ("delete", DEFAULT)
    assert cfg["min.compaction.lag.ms"].value == "2500"

    # AlterConfigs (the whole set replaced): a's policy becomes compact,delete, nothing else set
    res = ConfigResource(ResourceType.TOPIC, a, set_config={"cleanup.policy": "compact,delete",
                                                           "delete.retention.ms": "1000"})
    admin.alter_configs([res])[res].result(timeout=20)
    cfg = describe(admin, a)
    assert (cfg["cleanup.policy"].value, cfg["delete.retention.ms"].value) == ("compact,delete", "1000")
    assert cfg["cleanup.policy"].source == DYNAMIC_TOPIC

    # an unknown policy is INVALID_CONFIG everywhere, and changes nothing
    bad = f"{topic}-bad"
    assert error_name(admin.create_topics([NewTopic(bad, 1, 1, config={"cleanup.policy": "compacted"})])[bad]) \
        == "INVALID_CONFIG"
    assert bad not in admin.list_topics(timeout=10).topics
    res = ConfigResource(ResourceType.TOPIC, a, incremental_configs=[
        ConfigEntry("cleanup.policy", "shred", incremental_operation=AlterConfigOpType.SET)])
    assert error_name(admin.incremental_alter_configs([res])[res]) == "INVALID_CONFIG"
    res = ConfigResource(ResourceType.TOPIC, a, set_config={"cleanup.policy": "compact,shred"})
    assert error_name(admin.alter_configs([res])[res]) == "INVALID_CONFIG"
    assert describe(admin, a)["cleanup.policy"].value == "compact,delete"


def test_kafka_python_admin_creates_and_describes_a_compacted_topic(shim, topic):
    from kafka.admin import ConfigResource as KConfigResource
    from kafka.admin import ConfigResourceType
    from kafka.admin import NewTopic as KNewTopic
    from kafka.errors import InvalidConfigurationError

    admin = kafka_python_admin(shim.bootstrap, client_id="real-tools-kafka-python")
    try:
        admin.create_topics([KNewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact",
                                                                   "min.compaction.lag.ms": "100"})])
        described = admin.describe_configs([KConfigResource(ConfigResourceType.TOPIC, topic)])
        values = {k: (d["value"] if isinstance(d, dict) else d) for k, d in described["topic"][topic].items()}
        assert values["cleanup.policy"] == "compact" and values["min.compaction.lag.ms"] == "100", described
        with pytest.raises(InvalidConfigurationError):
            admin.create_topics([KNewTopic(f"{topic}-bad", 1, 1, topic_configs={"cleanup.policy": "squash"})])
    finally:
        admin.close()


def test_aiokafka_admin_creates_and_describes_a_compacted_topic(shim, topic):
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin import NewTopic as ANewTopic
    from aiokafka.admin.config_resource import ConfigResource as AConfigResource
    from aiokafka.admin.config_resource import ConfigResourceType as AType

    async def go():
        admin = AIOKafkaAdminClient(bootstrap_servers=shim.bootstrap)
        await admin.start()
        try:
            resp = await admin.create_topics([ANewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
            assert [tuple(t)[1] for t in resp.topic_errors] == [0]
            [resp] = await admin.describe_configs([AConfigResource(AType.TOPIC, topic)])
            [(err, _msg, _type, name, entries)] = [tuple(r)[:5] for r in resp.resources]
            assert (err, name) == (0, topic)
            return {e[0]: e[1] for e in entries}
        finally:
            await admin.close()

    values = asyncio.run(go())
    assert values["cleanup.policy"] == "compact"
    assert values["delete.retention.ms"] == "86400000"
