"""The TCP server: frames in, handlers run, responses out in request order.

How this works. Each connection has a reader and a writer loop. The reader takes
frames off the socket (refusing one over ``max_frame_bytes`` before reading it), decodes each, lets
the broker prepare it (``Broker.prepare``: a produce starts opening its partitions, which no client
can see) and hands it to the connection's starter (``_Starter``), which starts each request's
handler as a task and queues the task; the writer awaits the queued tasks in order and writes
their responses, so answers leave in request order. Requests also *take effect* in the order sent,
as in Kafka: the starter starts the next handler only once the previous one has applied its
effects — when it returned, or earlier when it called ``codec.effects_applied()`` before a wait
that changes nothing (a produce waiting for its acknowledgements, a fetch's long poll); it starts
it eagerly (``_start_eagerly``: up to its first wait, at once), so the requests read in one loop
turn are handled in that turn. So 50 pipelined
OffsetCommits are applied one after another and the last one sent is the one that stays, while
pipelined produces still overlap their replication. Pipelined produces that the reader finds
already read together (a whole next Produce frame in its buffer) and that may share a handler
(``Broker.coalesce_key``: same version, acks, timeout, client id, no transactional id) go to the
starter as one ``_Group``, handled by ``Broker.produce_group``: one append per partition for all
of them in request order (each request checked as if alone: one request's error is its own), and
each its own answer, in order, as soon as its own batches are acknowledged (one future per request
in the send loop's queue). The produce budget is still taken per frame and quotas recorded per
request. So a listener that falls behind pays less per request. An acks=0 produce is handled but
answered with nothing. A frame that cannot be read (garbage, truncated, oversize, an unknown API key or
version) closes that connection, as a Kafka broker does; an ApiVersions request above our range
is answered (v0, UNSUPPORTED_VERSION) instead. Other connections are not affected.

SASL (``ServerConfig.sasl_mechanisms``, ``sasl.py``). SaslHandshake and SaslAuthenticate are
answered by the read loop itself, one at a time, before any later request is read. With SASL on,
a connection may send only ApiVersions, SaslHandshake and SaslAuthenticate until it has
authenticated; anything else closes it (as Kafka does). A failed authentication is answered with
SASL_AUTHENTICATION_FAILED, then the connection is closed. Handlers see the principal through
``codec.current_principal()`` (and a TLS client's verified certificate subject through
``codec.current_tls_subject()``: the ACL principal without SASL, ``authorizer.py``). KIP-368: with
``connections_max_reauth_ms``, SaslAuthenticate v1+ answers that session lifetime; a SaslHandshake
on an authenticated connection then starts a re-authentication (same principal, or the connection
is closed), and any other request after the session ended closes the connection.

TLS certificates: ``KafkaServer.reload_certificates`` (``scroll kafka`` calls it on SIGHUP) re-reads
each TLS listener's certificate, key and client CA for new handshakes; connected clients carry on;
files that cannot be used are logged and the certificate in use stays (``fragments.tlsreload``).

Overload (``ServerConfig``). A connection over ``max_connections`` (per listener) or
``max_connections_per_ip`` (and its per-address overrides) is closed as soon as it is accepted,
and counted (``stats``). A produce frame's body is read only once its memory fits in
``max_inflight_produce_bytes`` (all connections): the frame counts ``PRODUCE_COPIES`` times its
size until it is answered, and the bytes the partitions' writers still hold count against the same
bound (``_WritersHeld``), so a flood of produces waits in the clients' sockets and the listener's
memory stays near the bound. An answer over a client quota (``quotas.py``) carries its
throttle time and mutes the connection: nothing more is read from it until that time has passed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import datetime
import functools
import logging
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode

from fragments.tlsreload import ReloadableServerContext

from .broker import Broker
from .partitions import tailcache
from .security import sasl
from .wire import codec
from .wire.errors import DropConnection, ProtocolError, UnsupportedRequest

log = logging.getLogger(__name__)

_SIZE = struct.Struct(">i")
_PRE_AUTH_MAX_FRAME = 512 * 1024


@dataclass(frozen=True)
class TlsConfig:
    """The listener speaks TLS (Kafka's SSL security protocol): its certificate chain and key (PEM
    files); ``client_ca``: PEM bundle of the CAs whose client certificates are accepted, and with
    ``require_client_cert`` a client without a certificate it trusts is refused (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    require_client_cert: bool = False

    def __post_init__(self):
        if self.require_client_cert and not self.client_ca_file:
            raise ValueError("mutual TLS needs the CA file that signs the client certificates")

    def server_context(self) -> ssl.SSLContext:
        """A server-side context (TLS 1.2+); files are read now (KafkaServer.reload_certificates reads them again)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file:
                ctx.load_verify_locations(self.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS certificate, key or CA ({self.cert_file}, {self.key_file}, "
                             f"{self.client_ca_file}): {exc}") from exc
        ctx.verify_mode = (ssl.CERT_REQUIRED if self.require_client_cert
                           else ssl.CERT_OPTIONAL if self.client_ca_file else ssl.CERT_NONE)
        return ctx


PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


@dataclass(frozen=True)
class ListenerConfig:
    """One listening socket, as one entry of Kafka's ``listeners``: its security protocol (also its
    name: one listener per protocol), where it binds, and the TLS and SASL settings it uses."""

    protocol: str = "PLAINTEXT"
    host: str = "127.0.0.1"
    port: int = 9092  # 0: any free port
    tls: TlsConfig | None = None
    sasl_mechanisms: tuple[str, ...] = ()

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown security protocol {self.protocol!r}; one of {', '.join(PROTOCOLS)}")
        if self.protocol.endswith("SSL") and self.tls is None:
            raise ValueError(f"the {self.protocol} listener needs a certificate and key (--ssl-cert/--ssl-key)")
        if self.protocol.startswith("SASL_") and not self.sasl_mechanisms:
            raise ValueError(f"the {self.protocol} listener needs SASL mechanisms (--sasl-mechanisms)")
        if any(m not in sasl.MECHANISMS for m in self.sasl_mechanisms):
            raise ValueError(f"unsupported SASL mechanisms {self.sasl_mechanisms}; supported: {sasl.MECHANISMS}")

    @property
    def name(self) -> str:
        return self.protocol

    @property
    def tls_on(self) -> bool:
        return self.protocol.endswith("SSL")

    @property
    def sasl_on(self) -> bool:
        return self.protocol.startswith("SASL_")

    @classmethod
    def parse(cls, spec: str, tls: TlsConfig | None, sasl_mechanisms: tuple[str, ...]) -> ListenerConfig:
        """``PROTOCOL://host:port`` (Kafka's ``listeners`` syntax; an empty host binds 127.0.0.1)."""
        proto, sep, rest = spec.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or not colon or not port.isdigit():
            raise ValueError(f"a listener is PROTOCOL://host:port (e.g. SASL_SSL://127.0.0.1:9093), not {spec!r}")
        proto = proto.upper()
        return cls(proto, host.strip("[]") or "127.0.0.1", int(port), tls if proto.endswith("SSL") else None,
                   sasl_mechanisms if proto.startswith("SASL_") else ())


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9092  # 0: any free port (see KafkaServer.port)
    max_frame_bytes: int = codec.MAX_FRAME_BYTES
    # requests read ahead per connection (each read one is prepared: a produce starts opening its
    # partitions). librdkafka sends one Produce per partition, pipelined: a first produce to a
    # 500-partition topic is 500 requests, and a smaller window opened them only as fast as the
    # in-order dispatcher let the reader read on (their bytes are bounded by the produce budget)
    max_inflight_requests: int = 1024
    max_connections: int = 1000  # per listener (Kafka's max.connections, listener.name.X.max.connections)
    max_connections_per_ip: int = 0  # Kafka's max.connections.per.ip; 0: no limit
    max_connections_per_ip_overrides: tuple[tuple[str, int], ...] = ()  # (ip, limit): max.connections.per.ip.overrides
    # produce request bytes read and not yet answered, all connections together (Kafka's
    # queued.max.request.bytes, for produce): a connection whose next produce would go over waits,
    # not read further, until earlier ones are answered (TCP backpressure). 0: no limit
    max_inflight_produce_bytes: int = 256 << 20
    tls: TlsConfig | None = None  # None: PLAINTEXT
    sasl_mechanisms: tuple[str, ...] = ()  # e.g. ("PLAIN", "SCRAM-SHA-256"); empty: no SASL
    # several listeners (PLAINTEXT beside SASL_SSL, say); empty: one, from host/port/tls/sasl_mechanisms
    listeners: tuple[ListenerConfig, ...] = ()
    # KIP-368: a SASL session (SaslAuthenticate v1+) lasts this long; a request after it ended that
    # is not a re-authentication closes the connection. 0: sessions never end
    connections_max_reauth_ms: int = 0

    def __post_init__(self):
        if (self.max_frame_bytes < 1024 or self.max_inflight_requests < 1 or self.max_connections < 1
                or self.max_connections_per_ip < 0 or self.max_inflight_produce_bytes < 0
                or any(n < 0 for _ip, n in self.max_connections_per_ip_overrides)):
            raise ValueError(f"invalid server config {self}")
        if not self.listeners:
            protocol = ("SASL_" if self.sasl_mechanisms else "") + ("SSL" if self.tls else "PLAINTEXT")
            object.__setattr__(self, "listeners", (ListenerConfig(protocol, self.host, self.port, self.tls,
                                                                  self.sasl_mechanisms),))
        names = [li.name for li in self.listeners]
        if len(set(names)) != len(names):
            raise ValueError(f"one listener per security protocol, got {', '.join(names)}")
        if self.connections_max_reauth_ms < 0:
            raise ValueError("connections_max_reauth_ms must be 0 (off) or positive")


