"""Kafka SASL on the listener: PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512 (SaslHandshake v0-1 then
SaslAuthenticate v0-2, KIP-152), and the SCRAM credentials in the metadata store.

Credentials. ``kafka/scram/<user>/<mechanism>`` holds a salted credential made by ``scramp`` (salt,
iterations, stored key, server key), never the password. PLAIN checks its password against the
user's SCRAM-SHA-256 credential: derive with the same salt and iterations, compare the stored key
in constant time.

Bounded work per failed attempt. A SCRAM exchange costs the server a few HMACs; PLAIN costs one
PBKDF2 with the stored iteration count, run on one thread of its own with a bounded queue (a flood
of PLAIN attempts costs at most that thread; beyond the queue an attempt fails at once). An unknown user gets a fake credential
(a salt fixed per user name, 4096 iterations, keys that match nothing), so it costs the same and
fails with the same message as a wrong password. A failure is answered after a short delay on
that connection only, and the connection is then closed.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass

from scramp import ScramException, ScramMechanism

log = logging.getLogger(__name__)

PLAIN = "PLAIN"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
MECHANISMS = (PLAIN, *SCRAM_MECHANISMS)
DEFAULT_ITERATIONS = 4096
PREFIX = "kafka/scram/"
FAILURE_DELAY_S = 0.1
_FAKE_SALT_KEY = b"scroll-kafka-sasl-unknown-user"


def cred_key(user: str, mechanism: str) -> str:
    return f"{PREFIX}{user}/{mechanism}"


RESERVED_PREFIX = "__"  # __scroll_broker: the listeners' own identity (interbroker.py)


def check_user_name(user: str) -> None:
    if not user or "/" in user or len(user) > 255 or not user.isprintable():
        raise ValueError(f"invalid user name {user!r}: 1-255 printable characters, no '/'")
    if user.startswith(RESERVED_PREFIX):
        raise ValueError(f"invalid user name {user!r}: names starting with {RESERVED_PREFIX!r} are reserved")


def parse_mechanisms(text: str) -> tuple[str, ...]:
    """``PLAIN,SCRAM-SHA-256`` -> the mechanisms, checked."""
    mechs = tuple(m.strip().upper() for m in text.split(",") if m.strip())
    bad = [m for m in mechs if m not in MECHANISMS]
    if bad or not mechs:
        raise ValueError(f"unsupported SASL mechanism(s) {bad or text!r}; supported: {', '.join(MECHANISMS)}")
    return mechs


@dataclass(frozen=True)
class ScramCredential:
    salt: bytes
    stored_key: bytes
    server_key: bytes
    iterations: int

    def to_bytes(self) -> bytes:
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        return json.dumps({"salt": b64(self.salt), "stored_key": b64(self.stored_key),
                           "server_key": b64(self.server_key), "iterations": self.iterations}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ScramCredential:
        d = json.loads(data)
        return cls(base64.b64decode(d["salt"]), base64.b64decode(d["stored_key"]),
                   base64.b64decode(d["server_key"]), int(d["iterations"]))

    def auth_info(self) -> tuple[bytes, bytes, bytes, int]:
        return self.salt, self.stored_key, self.server_key, self.iterations


def make_credential(mechanism: str, password: str, iterations: int = DEFAULT_ITERATIONS,
                    salt: bytes | None = None) -> ScramCredential:
    salt, stored_key, server_key, i = ScramMechanism(mechanism).make_auth_info(password, iterations, salt)
    return ScramCredential(salt, stored_key, server_key, i)


def credential_from_salted(mechanism: str, salted_password: bytes, salt: bytes, iterations: int) -> ScramCredential:
    """The stored credential for a salted password made by the client (AlterUserScramCredentials):
    RFC 5802's StoredKey = H(HMAC(SaltedPassword, "Client Key")), ServerKey = HMAC(SaltedPassword,
    "Server Key"); scramp has no public helper from a salted password."""
    hf = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}[mechanism]
    client_key = hmac.new(salted_password, b"Client Key", hf).digest()
    server_key = hmac.new(salted_password, b"Server Key", hf).digest()
    return ScramCredential(salt, hf(client_key).digest(), server_key, iterations)


def fake_credential(user: str) -> ScramCredential:
    """What an unknown user is checked against: same cost, never matches."""
    salt = hmac.new(_FAKE_SALT_KEY, user.encode(), hashlib.sha256).digest()[:16]
    return ScramCredential(salt, os.urandom(32), os.urandom(32), DEFAULT_ITERATIONS)


def check_plain(cred: ScramCredential, password: str) -> bool:
    """Whether ``password`` is the one of this SCRAM-SHA-256 credential (PBKDF2: run it in a thread)."""
    derived = make_credential("SCRAM-SHA-256", password, cred.iterations, cred.salt)
    return hmac.compare_digest(derived.stored_key, cred.stored_key)


# PLAIN's PBKDF2 runs on one thread of its own, with at most _PLAIN_QUEUE checks waiting: a flood of
# PLAIN attempts (a brute-force loop on many connections) costs the listener one core at most and
# is refused beyond the queue, while SCRAM clients (whose PBKDF2 runs in the client) and
# authenticated connections are served by the event loop as before.
_PLAIN_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sasl-plain")
_PLAIN_QUEUE = 16
_plain_pending = 0


async def _check_plain_bounded(cred: ScramCredential, password: str) -> bool:
    global _plain_pending
    if _plain_pending >= _PLAIN_QUEUE:
        log.warning("SASL/PLAIN: %d checks already waiting; refusing one more", _plain_pending)
        return False
    _plain_pending += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_PLAIN_POOL, check_plain, cred, password)
    finally:
        _plain_pending -= 1


# ---------------------------------------------------------------- the store
async def add_user(store, user: str, password: str, mechanisms=SCRAM_MECHANISMS,
                   iterations: int = DEFAULT_ITERATIONS) -> None:
    check_user_name(user)
    await store_credentials(store, user, password, mechanisms, iterations)


async def store_credentials(store, user: str, password: str, mechanisms=SCRAM_MECHANISMS,
                            iterations: int = DEFAULT_ITERATIONS) -> None:
    """Store the salted credentials (no name check: also the reserved broker user's)."""
    for m in mechanisms:
        if m not in SCRAM_MECHANISMS:
            raise ValueError(f"credentials are stored for {', '.join(SCRAM_MECHANISMS)} (PLAIN uses SCRAM-SHA-256)")
        cred = await asyncio.to_thread(make_credential, m, password, iterations)
        await store.put(cred_key(user, m), cred.to_bytes())


async def remove_user(store, user: str) -> bool:
    check_user_name(user)
    found = False
    for m in SCRAM_MECHANISMS:
        found = await store.delete(cred_key(user, m)) or found
    return found


async def list_users(store) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for key, _v in await store.list_prefix(PREFIX):
        user, _, mech = key[len(PREFIX):].rpartition("/")
        if not user.startswith(RESERVED_PREFIX):
            users.setdefault(user, []).append(mech)
    return {u: sorted(ms) for u, ms in sorted(users.items())}


async def load_credential(store, user: str, mechanism: str) -> ScramCredential | None:
    if not user or "/" in user:
        return None
    v = await store.get(cred_key(user, mechanism))
    return None if v is None else ScramCredential.from_bytes(v.value)


# ---------------------------------------------------------------- one connection's exchange
def _tolerate_doubled_client_nonce(server, client_final: str) -> None:
    """librdkafka before 2.3 (Debian's kcat) sends its nonce twice in the client-final message
    (``r=<client nonce><client nonce><server nonce>``); Kafka's broker accepts a final nonce that
    *ends with* the one it sent, and so do we: the client's proof is still checked over the
    messages as they were sent (the auth message takes the client-final as received), so nothing
    else is relaxed. scramp compares the whole nonce, so it is told the nonce it will see."""
    sent = str(server.nonce) if server.nonce is not None else ""
    got = next((a[2:] for a in client_final.split(",") if a.startswith("r=")), None)
    if sent and got is not None and got != sent and got.endswith(sent):
        from scramp.core import Nonce  # the type scramp compares with

        server.nonce = Nonce(got)


class AuthenticationFailed(Exception):
    pass


def _failed(mechanism: str) -> AuthenticationFailed:
    return AuthenticationFailed(f"Authentication failed during authentication due to invalid credentials "
                                f"with SASL mechanism {mechanism}")


class SaslSession:
    """The server side of one connection's SASL exchange (after its SaslHandshake chose ``mechanism``)."""

    def __init__(self, store, mechanism: str):
        self.store = store
        self.mechanism = mechanism
        self._scram = None  # the scramp server between the client's first and final messages
        self.principal: str | None = None  # set once authenticated

    async def step(self, token: bytes) -> bytes:
        """The answer to one SaslAuthenticate token; raises ``AuthenticationFailed``."""
        if self.mechanism == PLAIN:
            return await self._plain(token)
        if self._scram is None:
            return await self._scram_first(token)
        return self._scram_final(token)

    async def _plain(self, token: bytes) -> bytes:
        parts = token.split(b"\0")
        if len(parts) != 3:
            raise AuthenticationFailed("Invalid SASL/PLAIN message: authzid\\0user\\0password expected")
        authzid, user, password = (p.decode("utf-8", "replace") for p in parts)
        cred = await load_credential(self.store, user, "SCRAM-SHA-256")
        ok = await _check_plain_bounded(cred or fake_credential(user), password)
        if not ok or cred is None or (authzid and authzid != user):
            raise _failed(PLAIN)
        self.principal = user
        return b""

    async def _scram_first(self, token: bytes) -> bytes:
        msg = token.decode("utf-8", "replace")
        user = ""
        for attr in msg.split(",")[2:]:
            if attr.startswith("n="):
                user = attr[2:].replace("=2C", ",").replace("=3D", "=")
                break
        cred = await load_credential(self.store, user, self.mechanism) or fake_credential(user)
        self._scram = ScramMechanism(self.mechanism).make_server(lambda _u: cred.auth_info())
        self._user = user
        try:
            self._scram.set_client_first(msg)
            return self._scram.get_server_first().encode()
        except ScramException as exc:
            raise _failed(self.mechanism) from exc

    def _scram_final(self, token: bytes) -> bytes:
        msg = token.decode("utf-8", "replace")
        try:
            _tolerate_doubled_client_nonce(self._scram, msg)
            self._scram.set_client_final(msg)
            final = self._scram.get_server_final()
        except ScramException as exc:
            raise _failed(self.mechanism) from exc
        self.principal = self._user
        return final.encode()
