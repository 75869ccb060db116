"""Helpers for tests that run `scroll kafka` shims as real processes and talk raw Kafka protocol:
the shim process, a RecordBatch encoder (magic 2, with idempotent producer fields) and a blocking
one-request client over a socket."""

from __future__ import annotations

import socket
import struct
import sys
import time
from pathlib import Path

import crc32c

from compat_kafka.wire import codec
from streams.tools.localcluster import Proc, free_port


class ShimProcess(Proc):
    """`scroll kafka` in its own process (SIGKILL/SIGSTOP-able), logging to ``log``."""

    def __init__(self, metadata_url: str, log_dir: Path, *args: str, node_id: int | None = None,
                 lease_ttl_s: float = 5.0):
        # 5 s: a 2 s lease lapsed once on a loaded 2-core CI machine in a test that is not about
        # fail-over (the shim then rightly answered NOT_LEADER); fail-over tests pass their own TTL
        port = free_port()
        argv = [sys.executable, "-m", "streams.tools.cli", "kafka", "--metadata", metadata_url, "--port", str(port),
                "--lease-ttl", str(lease_ttl_s), *args]
        if node_id is not None:
            argv += ["--node-id", str(node_id)]
        super().__init__(f"shim-{port}", argv, port, log_dir / f"shim-{port}.log")
        self.bootstrap = f"127.0.0.1:{port}"

    def start_and_wait(self, timeout_s: float = 30.0) -> ShimProcess:
        self.start()
        return self.wait_listening(timeout_s)

    def wait_listening(self, timeout_s: float = 30.0) -> ShimProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the shim listens only once registered
            if not self.alive:
                raise RuntimeError(f"shim exited: {self.log_text()[-3000:]}")
            with socket.socket() as s:
                s.settimeout(0.2)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"shim not listening after {timeout_s}s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def node_id(self) -> int:
        for line in self.log_text().splitlines():
            if "registered as node" in line:
                return int(line.split("registered as node")[1].split()[0])
        raise RuntimeError("shim has not logged its node id")


# ---------------------------------------------------------------- record batches
def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b = z & 0x7F
        z >>= 7
        if z:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def record_batch(values: list[bytes], producer_id: int = -1, epoch: int = -1, base_sequence: int = -1,
                 timestamp_ms: int | None = None) -> bytes:
    """One uncompressed magic-2 RecordBatch of ``values`` (no keys, no headers)."""
    ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    recs = b""
    for i, v in enumerate(values):
        body = b"\x00" + _varint(0) + _varint(i) + _varint(-1) + _varint(len(v)) + v + _varint(0)
        recs += _varint(len(body)) + body
    after_crc = struct.pack(">hiqqqhii", 0, len(values) - 1, ts, ts, producer_id, epoch, base_sequence,
                            len(values)) + recs
    crc = crc32c.crc32c(after_crc)
    batch_len = 4 + 1 + 4 + len(after_crc)  # leader epoch, magic, crc, rest
    return struct.pack(">qiibI", 0, batch_len, -1, 2, crc) + after_crc


# ---------------------------------------------------------------- raw requests
class RawConnection:
    def __init__(self, port: int, timeout_s: float = 15.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self._corr = 0

    def call(self, body):
        self.send(body)
        return self.receive(body)

    def send(self, body) -> None:
        self._corr += 1
        self.sock.sendall(codec.encode_request(body, self._corr))

    def receive(self, body):
        """The response to the last request sent (``body``: that request, for its schema)."""
        head = self._recv(4)
        (n,) = struct.unpack(">i", head)
        corr, resp = codec.decode_response(self._recv(n), body.__api_key__, body.__version__)
        assert corr == self._corr
        return resp

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
