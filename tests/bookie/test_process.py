"""``scroll bookie`` as a real process: readiness, graceful stop on SIGTERM/SIGINT, metrics, and
bad input on the real port (each a clear error; the bookie keeps serving and loses nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest

from bookie import digest
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


def test_bad_input_gets_clear_errors_and_loses_nothing(bookie_process) -> None:
    bp = bookie_process(overrides={"max_entry_bytes": 4096, "verify_digest_on_add": "true"}).start()
    written = run(write_some(bp.address, 1, 200, term=2))

    # garbage and truncated traffic straight to the port
    raw_bytes(bp.port, b"\x00\xff garbage \x13\x37" * 100)
    raw_bytes(bp.port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00")  # frame cut short
    raw_bytes(bp.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw_grpc(bp.address, "/scroll.bookie.v1.Bookie/Add", b"\xff\xff\xff\xff\x0f", True) != grpc.StatusCode.OK
    valid = pb.ReadRequest(ledger_id=1, first_entry_id=0).SerializeToString()
    assert raw_grpc(bp.address, "/scroll.bookie.v1.Bookie/Read", valid[:-1] + b"\xff", False) != grpc.StatusCode.OK
    assert raw_grpc(bp.address, "/scroll.bookie.v1.Bookie/Nope", b"", False) == grpc.StatusCode.UNIMPLEMENTED

    async def protocol_abuse() -> None:
        async with BookieClient(bp.address, max_entry_bytes=1 << 30) as c:
            b = c.bookie
            # stale terms
            assert await c.add(AddRequest(1, 500, 1, 0, 0, b"stale")) == InvalidTerm(b, 1, 1, 2)
            assert await c.fence(1, 1) == InvalidTerm(b, 1, 1, 2)
            # oversized entry (within the message limit): refused on its own
            res = await c.submit([AddRequest(1, 200, 2, 0, 0, b"ok"), AddRequest(1, 201, 2, 0, 0, b"x" * 10_000)])
            assert res.statuses == [Status.OK, Status.TOO_LARGE]
            # a submission over the batch limits is split by the client; each oversized entry is refused
            huge = await c.submit([AddRequest(1, 300 + i, 2, 0, 0, b"h" * 4000) for i in range(5000)])
            assert set(huge.statuses) == {Status.TOO_LARGE}
            # a raw message over the gRPC limit: that stream breaks, nothing else does
            raw = c._stub.Add()
            n = 5000
            with contextlib.suppress(grpc.aio.AioRpcError):
                await raw.write(pb.AddBatch(batch_id=1, ledger_id=[1] * n, entry_id=list(range(300, 300 + n)),
                                            term=[2] * n, lac=[0] * n, lafr=[0] * n, digest=[b"1234"] * n,
                                            data=[b"h" * 4000] * n))
                await raw.done_writing()
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in raw:
                    pass
            # malformed batches: columns of different lengths, negative ids, bad digests
            stub_stream = c._stub.Add()
            await stub_stream.write(pb.AddBatch(batch_id=9, ledger_id=[1, 1], entry_id=[1], term=[2], lac=[0], lafr=[0],
                                                digest=[b"1234"], data=[b"a"]))
            bad_ids = pb.AddBatch(batch_id=10, ledger_id=[1], entry_id=[-5], term=[2], lac=[0], lafr=[0],
                                  digest=[digest.crc32c_digest(1, 0, b"a")], data=[b"a"])
            await stub_stream.write(bad_ids)
            await stub_stream.write(pb.AddBatch(batch_id=11, ledger_id=[1], entry_id=[202], term=[2], lac=[0], lafr=[0],
                                                digest=[b"\0\0\0\0"], data=[b"a"]))
            await stub_stream.done_writing()
            answers = {r.batch_id: list(r.status) async for r in stub_stream}
            assert answers == {9: [Status.BAD_REQUEST, Status.BAD_REQUEST], 10: [Status.BAD_REQUEST], 11: [Status.BAD_DIGEST]}
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
