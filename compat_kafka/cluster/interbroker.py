"""Calls from one listener process to another (WriteTxnMarkers), through the listeners' security.

How this works. A transaction coordinator writes its markers into partitions another listener owns
by sending that listener a WriteTxnMarkers request, as Kafka brokers do over their inter-broker
listener. Each listener registers every endpoint it serves (``BrokerInfo.endpoints``); a call goes
to an authenticated one first (SASL_PLAINTEXT, then SASL_SSL: the broker identity passes ACLs),
then PLAINTEXT, then SSL; TLS ones only when ``inter_broker_ca`` is known. Over TLS the
other listener's certificate is checked against ``inter_broker_ca`` (the CA that issued the
listeners' certificates); there is no unverified TLS. Over SASL the caller authenticates as the
reserved user ``__scroll_broker`` (SCRAM-SHA-256/512 or PLAIN, whichever the other listener offers),
whose password is a random secret in the metadata store (``kafka/internal/broker-secret``): any
listener that can read the metadata store can act as a broker, nothing else can. The first listener
with a SASL listener creates the secret and the user's SCRAM credentials; the user is hidden from
``scroll kafka user list`` and cannot be added, removed or altered by clients. ACLs treat it as a
superuser (``acls.BROKER_PRINCIPAL``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import struct

from ..security import sasl
from ..security.client_security import ClientAuthError, KafkaClientConfig
from ..wire import codec
from .ownership import BrokerInfo

BROKER_USER = "__scroll_broker"
BROKER_PRINCIPAL = f"User:{BROKER_USER}"
SECRET_KEY = "kafka/internal/broker-secret"
_ORDER = ("SASL_PLAINTEXT", "SASL_SSL", "PLAINTEXT", "SSL")
_SIZE = struct.Struct(">i")


class InterBrokerError(Exception):
    """Another listener could not be called (no usable endpoint, TLS or SASL refused)."""


async def ensure_identity(store) -> str:
    """The brokers' shared secret, creating it and the user's credentials on first use."""
    v = await store.get(SECRET_KEY)
    if v is None:
        await store.create(SECRET_KEY, secrets.token_urlsafe(32).encode())  # None: another listener won
        v = await store.get(SECRET_KEY)
    secret = v.value.decode()
    if await sasl.load_credential(store, BROKER_USER, "SCRAM-SHA-256") is None:  # the creator died halfway
        await sasl.store_credentials(store, BROKER_USER, secret)
    return secret


def endpoint_for_calls(info: BrokerInfo, tls_ok: bool = True) -> tuple[str, str, int]:
    """(protocol, host, port) of the endpoint another listener is called on: an authenticated one
    first (the broker identity passes ACLs), then plaintext; TLS ones only with a CA to check them."""
    if not info.endpoints:  # registered by a listener without named endpoints: plaintext
        return "PLAINTEXT", info.host, info.port
    usable = [e for e in info.endpoints if e[0] in _ORDER and (tls_ok or not e[0].endswith("SSL"))]
    return min(usable or info.endpoints, key=lambda e: _ORDER.index(e[0]) if e[0] in _ORDER else len(_ORDER))


class InterBrokerClient:
    """Makes one request on a fresh connection to another listener (markers are rare: no pooling)."""

    def __init__(self, store, ca_file: str | None = None):
        self.store = store
        self.ca_file = ca_file
        self._mechanism: dict[tuple[str, int], str] = {}  # (host, port) -> the SASL mechanism it took

    async def client_config(self, protocol: str, mechanism: str = "SCRAM-SHA-256") -> KafkaClientConfig:
        """How to reach a listener of ``protocol`` as the broker user."""
        if protocol.endswith("SSL") and self.ca_file is None:
            raise InterBrokerError("the other listener speaks TLS only: give --inter-broker-ca (the CA that "
                                   "issued the listeners' certificates) to call it")
        secret = None
        if protocol.startswith("SASL_"):
            v = await self.store.get(SECRET_KEY)
            if v is None:
                raise InterBrokerError(f"no broker secret at {SECRET_KEY} (no listener with SASL has started)")
            secret = v.value.decode()
        return KafkaClientConfig(protocol, ca_file=self.ca_file if protocol.endswith("SSL") else None,
                                 mechanism=mechanism if secret else None, username=BROKER_USER if secret else None,
                                 password=secret)

    async def call(self, info: BrokerInfo, body, timeout_s: float):
        """The response to ``body`` from the listener ``info``."""
        return await asyncio.wait_for(self._call(*endpoint_for_calls(info, self.ca_file is not None), body), timeout_s)

    async def _call(self, protocol: str, host: str, port: int, body):
        mechanism = self._mechanism.get((host, port), "SCRAM-SHA-256")
        try:
            reader, writer = await (await self.client_config(protocol, mechanism)).open(host, port)
        except ClientAuthError as exc:
            offered = [m for m in ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN") if m in getattr(exc, "offered", ())]
            if not offered:
                raise InterBrokerError(f"{host}:{port}: {exc}") from exc
            mechanism = self._mechanism[(host, port)] = offered[0]  # that mechanism is served there
            reader, writer = await (await self.client_config(protocol, mechanism)).open(host, port)
        try:
            writer.write(codec.encode_request(body, 9, client_id="scroll-inter-broker"))
            await writer.drain()
            return await _receive(reader, body)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _receive(reader, body):
    (n,) = _SIZE.unpack(await reader.readexactly(4))
    _, resp = codec.decode_response(await reader.readexactly(n), body.__api_key__, body.__version__)
    return resp


