"""Async client of one bookie, with add batching; answers are the events of ``terms.messages``.

How this works. The data plane (adds, reads, LAC reads and writes, and a take-over's fences and
recovery reads) runs on one TCP connection to the bookie's data port, in the binary frames of
``bookie.wire``; the control plane (trim, info, scrub) on gRPC. A client given only the gRPC address learns the data port from
Info. ``submit`` (a list of ``AddRequest``) or ``submit_columns`` hands adds to the connection and
returns one future for them: they leave as one ADD frame at the end of the loop turn (with the
turn's other frames to that bookie, in one send) while fewer than ``max_inflight_batches`` frames
await their answer; otherwise they gather (up to ``max_batch_adds`` / ``max_batch_bytes``) and
leave with the next answer. So a lone add costs one
frame and a busy client sends few, large ones. If the connection breaks, or an add is not answered
within ``add_timeout_s``, every add not yet answered resolves as failed (``WriteFailed``) and the
next request opens a fresh connection.

The client computes each add's digest: CRC32C, or the MAC when ``set_password`` gave the ledger a
password; reads verify digests (CRC32C always, MACs when the key is known).

Answers for protocol calls are the sans-IO core's events (``AddOk``, ``InvalidTerm``,
``NotTruncated``, ``WriteFailed``, ``FenceOk``, ``FenceFailed``, ``ReadOk``, ``ReadMissing``,
``ReadFailed``) with ``bookie`` set to this client's bookie name, ready to feed to the core.
Regular reads, long-poll reads, trims and info raise typed ``BookieError``s instead.

Security (``fragments.security.ClientSecurity``): with ``tls_ca`` both connections use TLS (gRPC's
SSL channel credentials; the data port through ``security.ssl_context()``, checking the certificate
against the host of the address), presenting ``tls_cert`` when given (mutual TLS). A token goes as
``authorization: Bearer`` metadata on every gRPC call and as the first frame (AUTH) of every data
connection, whose other requests wait for its answer. A refusal (no or a wrong token or
certificate, a failed TLS handshake) raises ``BookieAuthError`` (not retriable) from reads, trims
and info, and makes adds, fences and LAC writes fail at once with the reason logged as an error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from fragments.security import ClientSecurity
from terms.messages import (
    AddOk,
    AddRequest,
    FenceFailed,
    FenceOk,
    InvalidTerm,
    NotTruncated,
    ReadFailed,
    ReadMissing,
    ReadOk,
    WriteFailed,
)

from . import digest as digests
from . import wire
from .errors import (
    BookieAuthError,
    BookieError,
    BookieUnavailableError,
    CorruptEntryError,
    Status,
    TooLargeError,
    error_for,
)
from .proto import bookie_pb2 as pb
from .proto import bookie_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MiB = 1 << 20
UNAVAILABLE = -1  # client-side status: the connection broke or timed out before an answer came
WATCHDOG_S = 0.5  # how often requests in flight are checked against their deadlines


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True, slots=True)
class AddResults:
    """Answers to one submitted group of adds, in order. ``statuses`` None means all OK."""

    count: int
    statuses: list[int] | None = None
    bookie_terms: list[int] | None = None
    error: str = ""

    @property
    def all_ok(self) -> bool:
        return self.statuses is None

    def status(self, i: int) -> int:
        return Status.OK if self.statuses is None else self.statuses[i]

    def event(self, i: int, req: AddRequest, bookie: str):
        code = self.status(i)
        if code == Status.OK:
            return AddOk(bookie, req.ledger_id, req.entry_id, req.term)
        if code == Status.INVALID_TERM:
            return InvalidTerm(bookie, req.ledger_id, req.term, self.bookie_terms[i])
        if code == Status.NOT_TRUNCATED:
            return NotTruncated(bookie, req.ledger_id, req.entry_id, req.term)
        try:
            reason = Status(code).name
        except ValueError:
            reason = f"status {code}"
        return WriteFailed(bookie, req.ledger_id, req.entry_id, req.term, self.error or reason)

    def events(self, reqs: Sequence[AddRequest], bookie: str) -> list:
        if self.statuses is None:
            return [AddOk(bookie, r.ledger_id, r.entry_id, r.term) for r in reqs]
        return [self.event(i, r, bookie) for i, r in enumerate(reqs)]


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: int
    entry_term: int  # the term of the add that wrote this copy
    data: bytes
    digest_type: int = digests.DIGEST_CRC32C
    digest: bytes = b""


@dataclass(frozen=True, slots=True)
class ReadResult:
    lac: int
    lafr: int
    entries: list[Entry]  # contiguous from the first id asked
    stop: Status  # why the run ended: OK (range or a limit reached), NO_SUCH_ENTRY, CORRUPT
    term: int = -1  # the bookie's term for the ledger
    timed_out: bool = False  # a long-poll read that saw no new entry in time


@dataclass(frozen=True, slots=True)
class LacResult:
    lac: int
    lafr: int
    timed_out: bool
    term: int = -1  # the bookie's term for the ledger


@dataclass(frozen=True, slots=True)
class LacWritten:
    bookie: str
    ledger_id: int
    term: int


@dataclass(frozen=True, slots=True)
class BookieInfo:
    bookie_id: str
    free_bytes: int
    used_bytes: int
    read_only: bool
    read_only_reason: str
    ledgers: int
    write_cache_bytes: int
    version: str
    scrub_passes: int = 0  # scrubbing since the bookie started (bookie/scrub.py)
    scrub_entries: int = 0
    scrub_corrupt: int = 0
    scrub_last_pass_end: float = 0.0
    scrub_running: bool = False
    scrub_findings: tuple = ()  # ((ledger, entry, reason, found_by, unix time, removed), ...), the latest
    scrub_last_pass_start: float = 0.0
    scrub_pass_started: float = 0.0  # the pass under way or interrupted (0: none)
    scrub_pass_entries: int = 0
    scrub_position: tuple | None = None  # (ledger, entry) that pass continues from
    scrub_repaired: int = 0
    scrub_awaiting_repair: int = 0


# ------------------------------------------------------------------------------ the data connection


class _OpenBatch:
    """Encoded adds waiting for a free in-flight slot; they leave as one ADD frame."""

    __slots__ = ("parts", "waiters", "n", "size", "deadline")

    def __init__(self) -> None:
        self.parts: list = []  # per add: ADD_HEAD, digest, data
        self.waiters: list[tuple] = []  # (future or callback, count), in order
        self.n = 0
        self.size = 0
        self.deadline = 0.0


class _Call:
    """A read or LAC request awaiting its answer."""

    __slots__ = ("op", "fut", "deadline", "ledger_id")

    def __init__(self, op: int, fut: asyncio.Future, deadline: float, ledger_id: int) -> None:
        self.op = op
        self.fut = fut
        self.deadline = deadline
        self.ledger_id = ledger_id


class _DataConnection(asyncio.Protocol):
    """One TCP connection to a bookie's data port: frames out, answers matched by request id.

    Adds leave at the end of the turn while fewer than ``max_inflight_batches`` ADD frames await their answer;
    beyond that they gather into one open batch that leaves with the next answer, so a lone add
    costs one frame and a busy client sends few, large ones. Nothing here runs a task per request:
    answers resolve futures from ``data_received``; one watchdog timer, armed only while requests
    are out, fails an add stream that stopped answering (``add_timeout_s``) and reads that did."""

    def __init__(self, client: BookieClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.reader = wire.FrameReader(client.max_message_bytes)
        self.adds: dict[int, _OpenBatch] = {}
        self.calls: dict[int, _Call] = {}
        self.open: collections.deque[_OpenBatch] = collections.deque()
        self.next_rid = 1
        self.dead = False
        self.live = False  # connected (and authenticated): requests may go out
        self.ready = asyncio.get_running_loop().create_future()
        self.watchdog: asyncio.TimerHandle | None = None
        # request frames of this loop turn, adds included, written together at its end (``_flush_out``)
        self._out: list = []
        self.connecting = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            host, port = await self.client._data_address()
            ctx = self.client._ssl
            await asyncio.wait_for(loop.create_connection(lambda: self, host, port, ssl=ctx,
                                                          server_hostname=host if ctx is not None else None),
                                   self.client.call_timeout_s)
        except asyncio.CancelledError:
            self.fail("connection attempt cancelled", quiet=True)
            raise
        except BookieAuthError as exc:
            self.fail(exc.message, auth=True, definite=exc.definite)
        except ssl.SSLError as exc:
            if _tls_refusal(exc):
                self.fail(f"TLS handshake with the data port failed: {exc}", auth=True, definite=False)
            else:
                self.client._forget_data_address()
                self.fail(f"cannot connect to the data port: {_describe(exc)}")
        except Exception as exc:  # noqa: BLE001 - any failure: every waiting request fails
            self.client._forget_data_address()
            self.fail(f"cannot connect to the data port: {_describe(exc)}")

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport) -> None:
        if self.dead:
            transport.close()
            return
        self.transport = transport
        token = self.client.security.token
        if token is not None:
            transport.write(wire.encode_auth(self._rid(), token))  # answered before anything else goes
            return
        self._live()

    def _live(self) -> None:
        self.live = True
        if not self.ready.done():
            self.ready.set_result(None)
        self._pump()

    def connection_lost(self, exc) -> None:
        if isinstance(exc, ssl.SSLError) and _tls_refusal(exc):
            self.fail(f"TLS with the data port failed: {exc}", auth=True, definite=False)
            return
        self.fail(f"data connection lost: {exc!r}" if exc else "data connection closed by the bookie")

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
        except wire.FrameError as exc:
            self.fail(f"malformed answer from the bookie: {exc}")
            return
        for op, rid, body in frames:
            if self.dead:
                return
            try:
                if op == wire.ADD | wire.ANSWER:
                    self._add_answered(rid, body)
                elif op == wire.ERROR:
                    self._error_answered(rid, body)
                elif op == wire.AUTH | wire.ANSWER:
                    status, message = wire.decode_error(body)
                    if status != Status.OK:
                        self.fail(message, auth=True)
                    elif not self.live:
                        self._live()
                else:
                    self._call_answered(op, rid, body)
            except (wire.FrameError, struct.error) as exc:
                self.fail(f"malformed answer from the bookie: {exc}")
                return

    # ---------------------------------------------------------------- adds
    def enqueue(self, parts: list, k: int, size: int, on_done=None) -> asyncio.Future | None:
        """Queue ``k`` encoded adds (``size`` bytes of ``parts``); one future answers them, or
        ``on_done(AddResults)``, called as the answer is read (no future, no loop hop)."""
        c = self.client
        ob = self.open[-1] if self.open else None
        if ob is None or ob.n + k > c.max_batch_adds or (ob.n and ob.size + size > c.max_batch_bytes):
            ob = _OpenBatch()
            self.open.append(ob)
        fut = asyncio.get_running_loop().create_future() if on_done is None else None
        ob.parts += parts
        ob.waiters.append((fut if on_done is None else on_done, k))
        ob.n += k
        ob.size += size
        if self.live and len(self.adds) < c.max_inflight_batches:
            self._pump()
        return fut

    def _pump(self) -> None:
        """Send open batches while in-flight slots are free. The frames join this loop turn's
        other requests (``_out``, in the order made): the adds of many writers (a listener's
        partitions) and their LAC writes to one bookie leave in one send at the end of the turn."""
        limit = self.client.max_inflight_batches
        now = None
        while self.open and len(self.adds) < limit and not self.dead:
            ob = self.open.popleft()
            rid = self._rid()
            if now is None:
                now = asyncio.get_running_loop().time()
            ob.deadline = now + self.client.add_timeout_s
            self.adds[rid] = ob
            self._queue_out(wire.add_frame(rid, ob.n, ob.size, ob.parts))
            ob.parts = None  # queued: the payloads are referenced by the frame alone
        if self.adds:
            self._arm()

    def _add_answered(self, rid: int, body: memoryview) -> None:
        ob = self.adds.pop(rid, None)
        if ob is None:
            log.warning("bookie %s answered unknown add batch %d", self.client.bookie, rid)
            return
        n, statuses, terms, error = wire.decode_add_answer(body)
        if self.open:
            self._pump()  # the freed slot first: callbacks below may queue more
        if statuses is None:
            for w, k in ob.waiters:
                _settle(w, AddResults(k), True)
        else:
            if len(statuses) != ob.n:
                statuses, terms = [Status.INTERNAL] * ob.n, [-1] * ob.n
            start = 0
            for w, k in ob.waiters:
                _settle(w, AddResults(k, statuses[start:start + k], terms[start:start + k], error), True)
                start += k

    # ---------------------------------------------------------------- reads and LACs
    def call(self, op: int, frame_of, ledger_id: int, timeout_s: float) -> asyncio.Future:
        """Send one request (``frame_of(rid)`` builds it); the future gets the answer's body."""
        if self.dead:
            raise BookieUnavailableError(f"bookie {self.client.bookie}: the data connection is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rid = self._rid()
        self.calls[rid] = _Call(op, fut, loop.time() + timeout_s, ledger_id)
        frame = frame_of(rid)
        self._queue_out(frame if isinstance(frame, list) else [frame])
        self._arm()
        return fut

    def _queue_out(self, parts: list) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush_out)
        self._out += parts

    def _flush_out(self) -> None:
        """Write the requests of this loop turn in one ``writelines``: many streams' adds and LAC
        writes, a take-over of many streams (fences, recovery reads) or many readers cost one send,
        not one per request."""
        out, self._out = self._out, []
        if out and not self.dead and self.transport is not None:
            self.transport.writelines(out)

    def _call_answered(self, op: int, rid: int, body: memoryview) -> None:
        call = self.calls.pop(rid, None)
        if call is None or call.op | wire.ANSWER != op:
            if call is not None:
                self.fail(f"bookie answered request {rid} with op {op}")
            return
        if not call.fut.done():
            call.fut.set_result(body)

    def _error_answered(self, rid: int, body: memoryview) -> None:
        status, message = wire.decode_error(body)
        err = error_for(status, message)
        call = self.calls.pop(rid, None)
        if call is not None:
            if not call.fut.done():
                call.fut.set_exception(err)
            return
        ob = self.adds.pop(rid, None)
        if ob is not None:
            for w, k in ob.waiters:
                _settle(w, AddResults(k, [status] * k, [-1] * k, message), False)
            return
        if status == Status.UNAUTHENTICATED:
            self.fail(message, auth=True)
            return
        self.fail(f"the bookie refused the connection: {message}")  # it closes the connection next

    # ---------------------------------------------------------------- timeouts, failure
    def _rid(self) -> int:
        rid = self.next_rid
        self.next_rid = rid + 1 if rid < 0xFFFFFFFF else 1
        return rid

    def _arm(self) -> None:
        if self.watchdog is None and not self.dead:
            self.watchdog = asyncio.get_running_loop().call_later(WATCHDOG_S, self._check)

    def _check(self) -> None:
        self.watchdog = None
        if self.dead:
            return
        now = asyncio.get_running_loop().time()
        for ob in self.adds.values():
            if ob.deadline <= now:
                self.fail(f"no answer to an add within {self.client.add_timeout_s}s")
                return
        late = [rid for rid, call in self.calls.items() if call.deadline <= now]
        for rid in late:
            call = self.calls.pop(rid)
            if not call.fut.done():
                call.fut.set_exception(BookieUnavailableError(f"bookie {self.client.bookie}: no answer in time"))
        if self.adds or self.calls:
            self._arm()

    def fail(self, reason: str, quiet: bool = False, auth: bool = False, definite: bool = True) -> None:
        """Every request not yet answered fails; the client opens a new connection next time.
        ``auth``: the bookie refused our credentials (requests fail with ``BookieAuthError`` and
        adds with UNAUTHENTICATED, so nobody retries them as if the bookie were down)."""
        if self.dead:
            return
        self.dead = True
        if auth:
            if not reason.startswith(f"bookie {self.client.bookie} "):
                reason = f"bookie {self.client.bookie} refused this client: {reason}"
            log.error("%s", reason)
        elif self.adds or self.open or self.calls or not quiet:
            log.warning("bookie %s: %s", self.client.bookie, reason)
        code = Status.UNAUTHENTICATED if auth else UNAVAILABLE
        batches = list(self.adds.values()) + list(self.open)
        self.adds.clear()
        self.open.clear()
        for ob in batches:
            for w, k in ob.waiters:
                _settle(w, AddResults(k, [code] * k, [-1] * k, reason), False)

        def error() -> BookieError:
            if auth:
                return BookieAuthError(reason, definite=definite)
            return BookieUnavailableError(f"bookie {self.client.bookie}: {reason}")

        calls, self.calls = list(self.calls.values()), {}
        for call in calls:
            if not call.fut.done():
                call.fut.set_exception(error())
        if not self.ready.done():
            self.ready.set_exception(error())
            self.ready.exception()  # retrieved: a connection nobody awaited must not log it
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.transport is not None:
            self.transport.close()
            if not quiet:
                self.client._forget_data_address()  # the bookie may come back on another data port
        if self.client._conn is self:
            self.client._conn = None

    async def close(self) -> None:
        self.fail("client closed", quiet=True)
        if not self.connecting.done():
            self.connecting.cancel()
        with contextlib.suppress(BaseException):
            await self.connecting


