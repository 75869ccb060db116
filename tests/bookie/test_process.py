"""``scroll bookie`` as a real process: readiness, graceful stop on SIGTERM/SIGINT, metrics, and
bad input on the real port (each a clear error; the bookie keeps serving and loses nothing)."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest

from bookie import digest, wire
from bookie.client import UNAVAILABLE, BookieClient
from bookie.errors import NoSuchLedgerError, Status
from bookie.proto import bookie_pb2 as pb
from terms.messages import AddOk, AddRequest, FenceOk, InvalidTerm

from .helpers import run

pytestmark = pytest.mark.process


async def write_some(address: str, ledger: int, n: int, term: int = 1) -> list[bytes]:
    async with BookieClient(address) as c:
        assert isinstance(await c.fence(ledger, term), FenceOk)
        assert isinstance(await c.add(AddRequest(ledger, 0, term, -1, -1, b"noop", truncate=True)), AddOk)
        payloads = [b"p%d-" % i + bytes([i % 256]) * 50 for i in range(1, n)]
        res = await c.submit([AddRequest(ledger, i, term, 0, 0, p) for i, p in enumerate(payloads, 1)])
        assert res.all_ok
        return [b"noop", *payloads]


async def read_all(address: str, ledger: int) -> list[bytes]:
    async with BookieClient(address) as c:
        return [e.data for e in (await c.read(ledger, 0, 10_000)).entries]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stops_cleanly_on_a_signal_and_restarts_with_everything(bookie_process, sig) -> None:
    bp = bookie_process(extra=["--log-level", "INFO"]).start()
    assert bp.address.startswith("127.0.0.1:")
    written = run(write_some(bp.address, 5, 300))
    assert bp.terminate(sig) == 0
    assert bp.stdout_lines[-1] == "bookie stopped"
    bp.stderr_lines.clear()
    bp.start()
    assert run(read_all(bp.address, 5)) == written
    # the clean stop checkpointed: nothing left to replay
    assert any(re.search(r" 0 journal records replayed", line) for line in bp.stderr_lines), bp.stderr_lines


def test_second_bookie_on_the_same_data_dir_is_refused(bookie_process, tmp_path: Path) -> None:
    first = bookie_process(tmp_path / "shared").start()
    second = bookie_process(tmp_path / "shared")
    with pytest.raises(RuntimeError):
        second.start(timeout=20)
    assert second.proc.wait(20) == 1
    assert any("in use" in line for line in second.stderr_lines)
    assert first.alive()


def test_metrics_endpoint(bookie_process) -> None:
    bp = bookie_process(extra=["--metrics-port", "0"]).start()
    metrics_at = re.search(r"metrics=(\S+)", bp.stdout_lines[0]).group(1)
    run(write_some(bp.address, 1, 50))
    text = urllib.request.urlopen(f"http://{metrics_at}/metrics", timeout=10).read().decode()
    for name in ("scroll_bookie_adds_total 50.0", "scroll_bookie_journal_fsync_seconds_bucket",
                 "scroll_bookie_journal_group_records_bucket", "scroll_bookie_add_queue_depth",
                 'scroll_bookie_cache_hit_ratio{cache="write"}', "scroll_bookie_gc_reclaimed_bytes_total",
                 "scroll_bookie_add_bytes_total", "scroll_bookie_read_only 0.0"):
        assert name in text, name


# ---------------------------------------------------------------------------------- bad input


def raw_bytes(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        s.settimeout(2)
        try:
            s.recv(4096)  # whatever the server answers (a GOAWAY) or a close
        except (TimeoutError, ConnectionError):
            pass


def raw_grpc(address: str, method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    """Send undecodable bytes as a request message and return the gRPC status."""

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as ch:
            ident = lambda b: b  # noqa: E731 - raw bytes in and out
            try:
                if streaming:
                    stream = ch.stream_stream(method, request_serializer=ident, response_deserializer=ident)(iter([payload]))
                    async for _ in stream:
                        pass
                else:
                    await ch.unary_unary(method, request_serializer=ident, response_deserializer=ident)(payload, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    return run(call())


def data_frames(port: int, payload: bytes, expect: int = 1, half_close: bool = False) -> list[tuple[int, int, memoryview]] | None:
    """Send raw bytes to the data port (``half_close``: then end the sending side); the answer
    frames (up to ``expect``), or None when the bookie closed the connection without answering."""
    reader = wire.FrameReader()
    frames: list = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        while len(frames) < expect:
            chunk = s.recv(65536)
            if not chunk:
                return frames or None
            frames.extend(reader.feed(chunk))
    return frames


def add_frame(rid: int, adds: list[tuple]) -> bytes:
    """An ADD frame from (ledger, entry, term, digest, data) tuples."""
    parts, size = [], 0
    for lid, eid, term, dig, data in adds:
        p, n = wire.add_entry(lid, eid, term, 0, 0, False, False, 0, dig, data)
        parts += p
        size += n
    return b"".join(wire.add_frame(rid, len(adds), size, parts))


def test_bad_input_gets_clear_errors_and_loses_nothing(bookie_process) -> None:
    bp = bookie_process(overrides={"max_entry_bytes": 4096, "verify_digest_on_add": "true"}).start()
    written = run(write_some(bp.address, 1, 200, term=2))

    # garbage and truncated traffic straight to the gRPC port
    raw_bytes(bp.port, b"\x00\xff garbage \x13\x37" * 100)
    raw_bytes(bp.port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00")  # frame cut short
    raw_bytes(bp.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    valid = pb.FenceRequest(ledger_id=1, term=2).SerializeToString()
    assert raw_grpc(bp.address, "/scroll.bookie.v1.Bookie/Fence", valid[:-1] + b"\xff\xff", False) != grpc.StatusCode.OK
    assert raw_grpc(bp.address, "/scroll.bookie.v1.Bookie/Add", b"", False) == grpc.StatusCode.UNIMPLEMENTED

    # ... and to the data port: a frame that cannot be parsed gets ERROR and the connection closes
    dp = bp.data_port
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # a length far over the frame limit
                 wire.FRAME.pack(2, wire.ADD, 1),  # a length below the header's
                 wire.frame_head(99, 7, 0),  # an unknown op
                 wire.frame_head(wire.READ, 8, 3) + b"abc",  # a read body of the wrong size
                 # an add whose payload runs past the frame
                 wire.frame_head(wire.ADD, 9, wire.COUNT.size + wire.ADD_HEAD.size) + wire.COUNT.pack(1)
                 + wire.ADD_HEAD.pack(1, 201, 2, 0, 0, 0, 0, 4, 100)):
        answer = data_frames(dp, junk)
        assert answer is None or (answer[0][0] == wire.ERROR and wire.decode_error(answer[0][2])[0] == Status.BAD_REQUEST)
    # a frame cut short and a silent close: nothing to answer, nothing applied
    assert data_frames(dp, add_frame(3, [(1, 202, 2, digest.crc32c_digest(1, 202, b"x"), b"x")])[:-1], half_close=True) is None

    # bad requests inside well-formed frames are answered one by one; the connection stays
    ok = digest.crc32c_digest(1, 200, b"ok")
    frames = data_frames(dp, add_frame(10, [(1, 5, -5, b"1234", b"a")])  # a negative term
                         + add_frame(11, [(1, 202, 2, b"\0\0\0\0", b"a")])  # a bad digest
                         + add_frame(12, [(1, 200, 2, ok, b"ok"), (1, 201, 2, b"", b"x" * 10_000)])  # oversized entry
                         + add_frame(13, [(1, 500, 1, digest.crc32c_digest(1, 500, b"s"), b"s")])  # a stale term
                         + wire.encode_read(14, 424242, 0, 0, 0, 0, 0), expect=5)
    answers = {rid: (op, body) for op, rid, body in frames}
    assert wire.decode_add_answer(answers[10][1])[1] == [Status.BAD_REQUEST]
    assert wire.decode_add_answer(answers[11][1])[1] == [Status.BAD_DIGEST]
    assert wire.decode_add_answer(answers[12][1])[1] == [Status.OK, Status.TOO_LARGE]
    assert wire.decode_add_answer(answers[13][1])[1:3] == ([Status.INVALID_TERM], [2])
    assert wire.decode_read_answer(answers[14][1])[0] == Status.NO_SUCH_LEDGER

    async def protocol_abuse() -> None:
        async with BookieClient(bp.address, max_entry_bytes=1 << 30) as c:
            b = c.bookie
            # stale terms
            assert await c.add(AddRequest(1, 500, 1, 0, 0, b"stale")) == InvalidTerm(b, 1, 1, 2)
            assert await c.fence(1, 1) == InvalidTerm(b, 1, 1, 2)
            # oversized entry (within the message limit): refused on its own
            res = await c.submit([AddRequest(1, 200, 2, 0, 0, b"ok"), AddRequest(1, 201, 2, 0, 0, b"x" * 10_000)])
            assert res.statuses == [Status.OK, Status.TOO_LARGE]
            # a submission over the bookie's batch limits is split by the client (to the limits Info
            # gave); each oversized entry is refused on its own
            huge = await c.submit([AddRequest(1, 300 + i, 2, 0, 0, b"h" * 5000) for i in range(5000)])
            assert set(huge.statuses) == {Status.TOO_LARGE}
            # reads of unknown ledgers and entries
            with pytest.raises(NoSuchLedgerError):
                await c.read(424242, 0)
            with pytest.raises(NoSuchLedgerError):
                await c.read_lac(424242, timeout_s=0.05)
            rr = await c.recovery_read(1, 99_999, 2)
            assert type(rr).__name__ == "ReadMissing"
            # still serving, nothing lost
            assert [e.data for e in (await c.read(1, 0, 10_000)).entries][: len(written)] == written
            assert (await c.read(1, 200)).entries[0].data == b"ok"

    run(protocol_abuse())
    assert bp.alive()
    assert run(read_all(bp.address, 1))[: len(written)] == written
    assert bp.terminate() == 0


def test_client_gives_up_cleanly_on_a_dead_port() -> None:
    async def scenario() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with BookieClient(f"127.0.0.1:{port}", call_timeout_s=2, add_timeout_s=2) as c:
            res = await c.submit([AddRequest(1, 0, 1, -1, -1, b"x", truncate=True)])
            assert res.statuses == [UNAVAILABLE]
            assert type(await c.fence(1, 1)).__name__ == "FenceFailed"

    run(asyncio.wait_for(scenario(), 30))


def test_a_client_follows_a_restarted_bookie_to_its_new_data_port(bookie_process) -> None:
    """The data port is any free port by default, so a bookie that restarts on the same gRPC
    address may serve data elsewhere: a client that lost its connection asks Info again."""
    bp = bookie_process().start()

    async def scenario() -> None:
        async with BookieClient(bp.address, call_timeout_s=5) as c:
            assert isinstance(await c.fence(3, 1), FenceOk)
            assert isinstance(await c.add(AddRequest(3, 0, 1, -1, -1, b"before", truncate=True)), AddOk)
            before = c.data_address
            assert bp.terminate() == 0
            bp.start()  # same gRPC port, a fresh data port
            assert c.data_address is None or c.data_address == before  # forgotten once the connection broke
            await c.wait_ready(30)  # gRPC has reconnected: Info can tell the new data port
            got = await c.read(3, 0)
            assert got.entries[0].data == b"before"
            assert c.data_address == f"127.0.0.1:{bp.data_port}"

    run(scenario())
    assert bp.terminate() == 0


def test_a_client_keeps_its_frames_under_the_bookies_limits(bookie_process) -> None:
    """A bookie configured for smaller ADD frames than the client's defaults (4 MiB, 2,000 adds)
    says so in Info; the client splits a large submit (as a writer's resend after an ensemble change
    is) to fit, instead of sending frames the bookie refuses every time."""
    bp = bookie_process(overrides={"max_batch_bytes": 256 * 1024, "max_batch_adds": 100}).start()

    async def scenario() -> None:
        async with BookieClient(bp.address, call_timeout_s=10) as c:
            assert isinstance(await c.fence(5, 1), FenceOk)
            assert isinstance(await c.add(AddRequest(5, 0, 1, -1, -1, b"noop", truncate=True)), AddOk)
            assert (c.max_batch_bytes, c.max_batch_adds) == (256 * 1024, 100)  # learnt with the data port
            payloads = [bytes([i % 251]) * 1024 for i in range(1, 1201)]  # 1.2 MB, 1,200 adds
            res = await c.submit([AddRequest(5, i, 1, 0, 0, p) for i, p in enumerate(payloads, 1)])
            assert res.all_ok, res.error
            got = await c.read(5, 0, 2000)
            assert [e.data for e in got.entries] == [b"noop", *payloads]

    run(scenario())
