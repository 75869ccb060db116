"""The bookie's servers on top of the storage engine: gRPC (grpc.aio) for the control plane and
the binary data plane (``bookie.dataplane``) for adds, reads and LACs.

How this works. One asyncio event loop runs both servers and the engine. The control-plane calls
(fence, recovery read, trim, info) decide synchronously, then await durability of whatever the
answer depends on; a recovery read goes through the engine's caches and read threads. Info
reports the data plane's port, which is how a client that knows only the gRPC address finds it.

Every handler turns a ``BookieError`` into its status code in the answer; anything unexpected is
logged and answered INTERNAL; the server never dies on a bad request. ``BookieServer`` owns the
life cycle: open storage, bind both ports (127.0.0.1 by default), serve, and on stop: refuse new
work, let in-flight calls finish, sync, checkpoint, close.

Security (``fragments.security.BookieSecurity``): with a certificate both ports speak TLS. When
authentication is required, ``AuthInterceptor`` stands in front of every gRPC method (including
Info): a call passes with ``authorization: Bearer <token>`` metadata naming an accepted token, or
with a verified client certificate; otherwise it ends UNAUTHENTICATED before the handler runs.
``reload_certificates`` (``scroll bookie`` calls it on SIGHUP) re-reads the certificate, key and
client CA files: new handshakes on both ports use them, existing connections carry on; files that
cannot be used are logged and the certificate in use stays (``fragments.tlsreload``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from fragments.security import AUTH_REQUIRED_MESSAGE, INVALID_TOKEN_MESSAGE, BookieSecurity
from fragments.tlsreload import GrpcServerCertificates
from terms.bookie_rules import Reject

from .config import BookieConfig
from .dataplane import DataServer
from .errors import BookieError, Status
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
    def __init__(self, engine: Engine, bookie_id: str, data_port: int) -> None:
        self.engine = engine
        self.bookie_id = bookie_id
        self.data_port = data_port

    # ---------------------------------------------------------------- fence, recovery read

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
                digest_type=entry[1], digest=bytes(entry[2]), data=bytes(entry[3]), lac=lac,
            )
        except Exception as exc:
            code, message = _status_of(exc)
            return pb.RecoveryReadResponse(status=code, error=message)

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

    async def Scrub(self, request: pb.ScrubRequest, context) -> pb.ScrubResponse:
        running = self.engine.scrubber.running
        self.engine.scrubber.trigger()
        return pb.ScrubResponse(status=Status.OK, started=not running)

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        e = self.engine
        loop = asyncio.get_running_loop()
        used = await loop.run_in_executor(None, e.used_bytes)
        return pb.InfoResponse(
            status=Status.OK, bookie_id=self.bookie_id, free_bytes=e.free_bytes(), used_bytes=used,
            read_only=e.read_only_reason is not None, read_only_reason=e.read_only_reason or "",
            ledgers=len(e.states), write_cache_bytes=e.write_cache.bytes, version=VERSION,
            data_port=self.data_port, max_batch_adds=e.config.max_batch_adds, max_batch_bytes=e.config.max_batch_bytes,
            **_scrub_info(e.scrubber),
        )


def _scrub_info(sc) -> dict:
    sc.check_repaired()
    lid, eid = sc.position_ids()
    findings = [pb.ScrubFinding(ledger_id=f.ledger_id, entry_id=f.entry_id, reason=f.reason, found_by=f.found_by, at=f.at,
                                removed=f.removed)
                for f in list(sc.recent)]
    return dict(scrub_passes=sc.passes, scrub_entries=sc.entries, scrub_corrupt=sc.corrupt,
                scrub_last_pass_end=sc.last_pass_end, scrub_running=sc.running, scrub_findings=findings,
                scrub_last_pass_start=sc.last_pass_start, scrub_pass_started=sc.pass_started,
                scrub_pass_entries=sc.pass_entries, scrub_position_ledger=-1 if lid is None else lid,
                scrub_position_entry=-1 if eid is None else eid, scrub_repaired=sc.repaired,
                scrub_awaiting_repair=len(sc.awaiting))


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = (value if isinstance(value, str) else value.decode("latin-1")).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every gRPC call must carry an accepted bearer token or come with a verified client
    certificate; anything else ends UNAUTHENTICATED with a message saying what to pass."""

    def __init__(self, security: BookieSecurity) -> None:
        self.security = security

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is not None and self.security.token_ok(token):
            return handler
        message = AUTH_REQUIRED_MESSAGE if token is None else INVALID_TOKEN_MESSAGE
        inner = handler.unary_unary
        certs = self.security.certs_authenticate and inner is not None and token is None

        async def guarded(request, context):
            if certs and _peer_certificate(context):
                return await inner(request, context)
            log.warning("gRPC %s from %s refused: %s", handler_call_details.method, context.peer(), message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _peer_certificate(context) -> bool:
    """Whether the caller presented a client certificate that verified (gRPC's TLS puts it in the
    auth context only then)."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - no auth context: no certificate
        return False
    return bool(auth.get("x509_pem_cert"))


class BookieServer:
    """Open storage, serve gRPC, stop gracefully."""

    def __init__(self, config: BookieConfig, host: str = "127.0.0.1", port: int = 0, metrics: BookieMetrics | None = None,
                 data_port: int = 0, security: BookieSecurity | None = None) -> None:
        self.config = config
        self.security = security or BookieSecurity()
        self.host = host
        self.port = port
        self.data_port = data_port
        self.data: DataServer | None = None
        self.metrics = metrics or BookieMetrics()
        self.engine = Engine(config, self.metrics)
        self.server: grpc.aio.Server | None = None
        self.service: BookieService | None = None
        self.grpc_certs: GrpcServerCertificates | None = None
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
            ],
            interceptors=[AuthInterceptor(self.security)] if self.security.auth_required else None,
        )
        sec = self.security
        if sec.tls:
            self.grpc_certs = GrpcServerCertificates(sec.tls_cert, sec.tls_key, sec.client_ca,
                                                     sec.client_auth == "required", "bookie gRPC port")
            bound = self.server.add_secure_port(f"{self.host}:{self.port}", self.grpc_certs.credentials)
        else:
            bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot bind {self.host}:{self.port}")
        self.port = bound
        self.bookie_id = self.bookie_id or self.address
        self.data = DataServer(self.engine, self.host, self.data_port, limit, security=self.security)
        await self.data.start()
        self.data_port = self.data.port
        self.service = BookieService(self.engine, self.bookie_id, self.data_port)
        pb_grpc.add_BookieServicer_to_server(self.service, self.server)
        await self.server.start()

    def reload_certificates(self) -> bool:
        """Re-read the TLS files for new handshakes on both ports (all or nothing: if either port
        cannot use them, both keep the certificate in use, and the reason is logged). Whether the
        new files are in use; False without TLS."""
        if self.grpc_certs is None or self.data is None or self.data.tls is None:
            log.warning("certificate reload asked for, but this bookie does not use TLS")
            return False
        try:
            ctx, desc = self.data.tls.prepare()
            config, _ = self.grpc_certs.prepare()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the certificate in use
            log.error("certificate reload failed, the bookie keeps the certificate in use (%s, key %s): %s",
                      self.security.tls_cert, self.security.tls_key, exc)
            return False
        self.data.tls.commit(ctx)
        self.grpc_certs.commit(config)
        log.info("certificates reloaded: new handshakes on the gRPC and data ports present %s", desc)
        return True

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.data is not None:
            await self.data.stop(grace_s)
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.engine.aclose()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
