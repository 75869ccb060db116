"""Client credentials shared by every part that talks to bookies or the metadata store.

How this works. ``ClientSecurity`` is one frozen value carried from the user's options (the
streams API's ``connect(..., security=...)``, the Spark connector's ``tls.*`` / ``token`` /
``user`` / ``password`` options, the CLIs' flags) down to the bookie client (TLS towards the
bookie's gRPC and data ports, the bookie token) and the metadata store (etcd user/password and
TLS). Nothing here opens a socket: it only names files and secrets, and builds the ``ssl``
contexts and gRPC credentials the transports use.

Option names follow the Kafka source's style where they fit (``tls.ca`` ~ ``ssl.ca.location``):

* ``tls.ca``    - CA bundle (PEM) that server certificates must chain to; turns TLS on.
* ``tls.cert``  - client certificate (PEM) for mutual TLS; ``tls.key`` its private key.
* ``token``     - the bookie token (``token.file``: read it from a file).
* ``user`` / ``password`` - etcd credentials (else those of the metadata URL, if any).
"""

from __future__ import annotations

import hmac
import logging
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

log = logging.getLogger(__name__)


class SecurityConfigError(ValueError):
    """A credential option is missing, unreadable or inconsistent."""

    retriable = False


@dataclass(frozen=True)
class ClientSecurity:
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityConfigError("tls.cert and tls.key go together (a client certificate needs its key)")
        if self.tls_cert is not None and self.tls_ca is None:
            raise SecurityConfigError("tls.cert needs tls.ca (mutual TLS runs over TLS)")
        if (self.user is None) != (self.password is None):
            raise SecurityConfigError("user and password go together")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise SecurityConfigError(f"{name.replace('_', '.')}: no such file: {path}")

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None

    @property
    def empty(self) -> bool:
        return self == ClientSecurity()

    @classmethod
    def from_options(cls, options: Mapping[str, str | None]) -> ClientSecurity:
        """From string options (``tls.ca``, ``tls.cert``, ``tls.key``, ``token``, ``token.file``,
        ``user``, ``password``); unknown keys are ignored (the caller owns its other options)."""
        token = options.get("token")
        token_file = options.get("token.file")
        if token is not None and token_file is not None:
            raise SecurityConfigError("give token or token.file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        return cls(tls_ca=options.get("tls.ca"), tls_cert=options.get("tls.cert"), tls_key=options.get("tls.key"),
                   token=token, user=options.get("user"), password=options.get("password"))

    def with_(self, **changes: str | None) -> ClientSecurity:
        return replace(self, **changes)

    # ---------------------------------------------------------------- transports
    def ssl_context(self) -> ssl.SSLContext | None:
        """A client-side context verifying servers against ``tls_ca`` (None without TLS)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert is not None:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def pem(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(root CA, client key, client certificate) as bytes, as gRPC's credentials take them."""
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return read(self.tls_ca), read(self.tls_key), read(self.tls_cert)


