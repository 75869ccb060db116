"""The object-store tier's client: a thin async wrapper over obstore's S3 store.

Every request is bounded: obstore gets an explicit connect timeout, a per-request timeout, a retry
count and a retry deadline (with its defaults a silent server keeps a request waiting as long as it
stays silent), and each call is also bounded from outside (``ObjectStore.deadline_s``).

obstore's exceptions are mapped onto ours (``ObjectStoreError`` and its subclasses); their messages
name the endpoint, the bucket, the operation and the key, keep the server's S3 error code, lose
obstore's long "Debug source" dump, and never contain the secret key.

Why the synchronous obstore calls, each in a worker thread, rather than its ``*_async`` functions:
the async ones complete on a tokio thread that calls back into Python (the event loop's
``call_soon_threadsafe``). When that lands while the interpreter finalizes (a script that awaited
its last request and exits at once), CPython 3.11 ends the foreign thread with ``pthread_exit``,
whose forced unwind through Rust frames aborts the process ("Aborted", exit status 134: seen in
about 1 run in 8 of a short script with a timed-out request, with a gdb backtrace of the tokio
thread in ``pyo3_async_runtimes::generic::set_result`` -> ``sock_send`` -> ``take_gil`` ->
``PyThread_exit_thread``). The synchronous calls release the GIL and run the request on the calling
(Python) thread, so no tokio thread ever enters Python; the worker threads are joined at exit, and
every request is bounded, so exit waits at most one deadline.

obstore's S3 builder also reads ``AWS_*`` environment variables (a stray ``AWS_SESSION_TOKEN`` or
``AWS_VIRTUAL_HOSTED_STYLE_REQUEST`` breaks every request): the settings that matter here are given
explicitly, so only deployment-wide ones (server-side encryption, checksum algorithm) still come
from there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

__all__ = [
    "TierConfig", "ObjectStore", "ObjectStoreError", "ObjectStoreUnavailable", "ObjectMissing", "ObjectExists",
    "ObjectStoreAuthError", "NoSuchBucket", "load_credentials",
]


@dataclass(frozen=True)
class TierConfig:
    """Where the tier lives and how hard to try. JSON-able (``to_dict``/``from_dict``) and free of
    secrets: the credentials come from ``credentials_file`` or the environment (``load_credentials``)."""

    endpoint: str  # e.g. "http://127.0.0.1:8333" or "https://s3.example.com"
    bucket: str
    prefix: str = "scroll"  # every key lives under "<prefix>/"
    region: str = "us-east-1"
    credentials_file: str | None = None
    ca_file: str | None = None  # PEM CA(s) for an https endpoint with a private CA
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 30.0  # per request, body included
    retries: int = 3
    retry_timeout_s: float = 60.0  # no retry starts later than this after the first attempt

    def __post_init__(self):
        if not re.match(r"^https?://[^/]+/?$", self.endpoint or ""):
            raise ValueError(f"tier endpoint must be http(s)://host[:port], not {self.endpoint!r}")
        if not self.bucket or "/" in self.bucket:
            raise ValueError(f"tier bucket must be a bucket name, not {self.bucket!r}")
        object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        object.__setattr__(self, "prefix", (self.prefix or "").strip("/"))
        for name in ("connect_timeout_s", "request_timeout_s", "retry_timeout_s"):
            value = float(getattr(self, name))
            if value <= 0:
                raise ValueError(f"tier {name} must be positive, not {value}")
            object.__setattr__(self, name, value)
        if int(self.retries) < 0:
            raise ValueError(f"tier retries must be >= 0, not {self.retries}")
        object.__setattr__(self, "retries", int(self.retries))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TierConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown tier setting(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def key(self, rel: str) -> str:
        rel = rel.lstrip("/")
        return f"{self.prefix}/{rel}" if self.prefix else rel

    @property
    def deadline_s(self) -> float:
        """The longest one call may take: obstore starts no retry after ``retry_timeout_s``, the
        last attempt takes at most ``request_timeout_s``; plus the longest backoff and some slack."""
        return self.retry_timeout_s + self.request_timeout_s + _MAX_BACKOFF_S + 2.0


_MAX_BACKOFF_S = 2.0


class ObjectStoreError(Exception):
    """Base of the tier's errors; the message never contains a secret."""


class ObjectStoreUnavailable(ObjectStoreError):
    """Timed out, refused, or a 5xx after the retries: try again later."""


class ObjectMissing(ObjectStoreError):
    pass


class ObjectExists(ObjectStoreError):
    """A conditional PUT (``If-None-Match: *``) found the key taken."""


class ObjectStoreAuthError(ObjectStoreError):
    """The credentials are wrong or lack a permission: retrying does not help."""


class NoSuchBucket(ObjectStoreError):
    pass