class KafkaServer:
    def __init__(self, broker: Broker, config: ServerConfig | None = None):
        self.broker = broker
        self.config = config or ServerConfig()
        self._servers: list[tuple[ListenerConfig, asyncio.AbstractServer]] = []
        self._conns: set[asyncio.Task] = set()
        self._tls: dict[str, ReloadableServerContext] = {}  # listener name -> its reloadable context
        self._per_listener: dict[str, int] = {}
        self._per_ip: dict[str, int] = {}
        self._ip_limits = dict(self.config.max_connections_per_ip_overrides)
        # connections refused, by reason (metrics); throttled: connections muted by a quota
        self.stats = {"refused_max_connections": 0, "refused_max_connections_per_ip": 0, "throttled_responses": 0,
                      "produce_bytes_waits": 0,
                      # pipelined produces handled as one group (_Group), and the requests in them
                      "coalesced_produce_groups": 0, "coalesced_produce_requests": 0}
        if self.config.max_inflight_produce_bytes:  # the tail caches take at most a sixteenth of it
            tailcache.PROCESS_BUDGET.limit = min(tailcache.PROCESS_BUDGET.limit,
                                                 self.config.max_inflight_produce_bytes // 16)
        self._group_tasks: set[asyncio.Task] = set()  # produce groups being handled (their answers are futures)
        self.produce_budget = ByteBudget(self.config.max_inflight_produce_bytes,
                                         held_elsewhere=_WritersHeld(broker).bytes)

    def reload_certificates(self) -> bool:
        """Re-read every TLS listener's files for new handshakes; whether all of them took the new ones."""
        return all([tls.reload() for tls in self._tls.values()])

    @property
    def port(self) -> int:
        """The port of the first listener."""
        assert self._servers, "server not started"
        return self._servers[0][1].sockets[0].getsockname()[1]

    @property
    def ports(self) -> dict[str, int]:
        """Listener name -> the port it listens on."""
        return {li.name: srv.sockets[0].getsockname()[1] for li, srv in self._servers}

    async def start(self) -> None:
        """Bind every listener, register the broker with their ports, then serve."""
        try:
            for li in self.config.listeners:
                tls = None
                if li.tls_on:
                    self._tls[li.name] = ReloadableServerContext(li.tls.server_context, f"Kafka {li.name} listener",
                                                                 li.tls.cert_file)
                    tls = self._tls[li.name].context
                # a handshake that fails (a plaintext client, an untrusted or missing client
                # certificate) is logged by asyncio and the connection closed before any request
                srv = await asyncio.start_server(functools.partial(self._connection, li), li.host, li.port,
                                                 start_serving=False, ssl=tls,
                                                 ssl_handshake_timeout=10.0 if tls is not None else None)
                self._servers.append((li, srv))
            ports = self.ports
            # where each listener binds (DescribeConfigs' ``listeners``; ``advertised.listeners`` are
            # the registered endpoints)
            self.broker.bound_listeners = tuple((li.name, li.host, ports[li.name]) for li in self.config.listeners)
            await self.broker.start(self.port, [(li.name, ports[li.name]) for li in self.config.listeners])
        except BaseException:
            for _li, srv in self._servers:
                srv.close()
            raise
        for li, srv in self._servers:
            await srv.start_serving()
            log.info("Kafka shim node %s listening on %s:%d (%s)", self.broker.node_id, li.host,
                     srv.sockets[0].getsockname()[1],
                     li.protocol + (f" {','.join(li.sasl_mechanisms)}" if li.sasl_on else ""))

    async def stop(self) -> None:
        for _li, srv in self._servers:
            srv.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for _li, srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 2.0)
        await self.broker.close()

    async def _connection(self, listener: ListenerConfig, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve_connection(listener, reader, writer)
        except asyncio.CancelledError:  # server stopping
            writer.close()

    async def _serve_connection(self, listener: ListenerConfig, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        peer = writer.get_extra_info("peername")
        codec.set_client_host(peer)  # inherited by this connection's request tasks (group members' host)
        codec.set_listener(listener.name)  # Metadata/FindCoordinator answer with this listener's addresses
        ip = peer[0] if isinstance(peer, tuple) and peer else str(peer)
        refused = None
        if self._per_listener.get(listener.name, 0) >= self.config.max_connections:
            refused = "max_connections"
        elif self._per_ip.get(ip, 0) >= self._ip_limits.get(ip, self.config.max_connections_per_ip or 1 << 62):
            refused = "max_connections_per_ip"
        if refused is not None:
            self.stats["refused_" + refused] += 1
            log.warning("refusing connection from %s on %s: %s reached", peer, listener.name, refused)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        self._per_listener[listener.name] = self._per_listener.get(listener.name, 0) + 1
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        self._conns.add(task)
        try:
            await self._serve_open_connection(listener, reader, writer, peer)
        finally:
            self._conns.discard(task)
            self._per_listener[listener.name] -= 1
            self._per_ip[ip] -= 1
            if not self._per_ip[ip]:
                del self._per_ip[ip]

    async def _serve_open_connection(self, listener: ListenerConfig, reader: asyncio.StreamReader,
                                     writer: asyncio.StreamWriter, peer) -> None:
        conn = _Conn()
        auth = codec.ConnectionAuth()
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is not None:  # a verified client certificate names the principal (without SASL)
            with contextlib.suppress(Exception):
                auth.tls_subject = (ssl_object.getpeercert() or {}).get("subject") or None
        codec.set_connection_auth(auth)  # before the starter is made: its request tasks inherit it
        queue: asyncio.Queue = asyncio.Queue(self.config.max_inflight_requests)  # started, answers in order
        # read, not started; its request tasks inherit this context (connection auth, client host)
        requests = _Starter(self, conn, queue, self.config.max_inflight_requests)
        sender = asyncio.create_task(self._send_loop(queue, writer, requests))
        try:
            await self._read_loop(listener, reader, requests, peer, auth, conn)
        except ProtocolError as exc:
            log.warning("closing connection from %s: %s", peer, exc)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away (or sent a truncated frame and closed)
        finally:
            requests.close()
            with contextlib.suppress(Exception):  # what was read is still handled and answered (5 s at most)
                await asyncio.wait([sender], timeout=5.0)
            requests.stop()
            sender.cancel()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if conn.held:  # read, never answered
                self.produce_budget.release(conn.held)
                conn.held = 0

    async def _read_loop(self, listener: ListenerConfig, reader: asyncio.StreamReader, requests: _Starter,
                         peer, auth: codec.ConnectionAuth, conn: _Conn) -> None:
        session: list[sasl.SaslSession] = []  # the mechanism chosen by SaslHandshake
        loop = asyncio.get_running_loop()
        group = _Group()  # pipelined produces read together, not yet handed to the starter
        try:
            await self._read_frames(listener, reader, requests, peer, auth, conn, session, loop, group)
        finally:
            if group.reqs:  # read: still handled and answered
                await self._flush_group(group, requests)

    async def _flush_group(self, group: _Group, requests: _Starter) -> None:
        """Hand the produces held in ``group`` to the starter: alone, or as one group item."""
        if len(group.reqs) == 1:
            item: Any = (group.reqs[0], group.helds[0])
        else:
            item = _Group(group.reqs, group.helds)
            self.stats["coalesced_produce_groups"] += 1
            self.stats["coalesced_produce_requests"] += len(group.reqs)
        group.reqs, group.helds, group.key = [], [], None
        await requests.put(item)

    async def _read_frames(self, listener: ListenerConfig, reader: asyncio.StreamReader, requests: _Starter,
                           peer, auth: codec.ConnectionAuth, conn: _Conn, session: list, loop,
                           group: _Group) -> None:
        while True:
            if group.reqs and (not _next_frame_is_produce(reader) or conn.muted_until > loop.time()):
                await self._flush_group(group, requests)  # nothing more to join it without waiting
            await conn.unmuted(loop)  # a quota throttled this connection: nothing is read meanwhile
            try:
                head = await reader.readexactly(4)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise ProtocolError(f"truncated frame size ({len(exc.partial)} bytes)") from exc
                return  # clean end of stream
            (size,) = _SIZE.unpack(head)
            unauthenticated = listener.sasl_on and auth.principal is None
            # before authenticating, frames are small (Kafka: sasl max receive size, 512 KiB)
            codec.check_frame_size(size, min(self.config.max_frame_bytes, _PRE_AUTH_MAX_FRAME) if unauthenticated
                                   else self.config.max_frame_bytes)
            held = 0
            try:
                key = await reader.readexactly(2)
                if key == _PRODUCE_KEY and not unauthenticated and self.produce_budget.limit:
                    # a produce waits for room among the produce bytes in flight before its body is read
                    held = self.produce_budget.clamp(size * PRODUCE_COPIES)
                    if not self.produce_budget.try_acquire(held):
                        if group.reqs:  # the held ones go on first (they may be what frees the bytes)
                            await self._flush_group(group, requests)
                        self.stats["produce_bytes_waits"] += 1
                        tailcache.PROCESS_BUDGET.shed()  # memory for produces first
                        await self.produce_budget.acquire(held)
                    conn.held += held
                data = key + await reader.readexactly(size - 2)
            except asyncio.IncompleteReadError as exc:
                raise ProtocolError(f"truncated frame: {len(exc.partial)} of {size} bytes") from exc
            await conn.unmuted(loop)
            try:
                req = codec.decode_request(data)
            except UnsupportedRequest as exc:
                if exc.api_key != codec.API_API_VERSIONS:
                    raise
                await requests.put(_done(codec.unsupported_api_versions_response(exc.correlation_id)))
                continue
            finally:
                del data  # the decoded request holds its own copy: the frame is not kept while the next one is read
            if (auth.expires_at is not None and asyncio.get_running_loop().time() >= auth.expires_at
                    and req.api_key not in (codec.API_SASL_HANDSHAKE, codec.API_SASL_AUTHENTICATE)):
                raise ProtocolError(f"api key {req.api_key} after the SASL session of {auth.principal} expired "
                                    f"(not re-authenticated, KIP-368)")
            if req.api_key in (codec.API_SASL_HANDSHAKE, codec.API_SASL_AUTHENTICATE):
                body, close = await self._sasl(listener, req, auth, session, peer)
                await requests.put(_done(codec.encode_response(req.correlation_id, body)))
                if close:
                    return
                continue
            if unauthenticated and req.api_key != codec.API_API_VERSIONS:
                raise ProtocolError(f"api key {req.api_key} before SASL authentication")
            self.broker.prepare(req)  # e.g. start opening a produce's partitions (no effect a client sees)
            key = self.broker.coalesce_key(req) if req.api_key == codec.API_PRODUCE else None
            if group.reqs and key != group.key:
                await self._flush_group(group, requests)
            if key is not None and (group.reqs or _next_frame_is_produce(reader)):
                # a produce with another one read behind it: they may be handled as one (_Group)
                group.key = key
                group.reqs.append(req)
                group.helds.append(held)
                if len(group.reqs) >= min(_GROUP_MAX, self.config.max_inflight_requests):
                    await self._flush_group(group, requests)
            else:
                await requests.put((req, held))
            del req  # not kept past its answer while the next frame is awaited

    async def _sasl(self, listener: ListenerConfig, req: codec.Request, auth: codec.ConnectionAuth, session: list,
                    peer) -> tuple[Any, bool]:
        """The answer to a SaslHandshake or SaslAuthenticate, and whether to close the connection."""
        resp_cls = codec.response_schema(req.api_key, req.api_version)
        mechs = listener.sasl_mechanisms
        if req.api_key == codec.API_SASL_HANDSHAKE:
            # KIP-368: a connection authenticated with an ending session may authenticate again
            reauth = auth.principal is not None and auth.expires_at is not None
            if (auth.principal is not None and not reauth) or (session and not reauth):
                return codec.build(resp_cls, error_code=ErrorCode.illegal_sasl_state, mechanisms=mechs), True
            if req.body.mechanism not in mechs:
                return codec.build(resp_cls, error_code=ErrorCode.unsupported_sasl_mechanism, mechanisms=mechs), True
            session.clear()
            session.append(sasl.SaslSession(self.broker.store, req.body.mechanism))
            return codec.build(resp_cls, error_code=ErrorCode.none, mechanisms=mechs), False
        if not session or session[0].principal is not None:
            return codec.build(resp_cls, error_code=ErrorCode.illegal_sasl_state, auth_bytes=b"",
                               error_message="SaslAuthenticate without a SaslHandshake"), True
        try:
            token = await session[0].step(req.body.auth_bytes)
        except sasl.AuthenticationFailed as exc:
            log.warning("SASL authentication failed from %s: %s (%s)", peer, exc, exc.__cause__ or "wrong credentials")
            await asyncio.sleep(sasl.FAILURE_DELAY_S)  # this connection only
            return codec.build(resp_cls, error_code=ErrorCode.sasl_authentication_failed, error_message=str(exc),
                               auth_bytes=b""), True
        except Exception:  # e.g. the metadata store unreachable: refuse, and say so in the log
            log.exception("SASL authentication from %s could not be checked", peer)
            return codec.build(resp_cls, error_code=ErrorCode.sasl_authentication_failed, auth_bytes=b"",
                               error_message="Authentication could not be checked (server error)"), True
        lifetime_ms = 0
        if session[0].principal is not None:
            if auth.principal is not None and session[0].principal != auth.principal:
                log.warning("SASL re-authentication from %s as %s, not %s: closing", peer, session[0].principal,
                            auth.principal)
                return codec.build(resp_cls, error_code=ErrorCode.sasl_authentication_failed, auth_bytes=b"",
                                   error_message="Cannot change principals during re-authentication"), True
            again = auth.principal is not None
            auth.principal = session[0].principal
            reauth_ms = self.config.connections_max_reauth_ms
            if reauth_ms and req.api_version >= 1:  # v0 clients cannot be told: their sessions never end
                lifetime_ms = reauth_ms
                auth.expires_at = asyncio.get_running_loop().time() + reauth_ms / 1000
            log.info("SASL %s: %s %sauthenticated from %s", session[0].mechanism, auth.principal,
                     "re-" if again else "", peer)
        return codec.build(resp_cls, error_code=ErrorCode.none, error_message=None, auth_bytes=token,
                           session_lifetime=datetime.timedelta(milliseconds=lifetime_ms)), False

    async def _respond(self, req: codec.Request, held: int, applied, conn: _Conn) -> bytes | None:
        """Handle one request; ``applied()`` once it has taken effect (see ``_Starter``)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()  # not loop.time(): uvloop's is cached per loop turn, in ms
        handled = [-1.0]

        def done() -> None:
            if handled[0] < 0:
                handled[0] = time.perf_counter() - started  # handling time for the request quota (waits excluded)
                applied()

        codec.set_effects_applied_callback(done)
        try:
            body = await self.broker.handle(req)
        finally:
            done()
            if held:
                conn.held -= held
                self.produce_budget.release(held)
        body, throttle_s = self.broker.throttle(req, body, handled[0])
        if throttle_s > 0:  # as Kafka >= 2.0: the channel is muted until the throttle time has passed
            self.stats["throttled_responses"] += 1
            conn.muted_until = max(conn.muted_until, loop.time() + throttle_s)
        return None if body is None else codec.encode_response(req.correlation_id, body)

    async def _respond_group(self, group: _Group, applied, conn: _Conn) -> None:
        """Handle a group of pipelined produces as one (``Broker.produce_group``): each request's
        answer (None for acks=0) resolves its own future in ``group.answers`` (the send loop's queue
        holds those, in order) as soon as it is made. Quotas are recorded per request, each with
        its share of the group's handling time; each request's produce bytes are released with its
        answer."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        handled = [-1.0]
        reqs, helds, answers = group.reqs, group.helds, group.answers

        def done() -> None:
            if handled[0] < 0:
                handled[0] = time.perf_counter() - started
                applied()

        def release(i: int) -> None:
            if helds[i]:
                conn.held -= helds[i]
                self.produce_budget.release(helds[i])
                helds[i] = 0

        def answer(i: int, body) -> None:
            done()
            release(i)
            req = reqs[i]
            body, throttle_s = self.broker.throttle(req, body, handled[0] / len(reqs))
            if throttle_s > 0:  # as _respond
                self.stats["throttled_responses"] += 1
                conn.muted_until = max(conn.muted_until, loop.time() + throttle_s)
            answers[i].set_result(None if body is None else codec.encode_response(req.correlation_id, body))

        codec.set_effects_applied_callback(done)
        try:
            await self.broker.produce_group(reqs, answer)
        except BaseException as exc:  # the send loop meets it at the first request not answered
            for f in answers:
                if not f.done():
                    f.set_exception(exc if isinstance(exc, Exception) else ConnectionError("handler cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            done()
            for i in range(len(reqs)):
                release(i)

    async def _send_loop(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, starter: _Starter) -> None:
        """Answers in request order. The answers already made when one is written go out with it in
        one write (one syscall): the produces acknowledged by one entry finish together."""
        carry: Any = _NOTHING  # an answer taken off the queue but not made yet: the next to wait for
        while True:
            item = await queue.get() if carry is _NOTHING else carry
            carry = _NOTHING
            starter.start()  # room in the queue: requests held back by a full one may start
            if item is None:
                return
            out: list[bytes] = []
            while True:
                try:
                    data = await item  # after the first: a finished task, no wait
                except DropConnection:  # test-only fault injection: the client sees a lost connection
                    writer.writelines(out)
                    writer.close()
                    return
                except Exception:
                    log.exception("handler failed; closing the connection")
                    writer.writelines(out)
                    writer.close()
                    return
                if data is not None:
                    out.append(data)
                if queue.empty():
                    break
                item = queue.get_nowait()
                starter.start()
                if item is None or not item.done():
                    carry = item
                    break
            if out:
                writer.writelines(out)
                await writer.drain()


_PRODUCE_KEY = struct.pack(">h", codec.API_PRODUCE)
# what a produce frame of n bytes takes in the listener until it is answered: the frame as read
# (the reader's buffer, then its bytes), its decoded records, the partition producer's copy of each
# batch, the bookie connections' send buffers (the entries the writers keep are counted by
# _WritersHeld). Measured with tracemalloc under a flood (docs/benchmarks.md, "Quotas and overload").
PRODUCE_COPIES = 4
_HELD_RECHECK_S = 0.01
_HELD_ESCAPE_S = 1.0


class _WritersHeld:
    """Produce bytes the partitions still hold after (or before) a produce is answered: batches
    queued for their writers and entries not yet on every bookie of the write quorum (a writer
    keeps an entry until then, to resend it). Summed over the open partitions at most every
    ``_HELD_RECHECK_S``."""

    def __init__(self, broker):
        self.broker = broker
        self._at = -1.0
        self._value = 0

    def bytes(self) -> int:
        now = asyncio.get_running_loop().time()
        if now - self._at >= _HELD_RECHECK_S:
            total = 0
            for plog in self.broker.open_partitions():
                if plog.producer is not None:
                    total += plog.producer.held_bytes
            self._at, self._value = now, total
        return self._value


_NOTHING = object()
_GROUP_MAX = 64  # produce requests handled as one group at most


class _Group:
    """Pipelined Produce requests of one connection, read together and handled as one
    (``Broker.produce_group``): each keeps its own answer, in order. ``key``: what they share
    (``Broker.coalesce_key``)."""

    __slots__ = ("reqs", "helds", "key", "answers")

    def __init__(self, reqs: list | None = None, helds: list | None = None):
        self.reqs: list = reqs if reqs is not None else []
        self.helds: list = helds if helds is not None else []
        self.key: tuple | None = None
        self.answers: list[asyncio.Future] = []  # one per request, made when the group starts


def _next_frame_is_produce(reader: asyncio.StreamReader) -> bool:
    """Whether the reader already holds a whole next frame, and it is a Produce request: reading
    it takes no wait, so a produce read before it may wait for it to join its group. (Peeks at
    the StreamReader's buffer: asyncio has no public peek.)"""
    buf = getattr(reader, "_buffer", None)
    if buf is None or len(buf) < 6:
        return False
    return buf[4:6] == _PRODUCE_KEY and len(buf) >= 4 + _SIZE.unpack_from(buf)[0]


class _Starter:
    """Starts a connection's requests, in the order read, each once the previous one has taken
    effect (``applied``: its handler returned or called ``codec.effects_applied()``), and queues
    their tasks (and the answers made while reading) for the send loop. No task of its own: the
    read loop hands it each request and the previous handler's ``applied`` starts the next one
    at once, so a pipelined request starts in the loop turn its predecessor took effect (the
    dispatcher task it replaces cost two more turns per request). At most ``limit`` requests wait
    here (the read loop waits beyond that), and ``limit`` started ones in the send queue."""

    __slots__ = ("server", "conn", "queue", "limit", "waiting", "busy", "closed", "stopped", "room", "ctx",
                 "starting")

    def __init__(self, server: KafkaServer, conn: _Conn, queue: asyncio.Queue, limit: int):
        self.server = server
        self.conn = conn
        self.queue = queue
        self.limit = limit
        self.waiting: collections.deque = collections.deque()  # (request, held) or an answer's future
        self.busy = False  # a handler started and not yet applied
        self.closed = False  # nothing more is read: the send loop gets None once all are queued
        self.stopped = False  # the connection is gone: nothing more starts
        self.room: asyncio.Future | None = None  # the read loop waits on it while ``limit`` wait
        self.ctx = contextvars.copy_context()  # each request task runs in its own copy, as if started here
        self.starting = False  # inside ``start``: a handler applied meanwhile is followed by its loop

    async def put(self, item) -> None:
        while len(self.waiting) >= self.limit:
            self.room = asyncio.get_running_loop().create_future()
            await self.room
        self.waiting.append(item)
        self.start()

    def start(self) -> None:
        if self.starting:  # a handler started below applied its effects: the loop below goes on
            return
        self.starting = True
        try:
            self._start()
        finally:
            self.starting = False

    def _start(self) -> None:
        q = self.queue
        while not self.busy and self.waiting and not q.full() and not self.stopped:
            item = self.waiting[0]
            if isinstance(item, asyncio.Future):  # an answer made while reading
                q.put_nowait(self.waiting.popleft())
                continue
            self.busy = True
            if type(item) is _Group:  # one answer future each in the queue: room for all of them first
                if q.maxsize and q.maxsize - q.qsize() < len(item.reqs):
                    self.busy = False
                    break
                self.waiting.popleft()
                loop = asyncio.get_running_loop()
                item.answers = [loop.create_future() for _ in item.reqs]
                for f in item.answers:
                    q.put_nowait(f)
                task = _start_eagerly(self.server._respond_group(item, self._applied, self.conn), self.ctx.copy())
                self.server._group_tasks.add(task)
                task.add_done_callback(self.server._group_tasks.discard)
            else:
                self.waiting.popleft()
                q.put_nowait(_start_eagerly(self.server._respond(*item, self._applied, self.conn), self.ctx.copy()))
            item = None  # the request is its task's alone (freed once answered)
        if self.room is not None and len(self.waiting) < self.limit:
            if not self.room.done():
                self.room.set_result(None)
            self.room = None
        if self.closed and not self.waiting and not q.full() and not self.stopped:
            self.stopped = True
            q.put_nowait(None)

    def _applied(self) -> None:
        self.busy = False
        self.start()

    def close(self) -> None:
        self.closed = True
        self.start()

    def stop(self) -> None:
        self.stopped = True
        if self.room is not None and not self.room.done():
            self.room.cancel()


class _Conn:
    """Per-connection state: quota mute, produce bytes held from the budget."""

    __slots__ = ("muted_until", "held")

    def __init__(self):
        self.muted_until = 0.0
        self.held = 0

    async def unmuted(self, loop) -> None:
        while (wait := self.muted_until - loop.time()) > 0:
            await asyncio.sleep(wait)


class ByteBudget:
    """Bytes shared by every connection, handed out first come first served (a waiter blocks the
    ones after it, so a large request is not starved by small ones). 0: unlimited.
    ``held_elsewhere``: bytes outside this budget that count against the same limit (the writers'
    entries, which shrink as bookies acknowledge: waiters check again every ``_HELD_RECHECK_S``).
    The first waiter is let in over it when nothing of the budget has been in use for
    ``_HELD_ESCAPE_S`` (writers stuck on a bookie must not stop every produce for good)."""

    def __init__(self, limit: int, held_elsewhere=None):
        self.limit = limit
        self.used = 0
        self.peak = 0  # of used
        self.peak_total = 0  # of used + held elsewhere, when a request was let in
        self._held_elsewhere = held_elsewhere
        self._poller: asyncio.Task | None = None
        self._waiters: collections.deque = collections.deque()

    def _fits(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        return self._held_elsewhere is None or self.used + n + self._held_elsewhere() <= self.limit

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if self._held_elsewhere is not None:
            self.peak_total = max(self.peak_total, self.used + self._held_elsewhere())

    def clamp(self, n: int) -> int:
        return min(n, self.limit)  # a frame over the whole budget waits for all of it

    def try_acquire(self, n: int) -> bool:
        if self._waiters or not self._fits(n):
            return False
        self._take(n)
        return True

    async def acquire(self, n: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        entry = [n, fut]
        self._waiters.append(entry)
        if self._held_elsewhere is not None and self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="produce-budget")
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
            raise

    async def _poll(self) -> None:
        """While requests wait: what the writers hold shrinks as bookies acknowledge, and no
        release wakes the waiters for that, so check again every ``_HELD_RECHECK_S``; let the first
        one in when nothing of the budget has been in use for ``_HELD_ESCAPE_S``."""
        loop = asyncio.get_running_loop()
        idle_since = None
        try:
            while self._waiters:
                await asyncio.sleep(_HELD_RECHECK_S)
                self._wake()
                if not self._waiters or self.used:
                    idle_since = None
                elif idle_since is None:
                    idle_since = loop.time()
                elif loop.time() - idle_since >= _HELD_ESCAPE_S:
                    n, fut = self._waiters.popleft()
                    if not fut.done():
                        self._take(n)
                        fut.set_result(None)
                    idle_since = None
        finally:
            self._poller = None

    def release(self, n: int) -> None:
        self.used -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and (self._waiters[0][1].done() or self._fits(self._waiters[0][0])):
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._take(n)
            fut.set_result(None)


def _start_eagerly(coro, ctx: contextvars.Context) -> asyncio.Task:
    """A task of ``coro`` that has already run, now, up to its first wait (as Python 3.12's eager
    tasks; 3.11 and uvloop have none): a request's handler applies its effects in the turn it is
    started, so the requests read in one turn (a client's pipelined produces) are all handled in
    that turn and their entries leave together. During that first step ``ctx`` is the context and
    the new task is the current one (``asyncio.timeout`` and the like bind to it)."""
    loop = asyncio.get_running_loop()
    state: list = [coro, "first", None]
    task = loop.create_task(_resumed(state), context=ctx)
    current = asyncio.current_task(loop)
    if current is not None:
        asyncio.tasks._leave_task(loop, current)
    asyncio.tasks._enter_task(loop, task)
    try:
        state[2] = ctx.run(coro.send, None)
    except StopIteration as stop:
        state[1], state[2] = "done", stop.value
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the task raises it: the send loop logs it and closes
        state[1], state[2] = "error", exc
    finally:
        asyncio.tasks._leave_task(loop, task)
        if current is not None:
            asyncio.tasks._enter_task(loop, current)
    return task


async def _resumed(state: list):
    """The task's side of ``_start_eagerly``: the outcome of the first step, or the rest."""
    coro, kind, value = state
    state.clear()
    if kind == "done":
        return value
    if kind == "error":
        raise value
    try:
        return await _Started(coro, value)
    finally:
        del coro, value


class _Started:
    """Awaiting it goes on with a coroutine that was run up to its first wait, where it yielded
    ``first`` (the future it waits for): what the task hands back (a value, an exception, a
    cancellation) is passed on to it, as ``yield from`` would had the coroutine not started."""

    __slots__ = ("coro", "first")

    def __init__(self, coro, first):
        self.coro = coro
        self.first = first

    def __await__(self):
        coro, value = self.coro, self.first
        self.first = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - thrown in by the task (a cancellation): passed on
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


def _done(data: bytes) -> asyncio.Future:
    f = asyncio.get_running_loop().create_future()
    f.set_result(data)
    return f
