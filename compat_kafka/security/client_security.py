"""The client side of a Kafka listener's security, for Scroll's own Kafka clients: the operators'
tools (``scroll kafka groups --command-config``), the lag metrics, and calls between listeners.

How this works. ``KafkaClientConfig`` holds what librdkafka's properties say
(``security.protocol``, ``ssl.ca.location``, ``ssl.certificate.location``, ``ssl.key.location``,
``sasl.mechanism``, ``sasl.username``, ``sasl.password``) and can be read from the same
``client.properties`` file librdkafka and kcat take (``from_properties``). ``open(host, port)``
connects, wraps TLS (verifying the listener's certificate and host name against the CA), and runs
SaslHandshake + SaslAuthenticate (PLAIN, or SCRAM through ``scramp``) before handing back the
stream pair, so the caller just sends requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path

from kio.schema.errors import ErrorCode
from scramp import ScramClient, ScramException

from fragments.security import read_client_properties as read_properties

from ..wire import codec

_SIZE = struct.Struct(">i")
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


class ClientAuthError(Exception):
    """The listener refused the TLS handshake or the SASL credentials (or they are misconfigured)."""


@dataclass(frozen=True)
class KafkaClientConfig:
    protocol: str = "PLAINTEXT"
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    mechanism: str | None = None
    username: str | None = None
    password: str | None = None

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"security.protocol must be one of {', '.join(PROTOCOLS)}, not {self.protocol!r}")
        if self.protocol.startswith("SASL_") and not (self.mechanism and self.username and self.password is not None):
            raise ValueError(f"{self.protocol} needs sasl.mechanism, sasl.username and sasl.password")

    @classmethod
    def from_properties(cls, props: dict[str, str] | str | Path) -> KafkaClientConfig:
        if not isinstance(props, dict):
            props = read_properties(props)
        return cls(protocol=props.get("security.protocol", "PLAINTEXT").upper(),
                   ca_file=props.get("ssl.ca.location"), cert_file=props.get("ssl.certificate.location"),
                   key_file=props.get("ssl.key.location"), mechanism=(props.get("sasl.mechanism") or "").upper() or None,
                   username=props.get("sasl.username"), password=props.get("sasl.password"))

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.protocol.endswith("SSL"):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    async def open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection ready for requests (TLS done, SASL authenticated)."""
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=self.ssl_context())
        except ssl.SSLError as exc:
            raise ClientAuthError(f"{host}:{port}: TLS handshake failed: {exc.reason or exc}") from exc
        if self.protocol.startswith("SASL_"):
            try:
                await sasl_login(reader, writer, self.mechanism, self.username, self.password)
            except BaseException:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
                raise
        return reader, writer


async def _ask(reader, writer, body, corr: int):
    writer.write(codec.encode_request(body, corr, client_id="scroll"))
    await writer.drain()
    (n,) = _SIZE.unpack(await reader.readexactly(4))
    return codec.decode_response(await reader.readexactly(n), body.__api_key__, body.__version__)[1]


async def sasl_login(reader, writer, mechanism: str, user: str, password: str) -> None:
    """SaslHandshake v1 then SaslAuthenticate v2 on a fresh connection; raises ``ClientAuthError``
    (``.offered``: the listener's mechanisms when it does not serve ``mechanism``)."""
    from kio.schema.sasl_authenticate.v2.request import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest

    hs = await _ask(reader, writer, SaslHandshakeRequest(mechanism=mechanism), 1)
    if hs.error_code != ErrorCode.none:
        err = ClientAuthError(f"SASL mechanism {mechanism} refused ({hs.error_code.name}); the listener offers "
                              f"{', '.join(hs.mechanisms) or 'none'}")
        err.offered = list(hs.mechanisms)
        raise err
    corr = iter(range(2, 6))

    async def token(data: bytes) -> bytes:
        r = await _ask(reader, writer, SaslAuthenticateRequest(auth_bytes=data), next(corr))
        if r.error_code != ErrorCode.none:
            raise ClientAuthError(f"SASL authentication as {user!r} failed: {r.error_message or r.error_code.name}")
        return r.auth_bytes

    if mechanism == "PLAIN":
        await token(b"\0" + user.encode() + b"\0" + password.encode())
        return
    try:
        client = ScramClient([mechanism], user, password)
        client.set_server_first((await token(client.get_client_first().encode())).decode())
        client.set_server_final((await token(client.get_client_final().encode())).decode())
    except ScramException as exc:
        raise ClientAuthError(f"SCRAM exchange as {user!r} failed: {exc}") from exc