def load_credentials(config: TierConfig) -> tuple[str, str, str | None] | None:
    """``(access_key_id, secret_access_key, session_token)``, or None for anonymous access.

    ``credentials_file``: JSON ``{"access_key_id": .., "secret_access_key": ..}`` (optionally
    ``"session_token"``) or two lines, the key id then the secret. Without a file:
    ``SCROLL_S3_ACCESS_KEY_ID``/``SCROLL_S3_SECRET_ACCESS_KEY``, else ``AWS_ACCESS_KEY_ID``/
    ``AWS_SECRET_ACCESS_KEY`` (with ``AWS_SESSION_TOKEN`` if set), else anonymous."""
    if config.credentials_file:
        path = Path(config.credentials_file)
        try:
            text = path.read_text()
        except OSError as e:
            raise ObjectStoreError(f"cannot read the object store credentials file {path}: {e.strerror}") from None
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                d = json.loads(stripped)
                return str(d["access_key_id"]), str(d["secret_access_key"]), d.get("session_token") or None
            except (ValueError, KeyError, TypeError):
                raise ObjectStoreError(f"object store credentials file {path}: expected JSON with access_key_id "
                                       "and secret_access_key") from None
        lines = [line.strip() for line in stripped.splitlines() if line.strip()]
        if len(lines) != 2:
            raise ObjectStoreError(f"object store credentials file {path}: expected two lines (access key id, "
                                   "secret access key) or JSON")
        return lines[0], lines[1], None
    env = os.environ
    if env.get("SCROLL_S3_ACCESS_KEY_ID") and env.get("SCROLL_S3_SECRET_ACCESS_KEY"):
        return env["SCROLL_S3_ACCESS_KEY_ID"], env["SCROLL_S3_SECRET_ACCESS_KEY"], None
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        token = env.get("AWS_SESSION_TOKEN") or env.get("AWS_TOKEN") or None
        return env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], token
    return None


# --- obstore's errors -> ours

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_OS_MESSAGE = re.compile(r'message: "([^"]*)"')
_UNAVAILABLE_HINTS = ("timed out", "timedout", "timeout", "connection refused", "connectionrefused",
                      "error sending request", "connection reset", "connection closed", "broken pipe",
                      "dns error", "incompletemessage", "unexpected eof", "error reading a body")
_AUTH_CODES = {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken", "ExpiredToken",
               "AuthorizationHeaderMalformed", "MissingSecurityHeader"}


def _summary(text: str) -> str:
    """obstore's message without its "Debug source" dump: its first line, the S3 error code and
    message of the response body, and the cause of a transport error (timed out, refused)."""
    main, _, debug = text.partition("\n\nDebug source:")
    first = main.splitlines()[0] if main else ""
    first = re.sub(r":\s*<\?xml[^>]*\?>\s*$", "", first).rstrip(": ")
    extra = []
    code, message = _CODE.search(main), _MESSAGE.search(main)
    if code:
        extra.append(code.group(1) + (f": {message.group(1)}" if message else ""))
    if "HTTP error" in first or not code:
        if "TimedOut" in debug or "kind: Timeout" in debug:
            extra.append("timed out")
        else:
            os_message = _OS_MESSAGE.search(debug)
            if os_message:
                extra.append(os_message.group(1))
            elif "certificate" in debug.lower():
                cert = re.search(r"InvalidCertificate\(\s*(\w+)", debug)
                extra.append(f"TLS: invalid peer certificate: {cert.group(1)}" if cert else "TLS certificate error")
    out = first + (f" ({'; '.join(extra)})" if extra else "")
    return out[:600]


class _Redactor:
    def __init__(self, secrets: list[str]):
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return text


def _classify(e: BaseException) -> type[ObjectStoreError]:
    text = str(e)
    status_m = _STATUS.search(text)
    status = int(status_m.group(1)) if status_m else None
    code_m = _CODE.search(text)
    code = code_m.group(1) if code_m else None
    low = text.lower()
    if isinstance(e, (AlreadyExistsError, PreconditionError)) or status == 412:
        return ObjectExists
    if code == "NoSuchBucket":
        return NoSuchBucket
    if isinstance(e, FileNotFoundError) or status == 404 or code == "NoSuchKey":
        return ObjectMissing
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403) or code in _AUTH_CODES:
        return ObjectStoreAuthError
    if status is not None and (status >= 500 or status in (408, 429)):
        return ObjectStoreUnavailable
    if status is None and "certificate" in low:
        return ObjectStoreError  # a TLS setup problem: retrying does not help
    if status is None and any(h in low for h in _UNAVAILABLE_HINTS):
        return ObjectStoreUnavailable
    return ObjectStoreError


# --- the worker threads the (blocking, GIL-releasing) obstore calls run on

_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="scroll-objstore")
        return _executor