def read_token_file(path: str | Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise SecurityConfigError(f"the token file {path} is empty")
    return token.splitlines()[0].strip()


NO_SECURITY = ClientSecurity()


def redact_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***`` (``etcd://user:***@host``),
    for logs, messages and ``repr``s. Anything that is not such a URL is returned as it is."""
    if not isinstance(url, str) or "://" not in url or "@" not in url:
        return url
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    userinfo, sep, hostport = parts.netloc.rpartition("@")
    if not sep or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{hostport}"))


# ------------------------------------------------------------------------------ the bookie's side

CLIENT_AUTH_MODES = ("none", "requested", "required")
AUTH_REQUIRED_MESSAGE = ("this bookie requires authentication: pass a token (token/token.file, --token-file) "
                         "or a client certificate (tls.cert/tls.key)")
INVALID_TOKEN_MESSAGE = "invalid token"


@dataclass(frozen=True)
class BookieSecurity:
    """What a bookie's listeners demand (``scroll bookie --tls-cert ... --auth-token-file ...``).

    * ``tls_cert``/``tls_key``: TLS on the gRPC and data ports.
    * ``client_ca`` + ``client_auth``: mutual TLS. ``required``: a client without a certificate
      signed by ``client_ca`` fails the handshake; ``requested``: a certificate is asked for (on the
      data port; gRPC can only require one) and a verified one authenticates the caller.
    * ``token_file``: accepted tokens, one per line (blank lines and ``#`` comments ignored); a
      caller presenting one is authenticated. The file is a secret: it is read once at start
      (restart to reload) and its tokens are never logged.

    Authentication is required when a token file is given or client certificates are required;
    otherwise every caller is accepted (TLS alone only encrypts).
    """

    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    client_auth: str = "none"
    token_file: str | None = None
    tokens: tuple[bytes, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityConfigError("--tls-cert and --tls-key go together")
        if self.client_auth not in CLIENT_AUTH_MODES:
            raise SecurityConfigError(f"--tls-client-auth must be one of {'|'.join(CLIENT_AUTH_MODES)}, "
                                      f"not {self.client_auth!r}")
        if self.client_ca is not None and self.tls_cert is None:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert/--tls-key (mutual TLS runs over TLS)")
        if self.client_auth != "none" and self.client_ca is None:
            raise SecurityConfigError(f"--tls-client-auth {self.client_auth} needs --tls-client-ca")
        for name in ("tls_cert", "tls_key", "client_ca", "token_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise SecurityConfigError(f"--{name.replace('_', '-')}: no such file: {path}")
        if self.token_file is not None and not self.tokens:
            object.__setattr__(self, "tokens", read_accepted_tokens(self.token_file))

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def auth_required(self) -> bool:
        return self.token_file is not None or self.client_auth == "required"

    @property
    def certs_authenticate(self) -> bool:
        """A verified client certificate authenticates its caller."""
        return self.client_auth != "none"

    @property
    def empty(self) -> bool:
        return not self.tls and not self.auth_required

    def token_ok(self, token: bytes | str | None) -> bool:
        """Whether ``token`` is one of the accepted tokens (compared in constant time, against
        every accepted token, so the time taken says nothing about which one came close)."""
        if token is None or not self.tokens:
            return False
        if isinstance(token, str):
            token = token.encode("utf-8", "replace")
        ok = False
        for t in self.tokens:
            ok |= hmac.compare_digest(token, t)
        return ok

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The data port's context (None without TLS)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
            if self.client_ca is not None:
                ctx.load_verify_locations(cafile=self.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"cannot load the bookie's certificates: {exc}") from exc
        ctx.verify_mode = {"none": ssl.CERT_NONE, "requested": ssl.CERT_OPTIONAL,
                           "required": ssl.CERT_REQUIRED}[self.client_auth]
        return ctx

    def grpc_pem(self) -> tuple[bytes, bytes, bytes | None]:
        """(key, certificate chain, client CA or None) as gRPC's server credentials take them."""
        return (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes(),
                None if self.client_ca is None else Path(self.client_ca).read_bytes())


def read_accepted_tokens(path: str | Path) -> tuple[bytes, ...]:
    """The tokens of a bookie's token file: one per line; blank lines and ``#`` comments skipped."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
        mode = p.stat().st_mode
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the token file {path}: {exc.strerror}") from None
    tokens = tuple(t.encode() for t in (line.strip() for line in lines) if t and not t.startswith("#"))
    if not tokens:
        raise SecurityConfigError(f"the token file {path} holds no token")
    if mode & 0o077:
        log.warning("the token file %s is readable by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return tokens


def read_client_properties(path: str | Path) -> dict[str, str]:
    """A ``key=value`` settings file, Java-properties style (``#``/``!`` comments, ``=`` or ``:``), as
    librdkafka's ``-F`` reads: the Kafka ``client.properties`` and the ``scroll-client.properties``
    (``metadata`` plus the credential options ``tls.ca``, ``tls.cert``, ``tls.key``, ``token``,
    ``token.file``, ``user``, ``password``: the names the Spark connector takes, so Spark can use
    ``.options(**read_client_properties(path))``) that ``scroll standalone --secure`` writes."""
    out: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read the client settings {path}: {exc.strerror}") from None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        sep = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        if sep <= 0:
            raise SecurityConfigError(f"{path}: expected key=value, got {line[:40]!r}")
        out[line[:sep].strip()] = line[sep + 1:].strip()
    return out
