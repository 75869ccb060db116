"""The cluster test's clients, each run as a process on the client host (``ip netns exec``).

    python -m tests.cluster.workloads pyproduce  --metadata URL --stream S --out DIR --rate N
    python -m tests.cluster.workloads kproduce   --bootstrap B --topic T --partitions P --out DIR --rate N
    python -m tests.cluster.workloads kconsume   --bootstrap B --topic T --group G --out DIR --name NAME
    python -m tests.cluster.workloads verify     --metadata URL --bootstrap B --stream S --topic T --partitions P

Producers run until ``DIR/stop`` exists and write one line per acknowledged record to
``DIR/<name>.acked`` as it is acknowledged (``seq partition offset``), and the records that were
not (an error, or unknown outcome) to ``DIR/<name>.failed``, so the test can tell "acknowledged"
(must be read exactly once) from "maybe" (at most once). Every line is flushed at once: the test
watches the counts to wait for progress after each fault. ``verify`` reads everything back through
the streams API and through a Kafka consumer and prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections import deque
from pathlib import Path

log = logging.getLogger("workload")


class Ledger:
    """Append-only acknowledgement files, flushed per line."""

    def __init__(self, out: Path, name: str):
        out.mkdir(parents=True, exist_ok=True)
        self.acked = open(out / f"{name}.acked", "a", buffering=1)
        self.failed = open(out / f"{name}.failed", "a", buffering=1)
        self.stop_file = out / "stop"

    def stopped(self) -> bool:
        return self.stop_file.exists()


class Pacer:
    def __init__(self, rate: float):
        self.interval = 1.0 / rate
        self.next = time.monotonic()

    def delay(self) -> float:
        self.next += self.interval
        return max(0.0, self.next - time.monotonic())


# ------------------------------------------------------------------------------ Python producer
async def pyproduce(args) -> None:
    from streams.client import connect
    from streams.errors import StreamExists

    book = Ledger(Path(args.out), args.name)
    client = await connect(args.metadata)
    try:
        try:
            await client.create_stream(args.stream)
        except StreamExists:
            pass
        seq = 0
        pacer = Pacer(args.rate)
        while not book.stopped():
            try:
                producer = await client.producer(args.stream)
            except Exception as e:  # noqa: BLE001 - the cluster is under faults: retry
                log.warning("opening the producer: %r", e)
                await asyncio.sleep(0.5)
                continue
            pending: deque = deque()
            try:
                while not book.stopped():
                    fut = await producer.append_future(f"py-{seq}".encode())
                    pending.append((seq, fut))
                    seq += 1
                    while pending and pending[0][1].done():
                        s, f = pending.popleft()
                        book.acked.write(f"{s} 0 {f.result()}\n")
                    await asyncio.sleep(pacer.delay())
                while pending:
                    s, f = pending[0]
                    book.acked.write(f"{s} 0 {await f}\n")
                    pending.popleft()
            except Exception as e:  # noqa: BLE001 - record what is unknown, take over, go on
                log.warning("producer failed (%r): taking over again", e)
                for s, f in pending:
                    if f.done() and not f.cancelled() and f.exception() is None:
                        book.acked.write(f"{s} 0 {f.result()}\n")
                    else:
                        book.failed.write(f"{s}\n")
                pending.clear()
            finally:
                try:
                    await asyncio.wait_for(producer.close(), 30)
                except Exception as e:  # noqa: BLE001
                    log.warning("closing the producer: %r", e)
    finally:
        await client.close()


# ------------------------------------------------------------------------------- Kafka producer
def kproduce(args) -> None:
    from confluent_kafka import KafkaError, Producer

    book = Ledger(Path(args.out), args.name)
    p = Producer({"bootstrap.servers": args.bootstrap, "enable.idempotence": True, "acks": "all",
                  "linger.ms": 5, "message.timeout.ms": 300_000, "client.id": args.name,
                  "topic.metadata.refresh.interval.ms": 2000})

    def report(err, msg, seq):
        if err is None:
            book.acked.write(f"{seq} {msg.partition()} {msg.offset()}\n")
        else:
            book.failed.write(f"{seq} {err}\n")
            if err.code() == KafkaError._FATAL:
                log.error("fatal producer error: %s", err)

    seq = 0
    pacer = Pacer(args.rate)
    while not book.stopped():
        try:
            p.produce(args.topic, f"k-{seq}".encode(), partition=seq % args.partitions,
                      on_delivery=lambda err, msg, s=seq: report(err, msg, s))
            seq += 1
        except BufferError:
            p.poll(0.1)
            continue
        p.poll(0)
        time.sleep(pacer.delay())
    left = p.flush(120)
    if left:
        log.error("%d records not delivered at the end", left)


# ------------------------------------------------------------------------------- Kafka consumer
def kconsume(args) -> None:
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    out = Path(args.out)
    book = Ledger(out, args.name)
    c = Consumer({"bootstrap.servers": args.bootstrap, "group.id": args.group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "client.id": args.name, "session.timeout.ms": 10_000,
                  "heartbeat.interval.ms": 1000, "topic.metadata.refresh.interval.ms": 2000})
    positions: dict[int, int] = {}

    def revoked(consumer, parts) -> None:  # another member owns them now: never commit them again
        for tp in parts:
            positions.pop(tp.partition, None)

    c.subscribe([args.topic], on_revoke=revoked, on_lost=revoked)
    last_commit = time.monotonic()

    def commit() -> None:
        if not positions:
            return
        offsets = [TopicPartition(args.topic, p, o) for p, o in positions.items()]
        try:
            done = c.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:  # a rebalance or a coordinator move: not committed, read again
            log.warning("commit failed: %s", e)
            return
        # what the group has committed, as the broker acknowledged it
        book.acked.write(json.dumps({tp.partition: tp.offset for tp in done if tp.error is None}) + "\n")

    while not book.stopped():
        msg = c.poll(0.5)
        if msg is not None and msg.error() is None:
            positions[msg.partition()] = msg.offset() + 1
        if time.monotonic() - last_commit > 1.0:
            commit()
            last_commit = time.monotonic()
    commit()
    c.close()


# -------------------------------------------------------------------------------------- verify
async def verify(args) -> dict:
    """Everything in the stream and the topic, read through the streams API and a Kafka consumer."""
    from streams.client import connect
    from streams.topics import partition_stream

    out: dict = {"streams": {}, "kafka": {}, "ensembles": {}}
    client = await connect(args.metadata)
    try:
        out["racks"] = {b.bookie_id: b.rack for b in await client.live_bookies()}
        for name, parts in ((args.stream, 1), (args.topic, args.partitions)):
            for p in range(parts):
                stream = name if parts == 1 else partition_stream(name, p)
                info = await client.describe_stream(stream)
                out["ensembles"][stream] = [list(f.ensemble) for f in info.fragments]
                c = await client.consumer(name, partition=p if parts > 1 else None)
                end = await c.end_position()
                got = []
                while c.position < end:
                    batch = await c.read(1000, timeout_s=5)
                    if not batch:
                        break
                    got += [(r.offset, r.value.decode()) for r in batch]
                out["streams"][f"{name}/{p}"] = got
                await c.close()
    finally:
        await client.close()
    out["kafka"] = kafka_read(args.bootstrap, [(args.stream, 0)] + [(args.topic, p) for p in range(args.partitions)])
    return out


def kafka_read(bootstrap: str, tps: list[tuple[str, int]]) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "verify", "enable.auto.commit": False})
    out: dict = {}
    try:
        for topic, p in tps:
            lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            got: list = []
            c.assign([TopicPartition(topic, p, lo)])
            deadline = time.monotonic() + 120
            while (not got or got[-1][0] < hi - 1) and hi > lo and time.monotonic() < deadline:
                for m in c.consume(1000, 1.0):
                    if m.error() is None:
                        got.append((m.offset(), m.value().decode()))
            out[f"{topic}/{p}"] = got
    finally:
        c.close()
    return out


async def last_ensembles(args) -> dict:
    """stream -> the ensemble of its last (open) fragment."""
    from streams.client import connect
    from streams.topics import partition_stream

    client = await connect(args.metadata)
    try:
        out = {}
        for name in [args.stream] + [partition_stream(args.topic, p) for p in range(args.partitions)]:
            info = await client.describe_stream(name)
            out[name] = list(info.fragments[-1].ensemble)
        return out
    finally:
        await client.close()


async def spark_totals(args) -> dict:
    """What examples/pipeline.py --demo must have emitted, from its source stream (10 s windows per
    account, the last event - the one moving the watermark - excluded), and what its sink holds."""
    from streams.client import connect

    client = await connect(args.metadata)
    try:
        out = {}
        for name in (args.stream, args.topic):
            c = await client.consumer(name)
            end = await c.end_position()
            got = []
            while c.position < end:
                got += await c.read(1000, timeout_s=5)
            await c.close()
            out[name] = got
    finally:
        await client.close()
    events = sorted(out[args.stream], key=lambda r: r.timestamp_ms)[:-1]
    want: dict = {}
    for r in events:
        k = (r.timestamp_ms - r.timestamp_ms % 10_000, r.key.decode())
        n, total = want.get(k, (0, 0))
        want[k] = (n + 1, total + int(r.value))
    from datetime import UTC, datetime

    got = {}
    for r in out[args.topic]:
        v = json.loads(r.value)
        ws = int(datetime.fromisoformat(v["window_start"]).replace(tzinfo=UTC).timestamp() * 1000)
        k = f"{ws}/{v['account']}"
        got[k] = got.get(k, []) + [[v["events"], v["total"]]]
    return {"want": {f"{w}/{a}": [list(v)] for (w, a), v in want.items()}, "got": got,
            "input_events": len(events)}


def leaders(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=30)
    return {p: pm.leader for p, pm in md.topics[topic].partitions.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["pyproduce", "kproduce", "kconsume", "verify", "leaders", "spark-totals", "ensembles"])
    ap.add_argument("--metadata")
    ap.add_argument("--bootstrap")
    ap.add_argument("--stream", default="orders")
    ap.add_argument("--topic", default="events")
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--group", default="g1")
    ap.add_argument("--out", default=".")
    ap.add_argument("--name")
    ap.add_argument("--rate", type=float, default=200.0)
    args = ap.parse_args(argv)
    args.name = args.name or args.what
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.what == "pyproduce":
        asyncio.run(pyproduce(args))
    elif args.what == "kproduce":
        kproduce(args)
    elif args.what == "kconsume":
        kconsume(args)
    elif args.what == "ensembles":
        print(json.dumps(asyncio.run(last_ensembles(args))))
    elif args.what == "spark-totals":
        print(json.dumps(asyncio.run(spark_totals(args))))
    elif args.what == "leaders":
        print(json.dumps(leaders(args.bootstrap, args.topic)))
    else:
        print(json.dumps(asyncio.run(verify(args))))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
