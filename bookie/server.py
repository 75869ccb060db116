"""The bookie's gRPC service (grpc.aio) on top of the storage engine.

How this works. One asyncio event loop runs the gRPC server and the engine. The add stream handler
reads batches; for each it waits for write-cache space (back-pressure), then calls
``engine.add_batch`` (decide + apply + journal append, no await inside) and queues the batch's
journal seq. A second coroutine of the same call takes the queue in order, awaits each seq's group
commit, and writes the batch's answer; so the reader keeps feeding the journal while earlier
batches are being synced, and at most ``max_inflight_batches_per_stream`` batches wait per stream.
Unary calls (fence, recovery read, LAC write, trim) decide synchronously, then await durability of
whatever the answer depends on. Reads go through the engine's caches and a read thread pool.
Long-poll LAC reads park a future that the engine resolves the moment the LAC moves.

Every handler turns a ``BookieError`` into its status code in the answer; anything unexpected is
logged and answered INTERNAL; the server never dies on a bad request. ``BookieServer`` owns the
life cycle: open storage, bind (127.0.0.1 by default), serve, and on stop: refuse new work, let
in-flight calls finish, sync, checkpoint, close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from terms.bookie_rules import Reject

from .config import BookieConfig
from .errors import BookieError, InvalidTermError, Status
from .metrics import BookieMetrics
from .proto import bookie_pb2 as pb
from .proto import bookie_pb2_grpc as pb_grpc
from .storage import Engine

log = logging.getLogger(__name__)

VERSION = "scroll-bookie/0.1"


def _status_of(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BookieError):
        return int(exc.status), exc.message or type(exc).__name__
    log.exception("unexpected error while serving a request", exc_info=exc)
    return int(Status.INTERNAL), f"internal error: {type(exc).__name__}"


class BookieService(pb_grpc.BookieServicer):
    def __init__(self, engine: Engine, bookie_id: str) -> None:
        self.engine = engine
        self.bookie_id = bookie_id
        self.streams = 0
        self.inflight = 0

    # ---------------------------------------------------------------- adds

    async def Add(self, request_iterator: AsyncIterator[pb.AddBatch], context) -> AsyncIterator[pb.AddBatchResult]:
        cfg = self.engine.config
        if self.streams >= cfg.max_add_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many add streams (max {cfg.max_add_streams})")
        self.streams += 1
        queue: asyncio.Queue = asyncio.Queue(cfg.max_inflight_batches_per_stream)
        reader = asyncio.get_running_loop().create_task(self._read_adds(request_iterator, queue))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield await self._answer(*item)
            broken = await reader  # it ends right after queueing the None
        finally:
            self.streams -= 1
            reader.cancel()
            self._forget_queued(queue)
        if broken is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed add stream: {broken}")

    async def _read_adds(self, request_iterator: AsyncIterator[pb.AddBatch], queue: asyncio.Queue) -> str | None:
        """Feed the queue; returns why the stream broke (None: the client finished it)."""
        try:
            async for batch in request_iterator:
                await self.engine.wait_for_space()
                await queue.put(self._process(batch))
            reason = None
        except asyncio.CancelledError:
            raise  # the handler is gone: nobody reads the queue any more
        except Exception as exc:  # undecodable message: answered after the queued batches
            log.warning("add stream broken by bad input: %r", exc)
            reason = repr(exc)
        await queue.put(None)
        return reason

    def _forget_queued(self, queue: asyncio.Queue) -> None:
        """A cancelled stream leaves processed batches unanswered: keep the gauge right."""
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None and item[2] is not None:
                self.inflight -= 1
        self.engine.metrics.queue_depth.set(self.inflight)

    def _process(self, batch: pb.AddBatch) -> tuple:
        """Decide, apply and journal one batch; synchronous (no await between decide and append)."""
        n = len(batch.ledger_id)
        try:
            outcome = self.engine.add_batch(
                batch.ledger_id, batch.entry_id, batch.term, batch.lac, batch.lafr,
                batch.truncate, batch.recovery, batch.digest_type, batch.digest, batch.data,
            )
        except Exception as exc:
            code, message = _status_of(exc)
            return batch.batch_id, n, None, code, message
        self.inflight += 1
        self.engine.metrics.queue_depth.set(self.inflight)
        return batch.batch_id, n, outcome, 0, ""

    async def _answer(self, batch_id: int, n: int, outcome, code: int, message: str) -> pb.AddBatchResult:
        if outcome is None:
            return pb.AddBatchResult(batch_id=batch_id, status=[code] * n, bookie_term=[-1] * n, error=message)
        try:
            await self.engine.wait_durable(outcome.seq)
        except Exception as exc:
            code, message = _status_of(exc)
            statuses = outcome.statuses or [0] * n
            # rejected adds keep their answer; the accepted ones were not made durable
            failed = [s if s else code for s in statuses]
            return pb.AddBatchResult(batch_id=batch_id, status=failed, bookie_term=outcome.bookie_terms or [-1] * n, error=message)
        finally:
            self.inflight -= 1
            self.engine.metrics.queue_depth.set(self.inflight)
        if outcome.statuses is None:
            return pb.AddBatchResult(batch_id=batch_id, all_ok=True)
        return pb.AddBatchResult(batch_id=batch_id, status=outcome.statuses, bookie_term=outcome.bookie_terms)

    # ---------------------------------------------------------------- fence, recovery read, LAC

    async def Fence(self, request: pb.FenceRequest, context) -> pb.FenceResponse:
        try:
            decision, seq = self.engine.fence(request.ledger_id, request.term)
            if isinstance(decision, Reject):
                return pb.FenceResponse(status=Status.INVALID_TERM, bookie_term=decision.bookie_term)
            await self.engine.wait_durable(seq)
            st = decision.state
            return pb.FenceResponse(status=Status.OK, bookie_term=st.term, lac=st.lac, lafr=st.lafr)
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.FenceResponse(status=code, error=message)

    async def RecoveryRead(self, request: pb.RecoveryReadRequest, context) -> pb.RecoveryReadResponse:
        try:
            decision, seq = self.engine.recovery_read_decide(request.ledger_id, request.entry_id, request.term)
            if isinstance(decision, Reject):
                return pb.RecoveryReadResponse(status=Status.INVALID_TERM, bookie_term=decision.bookie_term)
            await self.engine.wait_durable(seq)
            entry = await self.engine.aread_entry(request.ledger_id, request.entry_id)
            st = self.engine.state(request.ledger_id)
            lac = st.lac if st is not None else -1
            if entry is None:
                return pb.RecoveryReadResponse(status=Status.NO_SUCH_ENTRY, bookie_term=decision.state.term, lac=lac)
            return pb.RecoveryReadResponse(
                status=Status.OK, bookie_term=decision.state.term, entry_term=entry[0],
                digest_type=entry[1], digest=entry[2], data=entry[3], lac=lac,
            )
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.RecoveryReadResponse(status=code, error=message)

    async def WriteLac(self, request: pb.WriteLacRequest, context) -> pb.WriteLacResponse:
        try:
            decision, seq = self.engine.write_lac(request.ledger_id, request.term, request.lac, request.lafr)
            if isinstance(decision, Reject):
                code = Status.NOT_TRUNCATED if decision.not_truncated else Status.INVALID_TERM
                return pb.WriteLacResponse(status=code, bookie_term=decision.bookie_term)
            await self.engine.wait_durable(seq)
            return pb.WriteLacResponse(status=Status.OK, bookie_term=decision.state.term)
        except Exception as exc:
            code, message = _status_of(exc)
            term = exc.bookie_term if isinstance(exc, InvalidTermError) else -1
            return pb.WriteLacResponse(status=code, bookie_term=term, error=message)

    # ---------------------------------------------------------------- reads

    async def Read(self, request: pb.ReadRequest, context) -> pb.ReadResponse:
        try:
            res = await self.engine.aread_range(
                request.ledger_id, request.first_entry_id, request.last_entry_id, request.max_entries, request.max_bytes
            )
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.ReadResponse(status=code, error=message)
        entries = res.entries
        status = Status.OK if entries else res.stop
        st = self.engine.state(request.ledger_id)
        term = st.term if st is not None else -1
        if not entries:
            return pb.ReadResponse(status=status, lac=res.lac, lafr=res.lafr, stop_status=res.stop, bookie_term=term)
        return pb.ReadResponse(
            status=status, lac=res.lac, lafr=res.lafr, stop_status=res.stop, bookie_term=term,
            entry_id=[eid for eid, _e in entries], entry_term=[e[0] for _i, e in entries],
            digest_type=[e[1] for _i, e in entries], digest=[e[2] for _i, e in entries], data=[e[3] for _i, e in entries],
        )

    async def ReadLac(self, request: pb.ReadLacRequest, context) -> pb.ReadLacResponse:
        engine = self.engine
        lid = request.ledger_id
        timeout = min(request.timeout_ms / 1000.0, engine.config.long_poll_max_s)
        timed_out = False
        try:
            fut = engine.lac_waiter(lid, request.after_lac) if timeout > 0 else None
            if fut is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout)
                except TimeoutError:
                    timed_out = True
                finally:
                    engine.forget_lac_waiter(lid, fut)
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.ReadLacResponse(status=code, error=message)
        st = engine.state(lid)
        if st is None:
            return pb.ReadLacResponse(status=Status.NO_SUCH_LEDGER, lac=-1, lafr=-1, timed_out=timed_out)
        return pb.ReadLacResponse(status=Status.OK, lac=st.lac, lafr=st.lafr, bookie_term=st.term,
                                  timed_out=timed_out or st.lac <= request.after_lac)

    # ---------------------------------------------------------------- trims, info

    async def Trim(self, request: pb.TrimRequest, context) -> pb.TrimResponse:
        try:
            if request.whole_ledger:
                seq = self.engine.delete_ledger(request.ledger_id)
            else:
                seq = self.engine.trim(request.ledger_id, request.first_entry_id, request.last_entry_id)
            await self.engine.wait_durable(seq)
            return pb.TrimResponse(status=Status.OK)
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.TrimResponse(status=code, error=message)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        e = self.engine
        loop = asyncio.get_running_loop()
        used = await loop.run_in_executor(None, e.used_bytes)
        return pb.InfoResponse(
            status=Status.OK, bookie_id=self.bookie_id, free_bytes=e.free_bytes(), used_bytes=used,
            read_only=e.read_only_reason is not None, read_only_reason=e.read_only_reason or "",
            ledgers=len(e.states), write_cache_bytes=e.write_cache.bytes, version=VERSION,
        )


class BookieServer:
    """Open storage, serve gRPC, stop gracefully."""

    def __init__(self, config: BookieConfig, host: str = "127.0.0.1", port: int = 0, metrics: BookieMetrics | None = None) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.metrics = metrics or BookieMetrics()
        self.engine = Engine(config, self.metrics)
        self.server: grpc.aio.Server | None = None
        self.service: BookieService | None = None
        self.bookie_id = config.bookie_id
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.open)
        await self.engine.start()
        limit = self.config.grpc_max_message_bytes
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot bind {self.host}:{self.port}")
        self.port = bound
        self.bookie_id = self.bookie_id or self.address
        self.service = BookieService(self.engine, self.bookie_id)
        pb_grpc.add_BookieServicer_to_server(self.service, self.server)
        await self.server.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.engine.aclose()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
