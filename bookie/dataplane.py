"""The bookie's data plane: adds, reads, LACs, fences and recovery reads over the binary frames of
``bookie.wire``.

How this works. One asyncio ``Protocol`` per client connection, on the event loop that runs the
engine. ``data_received`` splits frames and handles each one at once, without a task or a queue:
an add is decided, applied and journaled synchronously (``engine.add_batch``; nothing awaits
between the term check and the journal append) and its answer leaves from a callback on the
journal's group-commit future, the moment the fsync returns. Reads are served synchronously from
the caches; only a part that needs the disk continues in a task (the read threads). A long-poll
read or LAC read parks a callback on the engine's LAC waiters plus one timer. A fence (and the
term part of a recovery read) is decided and journaled synchronously like an add, so the fences of
many ledgers in one read share one journal commit; the answer waits for it to be durable, and a
recovery read's entry is then read as a read's is.

Limits: while the write cache is full, or a connection has ``max_inflight_batches_per_stream``
adds awaiting their fsync, or its answers are not being read (transport write buffer over the high
mark), the connection stops reading; frames already received wait in order. A frame that does not
parse is answered with ERROR and the connection is closed; a bad request inside a well-formed
frame (negative ids, a bad digest, an unknown ledger) gets its status in the answer and nothing
else changes.

Authentication (``BookieSecurity``): with TLS the listener wraps every connection in TLS. When the
bookie requires authentication, a connection starts unauthenticated unless its verified client
certificate authenticates it; until then it may send one AUTH frame (a token) of at most
``wire.MAX_PREAUTH_FRAME_BYTES`` within ``PREAUTH_TIMEOUT_S``, and anything else (another op, a
larger frame, a wrong token, silence) is answered UNAUTHENTICATED and closed, so an unauthenticated
peer costs a bounded amount of work and memory. Once authenticated, the connection is exactly the
plain one: one boolean, checked once per received chunk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct

from fragments.security import AUTH_REQUIRED_MESSAGE, INVALID_TOKEN_MESSAGE, BookieSecurity
from fragments.tlsreload import ReloadableServerContext
from terms.bookie_rules import Reject

from . import wire
from .errors import BookieError, Status
from .storage import Engine

log = logging.getLogger(__name__)

PREAUTH_TIMEOUT_S = 10.0  # an unauthenticated connection that does not authenticate by then is closed


def _status_of(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BookieError):
        return int(exc.status), exc.message or type(exc).__name__
    log.exception("unexpected error while serving a request", exc_info=exc)
    return int(Status.INTERNAL), f"internal error: {type(exc).__name__}"


class DataServer:
    """Listens for data-plane connections; ``inflight`` counts adds awaiting their fsync."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, max_frame_bytes: int = wire.MAX_FRAME_BYTES_DEFAULT,
                 security: BookieSecurity | None = None) -> None:
        self.engine = engine
        self.security = security or BookieSecurity()
        self.auth_required = self.security.auth_required
        self.host = host
        self.port = port
        self.max_frame_bytes = max_frame_bytes
        self.inflight = 0
        self.connections: set[DataConnection] = set()
        self._server: asyncio.Server | None = None
        # TLS: the certificate BookieServer.reload_certificates replaces (SIGHUP) for new handshakes
        self.tls: ReloadableServerContext | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.security.tls:
            self.tls = ReloadableServerContext(self.security.server_ssl_context, "bookie data port",
                                               self.security.tls_cert)
        self._server = await loop.create_server(lambda: DataConnection(self), self.host, self.port, reuse_address=True,
                                                ssl=self.tls.context if self.tls is not None else None)
        self.port = self._server.sockets[0].getsockname()[1]

    def gauge(self, delta: int) -> None:
        self.inflight += delta
        self.engine.metrics.queue_depth.set(self.inflight)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting; let answers owed to clients go out (up to ``grace_s``); close."""
        if self._server is None:
            return
        self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        for c in list(self.connections):
            c.pause()
        while self.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c.close()
        await self._server.wait_closed()


class DataConnection(asyncio.Protocol):
    def __init__(self, server: DataServer) -> None:
        self.server = server
        self.engine = server.engine
        self.authed = not server.auth_required
        self.reader = wire.FrameReader(server.max_frame_bytes if self.authed else wire.MAX_PREAUTH_FRAME_BYTES)
        self.auth_timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.backlog: collections.deque = collections.deque()  # frames received but held back
        self.inflight = 0  # adds awaiting their fsync on this connection
        self.write_paused = False
        self.read_paused = False
        self.space_task: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()
        self.waits: set = set()  # (ledger id, future, timer) of parked long polls
        self._unsynced: list = []  # adds of the frames being handled, answered once synced

    # ---------------------------------------------------------------- transport events
    def connection_made(self, transport) -> None:
        self.transport = transport
        limit = self.engine.config.max_add_streams
        if len(self.server.connections) >= limit:
            transport.write(wire.encode_error(0, Status.TOO_BUSY, f"too many data connections (max {limit})"))
            transport.close()
            self.closed = True
            return
        self.server.connections.add(self)
        if not self.authed:
            if self.server.security.certs_authenticate and transport.get_extra_info("peercert"):
                self._authenticated()  # a client certificate that verified against the client CA
            else:
                self.auth_timer = asyncio.get_running_loop().call_later(PREAUTH_TIMEOUT_S, self._refuse, 0,
                                                                        AUTH_REQUIRED_MESSAGE)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.auth_timer is not None:
            self.auth_timer.cancel()
        self.server.connections.discard(self)
        for lid, fut, timer in list(self.waits):
            timer.cancel()
            self.engine.forget_lac_waiter(lid, fut)
        self.waits.clear()
        for t in list(self.tasks):
            t.cancel()
        if self.space_task is not None:
            self.space_task.cancel()
        self.backlog.clear()

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()
        self._drain_backlog()

    def data_received(self, data: bytes) -> None:
        if not self.authed:
            self._preauth(data)
            return
        try:
            frames = self.reader.feed(data)
        except wire.FrameError as exc:
            self._broken(0, str(exc))
            return
        self._dispatch(frames)

    def _dispatch(self, frames: list) -> None:
        if self.backlog or self._held():
            self.backlog.extend(frames)
            self._update_reading()
            return
        committer = self.engine.committer
        if committer is not None:
            committer.hold()  # one journal commit for the whole read, right after it
        try:
            for i, (op, rid, body) in enumerate(frames):
                if self.closed:
                    return
                if op == wire.ADD and self._held():
                    self.backlog.extend(frames[i:])
                    self._update_reading()
                    return
                self._handle(op, rid, body)
        finally:
            if committer is not None:
                committer.release()
            self._answer_unsynced()

    # ---------------------------------------------------------------- authentication
    def _preauth(self, data: bytes) -> None:
        """Before authentication: only AUTH frames (small ones) are read."""
        try:
            frames = self.reader.feed(data)
        except wire.FrameError:
            self._refuse(0, AUTH_REQUIRED_MESSAGE)
            return
        for i, (op, rid, body) in enumerate(frames):
            if op != wire.AUTH:
                self._refuse(rid, AUTH_REQUIRED_MESSAGE)
                return
            try:
                token = wire.decode_auth(body)
            except wire.FrameError:
                self._refuse(rid, "malformed AUTH frame")
                return
            if not self.server.security.token_ok(token):
                self._refuse(rid, INVALID_TOKEN_MESSAGE)
                return
            self._authenticated()
            self._send(wire.encode_auth_answer(rid, Status.OK))
            if frames[i + 1:]:
                self._dispatch(frames[i + 1:])
            return

    def _authenticated(self) -> None:
        self.authed = True
        self.reader.max_frame_bytes = self.server.max_frame_bytes
        if self.auth_timer is not None:
            self.auth_timer.cancel()
            self.auth_timer = None

    def _auth_again(self, rid: int, body: memoryview) -> None:
        """An AUTH frame on an authenticated connection (a client with a token and a certificate)."""
        sec = self.server.security
        if sec.tokens and not sec.token_ok(wire.decode_auth(body)):
            self._refuse(rid, INVALID_TOKEN_MESSAGE)
            return
        self._send(wire.encode_auth_answer(rid, Status.OK))

    def _refuse(self, rid: int, reason: str) -> None:
        if self.closed:
            return
        log.warning("data connection %s: refused (%s): closing it", self._peer(), reason)
        self._send(wire.encode_error(rid, Status.UNAUTHENTICATED, reason))
        self.close()
        self.closed = True  # frames after it in the same read are not handled

    # ---------------------------------------------------------------- flow control
    def _held(self) -> bool:
        """Whether adds must wait: write cache full, too many adds in flight, answers unread."""
        e = self.engine
        if self.write_paused or self.inflight >= e.config.max_inflight_batches_per_stream:
            return True
        if e.adds_must_wait():
            if self.space_task is None:
                self.space_task = asyncio.get_running_loop().create_task(self._wait_space())
            return True
        return False

    async def _wait_space(self) -> None:
        try:
            await self.engine.wait_for_space()
        finally:
            self.space_task = None
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        committer = self.engine.committer
        if committer is not None:
            committer.hold()
        try:
            while self.backlog and not self.closed:
                op = self.backlog[0][0]
                if op == wire.ADD and self._held():
                    break
                op, rid, body = self.backlog.popleft()
                self._handle(op, rid, body)
        finally:
            if committer is not None:
                committer.release()
            self._answer_unsynced()
        self._update_reading()

    def _update_reading(self) -> None:
        if self.closed or self.transport is None:
            return
        want_pause = bool(self.backlog) or self.write_paused
        if want_pause and not self.read_paused:
            self.transport.pause_reading()
            self.read_paused = True
        elif not want_pause and self.read_paused:
            self.transport.resume_reading()
            self.read_paused = False

    def pause(self) -> None:
        """Shutdown: take no more frames."""
        if not self.closed and self.transport is not None and not self.read_paused:
            self.transport.pause_reading()
            self.read_paused = True

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _send(self, frame) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if isinstance(frame, list):
            self.transport.writelines(frame)
        else:
            self.transport.write(frame)

    def _broken(self, rid: int, reason: str) -> None:
        log.warning("data connection %s: malformed frame (%s): closing it", self._peer(), reason)
        self._send(wire.encode_error(rid, Status.BAD_REQUEST, f"malformed frame: {reason}"))
        self.close()
        self.closed = True  # frames after it in the same read are not handled

    def _peer(self) -> str:
        try:
            return str(self.transport.get_extra_info("peername"))
        except Exception:  # noqa: BLE001 - only for a log line
            return "?"

    # ---------------------------------------------------------------- dispatch
    def _handle(self, op: int, rid: int, body: memoryview) -> None:
        try:
            if op == wire.ADD:
                self._add(rid, body)
            elif op == wire.READ:
                self._read(rid, *wire.READ_REQ.unpack(body))
            elif op == wire.READ_LAC:
                self._read_lac(rid, *wire.READ_LAC_REQ.unpack(body))
            elif op == wire.WRITE_LAC:
                self._write_lac(rid, *wire.WRITE_LAC_REQ.unpack(body))
            elif op == wire.FENCE:
                self._fence(rid, *wire.FENCE_REQ.unpack(body))
            elif op == wire.RECOVERY_READ:
                self._recovery_read(rid, *wire.RECOVERY_READ_REQ.unpack(body))
            elif op == wire.AUTH:
                self._auth_again(rid, body)
            else:
                self._broken(rid, f"unknown op {op}")
        except (wire.FrameError, struct.error) as exc:  # a body that does not parse
            self._broken(rid, f"op {op}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a refused request (too busy, ...) or our bug
            code, message = _status_of(exc)
            self._send(wire.encode_error(rid, code, message))

    # ---------------------------------------------------------------- adds
    def _add(self, rid: int, body: memoryview) -> None:
        cols = wire.decode_add(body)
        n = len(cols[0])
        try:
            outcome = self.engine.add_batch(*cols)
        except Exception as exc:  # noqa: BLE001 - a bad batch is answered, not fatal
            code, message = _status_of(exc)
            self._send(wire.encode_add_answer(rid, n, [code] * n, [-1] * n, message))
            return
        if outcome.seq <= 0 or self.engine.committer is None:
            self._send(wire.encode_add_answer(rid, n, outcome.statuses, outcome.bookie_terms))
            return
        # answered after the read's journal commit (``_answer_unsynced``): most often synced by
        # then, and answered with no future or callback in between
        self._unsynced.append((rid, n, outcome))

    def _answer_unsynced(self) -> None:
        pending, self._unsynced = self._unsynced, []
        committer = self.engine.committer
        for rid, n, outcome in pending:
            fut = committer.wait_synced(outcome.seq)
            if fut is None:
                self._send(wire.encode_add_answer(rid, n, outcome.statuses, outcome.bookie_terms))
                continue
            self.inflight += 1
            self.server.gauge(1)
            fut.add_done_callback(lambda f, rid=rid, n=n, outcome=outcome: self._added(rid, n, outcome, f))

    def _added(self, rid: int, n: int, outcome, fut: asyncio.Future) -> None:
        self.inflight -= 1
        self.server.gauge(-1)
        exc = fut.exception() if not fut.cancelled() else BookieError("cancelled")
        if exc is None:
            self._send(wire.encode_add_answer(rid, n, outcome.statuses, outcome.bookie_terms))
        else:
            code, message = _status_of(exc)
            statuses = outcome.statuses or [0] * n
            # rejected adds keep their answer; the accepted ones were not made durable
            failed = [s if s else code for s in statuses]
            self._send(wire.encode_add_answer(rid, n, failed, outcome.bookie_terms or [-1] * n, message))
        if self.backlog:
            self._drain_backlog()

    # ---------------------------------------------------------------- reads
    def _read(self, rid: int, lid: int, first: int, last: int, max_entries: int, max_bytes: int, wait_ms: int) -> None:
        """``wait_ms`` 0: a plain range read; otherwise a tail read, capped at the LAC, which
        first waits up to ``wait_ms`` (> 0) for the LAC to reach ``first`` (-1: no wait)."""
        if wait_ms == 0:
            self._read_now(rid, lid, first, last, max_entries, max_bytes, False, False)
            return
        st = self.engine.state(lid)
        if wait_ms > 0 and (st is None or st.lac < first):
            self._park(lid, first - 1, wait_ms, lambda timed_out: self._read_now(rid, lid, first, last, max_entries, max_bytes, True, timed_out))
            return
        self._read_now(rid, lid, first, last, max_entries, max_bytes, True, False)

    def _park(self, lid: int, after: int, wait_ms: int, then) -> None:
        """Call ``then(timed_out)`` once the LAC passes ``after`` or ``wait_ms`` passed."""
        e = self.engine
        item: list = []

        def fire(timed_out: bool) -> None:
            if not item or item[0] not in self.waits:
                return
            self.waits.discard(item[0])
            item[0][2].cancel()
            e.forget_lac_waiter(lid, item[0][1])
            if not self.closed:
                then(timed_out)

        # answered from inside the add / LAC write that moves the LAC (before its fsync), not a
        # loop turn after the journal commit; the future's callback stays for shutdown
        fut = e.lac_waiter(lid, after, lambda: fire(False))  # raises TooBusyError at the waiter limit
        if fut is None:
            then(False)
            return
        loop = asyncio.get_running_loop()
        timeout = min(wait_ms / 1000.0, e.config.long_poll_max_s)

        timer = loop.call_later(timeout, fire, True)
        item.append((lid, fut, timer))
        self.waits.add(item[0])
        fut.add_done_callback(lambda _f: fire(False))

    def _read_now(self, rid: int, lid: int, first: int, last: int, max_entries: int, max_bytes: int,
                  long_poll: bool, timed_out: bool) -> None:
        e = self.engine
        st = e.state(lid)
        if long_poll:
            if st is None:
                self._send(wire.encode_read_answer(rid, Status.NO_SUCH_LEDGER, -1, -1, Status.NO_SUCH_LEDGER, -1,
                                                   timed_out, (), f"ledger {lid} is not on this bookie"))
                return
            if st.lac < first:  # nothing new (in time): the LAC and term tell the reader what is known
                self._send(wire.encode_read_answer(rid, Status.OK, st.lac, st.lafr, Status.NO_SUCH_ENTRY, st.term, True, ()))
                return
            last = min(last, st.lac)
            # a tail read answers the entries it has (OK, maybe none) with the LAC, never an error
            # for an entry this bookie does not hold (a striped fragment, or a member that joined later)
        try:
            steps = e.range_steps(lid, first, last, max_entries, max_bytes)
            args = next(steps)
        except StopIteration as done:
            self._answer_read(rid, lid, done.value, long_poll)
            return
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_read_answer(rid, code, -1, -1, code, -1, False, (), message))
            return
        t = asyncio.get_running_loop().create_task(self._read_disk(rid, lid, steps, args, long_poll))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _read_disk(self, rid: int, lid: int, steps, args, tail: bool) -> None:
        try:
            res = await self.engine.finish_range(steps, args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_read_answer(rid, code, -1, -1, code, -1, False, (), message))
            return
        self._answer_read(rid, lid, res, tail)

    def _answer_read(self, rid: int, lid: int, res, tail: bool = False) -> None:
        st = self.engine.state(lid)
        term = st.term if st is not None else -1
        status = Status.OK if res.entries or tail else res.stop
        self._send(wire.encode_read_answer(rid, status, res.lac, res.lafr, res.stop, term, False, res.entries))

    # ---------------------------------------------------------------- LACs
    def _read_lac(self, rid: int, lid: int, after: int, timeout_ms: int) -> None:
        if timeout_ms > 0:
            self._park(lid, after, timeout_ms, lambda timed_out: self._answer_lac(rid, lid, after, timed_out))
        else:
            self._answer_lac(rid, lid, after, False)

    def _answer_lac(self, rid: int, lid: int, after: int, timed_out: bool) -> None:
        st = self.engine.state(lid)
        if st is None:
            self._send(wire.encode_read_lac_answer(rid, Status.NO_SUCH_LEDGER, -1, -1, -1, timed_out,
                                                   f"ledger {lid} is not on this bookie"))
            return
        self._send(wire.encode_read_lac_answer(rid, Status.OK, st.lac, st.lafr, st.term, timed_out or st.lac <= after))

    def _write_lac(self, rid: int, lid: int, term: int, lac: int, lafr: int) -> None:
        e = self.engine
        try:
            decision, seq = e.write_lac(lid, term, lac, lafr)
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_write_lac_answer(rid, code, getattr(exc, "bookie_term", -1), message))
            return
        if isinstance(decision, Reject):
            code = Status.NOT_TRUNCATED if decision.not_truncated else Status.INVALID_TERM
            self._send(wire.encode_write_lac_answer(rid, code, decision.bookie_term))
            return
        term_now = decision.state.term
        committer = e.committer
        fut = committer.wait_synced(seq) if seq > 0 and committer is not None else None
        if fut is None:
            self._send(wire.encode_write_lac_answer(rid, Status.OK, term_now))
            return

        def done(f: asyncio.Future) -> None:
            exc = f.exception() if not f.cancelled() else BookieError("cancelled")
            if exc is None:
                self._send(wire.encode_write_lac_answer(rid, Status.OK, term_now))
            else:
                code, message = _status_of(exc)
                self._send(wire.encode_write_lac_answer(rid, code, -1, message))

        fut.add_done_callback(done)

    # ---------------------------------------------------------------- take-over: fence, recovery read
    def _fence(self, rid: int, lid: int, term: int) -> None:
        e = self.engine
        try:
            decision, seq = e.fence(lid, term)
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_fence_answer(rid, code, -1, -1, -1, message))
            return
        if isinstance(decision, Reject):
            self._send(wire.encode_fence_answer(rid, Status.INVALID_TERM, decision.bookie_term, -1, -1))
            return
        st = decision.state

        def answer() -> None:
            self._send(wire.encode_fence_answer(rid, Status.OK, st.term, st.lac, st.lafr))

        committer = e.committer
        fut = committer.wait_synced(seq) if seq > 0 and committer is not None else None
        if fut is None:
            answer()
            return

        def done(f: asyncio.Future) -> None:
            exc = f.exception() if not f.cancelled() else BookieError("cancelled")
            if exc is None:
                answer()
            else:
                code, message = _status_of(exc)
                self._send(wire.encode_fence_answer(rid, code, -1, -1, -1, message))

        fut.add_done_callback(done)

    def _recovery_read(self, rid: int, lid: int, eid: int, term: int) -> None:
        try:
            decision, seq = self.engine.recovery_read_decide(lid, eid, term)
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_recovery_read_answer(rid, code, -1, -1, error=message))
            return
        if isinstance(decision, Reject):
            self._send(wire.encode_recovery_read_answer(rid, Status.INVALID_TERM, decision.bookie_term, -1))
            return
        t = asyncio.get_running_loop().create_task(self._recovery_read_durable(rid, lid, eid, seq, decision.state))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _recovery_read_durable(self, rid: int, lid: int, eid: int, seq: int, state) -> None:
        e = self.engine
        try:
            await e.wait_durable(seq)
            entry = await e.aread_entry(lid, eid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with its status
            code, message = _status_of(exc)
            self._send(wire.encode_recovery_read_answer(rid, code, -1, -1, error=message))
            return
        st = e.state(lid)
        lac = st.lac if st is not None else -1
        if entry is None:
            self._send(wire.encode_recovery_read_answer(rid, Status.NO_SUCH_ENTRY, state.term, lac))
            return
        self._send(wire.encode_recovery_read_answer(rid, Status.OK, state.term, lac, entry[0], entry[1], entry[2],
                                                    entry[3]))
