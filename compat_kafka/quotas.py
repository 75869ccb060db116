"""Kafka client quotas (KIP-13, KIP-55, KIP-124, KIP-546): configs, resolution, rates, throttling.

How this works. A quota entity is a user, a client id, or both, each either named or the default
(``<default>``; None in the APIs); its configs are ``producer_byte_rate``, ``consumer_byte_rate``
(bytes/s) and ``request_percentage`` (share of one request handler, in %, over a window). Each
entity is one key ``kafka/quotas/<entity>`` of the metadata store (JSON of its configs); every
listener keeps them all in memory (``QuotaManager``) and reads them again when a watch on
``kafka/quotas/`` reports a change (as the ACLs: ``authorizer.py``), so a change applies on every
listener within about a second, without a restart. DescribeClientQuotas / AlterClientQuotas (APIs
48/49) and ``scroll kafka quotas`` go through ``describe`` / ``alter`` here.

Resolution, per quota key, as Kafka's ``ClientQuotaManager`` (first entity that sets the key wins):
user+client-id, user+default client-id, user, default user+client-id, default user+default
client-id, default user, client-id, default client-id. The rate is shared by the connections that
resolve to the same entity (the default user's quota applies to each user on its own, as Kafka's
metric tags name the actual user/client id). The user is the principal's name (``ANONYMOUS``
without SASL or a client certificate).

Enforcement, as Kafka's: each (key, entity) has a rate over ``window_num`` samples of
``window_size_s`` (Kafka: 11 x 1 s). A produce records its request's record bytes, a fetch its
answer's record bytes, every request the time its handler took until it had taken effect (acks and
long polls excluded: ``codec.effects_applied``). When the rate after recording is over the quota,
the throttle time is ``(rate - quota) / quota * window`` (Kafka's ``QuotaUtils.throttleTime``,
not capped); the response carries it in ``throttle_time_ms`` and the server does
not read from that connection until it has passed (Kafka >= 2.0 mutes the channel; KIP-219 clients
also back off). A fetch over its fetch byte rate or request percentage is answered as Kafka's
``handleFetchRequest`` does: no records (an empty, throttled answer; within a fetch session, the
session's empty answer) and its bytes unrecorded; a fetch asks for no more than one window's worth
of its fetch quota (``max_in_window``), and one over it only because its first batch alone is bigger
than that, with nothing recorded in the window, is served with its data (such a batch would
otherwise never be served).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import urllib.parse
from dataclasses import dataclass

from kio.schema.errors import ErrorCode

log = logging.getLogger(__name__)

PREFIX = "kafka/quotas/"
REFRESH_S = 0.5
RECHECK_S = 60.0

USER, CLIENT_ID, IP = "user", "client-id", "ip"
ENTITY_TYPES = (USER, CLIENT_ID)
PRODUCE, FETCH, REQUEST = "producer_byte_rate", "consumer_byte_rate", "request_percentage"
KEYS = (PRODUCE, FETCH, REQUEST)
DEFAULT_NAME = "<default>"  # how the CLI and the docs spell the default entity (None in the APIs)

_DEFAULT = object()  # the default entity of a type (None in the protocol)

MATCH_EXACT, MATCH_DEFAULT, MATCH_ANY = 0, 1, 2
MAX_THROTTLE_S = (2**31 - 1) / 1000


class QuotaError(ValueError):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


# an entity: ((type, name or None for the default), ...) sorted by type
Entity = tuple[tuple[str, str | None], ...]


def entity_of(components) -> Entity:
    """(type, name) pairs -> an entity; QuotaError (INVALID_REQUEST) as Kafka for a bad one."""
    seen: dict[str, str | None] = {}
    for etype, name in components:
        if etype in seen:
            raise QuotaError(ErrorCode.invalid_request, f"Duplicate {etype} entity in the quota entity")
        if etype == IP:
            raise QuotaError(ErrorCode.invalid_request, "IP connection-rate quotas are not supported by this listener "
                                                        "(see --max-connections-per-ip)")
        if etype not in ENTITY_TYPES:
            raise QuotaError(ErrorCode.invalid_request, f"Unknown quota entity type {etype!r}")
        if name == "":
            raise QuotaError(ErrorCode.invalid_request, f"Empty {etype} name in the quota entity")
        seen[etype] = name
    if not seen:
        raise QuotaError(ErrorCode.invalid_request, "Empty quota entity")
    return tuple(sorted(seen.items()))


def entity_key(entity: Entity) -> str:
    parts = [f"{t}={'' if n is None else '=' + urllib.parse.quote(n, safe='')}" for t, n in entity]
    return PREFIX + ",".join(parts)


def check_value(key: str, value: float) -> None:
    if key not in KEYS:
        raise QuotaError(ErrorCode.invalid_request, f"Unknown quota key {key!r} (one of {', '.join(KEYS)})")
    if not math.isfinite(value) or value <= 0:
        raise QuotaError(ErrorCode.invalid_request, f"{key} must be positive, not {value}")
    if key != REQUEST and value != int(value):
        raise QuotaError(ErrorCode.invalid_request, f"{key} must be a whole number of bytes per second, not {value}")


def show_entity(entity: Entity) -> str:
    return ",".join(f"{t}={DEFAULT_NAME if n is None else n}" for t, n in entity)


# ---------------------------------------------------------------- the configs (store)
async def load(store) -> dict[Entity, dict[str, float]]:
    out = {}
    for k, v in await store.list_prefix(PREFIX):
        try:
            doc = json.loads(v.value)
            out[tuple((t, n) for t, n in doc["entity"])] = {q: float(x) for q, x in doc["values"].items()}
        except Exception:
            log.warning("ignoring an unreadable quota at %s", k)
    return out


async def alter(store, entries, validate_only: bool = False) -> list[tuple[ErrorCode, str | None]]:
    """``entries``: [(components [(type, name|None)], ops [(key, value, remove)])] -> per entry
    (error code, message). Valid entries are applied even when others are not (as Kafka)."""
    checked = []
    results: list[tuple[ErrorCode, str | None]] = []
    seen: set[Entity] = set()
    for components, ops in entries:
        try:
            entity = entity_of(components)
            if entity in seen:
                raise QuotaError(ErrorCode.invalid_request, f"Duplicate quota entity {show_entity(entity)}")
            seen.add(entity)
            keys = [k for k, _v, _r in ops]
            if len(set(keys)) != len(keys):
                raise QuotaError(ErrorCode.invalid_request, "Duplicate quota key in one entity's changes")
            for k, v, remove in ops:
                if remove:
                    if k not in KEYS:
                        raise QuotaError(ErrorCode.invalid_request, f"Unknown quota key {k!r}")
                else:
                    check_value(k, v)
            checked.append((entity, ops))
            results.append((ErrorCode.none, None))
        except QuotaError as exc:
            results.append((exc.code, str(exc)))
    if validate_only:
        return results
    for entity, ops in checked:
        key = entity_key(entity)
        got = await store.get(key)
        values = json.loads(got.value)["values"] if got is not None else {}
        for k, v, remove in ops:
            if remove:
                values.pop(k, None)
            else:
                values[k] = float(v)
        if values:
            await store.put(key, json.dumps({"entity": [list(c) for c in entity], "values": values}).encode())
        elif got is not None:
            await store.delete(key)
        log.info("client quota %s: %s", show_entity(entity), values or "removed")
    return results


def describe(quotas: dict[Entity, dict[str, float]], components, strict: bool) -> list[tuple[Entity, dict]]:
    """Kafka's DescribeClientQuotas filter: ``components`` [(type, match_type, match)]; exact: that
    name, default: the default, any: the type present (named or default); ``strict``: no other types.
    QuotaError (INVALID_REQUEST) for a bad filter."""
    filt: dict[str, tuple[int, str | None]] = {}
    for etype, match_type, match in components:
        if etype in filt:
            raise QuotaError(ErrorCode.invalid_request, f"Duplicate {etype} filter component entity type")
        if etype not in ENTITY_TYPES and etype != IP:
            raise QuotaError(ErrorCode.invalid_request, f"Custom entity type {etype!r} not supported")
        if match_type == MATCH_EXACT and match is None:
            raise QuotaError(ErrorCode.invalid_request, f"Null match for an exact {etype} filter component")
        if match_type not in (MATCH_EXACT, MATCH_DEFAULT, MATCH_ANY):
            raise QuotaError(ErrorCode.invalid_request, f"Unknown match type {match_type}")
        filt[etype] = (match_type, match)
    out = []
    for entity, values in sorted(quotas.items(), key=lambda kv: show_entity(kv[0])):
        names = dict(entity)
        ok = True
        for etype, (mt, match) in filt.items():
            if etype not in names:
                ok = False
            elif mt == MATCH_EXACT and names[etype] != match:
                ok = False
            elif mt == MATCH_DEFAULT and names[etype] is not None:
                ok = False
        if ok and strict and set(names) - set(filt):
            ok = False
        if ok and values:
            out.append((entity, dict(values)))
    return out


# ---------------------------------------------------------------- rates
class Rate:
    """Kafka's ``Rate`` over ``num`` samples of ``size_s``: the total of the samples kept over the
    time they span (at least num - 1 whole samples)."""

    __slots__ = ("num", "size_s", "samples")

    def __init__(self, num: int, size_s: float):
        self.num, self.size_s = num, size_s
        self.samples: list[list[float]] = []  # [start, total]

    def record(self, value: float, now: float) -> None:
        if not self.samples or now >= self.samples[-1][0] + self.size_s:
            self.samples.append([now, 0.0])
            if len(self.samples) > self.num:  # Kafka reuses the oldest of its ``num`` samples
                self.samples.pop(0)
        self.samples[-1][1] += value
        self._purge(now)

    def _purge(self, now: float) -> None:
        oldest = now - self.num * self.size_s
        while self.samples and self.samples[0][0] + self.size_s <= oldest:
            self.samples.pop(0)

    def window(self, now: float) -> float:
        elapsed = now - self.samples[0][0] if self.samples else 0.0
        full = int(elapsed / self.size_s)
        if full < self.num - 1:
            elapsed += (self.num - 1 - full) * self.size_s
        return elapsed

    def rate(self, now: float) -> float:
        self._purge(now)
        return sum(s[1] for s in self.samples) / self.window(now)


@dataclass(frozen=True)
class QuotaConfig:
    window_num: int = 11  # Kafka's quota.window.num
    window_size_s: float = 1.0  # Kafka's quota.window.size.seconds


class QuotaManager:
    """The quotas in force on this listener and the rates of the entities they bind."""

    def __init__(self, store, config: QuotaConfig | None = None, refresh_s: float = REFRESH_S):
        self.store = store
        self.config = config or QuotaConfig()
        self.refresh_s = refresh_s
        self.quotas: dict[Entity, dict[str, float]] = {}
        self._rates: dict[tuple, Rate] = {}
        self._resolved: dict[tuple, tuple | None] = {}
        self._refresher: asyncio.Task | None = None
        self.throttled = {k: 0 for k in KEYS}  # responses throttled, per quota key (metrics)

    async def start(self) -> None:
        await self.reload()
        watch = self.store.watch_prefix(PREFIX)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(watch), name="kafka-quotas")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresher

    async def reload(self) -> None:
        quotas = await load(self.store)
        if quotas != self.quotas:
            self.quotas = quotas
            self._resolved = {}

    async def _refresh_loop(self, watch) -> None:
        changed = asyncio.Event()

        async def watcher(watch):
            while True:
                try:
                    async for _event in watch:
                        changed.set()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.info("the watch on the quotas broke: %r", exc)
                finally:
                    with contextlib.suppress(Exception):
                        await watch.aclose()
                changed.set()
                await asyncio.sleep(self.refresh_s)
                watch = self.store.watch_prefix(PREFIX)

        task = asyncio.get_running_loop().create_task(watcher(watch), name="kafka-quotas-watch")
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), RECHECK_S)
                changed.clear()
                try:
                    await self.reload()
                except Exception as exc:
                    log.warning("quotas could not be read again: %r", exc)
                    changed.set()
                await asyncio.sleep(self.refresh_s)
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    # ---------------------------------------------------------------- resolution
    def resolve(self, key: str, user: str, client_id: str) -> tuple[float, tuple] | None:
        """(quota, the rate's identity) of ``key`` for this user and client id, or None (unbound)."""
        memo = (key, user, client_id)
        if memo in self._resolved:
            return self._resolved[memo]
        q = self.quotas
        d = None  # the default
        order = [
            (((CLIENT_ID, client_id), (USER, user)), (user, client_id)),
            (((CLIENT_ID, d), (USER, user)), (user, client_id)),
            (((USER, user),), (user, None)),
            (((CLIENT_ID, client_id), (USER, d)), (user, client_id)),
            (((CLIENT_ID, d), (USER, d)), (user, client_id)),
            (((USER, d),), (user, None)),
            (((CLIENT_ID, client_id),), (None, client_id)),
            (((CLIENT_ID, d),), (None, client_id)),
        ]
        found = None
        for entity, tags in order:
            v = q.get(entity, {}).get(key)
            if v is not None:
                found = (v, (key, *tags))
                break
        if len(self._resolved) > 100_000:
            self._resolved = {}
        self._resolved[memo] = found
        return found

    def record(self, key: str, user: str, client_id: str | None, value: float, now: float) -> float:
        """Record ``value`` against the quota ``key`` binds this connection to: the throttle time
        (seconds; 0 when within the quota or unbound)."""
        if not self.quotas:
            return 0.0
        got = self.resolve(key, user, client_id or "")
        if got is None:
            return 0.0
        bound, tags = got
        if key == REQUEST:
            bound = bound / 100.0  # a share of one handler: seconds of handling per second
        rate = self._rates.get(tags)
        if rate is None:
            if len(self._rates) > 100_000:
                self._rates = {}
            rate = self._rates[tags] = Rate(self.config.window_num, self.config.window_size_s)
        rate.record(value, now)
        observed = rate.rate(now)
        if observed <= bound:
            return 0.0
        self.throttled[key] += 1
        throttle = (observed - bound) / bound * rate.window(now)
        return min(throttle, MAX_THROTTLE_S)  # Kafka's is unbounded (but an int32 of ms)

    def unrecord(self, key: str, user: str, client_id: str | None, value: float, now: float) -> None:
        """Take back ``value`` recorded by ``record`` (Kafka's ``unrecordQuotaSensor``: a throttled
        fetch is answered empty, so its bytes do not count)."""
        got = self.resolve(key, user, client_id or "") if self.quotas else None
        rate = self._rates.get(got[1]) if got is not None else None
        if rate is not None:
            rate.record(-value, now)

    def recorded(self, key: str, user: str, client_id: str | None, now: float) -> float:
        """What the rate of ``key`` binding this connection holds now (0 when unbound)."""
        got = self.resolve(key, user, client_id or "") if self.quotas else None
        rate = self._rates.get(got[1]) if got is not None else None
        if rate is None:
            return 0.0
        rate._purge(now)
        return sum(s[1] for s in rate.samples)

    def max_in_window(self, key: str, user: str, client_id: str | None) -> float | None:
        """The most one window may hold within the quota (Kafka's ``getMaxValueInQuotaWindow``:
        quota x (window_num - 1) x window_size); None when unbound. A fetch asks for no more, so
        one answer alone never goes over the quota."""
        got = self.resolve(key, user, client_id or "") if self.quotas else None
        if got is None:
            return None
        return got[0] * (self.config.window_num - 1) * self.config.window_size_s


# ---------------------------------------------------------------- APIs 48 and 49
class QuotaApis:
    """DescribeClientQuotas (DESCRIBE_CONFIGS on the cluster) and AlterClientQuotas (ALTER_CONFIGS
    on the cluster), as Kafka's."""

    def __init__(self, broker):
        self.broker = broker

    def handlers(self) -> dict:
        from .wire import codec

        return {codec.API_DESCRIBE_CLIENT_QUOTAS: self.describe, codec.API_ALTER_CLIENT_QUOTAS: self.alter}

    def _allowed(self, op) -> bool:
        az = self.broker.authorizer
        return az is None or az.cluster(op)

    async def describe(self, req, resp_cls):
        from .security.acls import Operation
        from .wire.codec import ZERO_MS, build, nested

        if not self._allowed(Operation.DESCRIBE_CONFIGS):
            return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.cluster_authorization_failed,
                         error_message="Authorization failed.", entries=None)
        mgr = self.broker.quotas
        try:
            await mgr.reload()  # what another listener just altered is listed
            found = describe(mgr.quotas, [(c.entity_type, c.match_type, c.match) for c in req.components],
                             req.strict)
        except QuotaError as exc:
            return build(resp_cls, throttle_time=ZERO_MS, error_code=exc.code, error_message=str(exc), entries=None)
        ec, vc, rc = (nested(resp_cls, n) for n in ("EntityData", "ValueData", "EntryData"))
        entries = tuple(rc(entity=tuple(ec(entity_type=t, entity_name=n) for t, n in entity),
                           values=tuple(vc(key=k, value=float(v)) for k, v in sorted(values.items())))
                        for entity, values in found)
        return build(resp_cls, throttle_time=ZERO_MS, error_code=ErrorCode.none, error_message=None, entries=entries)

    async def alter(self, req, resp_cls):
        from .security.acls import Operation
        from .wire.codec import ZERO_MS, build, nested

        ec, rc = nested(resp_cls, "EntityData"), nested(resp_cls, "EntryData")

        def entity(e):
            return tuple(ec(entity_type=x.entity_type, entity_name=x.entity_name) for x in e.entity)

        if not self._allowed(Operation.ALTER_CONFIGS):
            return build(resp_cls, throttle_time=ZERO_MS, entries=tuple(
                rc(error_code=ErrorCode.cluster_authorization_failed, error_message="Authorization failed.",
                   entity=entity(e)) for e in req.entries))
        results = await alter(self.broker.store, [([(x.entity_type, x.entity_name) for x in e.entity],
                                                   [(o.key, float(o.value), o.remove) for o in e.ops])
                                                  for e in req.entries], req.validate_only)
        if not req.validate_only:
            await self.broker.quotas.reload()  # applied here at once (elsewhere: through the watch)
        return build(resp_cls, throttle_time=ZERO_MS, entries=tuple(
            rc(error_code=code, error_message=msg, entity=entity(e)) for e, (code, msg) in zip(req.entries, results)))
