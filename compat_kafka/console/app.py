"""The console's pages and actions (Starlette routes) and how the app is put together.

How this works. ``build_app`` makes the Starlette app around one ``ConsoleData`` (what pages read),
one ``Auth`` (who may see what) and one ``Sampler`` (the graphs' samples, run as a task of the app's
lifespan). Each page handler: the session (under ``--secure``: a login, else redirect to /login),
the ACL check of what it shows, the data, one template. Actions are POSTs behind a CSRF token and
a confirmation field. Bad input (a page number, an offset, an unknown stream) gets the page again
with a clear message and status 400/404, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..security.acls import Operation, ResourceType
from .auth import SESSION_COOKIE, Auth, Session
from .data import DEFAULT_PAGE_ROWS, MAX_PAGE_RECORDS, MAX_PAGE_ROWS, ConsoleData, ConsoleError, fmt_bytes
from .timeseries import Sampler

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
TOPIC, GROUP = ResourceType.TOPIC, ResourceType.GROUP


class Denied(Exception):
    pass


def _ts(t: float | int | None, ms: bool = False) -> str:
    if not t:
        return "-"
    if ms:
        t = t / 1000
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))
    env.filters["bytes"] = fmt_bytes
    env.filters["ts"] = _ts
    env.filters["ts_ms"] = lambda t: _ts(t, ms=True)
    return env


class Console:
    def __init__(self, data: ConsoleData, auth: Auth, sampler: Sampler, *, scheme: str = "http"):
        self.data = data
        self.auth = auth
        self.sampler = sampler
        self.env = _env()
        self.scheme = scheme

    # ------------------------------------------------------------------ plumbing
    def session(self, request: Request) -> Session | None:
        return self.auth.session(request.cookies.get(SESSION_COOKIE))

    @staticmethod
    def host(request: Request) -> str:
        return request.client.host if request.client else ""

    def render(self, request: Request, name: str, session: Session | None, status: int = 200, **ctx) -> HTMLResponse:
        html = self.env.get_template(name).render(
            request=request, session=session, secure=self.auth.secure,
            csrf=self.auth.csrf(session) if session is not None else "", path=request.url.path, code=status, **ctx)
        return HTMLResponse(html, status_code=status, headers={
            "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
            "X-Frame-Options": "DENY", "Cache-Control": "no-store"})

    def page(self, check=None):
        """Decorate a handler ``(request, session) -> Response``: login and ACL ``check``, errors shown."""

        def wrap(fn):
            async def handler(request: Request) -> Response:
                s = self.session(request)
                self.sampler.touch()  # someone looks: the graphs sample every interval again
                if s is None:
                    return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
                try:
                    if check is not None and not check(self, request, s):
                        raise Denied("not authorized")
                    if request.method == "POST":
                        form = await request.form()
                        if not self.auth.check_csrf(s, form.get("csrf")):
                            return self.render(request, "error.html", s, 403, message="CSRF token missing or wrong")
                    return await fn(request, s)
                except Denied as exc:
                    return self.render(request, "error.html", s, 403,
                                       message=f"{s.principal} is not authorized: {exc}")
                except ConsoleError as exc:
                    return self.render(request, "error.html", s, 400, message=str(exc))
                except Exception as exc:  # noqa: BLE001 - logged; the user gets a message, not a traceback
                    log.exception("console: %s %s failed", request.method, request.url.path)
                    return self.render(request, "error.html", s, 500, message=f"{type(exc).__name__}: {exc}")
            return handler
        return wrap

    def may(self, request: Request, s: Session, rtype: ResourceType, name: str, op: Operation) -> bool:
        return self.auth.allowed(s, self.host(request), rtype, name, op)

    # ------------------------------------------------------------------ pages
    async def overview(self, request: Request, s: Session) -> Response:
        bookies, listeners, members = await asyncio.gather(self.data.bookies(), self.data.kafka_listeners(),
                                                           self.data.etcd_members())
        groups = await self.data.groups()
        lags = {g["group"]: self.sampler.ring.get(f"lag:{g['group']}")[1] for g in groups}
        behind = {g: v[-1] for g, v in lags.items() if v and v[-1]}
        problems = [f"bookie {b['id']} is down" for b in bookies if not b["up"]]
        problems += [f"bookie {b['id']} is read-only" for b in bookies if b["up"] and b["read_only"]]
        problems += [f"{name} metrics endpoint does not answer" for name, up in self.sampler.up.items() if not up]
        problems += [f"last {job} run failed" for job, j in self.sampler.jobs.items() if j["last_outcome"] == "failed"]
        if not listeners:
            problems.append("no Kafka listener is registered")
        streams = await self.data.ledgers()
        return self.render(request, "overview.html", s, bookies=bookies, listeners=listeners, members=members,
                           jobs=self.sampler.jobs, sources=self.sampler.up, problems=problems, behind=behind,
                           streams=len(streams), groups=len(groups))

    async def streams(self, request: Request, s: Session) -> Response:
        q = request.query_params.get("q", "")
        page = _int(request.query_params.get("page"), 1, "page", 1)
        size = _int(request.query_params.get("size"), DEFAULT_PAGE_ROWS, "size", 1, MAX_PAGE_ROWS)
        rows, total = await self.data.stream_rows(q, page, size,
                                                  visible=lambda topic: self.may(request, s, TOPIC, topic,
                                                                                 Operation.DESCRIBE))
        pages = max(1, -(-total // size))
        return self.render(request, "streams.html", s, rows=rows, q=q, page=page, size=size, total=total, pages=pages)

    async def topic(self, request: Request, s: Session) -> Response:
        name = request.path_params["name"]
        if not self.may(request, s, TOPIC, name, Operation.DESCRIBE):
            raise Denied(f"DESCRIBE on topic {name}")
        return self.render(request, "topic.html", s, t=await self.data.topic(name))

    async def stream(self, request: Request, s: Session) -> Response:
        name = request.path_params["name"]
        d = await self.data.stream(name) if self.may(request, s, TOPIC, _topic_of(name), Operation.DESCRIBE) \
            else _deny(f"DESCRIBE on topic {_topic_of(name)}")
        self.sampler.watch(name)  # its bytes are sampled from now on, for the graph
        return self.render(request, "stream.html", s, d=d, rate_series=f"stream_bytes:{name}")

    async def records(self, request: Request, s: Session) -> Response:
        out, err = await self._records(request, s)
        return self.render(request, "records.html", s, r=out, error=err, params=request.query_params,
                           max_limit=MAX_PAGE_RECORDS, status=400 if err else 200)

    async def records_api(self, request: Request, s: Session) -> Response:
        out, err = await self._records(request, s)
        if err:
            return JSONResponse({"error": err}, status_code=400)
        if out is None:
            return JSONResponse({"records": []})
        return JSONResponse({"end": out["end"], "next": out["next"], "records": [
            {"offset": r.offset, "timestamp": _ts(r.timestamp_ms, ms=True), "key": r.key, "headers": r.headers,
             "value": r.value, "kind": r.kind} for r in out["records"]]})

    async def _records(self, request: Request, s: Session):
        p = request.query_params
        stream = p.get("stream", "")
        if p.get("topic"):
            part = _int(p.get("partition"), 0, "partition", 0)
            stream = p["topic"] if part == 0 else f"{p['topic']}:{part}"
        if not stream:
            return None, None
        if not self.may(request, s, TOPIC, _topic_of(stream), Operation.READ):
            raise Denied(f"READ on topic {_topic_of(stream)}")
        limit = _int(p.get("limit"), 50, "page size", 1, MAX_PAGE_RECORDS)
        try:
            ts = None
            if p.get("timestamp"):
                ts = _parse_time(p["timestamp"])
            offset = _int(p.get("offset"), 0, "offset", 0) if p.get("offset") else None
            out = await self.data.records(stream, offset=offset, timestamp_ms=ts, tail=p.get("mode") == "tail",
                                          live=p.get("live") == "1", limit=limit)
        except ConsoleError as exc:
            return None, str(exc)
        return out, None

    async def groups(self, request: Request, s: Session) -> Response:
        groups = [g for g in await self.data.groups() if self.may(request, s, GROUP, g["group"], Operation.DESCRIBE)]
        for g in groups:
            g["lag"] = (self.sampler.ring.get(f"lag:{g['group']}")[1] or [None])[-1]
        return self.render(request, "groups.html", s, groups=groups)

    async def group(self, request: Request, s: Session, message: str | None = None, status: int = 200) -> Response:
        name = request.path_params["name"]
        if not self.may(request, s, GROUP, name, Operation.DESCRIBE):
            raise Denied(f"DESCRIBE on group {name}")
        try:
            g = await self.data.group(name)
        except Exception as exc:  # noqa: BLE001 - the listener down: say so on the page
            if isinstance(exc, ConsoleError):
                raise
            raise ConsoleError(f"group {name}: {exc}") from None
        g["partitions"] = [r for r in g["partitions"] if self.may(request, s, TOPIC, _row(r, "topic"),
                                                                  Operation.DESCRIBE)]
        return self.render(request, "group.html", s, g=g, message=message, status=status,
                           lag_series=f"lag:{name}")

    async def group_reset(self, request: Request, s: Session) -> Response:
        name = request.path_params["name"]
        form = await request.form()
        if not self.may(request, s, GROUP, name, Operation.READ):
            raise Denied(f"READ on group {name} (needed to commit offsets)")
        topics = [t.strip() for t in str(form.get("topics", "")).split(",") if t.strip()] or None
        for t in topics or []:
            if not self.may(request, s, TOPIC, t, Operation.READ):
                raise Denied(f"READ on topic {t}")
        to = str(form.get("to", ""))
        if to not in ("earliest", "latest", "offset", "shift", "timestamp"):
            raise ConsoleError(f"reset to earliest, latest, offset, shift or timestamp, not {to!r}")
        value = None
        if to in ("offset", "shift"):
            value = _int(form.get("value"), None, "value", -(2**62))
        elif to == "timestamp":
            value = _parse_time(str(form.get("value", "")))
        if form.get("confirm") != name:
            return await self.group(request, s, f"not reset: type the group's name ({name}) to confirm", 400)
        try:
            plan = await self.data.reset_offsets(name, topics, to, value)
        except Exception as exc:  # noqa: BLE001 - AdminError (active members, ...) shown as it is
            return await self.group(request, s, f"not reset: {exc}", 409)
        return await self.group(request, s, "offsets reset: " + ", ".join(f"{k}={v}" for k, v in plan.items()))

    async def group_delete(self, request: Request, s: Session) -> Response:
        name = request.path_params["name"]
        form = await request.form()
        if not self.may(request, s, GROUP, name, Operation.DELETE):
            raise Denied(f"DELETE on group {name}")
        if form.get("confirm") != name:
            return await self.group(request, s, f"not deleted: type the group's name ({name}) to confirm", 400)
        try:
            await self.data.delete_group(name)
        except Exception as exc:  # noqa: BLE001
            return await self.group(request, s, f"not deleted: {exc}", 409)
        return RedirectResponse("/groups", status_code=303)

    async def bookies(self, request: Request, s: Session) -> Response:
        bookies = await self.data.bookies()
        infos = await asyncio.gather(*(self.data.bookie_info(b["id"]) if b["up"] else _none() for b in bookies))
        for b, info in zip(bookies, infos):
            b["info"] = info or {}
            b["metrics"] = _bookie_metrics(self.sampler.last.get(b["id"], []))
        return self.render(request, "bookies.html", s, bookies=bookies)

    async def bookie(self, request: Request, s: Session) -> Response:
        bid = request.path_params["id"]
        bookies = {b["id"]: b for b in await self.data.bookies()}
        if bid not in bookies:
            raise ConsoleError(f"no bookie {bid!r} has been seen")
        b = bookies[bid]
        b["info"] = await self.data.bookie_info(bid) if b["up"] else {}
        b["metrics"] = _bookie_metrics(self.sampler.last.get(bid, []))
        frags, total = await self.data.bookie_fragments(bid)
        return self.render(request, "bookie.html", s, b=b, frags=frags, total=total)

    async def series(self, request: Request, s: Session) -> Response:
        out = {}
        ring = self.sampler.ring
        for spec in request.query_params.getlist("s")[:8]:
            kind, _, name = spec.partition(":")
            if name.startswith("lag:") and not self.may(request, s, GROUP, name[4:], Operation.DESCRIBE):
                continue
            if name.startswith("stream_bytes:") and not self.may(request, s, TOPIC, _topic_of(name[13:]),
                                                                 Operation.DESCRIBE):
                continue
            if name.startswith("stream_bytes:"):
                self.sampler.watch(name[13:])  # a page left open keeps its stream sampled
            times, values = ring.rate(name) if kind == "rate" else ring.get(name)
            out[spec] = {"t": times, "v": values}
        return JSONResponse(out)

    # ------------------------------------------------------------------ login
    async def login_form(self, request: Request) -> Response:
        return self.render(request, "login.html", None, next=request.query_params.get("next", "/"), error=None)

    async def login(self, request: Request) -> Response:
        form = await request.form()
        nxt = str(form.get("next", "/"))
        if not nxt.startswith("/") or nxt.startswith("//"):
            nxt = "/"
        s = await self.auth.login(str(form.get("user", "")).strip(), str(form.get("password", "")))
        if s is None:
            return self.render(request, "login.html", None, 401, next=nxt, error="wrong user name, password or token")
        r = RedirectResponse(nxt, status_code=303)
        r.set_cookie(SESSION_COOKIE, self.auth.cookie(s), httponly=True, samesite="strict",
                     secure=self.scheme == "https")
        return r

    async def logout(self, request: Request, _s: Session) -> Response:
        r = RedirectResponse("/login", status_code=303)
        r.delete_cookie(SESSION_COOKIE)
        return r


async def _none():
    return None


def _deny(what: str):
    raise Denied(what)


def _row(r, key):
    return r[key] if isinstance(r, dict) else getattr(r, key)


def _topic_of(stream: str) -> str:
    from streams.topics import stream_partition

    return stream_partition(stream)[0]


def _int(text, default, what: str, lo: int | None = None, hi: int | None = None):
    if text is None or text == "":
        if default is None:
            raise ConsoleError(f"{what} is required")
        return default
    try:
        v = int(str(text).strip())
    except ValueError:
        raise ConsoleError(f"{what} must be a whole number, not {str(text)[:40]!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConsoleError(f"{what} must be in {lo}..{hi if hi is not None else ''}, not {v}")
    return v


def _parse_time(text: str) -> int:
    """Milliseconds since the epoch, or an ISO time (UTC when no zone is given) -> ms."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        d = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ConsoleError(f"a time is ms since the epoch or ISO 8601 (2026-01-31T12:00), not {text[:40]!r}") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=datetime.UTC)
    return int(d.timestamp() * 1000)


