"""Fuzzed frames over TCP into a real Kafka listener process and a real bookie process.

A LocalCluster (etcd + 3 bookie processes) and a ``scroll kafka`` listener process; a few thousand
frames made by the fuzz targets' mutator from their seed corpora are sent to the listener (Kafka
request frames, several per connection: the listener closes a connection at its first bad frame)
and to one bookie's data port (data-plane byte streams), after the Kafka inputs of past crashes
(``tests/fuzz/regressions``: one of them aborted the listener process). Afterwards both processes are alive,
answer a valid request correctly (ApiVersions, Metadata, a produce and a fetch of it; a bookie
add and read) and their RSS stayed under ``RSS_LIMIT_MB``.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import time
from pathlib import Path

import pytest

from bookie import digest, wire
from compat_kafka.wire import codec
from streams.tools.localcluster import LocalCluster
from tests.kafka.shimproc import RawConnection, ShimProcess, record_batch

from . import targets
from .run import CORPUS
from .test_regressions import REGRESSIONS

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

KAFKA_FRAMES = 3000
BOOKIE_STREAMS = 1500
RSS_LIMIT_MB = 600


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(0, 6)):
        r = rnd.random()
        if r < 0.5 and b:
            b[rnd.randrange(len(b))] = rnd.getrandbits(8)
        elif r < 0.7:
            b[rnd.randrange(len(b) + 1):0] = rnd.randbytes(rnd.randint(1, 6))
        elif b:
            i = rnd.randrange(len(b))
            b[i:i + 4] = rnd.choice([b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x80\x00\x00\x00"])
    return bytes(b)


def _send(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(payload)
            s.settimeout(0.05)
            s.recv(65536)  # some of the answer (or the close), then go
        except OSError:
            pass  # closed on us: the frame was refused


def test_fuzzed_frames_over_tcp_leave_the_servers_serving(tmp_path: Path) -> None:
    rnd = random.Random(20261128)
    cluster = LocalCluster(tmp_path / "cluster", bookies=3)
    cluster.start()
    shim = None
    try:
        shim = ShimProcess(cluster.metadata_url, tmp_path).start_and_wait()
        targets.kafka_setup()
        seeds = [f.read_bytes() for f in sorted((CORPUS / "kafka_decode").iterdir())]
        started = time.monotonic()
        sent = 0
        for name in ("kafka_decode", "kafka_dispatch"):  # the inputs of past crashes first, as they are
            for f in sorted((REGRESSIONS / name).iterdir()):
                body = targets.kafka_body(f.read_bytes())
                _send(shim.port, codec.frame(body if body is not None else f.read_bytes()[3:]))
                sent += 1
        while sent < KAFKA_FRAMES:
            frames = []
            for _ in range(rnd.randint(1, 8)):
                body = targets.kafka_body(_mutate(rnd, rnd.choice(seeds)))
                if body is None or len(body) < 10:
                    continue
                frames.append(codec.frame(body))
            sent += len(frames)
            _send(shim.port, b"".join(frames))
        kafka_s = time.monotonic() - started
        assert shim.alive, shim.log_text()[-3000:]
        assert _rss_mb(shim.popen.pid) < RSS_LIMIT_MB
        _kafka_still_serves(shim.port)

        bookie = cluster.bookies[0]
        data_port = int(re.search(r"data_port=(\d+)", bookie.output()).group(1))
        bseeds = [f.read_bytes() for f in sorted((CORPUS / "bookie_frames").iterdir())]
        started = time.monotonic()
        for _ in range(BOOKIE_STREAMS):
            _send(data_port, _mutate(rnd, rnd.choice(bseeds))[1:])
        bookie_s = time.monotonic() - started
        assert bookie.alive, bookie.output()[-3000:]
        assert _rss_mb(bookie.popen.pid) < RSS_LIMIT_MB
        _bookie_still_serves(data_port)
        print(f"{KAFKA_FRAMES} Kafka frames in {kafka_s:.1f} s, {BOOKIE_STREAMS} bookie streams in {bookie_s:.1f} s")
    finally:
        if shim is not None:
            shim.stop()
        cluster.stop()


def _kafka_still_serves(port: int) -> None:
    with RawConnection(port) as conn:
        versions = conn.call(codec.build(codec.request_schema(codec.API_API_VERSIONS, 3), client_software_name="t",
                                         client_software_version="1"))
        assert versions.error_code == 0 and len(versions.api_keys) == len(codec.SUPPORTED)
        md_cls = codec.request_schema(codec.API_METADATA, 9)
        md = conn.call(codec.build(md_cls, allow_auto_topic_creation=True, include_topic_authorized_operations=False,
                                   include_cluster_authorized_operations=False,
                                   topics=(codec.build(codec.nested(md_cls, "MetadataRequestTopic"), name="after-fuzz"),)))
        assert md.topics[0].error_code in (0, 5), md  # created (5: LEADER_NOT_AVAILABLE while it is)
        produce_cls = codec.request_schema(codec.API_PRODUCE, 9)
        td, pd = codec.nested(produce_cls, "TopicProduceData"), codec.nested(produce_cls, "PartitionProduceData")
        produce = codec.build(produce_cls, transactional_id=None, acks=-1, timeout=codec.ZERO_MS.__class__(seconds=10),
                              topic_data=(codec.build(td, name="after-fuzz", partition_data=(
                                  codec.build(pd, index=0, records=record_batch([b"still here"])),)),))
        for _ in range(20):
            part = conn.call(produce).responses[0].partition_responses[0]
            if part.error_code == 0:
                break
            time.sleep(0.25)
        assert part.error_code == 0, part
        fetch_cls = codec.request_schema(codec.API_FETCH, 12)
        ft, fp = codec.nested(fetch_cls, "FetchTopic"), codec.nested(fetch_cls, "FetchPartition")
        got = conn.call(codec.build(fetch_cls, replica_id=-1, max_wait=codec.ZERO_MS, min_bytes=0, max_bytes=1 << 20,
                                    isolation_level=0, session_id=0, session_epoch=-1, rack_id="", forgotten_topics_data=(),
                                    topics=(codec.build(ft, topic="after-fuzz", partitions=(
                                        codec.build(fp, partition=0, current_leader_epoch=-1, fetch_offset=0,
                                                    last_fetched_epoch=-1, log_start_offset=-1,
                                                    partition_max_bytes=1 << 20),)),)))
        records = got.responses[0].partitions[0].records
        assert records and b"still here" in bytes(records)


def _bookie_still_serves(port: int) -> None:
    lid, data = 987654321, b"after the fuzzing"
    parts, size = wire.add_entry(lid, 0, 1, -1, -1, True, False, 0, digest.crc32c_digest(lid, 0, data), data)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"".join(bytes(p) for p in wire.add_frame(1, 1, size, parts)))
        reader = wire.FrameReader()
        answers = {}
        while 1 not in answers:
            answers.update({rid: (op, body) for op, rid, body in reader.feed(s.recv(65536))})
        op, body = answers[1]
        assert op == wire.ADD | wire.ANSWER and wire.decode_add_answer(body)[1] is None, bytes(body)
        s.sendall(wire.encode_read(2, lid, 0, 0, 10, 1 << 20, 0))
        while 2 not in answers:
            answers.update({rid: (op, body) for op, rid, body in reader.feed(s.recv(65536))})
        op, body = answers[2]
        status, *_rest, entries, _error = wire.decode_read_answer(body)
        assert status == 0 and entries[0][4] == data
    _ = struct  # (imported for readers of the frame layouts above)
