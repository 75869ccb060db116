"""Logins, sessions, CSRF tokens and ACL checks of ``scroll console --secure``.

How this works. A login names a Kafka SCRAM user and its password, checked as the Kafka listener
checks SASL/PLAIN: PBKDF2 with the salt and iterations of the user's stored SCRAM-SHA-256
credential, the stored key compared in constant time (an unknown user costs the same and fails
the same). Or it gives the console's token (``--token-file``), which logs in as ``User:console``
(name it in ``--super-users`` to make it one). A session is a cookie ``user|expiry|nonce|mac``
signed with a key made at start (HMAC-SHA256; restarting the console logs everyone out), HttpOnly,
SameSite=Strict and Secure. Every POST carries a CSRF token, HMAC(key, "csrf" + the session's
nonce), checked in constant time. Every page and action asks ``allowed`` with the principal
``User:<name>``, the client's address and the Kafka resource and operation it touches: the same
``AclSet`` the Kafka listener enforces (``kafka/acls/`` in the metadata store, watched), with the
same super users.

Without ``--secure`` there is no login and no ACL check: the console then binds loopback only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from ..security import sasl
from ..security.acls import CLUSTER_NAME, Operation, ResourceType
from ..security.authorizer import Authorizer

SESSION_COOKIE = "scroll_console"
SESSION_S = 8 * 3600.0
TOKEN_USER = "console"
FAILURE_DELAY_S = 0.2


@dataclass(frozen=True)
class Session:
    user: str
    nonce: str

    @property
    def principal(self) -> str:
        return f"User:{self.user}"


class Auth:
    """``secure=False``: everyone is ``User:ANONYMOUS`` and allowed everything (loopback only)."""

    def __init__(self, store=None, secure: bool = False, token: str | None = None,
                 super_users: frozenset[str] = frozenset()):
        self.secure = secure
        self.store = store
        self.token = token
        self.key = secrets.token_bytes(32)
        self.authorizer = Authorizer(store, super_users) if secure else None

    async def start(self) -> None:
        if self.authorizer is not None:
            await self.authorizer.start()

    async def close(self) -> None:
        if self.authorizer is not None:
            await self.authorizer.close()

    # ------------------------------------------------------------------ login
    async def login(self, user: str, password: str) -> Session | None:
        if self.token is not None and not user and hmac.compare_digest(password.encode(), self.token.encode()):
            return self._new(TOKEN_USER)
        ok = False
        if user and "/" not in user and not user.startswith(sasl.RESERVED_PREFIX):
            cred = await sasl.load_credential(self.store, user, "SCRAM-SHA-256")
            ok_cred = cred if cred is not None else sasl.fake_credential(user)
            ok = await asyncio.to_thread(sasl.check_plain, ok_cred, password) and cred is not None
        if not ok:
            await asyncio.sleep(FAILURE_DELAY_S)
            return None
        return self._new(user)

    def _new(self, user: str) -> Session:
        return Session(user, secrets.token_urlsafe(12))

    def cookie(self, s: Session) -> str:
        expiry = str(int(time.time() + SESSION_S))
        body = f"{s.user}|{expiry}|{s.nonce}"
        return body + "|" + self._mac(body)

    def session(self, cookie: str | None) -> Session | None:
        if not self.secure:
            return Session("ANONYMOUS", "")
        if not cookie:
            return None
        body, _, mac = cookie.rpartition("|")
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        user, expiry, nonce = (body.split("|") + ["", "", ""])[:3]
        if not expiry.isdigit() or int(expiry) < time.time():
            return None
        return Session(user, nonce)

    def csrf(self, s: Session) -> str:
        return self._mac("csrf" + s.nonce)

    def check_csrf(self, s: Session, token: str | None) -> bool:
        if not self.secure:
            return True  # loopback only, no sessions; the forms still send it
        return bool(token) and hmac.compare_digest(token, self.csrf(s))

    def _mac(self, text: str) -> str:
        return hmac.new(self.key, text.encode(), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ ACLs
    def allowed(self, s: Session, host: str, rtype: ResourceType, name: str, op: Operation) -> bool:
        if self.authorizer is None:
            return True
        return self.authorizer.acls.authorize(s.principal, host, rtype, name, op)

    def cluster(self, s: Session, host: str, op: Operation = Operation.DESCRIBE) -> bool:
        return self.allowed(s, host, ResourceType.CLUSTER, CLUSTER_NAME, op)