def _bookie_metrics(samples: list) -> dict:
    """Journal, cache and add figures of one bookie from its last scrape."""
    want = {"scroll_bookie_write_cache_bytes": "write cache bytes", "scroll_bookie_cache_hit_ratio": "read cache hit ratio",
            "scroll_bookie_add_queue_depth": "add queue depth", "scroll_bookie_adds_total": "adds",
            "scroll_bookie_add_bytes_total": "bytes added", "scroll_bookie_add_rejects_total": "adds rejected",
            "scroll_bookie_read_entries_total": "entries read", "scroll_bookie_read_only": "read-only",
            "scroll_bookie_journal_fsync_seconds_count": "journal fsyncs",
            "scroll_bookie_journal_fsync_seconds_sum": "journal fsync seconds (total)",
            "scroll_bookie_journal_group_bytes_sum": "journal bytes (total)",
            "scroll_bookie_journal_reclaimed_bytes_total": "journal bytes reclaimed"}
    out: dict[str, float] = {}
    for name, _labels, v in samples:
        if name in want:
            out[want[name]] = out.get(want[name], 0.0) + v
    return out


def build_app(data: ConsoleData, auth: Auth, sampler: Sampler, *, scheme: str = "http") -> Starlette:
    c = Console(data, auth, sampler, scheme=scheme)
    if sampler.stream_bytes is None:
        sampler.stream_bytes = data.stream_bytes
    cluster = lambda self, req, s: self.auth.cluster(s, self.host(req))  # noqa: E731

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await auth.start()
        stop = asyncio.Event()
        task = asyncio.create_task(sampler.run(stop), name="console-sampler")
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await task
            await auth.close()

    routes = [
        Route("/", c.page(cluster)(c.overview)),
        Route("/streams", c.page()(c.streams)),
        Route("/streams/{name:path}", c.page()(c.stream)),
        Route("/topics/{name:path}", c.page()(c.topic)),
        Route("/records", c.page()(c.records)),
        Route("/api/records", c.page()(c.records_api)),
        Route("/api/series", c.page()(c.series)),
        Route("/groups", c.page()(c.groups)),
        Route("/groups/{name}/reset", c.page()(c.group_reset), methods=["POST"]),
        Route("/groups/{name}/delete", c.page()(c.group_delete), methods=["POST"]),
        Route("/groups/{name}", c.page()(c.group)),
        Route("/bookies", c.page(cluster)(c.bookies)),
        Route("/bookies/{id}", c.page(cluster)(c.bookie)),
        Route("/login", c.login_form, methods=["GET"]),
        Route("/login", c.login, methods=["POST"]),
        Route("/logout", c.page()(c.logout), methods=["POST"]),
        Route("/healthz", lambda _r: Response("ok\n", media_type="text/plain")),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.console = c
    return app
