"""What the console shows, read on page view from the metadata store, the bookies and the Kafka listener.

How this works. ``ConsoleData`` holds one streams client (its metadata store and bookie clients)
and, when the console knows a Kafka listener, a ``KafkaAdmin`` for what only a listener knows
(members and assignments of consumer groups live in the coordinator's memory) and for the actions
(reset offsets, delete a group: the same requests ``scroll kafka groups`` sends). Every method reads
what one page needs and no more: the stream list lists the ledger records (one range read, cached
for ``LISTING_TTL_S``) and computes offsets and bytes for the rows of the page shown only; the
record browser reads at most ``MAX_PAGE_RECORDS`` records from one position. Nothing here runs on
a timer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from dataclasses import dataclass, field

from fragments.ledgers import BOOKIES
from fragments.registry import BookieRegistration
from streams.errors import NoSuchStream
from streams.topics import TOPICS, TopicMeta, stream_partition

from ..cluster.ownership import BROKERS, OWNERS, BrokerInfo
from ..groups.coordinator import OffsetStore

LISTING_TTL_S = 2.0  # how long the ledger listing of the stream list is reused
ROW_TTL_S = 5.0  # how long a row's offsets and bytes are reused
MAX_CACHED_ROWS = 10_000
DEFAULT_PAGE_ROWS = 25  # each row costs a fragment-record read and a LAC read when shown
MAX_PAGE_ROWS = 200
MAX_PAGE_RECORDS = 500
VALUE_PREVIEW_BYTES = 16 << 10  # a value is shown up to this many bytes ("... N more bytes")


class ConsoleError(Exception):
    """A request the console cannot serve (a bad parameter, an unknown stream); shown to the user."""


@dataclass
class StreamRow:
    stream: str
    topic: str
    partition: int
    status: str
    term: int
    fragments: int
    retention: dict
    configs: dict = field(default_factory=dict)
    earliest: int | None = None
    latest: int | None = None
    bytes: int | None = None
    records_in_per_s: float | None = None  # between the last two times the row was read (page views)
    # consumer groups' committed progress over the same interval, summed over the groups (records
    # read by readers that commit nothing are not seen); None before a second reading
    records_out_per_s: float | None = None


@dataclass
class ShownRecord:
    offset: int
    timestamp_ms: int
    key: str
    headers: list[tuple[str, str]]
    value: str
    kind: str  # text | json | hex | null


def render_bytes(data: bytes | None, limit: int = VALUE_PREVIEW_BYTES) -> tuple[str, str]:
    """(text, kind): JSON pretty-printed, UTF-8 text as is, anything else as hex; cut at ``limit``."""
    if data is None:
        return "", "null"
    more = len(data) - limit
    head = data[:limit] if more > 0 else data
    tail = f"\n... {more} more bytes" if more > 0 else ""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return head.hex(" ") + tail, "hex"
    if not text.isprintable() and not all(c.isprintable() or c in "\r\n\t" for c in text):
        return head.hex(" ") + tail, "hex"
    if more <= 0 and text[:1] in "{[":
        with contextlib.suppress(ValueError):
            return json.dumps(json.loads(text), indent=2, ensure_ascii=False), "json"
    return text + tail, "text"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class ConsoleData:
    def __init__(self, client, bootstrap: str | None = None, kafka_security=None):
        self.client = client
        self.store = client.cluster.store
        self.bootstrap = bootstrap
        self.kafka_security = kafka_security
        self._listing: tuple[float, list] = (0.0, [])
        self._topics: tuple[float, dict] = (0.0, {})
        self._lock = asyncio.Lock()
        self._committed: tuple[float, dict] | None = None  # (when, OffsetStore.committed_sums())
        self._committed_prev: tuple[float, dict] | None = None
        self._rows: dict[str, tuple] = {}  # stream -> (identity, when, (earliest, latest, bytes))
        self.seen_bookies: dict[str, BookieRegistration] = {}  # every bookie seen live (down ones stay listed)

    # ------------------------------------------------------------------ listings (cached briefly)
    async def ledgers(self) -> list:
        async with self._lock:
            at, metas = self._listing
            if time.monotonic() - at > LISTING_TTL_S:
                metas = sorted(await self.client.list_streams(), key=lambda m: m.name)
                self._listing = (time.monotonic(), metas)
            return metas

    async def topics(self) -> dict[str, TopicMeta]:
        at, topics = self._topics
        if time.monotonic() - at > LISTING_TTL_S:
            topics = {}
            for k, v in await self.store.list_prefix(TOPICS):
                name = k[len(TOPICS):]
                with contextlib.suppress(Exception):
                    topics[name] = TopicMeta.decode(name, v.value)
            self._topics = (time.monotonic(), topics)
        return topics

    # ------------------------------------------------------------------ overview
    async def bookies(self) -> list[dict]:
        """Every bookie registered now, and those seen before that are gone (down)."""
        regs = {r.bookie_id: r for r in await self.client.live_bookies()}
        self.seen_bookies.update(regs)
        out = []
        for bid in sorted(self.seen_bookies):
            r = self.seen_bookies[bid]
            out.append({"id": bid, "address": r.address, "rack": r.rack, "up": bid in regs,
                        "read_only": r.read_only, "free_bytes": r.free_bytes, "used_bytes": r.used_bytes,
                        "started_at": r.started_at})
        return out

    async def bookie_info(self, bookie_id: str) -> dict:
        """The bookie's own figures (disk, write cache, read-only reason, scrub), over gRPC."""
        c = self.client.cluster.client(bookie_id)
        if c is None:
            return {"error": "not registered"}
        try:
            info = await asyncio.wait_for(c.info(), 5.0)
        except Exception as exc:  # noqa: BLE001 - a down bookie is shown as such
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"free_bytes": info.free_bytes, "used_bytes": info.used_bytes, "read_only": info.read_only,
                "read_only_reason": info.read_only_reason, "ledgers": info.ledgers,
                "write_cache_bytes": info.write_cache_bytes, "version": info.version,
                "scrub_passes": info.scrub_passes, "scrub_corrupt": info.scrub_corrupt}

    async def kafka_listeners(self) -> list[dict]:
        brokers = []
        for _k, v in await self.store.list_prefix(BROKERS):
            with contextlib.suppress(Exception):
                brokers.append(BrokerInfo.decode(v.value))
        owned: dict[int, int] = {}
        for _k, v in await self.store.list_prefix(OWNERS):
            with contextlib.suppress(ValueError):
                owned[int(v.value)] = owned.get(int(v.value), 0) + 1
        return [{"node_id": b.node_id, "host": b.host, "port": b.port,
                 "endpoints": [f"{n or 'PLAINTEXT'}://{h}:{p}" for n, h, p in b.endpoints] or [f"{b.host}:{b.port}"],
                 "partitions": owned.get(b.node_id, 0)} for b in sorted(brokers)]

    async def etcd_members(self) -> list[dict]:
        """The metadata store's members (etcd's member list) and how long a read took."""
        started = time.monotonic()
        await self.store.get(BOOKIES)  # a round trip: the store answers
        rtt_ms = (time.monotonic() - started) * 1000
        etcd = getattr(self.store, "_client", None)
        members = []
        if etcd is not None and hasattr(etcd, "members"):
            async def listing():
                async for m in etcd.members():
                    members.append({"name": m.name or f"{m.id:x}", "client_urls": list(m.client_urls),
                                    "rtt_ms": rtt_ms})

            with contextlib.suppress(Exception):
                await asyncio.wait_for(listing(), 5.0)
        return members or [{"name": getattr(self.store, "url", type(self.store).__name__), "client_urls": [],
                            "rtt_ms": rtt_ms}]

    # ------------------------------------------------------------------ streams
    async def stream_rows(self, query: str = "", page: int = 1, size: int = 50, visible=None
                          ) -> tuple[list[StreamRow], int]:
        """One page of the streams whose name contains ``query`` (and whose topic ``visible(topic)``
        allows), and how many match in all."""
        size = max(1, min(size, MAX_PAGE_ROWS))
        q = query.strip().lower()
        metas = [m for m in await self.ledgers() if q in m.name.lower()
                 and (visible is None or visible(stream_partition(m.name)[0]))]
        total = len(metas)
        shown = metas[(max(page, 1) - 1) * size:max(page, 1) * size]
        topics = await self.topics()
        rows = []
        for m in shown:
            topic, part = stream_partition(m.name)
            t = topics.get(topic)
            rows.append(StreamRow(m.name, topic, part, m.status.value, m.term,
                                  m.last_fragment_index - m.first_fragment_index + 1, dict(m.retention),
                                  dict(t.configs) if t is not None else {}))
        await asyncio.gather(*(self._fill_offsets(r, m) for r, m in zip(rows, shown)))
        await self._fill_out_rates(rows)
        return rows, total

    async def _fill_out_rates(self, rows: list[StreamRow]) -> None:
        """records/s out of each row: the growth of the groups' committed offsets (summed over the
        groups) since the previous reading, at least 1 s before. The committed offsets of every
        group are one listing, read at most once per ``ROW_TTL_S``."""
        now = time.monotonic()
        if self._committed is None or now - self._committed[0] >= ROW_TTL_S:
            try:
                sums = await OffsetStore(self.store).committed_sums()
            except Exception:  # noqa: BLE001 - the rates are left unknown
                return
            self._committed_prev, self._committed = self._committed, (now, sums)
        prev, cur = self._committed_prev, self._committed
        if prev is None or cur[0] - prev[0] < 1.0:
            return
        for r in rows:
            a, b = prev[1].get((r.topic, r.partition)), cur[1].get((r.topic, r.partition))
            if b is None:
                continue
            if a is None or a[1] != b[1] or b[0] < a[0]:  # a group came or went, or an offset reset
                continue
            r.records_out_per_s = (b[0] - a[0]) / (cur[0] - prev[0])

    async def _fill_offsets(self, row: StreamRow, meta) -> None:
        """Earliest and latest offsets and bytes of one row: its fragment records (one range read),
        and the LAC of its last fragment from a bookie (none for a sealed one). Kept ``ROW_TTL_S``
        so paging back and forth or a refresh reads nothing again; records/s in comes from the
        previous reading of the row (so it shows from a page's second view on, nothing sampled)."""
        from streams.consumer import Consumer

        cached = self._rows.get(meta.name)
        if cached is not None and cached[0] == (meta.ledger_id, meta.term, meta.last_fragment_index) \
                and time.monotonic() - cached[1] < ROW_TTL_S:
            row.earliest, row.latest, row.bytes, row.records_in_per_s = cached[2]
            return
        c = Consumer(self.client.cluster, meta)
        try:
            frags = await self.client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                                meta.last_fragment_index)
            c.seed_fragments(frags)
            row.bytes = sum(f.size_bytes or 0 for f in frags)
            row.earliest = await c.earliest_offset()
            row.latest = await c.end_position()
        except Exception:  # noqa: BLE001 - a stream being taken over or deleted: shown as unknown
            return
        finally:
            with contextlib.suppress(Exception):
                await c.close()
        now = time.monotonic()
        if cached is not None and cached[0][0] == meta.ledger_id and cached[2][1] is not None \
                and row.latest >= cached[2][1] and now - cached[1] >= 1.0:
            row.records_in_per_s = (row.latest - cached[2][1]) / (now - cached[1])
        if len(self._rows) >= MAX_CACHED_ROWS:
            self._rows.clear()
        self._rows[meta.name] = ((meta.ledger_id, meta.term, meta.last_fragment_index), now,
                                 (row.earliest, row.latest, row.bytes, row.records_in_per_s))

    async def stream_bytes(self, names: list[str]) -> dict[str, int]:
        """Bytes in each stream's fragments first..last (the sealed ones' sizes: what standalone's
        ``scroll_stream_bytes`` gauge says), read from its records: the stream page's graph samples
        these for the streams shown lately, so nothing here grows with the streams stored. A stream
        that cannot be read now (deleted, being taken over) is left out: a gap, not a zero."""
        async def one(name: str) -> tuple[str, int | None]:
            try:
                meta, _ = await self.client.cluster.ledgers.get_ledger(name)
                frags = await self.client.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                                    meta.last_fragment_index)
            except Exception:  # noqa: BLE001 - see above
                return name, None
            return name, sum(f.size_bytes or 0 for f in frags)

        got = await asyncio.gather(*(one(n) for n in names))
        return {n: v for n, v in got if v is not None}

    async def stream(self, name: str) -> dict:
        """The stream's record, its fragment chain (with racks) and the history the chain tells."""
        from streams.tools.admin import ledger_show

        try:
            d = await ledger_show(self.client, name)
        except NoSuchStream as exc:
            raise ConsoleError(str(exc)) from None
        racks = {b["id"]: b["rack"] for b in await self.bookies()}
        live = {b["id"] for b in await self.bookies() if b["up"]}
        history = []
        prev = None
        for f in d["fragments"]:
            f["racks"] = [racks.get(b, "?") for b in f["ensemble"]]
            f["down"] = [b for b in f["ensemble"] if b not in live]
            if prev is not None:
                if f["created_term"] != prev["created_term"]:
                    history.append({"fragment": f["index"], "what": "take-over",
                                    "detail": f"term {prev['created_term']} -> {f['created_term']}",
                                    "entry": f["first_entry_id"]})
                if set(f["ensemble"]) != set(prev["ensemble"]):  # (placement rotates the order: not a change)
                    gone = sorted(set(prev["ensemble"]) - set(f["ensemble"]))
                    came = sorted(set(f["ensemble"]) - set(prev["ensemble"]))
                    history.append({"fragment": f["index"], "what": "ensemble change",
                                    "detail": f"{', '.join(gone) or 'none'} replaced by {', '.join(came) or 'none'}",
                                    "entry": f["first_entry_id"]})
            prev = f
        if d["fragments"] and d["fragments"][-1]["created_term"] != d["term"]:
            history.append({"fragment": None, "what": "take-over",
                            "detail": f"term {d['fragments'][-1]['created_term']} -> {d['term']} "
                                      "(the current writer has not started a fragment yet)", "entry": None})
        d["history"] = history
        d["topic"], d["partition"] = stream_partition(name)
        return d

    async def topic(self, name: str) -> dict:
        topics = await self.topics()
        t = topics.get(name)
        if t is None:
            raise ConsoleError(f"no topic named {name!r}")
        metas = {m.name: m for m in await self.ledgers()}
        rows = []
        for s in t.streams():
            m = metas.get(s)
            if m is None:
                continue
            _, p = stream_partition(s)
            rows.append(StreamRow(s, name, p, m.status.value, m.term, m.last_fragment_index - m.first_fragment_index + 1,
                                  dict(m.retention), dict(t.configs)))
        await asyncio.gather(*(self._fill_offsets(r, metas[r.stream]) for r in rows))
        return {"name": name, "partitions": t.partitions, "configs": t.configs, "rows": rows}

    # ------------------------------------------------------------------ records
    async def records(self, stream: str, *, offset: int | None = None, timestamp_ms: int | None = None,
                      tail: bool = False, live: bool = False, limit: int = 50) -> dict:
        """At most ``limit`` records from an offset, a time, or the last ``limit`` (tail). ``live``
        (the tail page polling from ``offset``): what came after ``offset``, read back from the LAC
        like the tail; more than ``limit`` behind, it jumps to the tail (a live view shows the newest)."""
        if not 1 <= limit <= MAX_PAGE_RECORDS:
            raise ConsoleError(f"page size must be 1-{MAX_PAGE_RECORDS}, not {limit}")
        if offset is not None and offset < 0:
            raise ConsoleError("offset must be >= 0")
        try:
            c = await self.client.consumer(stream, start="latest")
        except NoSuchStream as exc:
            raise ConsoleError(str(exc)) from None
        try:
            earliest = await c.earliest_offset()
            end = c.position
            if tail or (live and offset is not None):
                want = limit if tail or offset < end - limit else end - offset
                got = await self._last_records(c, want) if want > 0 else []
                start = got[0].offset if got else end
            else:
                if timestamp_ms is not None:
                    start = await c.seek_timestamp(timestamp_ms)
                else:
                    start = max(offset or 0, earliest)
                    if start < end:
                        await c.seek(start)
                got = await c.read(min(limit, end - start), timeout_s=0.0) if start < end else []
            out = []
            for r in got[:limit]:
                value, kind = render_bytes(r.value)
                key, _ = render_bytes(r.key, 1024)
                headers = [(h, render_bytes(v, 1024)[0]) for h, v in r.headers]
                out.append(ShownRecord(r.offset, r.timestamp_ms, key, headers, value, kind))
            nxt = out[-1].offset + 1 if out else max(start, end if (tail or live) else start)
            return {"stream": stream, "earliest": earliest, "end": end, "start": start, "records": out,
                    "next": nxt, "limit": limit}
        finally:
            with contextlib.suppress(Exception):
                await c.close()

    @staticmethod
    async def _last_records(c, n: int) -> list:
        """The last ``n`` records at or below the LAC, read backwards from it a few entries at a time
        (one bookie read for a tail of small batches; no search from the start of the stream)."""
        from streams.batches import records_of, stored_batch

        out: list = []
        hi, low = c.lac, c.earliest_entry()
        step = 4
        while hi >= low and len(out) < n:
            lo = max(low, hi - step + 1)
            recs = []
            for e in await c._read_all(lo, hi):
                b = stored_batch(e.entry_id, e.data)
                if b is not None:
                    recs.extend(records_of(b, c.name))
            out = recs + out
            hi, step = lo - 1, min(step * 4, 1024)
        return out[-n:]

    # ------------------------------------------------------------------ consumer groups
    def admin(self):
        from ..groups.group_admin import KafkaAdmin

        if self.bootstrap is None:
            raise ConsoleError("no Kafka listener known (start the console with --bootstrap)")
        return KafkaAdmin(self.bootstrap, timeout_s=10.0, client_id="scroll-console", security=self.kafka_security)

    async def groups(self) -> list[dict]:
        """Every group: those with committed offsets (the store) and those a listener knows."""
        names = set(await OffsetStore(self.store).groups())
        states = {}
        if self.bootstrap is not None:
            with contextlib.suppress(Exception):
                async with self.admin() as a:
                    for g in await a.list_groups():
                        states[g.group] = g
        out = []
        for name in sorted(names | set(states)):
            g = states.get(name)
            out.append({"group": name, "state": g.state if g else "Empty", "type": g.group_type if g else "?",
                        "coordinator": g.coordinator if g else None})
        return out

    async def group(self, name: str) -> dict:
        """Members, assignments, committed offsets and lag per partition."""
        if self.bootstrap is not None:
            async with self.admin() as a:
                view = await a.describe_or_empty(name)
            return {"group": name, "state": view.state, "type": view.group_type, "members": view.members,
                    "partitions": view.partitions, "lag": view.lag, "assignor": view.assignor}
        committed = await OffsetStore(self.store).fetch_group(name)
        rows = [{"topic": t, "partition": p, "committed": c.offset, "log_end": None, "lag": None}
                for (t, p), c in sorted(committed.items())]
        return {"group": name, "state": "?", "type": "?", "members": [], "partitions": rows, "lag": 0, "assignor": ""}

    async def reset_offsets(self, group: str, topics: list[str] | None, to: str, value: int | None) -> dict:
        async with self.admin() as a:
            plan = await a.plan_reset(group, topics, to=to, value=value)
            await a.commit(group, plan)
        return {f"{t}/{p}": o for (t, p), o in sorted(plan.items())}

    async def delete_group(self, group: str) -> None:
        async with self.admin() as a:
            await a.delete_group(group)

    # ------------------------------------------------------------------ bookies
    async def bookie_fragments(self, bookie_id: str, limit: int = 500) -> tuple[list[dict], int]:
        """The fragments whose ensemble holds ``bookie_id`` (computed on page view; at most ``limit`` listed)."""
        out, total = [], 0
        for m in await self.ledgers():
            frags = await self.client.cluster.ledgers.fragments(m.ledger_id, m.first_fragment_index,
                                                                m.last_fragment_index)
            for f in frags:
                if bookie_id in f.ensemble:
                    total += 1
                    if len(out) < limit:
                        out.append({"stream": m.name, "index": f.index, "first_entry_id": f.first_entry_id,
                                    "last_entry_id": f.last_entry_id, "sealed": f.sealed,
                                    "size_bytes": f.size_bytes, "term": f.created_term})
        return out, total


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")