class ObjectStore:
    """Async access to one bucket. Keys are full keys (callers use ``config.key(...)``)."""

    def __init__(self, config: TierConfig):
        self._config = config
        creds = load_credentials(config)
        self._redact = _Redactor([creds[1], creds[2] or ""] if creds else [])
        self._store = self._make_store(config, creds, retries=config.retries)
        # check(): one attempt, no retry, so a wrong setup fails within connect + request timeout
        self._probe = self._make_store(config, creds, retries=0)

    @staticmethod
    def _make_store(config: TierConfig, creds, *, retries: int) -> S3Store:
        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=config.connect_timeout_s),
            "timeout": timedelta(seconds=config.request_timeout_s),
            "allow_http": config.endpoint.startswith("http://"),
        }
        if config.ca_file:
            try:
                client["root_certificate"] = Path(config.ca_file).read_text()
            except OSError as e:
                raise ObjectStoreError(f"cannot read the object store CA file {config.ca_file}: {e.strerror}") from None
        retry = {
            "max_retries": retries,
            "retry_timeout": timedelta(seconds=config.retry_timeout_s),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=_MAX_BACKOFF_S),
                        "base": 2},
        }
        s3: dict[str, Any] = {
            "endpoint": config.endpoint, "region": config.region,
            # explicit, so that stray AWS_* environment variables cannot change them
            "virtual_hosted_style_request": False, "request_payer": False, "unsigned_payload": False,
        }
        if creds is None:
            s3["skip_signature"] = True
        else:
            # an empty token overrides an AWS_SESSION_TOKEN of the environment that belongs to other keys
            s3.update(access_key_id=creds[0], secret_access_key=creds[1], session_token=creds[2] or "",
                      skip_signature=False)
        return S3Store(config.bucket, config=s3, client_options=client, retry_config=retry)

    @property
    def config(self) -> TierConfig:
        return self._config

    def _error(self, e: BaseException, op: str, key: str | None) -> ObjectStoreError:
        cls = _classify(e)
        c = self._config
        where = f"object store {c.endpoint} bucket {c.bucket!r}"
        what = f"{op} {key!r}" if key is not None else op
        return cls(self._redact(f"{where}: {what}: {_summary(str(e))}"))

    async def _run(self, op: str, key: str | None, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(_pool(), lambda: fn(*args, **kwargs))
        try:
            return await asyncio.wait_for(fut, self._config.deadline_s)
        except ObjectStoreError:
            raise
        except TimeoutError:
            c = self._config
            raise ObjectStoreUnavailable(f"object store {c.endpoint} bucket {c.bucket!r}: {op} {key!r}: no answer "
                                         f"within {c.deadline_s:.0f}s") from None
        except (obstore.exceptions.BaseError, OSError) as e:
            raise self._error(e, op, key) from None

    async def check(self) -> None:
        """One short LIST of the prefix, no retry: raises ``ObjectStoreAuthError``, ``NoSuchBucket``
        or ``ObjectStoreUnavailable`` (unreachable) with a message naming the endpoint and bucket."""
        prefix = self._config.prefix or None

        def probe():
            stream = obstore.list(self._probe, prefix, chunk_size=1)
            next(iter(stream), None)

        await self._run("list", prefix or "", probe)

    async def put_if_absent(self, key: str, data) -> str:
        """One conditional PUT (``If-None-Match: *``); returns the new object's ETag. Raises
        ``ObjectExists`` if the key is taken -- also when an earlier attempt of this very call was
        stored but its answer lost (a retried PUT): compare ``head``'s size/ETag to tell."""
        result = await self._run("put", key, obstore.put, self._store, key, data, mode="create", use_multipart=False)
        return result.get("e_tag") or ""

    async def head(self, key: str) -> tuple[int, str | None]:
        meta = await self._run("head", key, obstore.head, self._store, key)
        return int(meta["size"]), meta.get("e_tag")

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``; a range past the end of the object is an error."""
        if not 0 <= start <= end:
            raise ValueError(f"bad range [{start}, {end})")
        if start == end:
            return b""
        return await self._run("get", key, lambda: bytes(obstore.get_range(self._store, key, start=start, end=end)))

    async def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges of one object, fetched in parallel (close ranges coalesced into one request)."""
        for start, end in ranges:
            if not 0 <= start <= end:
                raise ValueError(f"bad range [{start}, {end})")
        todo = [(i, s, e) for i, (s, e) in enumerate(ranges) if e > s]
        out = [b""] * len(ranges)
        if not todo:
            return out

        def fetch():
            got = obstore.get_ranges(self._store, key, starts=[s for _, s, _ in todo], ends=[e for _, _, e in todo])
            return [bytes(b) for b in got]

        for (i, _, _), data in zip(todo, await self._run("get", key, fetch)):
            out[i] = data
        return out

    async def get(self, key: str) -> bytes:
        return await self._run("get", key, lambda: bytes(obstore.get(self._store, key).bytes()))

    async def delete(self, key: str) -> None:
        """Idempotent: a missing key is fine."""
        try:
            await self._run("delete", key, obstore.delete, self._store, key)
        except ObjectMissing:
            pass

    async def list(self, prefix: str) -> list[tuple[str, int, int]]:
        """Every key under ``prefix`` (whole path segments: "a/b" covers "a/b/c", not "a/bc"), as
        ``(key, size, last_modified_ms)``, in no particular order."""

        def collect():
            out = []
            for chunk in obstore.list(self._store, prefix.rstrip("/") or None, chunk_size=1000):
                for m in chunk:
                    out.append((m["path"], int(m["size"]), int(m["last_modified"].timestamp() * 1000)))
            return out

        return await self._run("list", prefix, collect)