def _settle(waiter, results: AddResults, direct: bool) -> None:
    """Answer one waiter of a batch: a future, or a callback (called now when ``direct``, else
    on the next loop turn: failure paths must not re-enter the caller mid-way)."""
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():
            waiter.set_result(results)
    elif direct:
        try:
            waiter(results)
        except Exception:  # a bug of the caller must not break the connection reading answers
            log.exception("add answer callback failed")
    else:
        asyncio.get_running_loop().call_soon(waiter, results)


def _status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return str(status)


def _refused(exc: grpc.aio.AioRpcError) -> bool:
    """A call the bookie refused for our credentials: UNAUTHENTICATED, or a TLS handshake that
    failed (no channel could be set up: wrong CA, a refused client certificate, TLS vs plaintext)."""
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return True
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "handshake" in details


def _tls_refusal(exc: ssl.SSLError) -> bool:
    """A TLS failure that says something about credentials (a certificate that does not verify, an
    alert from the bookie, TLS against plaintext), not an EOF of a bookie that went away."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    reason = (exc.reason or "").upper()
    return "ALERT" in reason or "CERTIFICATE" in reason or "WRONG_VERSION" in reason or "RECORD_LAYER" in reason


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


# ------------------------------------------------------------------------------ the client


async def _merge(futs: list[asyncio.Future]) -> AddResults:
    parts = await asyncio.gather(*futs)
    n = sum(p.count for p in parts)
    if all(p.all_ok for p in parts):
        return AddResults(n)
    statuses: list[int] = []
    terms: list[int] = []
    for p in parts:
        statuses.extend(p.statuses if p.statuses is not None else [Status.OK] * p.count)
        terms.extend(p.bookie_terms if p.bookie_terms is not None else [-1] * p.count)
    return AddResults(n, statuses, terms, "; ".join(p.error for p in parts if p.error))


class BookieClient:
    """Talk to one bookie. Use as ``async with BookieClient(addr) as c:`` or call ``close()``."""

    def __init__(
        self,
        address: str,
        *,
        bookie: str | None = None,
        max_batch_adds: int = 2000,
        max_batch_bytes: int = 4 * MiB,
        max_inflight_batches: int = 8,
        max_entry_bytes: int = 1 * MiB,
        max_message_bytes: int = 64 * MiB,
        add_timeout_s: float = 30.0,
        call_timeout_s: float = 30.0,
        data_address: str | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address
        self.security = security or ClientSecurity()
        self._ssl = self.security.ssl_context()
        token = self.security.token
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
        self.data_address = data_address  # host:port of the data plane; None: asked with Info
        self._data_configured = data_address is not None
        self.max_message_bytes = max_message_bytes
        self.bookie = bookie or address
        self.max_batch_adds = max_batch_adds
        self.max_batch_bytes = max_batch_bytes
        self.max_inflight_batches = max_inflight_batches
        self.max_entry_bytes = max_entry_bytes
        self.add_timeout_s = add_timeout_s
        self.call_timeout_s = call_timeout_s
        self._keys: dict[int, bytes] = {}
        options = [
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                # a bookie that restarts is back within a couple of seconds: do not let gRPC's
                # default reconnect backoff (up to 120 s) keep failing calls to it fast. (Not
                # grpc.min_reconnect_backoff_ms: gRPC also uses it as the connect timeout, and at
                # 100 ms connections to a busy bookie failed with "connect() timed out".)
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if self.security.tls:
            root, key, chain = self.security.pem()
            creds = grpc.ssl_channel_credentials(root, key, chain)
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.BookieStub(self._channel)
        self._conn: _DataConnection | None = None
        self._closed = False
        self._calls: set = set()  # unary calls not yet finished

    async def __aenter__(self) -> BookieClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel every call still running and wait until gRPC has finished each (closing the
        channel alone cancels them but leaves their status tasks pending on the loop)."""
        self._closed = True
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        if calls:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls), return_exceptions=True), 2.0)
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError as exc:
            raise BookieUnavailableError(f"bookie {self.address} not reachable within {timeout_s}s") from exc

    def set_password(self, ledger_id: int, password: bytes | None) -> None:
        """Use a keyed MAC for this ledger's digests (None: back to CRC32C)."""
        if password is None:
            self._keys.pop(ledger_id, None)
        else:
            self._keys[ledger_id] = digests.mac_key(password)

    # ---------------------------------------------------------------- adds

    def submit(self, reqs: Sequence[AddRequest], on_done=None) -> asyncio.Future | None:
        """Queue adds; the future resolves to ``AddResults`` (one status per add, in order). With
        ``on_done`` there is no future: ``on_done(AddResults)`` is called as the answer is read
        (a failure of the connection calls it on the next loop turn)."""
        if len(reqs) == 1:
            return self._submit_one(reqs[0], on_done)
        fut = self.submit_columns(
            [r.ledger_id for r in reqs], [r.entry_id for r in reqs], [r.term for r in reqs],
            [r.lac for r in reqs], [r.lafr for r in reqs], [r.data for r in reqs],
            truncates=[r.truncate for r in reqs], recoveries=[r.recovery for r in reqs],
        )
        if on_done is None:
            return fut
        n = len(reqs)

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                on_done(AddResults(n, [UNAVAILABLE] * n, [-1] * n, "submission failed"))
            else:
                on_done(f.result())

        fut.add_done_callback(done)
        return None

    def _submit_one(self, r: AddRequest, on_done=None) -> asyncio.Future | None:
        """The common case on the hot path: one add (a writer's entry to one bookie)."""
        data = r.data
        if len(data) > self.max_entry_bytes:
            fut = self._refuse(1, [0], f"entry over max_entry_bytes={self.max_entry_bytes}")
            if on_done is None:
                return fut
            asyncio.get_running_loop().call_soon(on_done, fut.result())
            return None
        dtype, dig = self._digest(r.ledger_id, r.entry_id, data)
        parts, size = wire.add_entry(r.ledger_id, r.entry_id, r.term, r.lac, r.lafr, r.truncate, r.recovery, dtype, dig, data)
        conn = self._conn
        if conn is None or conn.dead:
            conn = self._connection()
        return conn.enqueue(parts, 1, size, on_done)

    def submit_columns(self, ledger_ids, entry_ids, terms, lacs, lafrs, datas, truncates=None, recoveries=None) -> asyncio.Future:
        """The columnar form of ``submit`` (no AddRequest objects needed)."""
        n = len(ledger_ids)
        too_big = [i for i, d in enumerate(datas) if len(d) > self.max_entry_bytes]
        if too_big:
            return self._refuse(n, too_big, f"entry over max_entry_bytes={self.max_entry_bytes}")
        dtypes, digest_col = self._digests(ledger_ids, entry_ids, datas)
        truncates = truncates if truncates is not None else [False] * n
        recoveries = recoveries if recoveries is not None else [False] * n
        parts: list = []
        sizes: list[int] = []
        for i in range(n):
            add, size = wire.add_entry(ledger_ids[i], entry_ids[i], terms[i], lacs[i], lafrs[i], truncates[i],
                                       recoveries[i], dtypes[i], digest_col[i], datas[i])
            parts += add
            sizes.append(size)
        conn = self._connection()
        chunks = list(self._chunks(datas))
        if len(chunks) == 1:
            return conn.enqueue(parts, n, sum(sizes))
        # A submission larger than one batch (e.g. an ensemble change resending a whole window)
        # goes out as several batches, each within the limits, and answers as one AddResults.
        futs = [conn.enqueue(parts[3 * a:3 * b], b - a, sum(sizes[a:b])) for a, b, _nb in chunks]
        return asyncio.ensure_future(_merge(futs))

    def _connection(self) -> _DataConnection:
        conn = self._conn
        if conn is None or conn.dead:
            conn = self._conn = _DataConnection(self)
        return conn

    async def _ready_connection(self) -> _DataConnection:
        conn = self._connection()
        if not conn.live:
            await asyncio.shield(conn.ready)
        return conn

    async def _data_address(self) -> tuple[str, int]:
        """The data plane's host and port: as configured, or from Info (same host as gRPC)."""
        if self.data_address is None:
            r = await self._unary(self._stub.Info, pb.InfoRequest())
            if not r.data_port:
                raise BookieUnavailableError(f"bookie {self.bookie} reports no data port")
            self.data_address = f"{self.address.rpartition(':')[0]}:{r.data_port}"
            # a bookie configured for smaller frames than ours would refuse every full one (a
            # resend after an ensemble change fills frames): keep under its limits
            if r.max_batch_adds:
                self.max_batch_adds = min(self.max_batch_adds, r.max_batch_adds)
            if r.max_batch_bytes:
                self.max_batch_bytes = min(self.max_batch_bytes, r.max_batch_bytes)
        host, _, port = self.data_address.rpartition(":")
        return host.strip("[]"), int(port)

    def _forget_data_address(self) -> None:
        """After a failed connect: a restarted bookie may listen on another data port."""
        if not self._data_configured:
            self.data_address = None

    async def _call(self, op: int, frame_of, ledger_id: int, extra_s: float = 0.0) -> memoryview:
        conn = await self._ready_connection()
        return await conn.call(op, frame_of, ledger_id, self.call_timeout_s + extra_s)

    def _chunks(self, datas):
        """(start, end, bytes) runs of at most max_batch_adds adds and max_batch_bytes bytes."""
        start, nbytes = 0, 0
        for i, d in enumerate(datas):
            if i > start and (i - start >= self.max_batch_adds or nbytes + len(d) > self.max_batch_bytes):
                yield start, i, nbytes
                start, nbytes = i, 0
            nbytes += len(d)
        yield start, len(datas), nbytes

    def _digest(self, ledger_id: int, entry_id: int, data) -> tuple[int, bytes]:
        """(digest type, digest) of one add: the ledger's MAC when it has a password, else CRC32C."""
        key = self._keys.get(ledger_id) if self._keys else None
        if key is None:
            return digests.DIGEST_CRC32C, digests.crc32c_digest(ledger_id, entry_id, data)
        return digests.DIGEST_MAC, digests.mac_digest(key, ledger_id, entry_id, data)

    def _digests(self, ledger_ids, entry_ids, datas) -> tuple[list[int], list[bytes]]:
        if not self._keys:
            crc = digests.crc32c_digest
            return [0] * len(ledger_ids), [crc(lid, eid, d) for lid, eid, d in zip(ledger_ids, entry_ids, datas)]
        pairs = [self._digest(lid, eid, d) for lid, eid, d in zip(ledger_ids, entry_ids, datas)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _refuse(self, n: int, bad: list[int], reason: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        statuses = [UNAVAILABLE] * n
        for i in bad:
            statuses[i] = Status.TOO_LARGE
        fut.set_result(AddResults(n, statuses, [-1] * n, reason))
        return fut

    async def add(self, req: AddRequest):
        """One add; answers AddOk, InvalidTerm, NotTruncated or WriteFailed."""
        res = await self.submit([req])
        return res.event(0, req, self.bookie)

    async def add_many(self, reqs: Sequence[AddRequest]) -> list:
        res = await self.submit(reqs)
        return res.events(reqs, self.bookie)

    # ---------------------------------------------------------------- term-carrying unary calls

    async def fence(self, ledger_id: int, term: int):
        """Answers FenceOk(lac, lafr), InvalidTerm or FenceFailed (a FENCE frame on the data plane)."""
        try:
            body = await self._call(wire.FENCE, lambda rid: wire.encode_fence(rid, ledger_id, term), ledger_id)
            status, bookie_term, lac, lafr, error = wire.decode_fence_answer(body)
        except (BookieError, wire.FrameError, struct.error) as exc:
            level = log.debug if self._closed else (log.error if isinstance(exc, BookieAuthError) else log.warning)
            level("fence ledger=%d term=%d on %s failed: %s", ledger_id, term, self.bookie, exc)
            return FenceFailed(self.bookie, ledger_id, term)
        if status == Status.OK:
            return FenceOk(self.bookie, ledger_id, term, lac, lafr)
        if status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, bookie_term)
        log.warning("fence ledger=%d term=%d on %s: %s %s", ledger_id, term, self.bookie, _status_name(status), error)
        return FenceFailed(self.bookie, ledger_id, term)

    async def recovery_read(self, ledger_id: int, entry_id: int, term: int):
        """Answers ReadOk(entry_term, data), ReadMissing, InvalidTerm or ReadFailed (a
        RECOVERY_READ frame on the data plane)."""
        try:
            body = await self._call(wire.RECOVERY_READ,
                                    lambda rid: wire.encode_recovery_read(rid, ledger_id, entry_id, term), ledger_id)
            status, bookie_term, _lac, entry_term, dtype, dig, data, error = wire.decode_recovery_read_answer(body)
        except (BookieError, wire.FrameError, struct.error) as exc:
            level = log.debug if self._closed else (log.error if isinstance(exc, BookieAuthError) else log.warning)
            level("recovery read ledger=%d entry=%d term=%d on %s failed: %s", ledger_id, entry_id, term, self.bookie,
                  exc)
            return ReadFailed(self.bookie, ledger_id, entry_id, term)
        if status == Status.OK:
            if not self._verify(ledger_id, entry_id, dtype, data, dig):
                log.error("recovery read ledger=%d entry=%d from %s: digest mismatch", ledger_id, entry_id, self.bookie)
                return ReadFailed(self.bookie, ledger_id, entry_id, term)
            return ReadOk(self.bookie, ledger_id, entry_id, term, entry_term, data)
        if status == Status.NO_SUCH_ENTRY:
            return ReadMissing(self.bookie, ledger_id, entry_id, term)
        if status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, bookie_term)
        log.warning("recovery read ledger=%d entry=%d: %s %s", ledger_id, entry_id, _status_name(status), error)
        return ReadFailed(self.bookie, ledger_id, entry_id, term)

    async def write_lac(self, ledger_id: int, term: int, lac: int, lafr: int):
        """Answers LacWritten, InvalidTerm, NotTruncated (entry_id = lac) or WriteFailed."""
        try:
            body = await self._call(wire.WRITE_LAC, lambda rid: wire.encode_write_lac(rid, ledger_id, term, lac, lafr), ledger_id)
            status, bookie_term, error = wire.decode_write_lac_answer(body)
        except BookieError as exc:
            level = log.debug if self._closed else (log.error if isinstance(exc, BookieAuthError) else log.warning)
            level("LAC write ledger=%d term=%d failed: %s", ledger_id, term, exc)
            return WriteFailed(self.bookie, ledger_id, lac, term)
        if status == Status.OK:
            return LacWritten(self.bookie, ledger_id, term)
        if status == Status.INVALID_TERM:
            return InvalidTerm(self.bookie, ledger_id, term, bookie_term)
        if status == Status.NOT_TRUNCATED:
            return NotTruncated(self.bookie, ledger_id, lac, term)
        return WriteFailed(self.bookie, ledger_id, lac, term)

    # ---------------------------------------------------------------- reads, trims, info

    async def read(self, ledger_id: int, first: int, last: int | None = None, *, max_entries: int = 0,
                   max_bytes: int = 0) -> ReadResult:
        """Entries first..last (contiguous prefix, bounded by the limits) and the bookie's LAC.
        Raises NoSuchLedgerError, NoSuchEntryError (first id absent), CorruptEntryError (first
        id corrupt), or another BookieError."""
        return await self._read(ledger_id, first, first if last is None else last, max_entries, max_bytes, 0, 0.0)

    async def read_tail(self, ledger_id: int, first: int, last: int, *, wait_s: float = 0.0, max_entries: int = 0,
                        max_bytes: int = 0) -> ReadResult:
        """A long-poll "read LAC and entries": once the bookie's LAC reaches ``first`` (waiting up
        to ``wait_s``), the entries it holds from ``first`` up to ``last`` and its LAC, which bounds
        them. No new entry in time gives no entries and ``timed_out``; an entry this bookie does not
        hold gives no entries (with the LAC). Raises NoSuchLedgerError or another BookieError."""
        wait_ms = max(1, int(wait_s * 1000)) if wait_s > 0 else -1
        return await self._read(ledger_id, first, last, max_entries, max_bytes, wait_ms, max(wait_s, 0.0))

    async def _read(self, ledger_id: int, first: int, last: int, max_entries: int, max_bytes: int, wait_ms: int,
                    wait_s: float) -> ReadResult:
        body = await self._call(
            wire.READ, lambda rid: wire.encode_read(rid, ledger_id, first, last, max_entries, max_bytes, wait_ms),
            ledger_id, extra_s=wait_s,
        )
        status, lac, lafr, stop, term, timed_out, raw, error = wire.decode_read_answer(body)
        if status != Status.OK:
            raise error_for(status, error or f"read ledger {ledger_id} entry {first}")
        entries, stop = [], Status(stop)
        for eid, eterm, dtype, dig, data in raw:
            if not self._verify(ledger_id, eid, dtype, data, dig):
                stop = Status.CORRUPT
                break
            entries.append(Entry(eid, eterm, data, dtype, dig))
        if not entries and not wait_ms:
            raise CorruptEntryError(f"ledger {ledger_id} entry {first}: digest mismatch")
        return ReadResult(lac, lafr, entries, stop, term, timed_out=timed_out)

    async def read_lac(self, ledger_id: int, after_lac: int = -1, timeout_s: float = 0.0) -> LacResult:
        """The ledger's LAC; with a timeout, waits until it is > after_lac (long poll)."""
        timeout_ms = int(timeout_s * 1000) if timeout_s > 0 else 0
        body = await self._call(
            wire.READ_LAC, lambda rid: wire.encode_read_lac(rid, ledger_id, after_lac, timeout_ms), ledger_id,
            extra_s=timeout_s,
        )
        status, lac, lafr, term, timed_out, error = wire.decode_read_lac_answer(body)
        if status != Status.OK:
            raise error_for(status, error or f"read LAC of ledger {ledger_id}")
        return LacResult(lac, lafr, timed_out, term)

    async def trim(self, ledger_id: int, first: int, last: int) -> None:
        """Delete the ledger's entries with first <= id <= last (retention)."""
        req = pb.TrimRequest(ledger_id=ledger_id, first_entry_id=first, last_entry_id=last)
        r = await self._unary(self._stub.Trim, req)
        if r.status != Status.OK:
            raise error_for(r.status, r.error)

    async def delete_ledger(self, ledger_id: int) -> None:
        r = await self._unary(self._stub.Trim, pb.TrimRequest(ledger_id=ledger_id, whole_ledger=True))
        if r.status != Status.OK:
            raise error_for(r.status, r.error)

    async def info(self) -> BookieInfo:
        r = await self._unary(self._stub.Info, pb.InfoRequest())
        return BookieInfo(
            r.bookie_id, r.free_bytes, r.used_bytes, r.read_only, r.read_only_reason, r.ledgers, r.write_cache_bytes, r.version,
            r.scrub_passes, r.scrub_entries, r.scrub_corrupt, r.scrub_last_pass_end, r.scrub_running,
            tuple((f.ledger_id, f.entry_id, f.reason, f.found_by, f.at, f.removed) for f in r.scrub_findings),
            r.scrub_last_pass_start, r.scrub_pass_started, r.scrub_pass_entries,
            (r.scrub_position_ledger, r.scrub_position_entry) if r.scrub_position_ledger >= 0 else None,
            r.scrub_repaired, r.scrub_awaiting_repair,
        )

    async def scrub(self) -> bool:
        """Have the bookie start a scrub pass now; False if one was already running. Its progress
        and findings are in ``info()`` (scrub_passes, scrub_corrupt, scrub_findings)."""
        r = await self._unary(self._stub.Scrub, pb.ScrubRequest())
        if r.status != Status.OK:
            raise error_for(r.status, r.error)
        return r.started

    def _tracked(self, method, req, extra_s: float = 0.0):
        """Start a unary call, kept in ``_calls`` until gRPC has its status, even when the task
        awaiting it was cancelled (a losing speculative read): close() waits for them."""
        call = method(req, timeout=self.call_timeout_s + extra_s, metadata=self._metadata)
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    async def _unary(self, method, req, extra_s: float = 0.0):
        try:
            return await self._tracked(method, req, extra_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise TooLargeError(_describe(exc)) from exc
            if _refused(exc):
                raise BookieAuthError(f"bookie {self.bookie} refused this client: {_describe(exc)}",
                                      definite=exc.code() == grpc.StatusCode.UNAUTHENTICATED) from exc
            # gRPC's only word for a TLS mismatch or a refused client certificate: "Socket closed" (a
            # bookie that is down says "Connection refused" and is not probed)
            closed = exc.code() == grpc.StatusCode.UNAVAILABLE and "socket closed" in (exc.details() or "").lower()
            reason = await self._diagnose() if closed else None
            if reason is not None:
                # inferred from one TLS connection of our own: a bookie stopping right then looks alike
                raise BookieAuthError(f"bookie {self.bookie} refused this client: {reason}", definite=False) from exc
            raise BookieUnavailableError(f"bookie {self.bookie}: {_describe(exc)}") from exc

    async def _diagnose(self, timeout_s: float = 1.0) -> str | None:
        """After gRPC could not set up a channel: whether TLS is why. gRPC only says "Socket
        closed" when the bookie refused our certificate (TLS 1.3 refuses after the handshake) or
        when one side speaks TLS and the other does not; one TLS connection of our own tells which,
        with OpenSSL's reason. None: not a TLS problem (the bookie is down, slow, ...)."""
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        ctx = self.security.ssl_context()
        if ctx is None:  # are we talking plaintext to a TLS bookie?
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=host), timeout_s)
        except ssl.SSLError as exc:
            return f"TLS handshake failed: {exc.reason or exc}" if self.security.tls else None
        except (OSError, TimeoutError):
            return None
        try:
            if not self.security.tls:
                return "the bookie speaks TLS and this client does not: pass tls.ca (--tls-ca)"
            try:
                first = await asyncio.wait_for(reader.read(1), timeout_s)
            except ssl.SSLError as exc:
                return f"the bookie refused this client's TLS: {exc.reason or exc}"
            except (OSError, TimeoutError):
                return None
            if first:
                return None
            return ("the bookie closed the TLS connection after the handshake: it requires a client certificate "
                    "it trusts (none given, from another CA, or expired?)")
        finally:
            writer.transport.abort()  # no TLS close_notify exchange: a gRPC server may never answer it

    def _log_rpc_error(self, exc: grpc.aio.AioRpcError, fmt: str, *args) -> None:
        if _refused(exc):
            log.error(fmt.replace("failed", "refused"), *args, _describe(exc))
        else:
            log.warning(fmt, *args, _describe(exc))

    def _verify(self, ledger_id: int, entry_id: int, dtype: int, data: bytes, dig: bytes) -> bool:
        return digests.verify(dtype, ledger_id, entry_id, data, dig, self._keys.get(ledger_id))


__all__ = [
    "AddResults",
    "BookieClient",
    "BookieError",
    "BookieInfo",
    "Entry",
    "LacResult",
    "LacWritten",
    "ReadResult",
    "UNAVAILABLE",
]
