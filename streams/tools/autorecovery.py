"""Autorecovery: re-replicate the fragments of a lost bookie with no command typed (BookKeeper's
Auditor and ReplicationWorker).

Every instance (``scroll autorecovery``, or the task ``scroll standalone`` runs) holds one lease in
the metadata store and runs a **worker**; one of them at a time is also the **auditor**: it holds
``/scroll/autorecovery/auditor`` (create-if-absent under its lease). When the holder dies its lease
expires, the key vanishes, and the other instances, which watch that key, race to create it again.

Keys (under ``/scroll/autorecovery/``):

* ``known/<bookie>``: every bookie the auditor has seen registered (no lease). A bookie that dies
  while no auditor runs is still noticed by the next one.
* ``lost/<bookie>`` -> ``{"since", "marked"}``: a known bookie that is not registered. Once it has
  been gone for ``lost_bookie_delay_s`` the auditor lists the streams' fragments (the only time it
  lists them) and marks every fragment that names it, then sets ``marked``. A bookie that
  registers again before that is dropped from ``lost/`` and nothing is marked. Once no to-do item
  names a marked bookie any more, its ``lost/`` and ``known/`` keys are removed: it is forgotten
  (it is known again if it ever registers).
* ``underreplicated/<ledger>/<fragment>`` -> ``{"stream", "bookies", "open", "since", ...}``: the
  to-do list, one item per fragment, kept in the store so that a new auditor and any worker resume.
* ``claims/<ledger>/<fragment>``: the worker repairing that item (under the worker's lease, so a
  dead worker's claims vanish with it).
* ``progress``: counters (fragments repaired, bytes copied, take-overs), for ``status``.

What a worker does with an item it claimed. It reads the fragment record again: gone (retention,
stream deleted) or released to the object store (``remote_only``) -> done. **Sealed**: it looks at
every copy (``admin.inspect_fragment``, what ``scroll check`` does) and repairs with
``admin.fix_fragment`` (what ``check --fix`` does): missing copies on a live bookie are refilled in
place; a bookie that is not registered is replaced, in the same ensemble slot, by a bookie chosen
to keep the racks spread, and the fragment record is changed by a CAS that compares the fragment
and ledger records' versions. A bookie that comes back mid-repair therefore causes neither a double
nor a lost write: either the CAS commits the replacement (the returned bookie's copies are then
unreferenced garbage) or the record moved and the item is looked at again; an item whose bookies
are all back with every copy is simply done. **Open** (the stream's last fragment): an open
fragment whose writer is alive is the writer's. A live writer holds the stream's writer key
(``streams.producer``: ``/scroll/writers/<ledger>`` with its term, under a lease: its client's, or
a Kafka listener's ownership lease) and watches the bookie registry, so it replaces a lost bookie
of its open ensemble itself, even when idle (an ensemble change: the written prefix becomes a
sealed fragment, repaired as above). Such an item just waits (re-checked every ``retry_s``). Only
when the key is gone (the writer's process died or stalled past its lease, or it closed) or names
an older term does BookKeeper's rule apply: once ``open_ledger_grace_s`` has passed since the
bookie was lost and the open fragment still names a bookie that is not registered, the worker
takes the stream over (``admin.force_recovery``: a new term, recovery, the writer's ensemble
change replaces the missing bookie) and the part written before is then a sealed fragment,
repaired as above.

Throttling: ``max_bytes_per_s`` (a token bucket in front of every batch of copies) and
``max_fragments_in_flight`` (fragments repaired at once by one worker). An item whose repair fails
(no bookie to place on, a source copy missing) keeps its error and is retried with a back-off.

Idle cost: one lease kept alive, watches on the registry (a bookie appearing or going wakes the
auditor; a registration rewritten in place does not), the auditor key and the to-do list, and a
re-list of the registry and to-do list every ``relist_s`` as a safety net. Streams are listed only
when a bookie has been lost for the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from bookie.errors import BookieError
from fragments.ledgers import BOOKIES, NoSuchLedger
from fragments.memstore import LeaseExpired
from fragments.placement import NotEnoughBookies
from fragments.registry import live_bookies
from fragments.store import MetadataError
from fragments.tier import remote_only

from ..errors import ScrollError
from ..producer import writer_key
from . import admin

log = logging.getLogger("scroll.autorecovery")

ROOT = "/scroll/autorecovery/"
AUDITOR = ROOT + "auditor"
KNOWN = ROOT + "known/"
LOST = ROOT + "lost/"
UNDER = ROOT + "underreplicated/"
CLAIMS = ROOT + "claims/"
PROGRESS = ROOT + "progress"


@dataclass
class AutoRecoveryConfig:
    lost_bookie_delay_s: float = 30.0
    open_ledger_grace_s: float = 60.0
    max_bytes_per_s: float | None = None  # None or 0: unthrottled
    max_fragments_in_flight: int = 2
    lease_ttl_s: float = 10.0
    relist_s: float = 30.0  # safety-net re-list of the registry and the to-do list
    retry_s: float = 5.0  # first back-off of a failed item (doubles, up to relist_s)


def item_key(ledger_id: int, index: int) -> str:
    return f"{UNDER}{ledger_id}/{index}"


def _claim_key(key: str) -> str:
    return CLAIMS + key[len(UNDER):]


class _Bucket:
    """A token bucket: ``take(n)`` sleeps as long as ``n`` bytes need at ``rate`` bytes/s."""

    def __init__(self, rate: float | None):
        self.rate = rate or None
        self._next = 0.0  # monotonic time when the bucket is empty again

    async def take(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        start = max(now, self._next)
        self._next = start + n / self.rate
        if start > now:
            await asyncio.sleep(start - now)


class AutoRecovery:
    """An auditor candidate and a replication worker. ``await run(stop)`` until ``stop`` is set."""

    def __init__(self, client, config: AutoRecoveryConfig | None = None, *, registry=None, instance_id: str | None = None,
                 before_commit=None):
        self.client = client
        self.store = client.cluster.store
        self.config = config or AutoRecoveryConfig()
        self.id = instance_id or f"autorecovery-{uuid.uuid4().hex[:8]}"
        self.is_auditor = False
        self.repaired = 0
        self.bytes_copied = 0
        self.takeovers = 0
        self.deferred = 0  # looks at an open fragment left to its live writer
        self._deferred: set[str] = set()
        self.before_commit = before_commit  # test hook: awaited between the copies and the record's CAS
        self._lease = None
        self._bucket = _Bucket(self.config.max_bytes_per_s)
        self._sem = asyncio.Semaphore(max(1, self.config.max_fragments_in_flight))
        self._audit_wake = asyncio.Event()
        self._work_wake = asyncio.Event()
        self._lease_lost = asyncio.Event()
        self._retry_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}
        self._inflight: dict[str, asyncio.Task] = {}
        self._metrics = self._make_metrics(registry) if registry is not None else None

    # ------------------------------------------------------------------------------- metrics
    @staticmethod
    def _make_metrics(reg) -> dict:
        from prometheus_client import Counter, Gauge

        return {
            "under": Gauge("scroll_autorecovery_underreplicated_fragments",
                           "fragments on the autorecovery to-do list", registry=reg),
            "repaired": Counter("scroll_autorecovery_repaired_fragments",
                                "fragments this instance re-replicated", registry=reg),
            "bytes": Counter("scroll_autorecovery_copied_bytes", "bytes this instance copied to bookies",
                             registry=reg),
            "takeovers": Counter("scroll_autorecovery_takeovers",
                                 "streams taken over to seal an open fragment on a lost bookie", registry=reg),
            "auditor": Gauge("scroll_autorecovery_auditor_up", "1 while this instance is the auditor", registry=reg),
            "lost": Gauge("scroll_autorecovery_lost_bookies", "known bookies that are not registered", registry=reg),
        }

    def _set(self, name: str, value: float) -> None:
        if self._metrics is not None:
            self._metrics[name].set(value)

    def _inc(self, name: str, n: float = 1) -> None:
        if self._metrics is not None and n:
            self._metrics[name].inc(n)

    # ------------------------------------------------------------------------------- lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        self._lease = await self.store.grant_lease(self.config.lease_ttl_s)
        tasks = [asyncio.create_task(t, name=f"{self.id}-{n}") for n, t in (
            ("lease", self._keepalive()), ("election", self._election()), ("worker", self._worker()),
            ("registry-watch", self._watch(BOOKIES, self._audit_wake, presence_only=True)),
            ("todo-watch", self._watch(UNDER, self._work_wake)))]
        try:
            await stop.wait()
        finally:
            for t in [*tasks, *self._inflight.values()]:
                t.cancel()
            for t in [*tasks, *self._inflight.values()]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            self.is_auditor = False
            self._set("auditor", 0)
            with contextlib.suppress(MetadataError, Exception):
                await self._lease.revoke()  # our auditor key and claims go at once

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self._lease.ttl_s / 3)
            try:
                try:
                    await self._lease.refresh()
                except LeaseExpired:
                    log.warning("%s: lease lost; taking a new one", self.id)
                    self._lease_lost.set()  # the auditor (if we were it) steps down
                    self._lease = await self.store.grant_lease(self.config.lease_ttl_s)
            except MetadataError as exc:
                log.warning("%s: keeping the lease alive failed: %s", self.id, exc)

    async def _watch(self, prefix: str, wake: asyncio.Event, *, presence_only: bool = False) -> None:
        """Wake on every change under ``prefix``; ``presence_only``: only when a key appears or goes
        (the registry: a bookie rewriting its registration, e.g. its free bytes, is no news to the
        auditor, and waking it cost a pass of five listings every 30 s per bookie)."""
        present: set[str] = set()
        while True:
            try:
                watch = self.store.watch_prefix(prefix)
                try:
                    async for ev in watch:
                        if presence_only:
                            if ev.value is None:
                                present.discard(ev.key)
                            elif ev.key not in present:
                                present.add(ev.key)
                            else:
                                continue
                        wake.set()
                finally:
                    await watch.aclose()
            except MetadataError as exc:
                log.debug("%s: watch on %s: %s", self.id, prefix, exc)
            wake.set()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------------------- election
    async def _election(self) -> None:
        while True:
            watch = self.store.watch_prefix(AUDITOR)  # before the create: no deletion is missed
            try:
                lease = self._lease
                self._lease_lost.clear()
                try:
                    won = await self.store.create(AUDITOR, json.dumps(
                        {"id": self.id, "since": time.time()}).encode(), lease=lease) is not None
                except LeaseExpired:
                    won = False
                if won:
                    await watch.aclose()
                    log.info("%s: elected auditor", self.id)
                    await self._be_auditor()
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.relist_s):
                        async for ev in watch:
                            if ev.key == AUDITOR and ev.value is None:
                                break
            except MetadataError as exc:
                log.warning("%s: auditor election: %s", self.id, exc)
                await asyncio.sleep(1.0)
            finally:
                await watch.aclose()

    async def _be_auditor(self) -> None:
        self.is_auditor = True
        self._set("auditor", 1)
        audit = asyncio.create_task(self._audit_loop())
        lost = asyncio.create_task(self._lease_lost.wait())
        try:
            await asyncio.wait({audit, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.is_auditor = False
            self._set("auditor", 0)
            for t in (audit, lost):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        log.warning("%s: no longer the auditor", self.id)
        if audit.done() and not audit.cancelled() and audit.exception() is not None:
            log.error("%s: the audit loop failed: %r", self.id, audit.exception())
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------------------- auditor
    async def _audit_loop(self) -> None:
        while True:
            self._audit_wake.clear()
            try:
                wait_s = await self.audit_once()
            except (MetadataError, ScrollError, BookieError) as exc:
                log.warning("%s: audit: %s", self.id, exc)
                wait_s = self.config.retry_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, wait_s)):
                    await self._audit_wake.wait()

    async def audit_once(self) -> float:
        """One pass; returns how long until the next is due (a lost bookie's delay ending, or the
        safety-net re-list)."""
        now = time.time()
        live = {r.bookie_id for r in await live_bookies(self.store)}
        known = {k[len(KNOWN):] for k, _ in await self.store.list_prefix(KNOWN)}
        for b in live - known:
            await self.store.put(KNOWN + b, b"{}")
        lost = {k[len(LOST):]: (json.loads(v.value), v.version) for k, v in await self.store.list_prefix(LOST)}
        for b in known - live - set(lost):
            rec = {"since": now, "marked": False}
            if await self.store.create(LOST + b, json.dumps(rec).encode()) is not None:
                log.warning("bookie %s is not registered: lost (fragments marked after %gs unless it returns)",
                            b, self.config.lost_bookie_delay_s)
                lost[b] = (rec, None)
        items = None
        next_due = self.config.relist_s
        for b, (rec, _version) in sorted(lost.items()):
            if b in live:
                await self.store.delete(LOST + b)
                log.info("bookie %s is registered again%s", b, "" if rec["marked"] else ": nothing marked")
                continue
            if not rec["marked"]:
                due = rec["since"] + self.config.lost_bookie_delay_s - now
                if due > 0:
                    next_due = min(next_due, due)
                    continue
                n = await self._mark(b, rec["since"])
                rec = {**rec, "marked": True, "fragments": n}
                await self.store.put(LOST + b, json.dumps(rec).encode())
                log.warning("bookie %s lost for %gs: %d fragments marked under-replicated", b,
                            now - rec["since"], n)
            else:
                if items is None:
                    items = [json.loads(v.value) for _, v in await self.store.list_prefix(UNDER)]
                if not any(b in it.get("bookies", []) for it in items):
                    await self.store.delete(LOST + b)
                    await self.store.delete(KNOWN + b)
                    log.info("bookie %s: every fragment that named it is repaired; forgotten", b)
        lost_now = [k for k, _ in await self.store.list_prefix(LOST)]
        self._set("lost", len(lost_now))
        self._set("under", len(await self.store.list_prefix(UNDER)))
        return next_due

    async def _mark(self, bookie: str, since: float) -> int:
        """Put every fragment naming ``bookie`` (sealed, or the open last one) on the to-do list."""
        n = 0
        for m in await self.client.list_streams():
            try:
                meta, _ = await admin._meta(self.client, m.name)
                frags = await admin._visible(self.client, meta)
            except (ScrollError, NoSuchLedger):
                continue
            for f in frags:
                if bookie not in f.ensemble or remote_only(f):
                    continue
                await self._add_item(meta, f, bookie, since)
                n += 1
        return n

    async def _add_item(self, meta, f, bookie: str, since: float) -> None:
        key = item_key(meta.ledger_id, f.index)
        while True:
            cur = await self.store.get(key)
            if cur is None:
                item = {"stream": meta.name, "ledger": meta.ledger_id, "fragment": f.index, "bookies": [bookie],
                        "open": not f.sealed, "since": since, "marked_at": time.time()}
                if await self.store.create(key, json.dumps(item).encode()) is not None:
                    return
                continue
            item = json.loads(cur.value)
            if bookie in item["bookies"]:
                return
            item["bookies"] = sorted({*item["bookies"], bookie})
            item["since"] = min(item["since"], since)
            if await self.store.cas(key, json.dumps(item).encode(), cur.version) is not None:
                return

    # ------------------------------------------------------------------------------- worker
    async def _worker(self) -> None:
        while True:
            self._work_wake.clear()
            wait_s = self.config.relist_s
            try:
                now = time.monotonic()
                todo = await self.store.list_prefix(UNDER)
                present = {k for k, _ in todo}
                for k in list(self._retry_at):
                    if k not in present:
                        self._retry_at.pop(k, None)
                        self._failures.pop(k, None)
                for key, v in todo:
                    if key in self._inflight:
                        continue
                    at = self._retry_at.get(key, 0.0)
                    if at > now:
                        wait_s = min(wait_s, at - now)
                        continue
                    if len(self._inflight) >= self.config.max_fragments_in_flight:
                        break
                    if await self.store.create(_claim_key(key), self.id.encode(), lease=self._lease) is None:
                        continue  # another worker has it
                    self._inflight[key] = asyncio.create_task(self._repair(key, v))
            except (MetadataError, LeaseExpired) as exc:
                log.warning("%s: worker: %s", self.id, exc)
                wait_s = self.config.retry_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, wait_s)):
                    await self._work_wake.wait()

    async def _repair(self, key: str, v) -> None:
        try:
            async with self._sem:
                outcome, later = await self._repair_item(key, v)
            if outcome == "done":
                self._retry_at.pop(key, None)
                self._failures.pop(key, None)
            else:
                fails = self._failures.get(key, 0) + (1 if outcome == "error" else 0)
                self._failures[key] = fails
                backoff = min(self.config.relist_s, self.config.retry_s * (2 ** max(0, fails - 1)))
                self._retry_at[key] = time.monotonic() + (later if later is not None else backoff)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one item's failure must not stop the worker
            log.exception("%s: repairing %s", self.id, key)
            self._retry_at[key] = time.monotonic() + self.config.retry_s
            await self._note_error(key, v, repr(exc))
        finally:
            with contextlib.suppress(MetadataError, Exception):
                await self.store.delete(_claim_key(key))
            self._inflight.pop(key, None)
            self._work_wake.set()

    async def _done(self, key: str, v) -> str:
        """Remove the item unless the auditor changed it meanwhile (another bookie lost)."""
        await self.store.delete(key, expected_version=v.version)
        return "done"

    async def _note_error(self, key: str, v, error: str) -> None:
        item = json.loads(v.value)
        item.update(error=error, attempts=item.get("attempts", 0) + 1, last_attempt=time.time())
        with contextlib.suppress(MetadataError):
            await self.store.cas(key, json.dumps(item).encode(), v.version)

    async def _repair_item(self, key: str, v) -> tuple[str, float | None]:
        """One attempt: ("done" | "wait" | "error", seconds until the next attempt or None)."""
        item = json.loads(v.value)
        client, cluster = self.client, self.client.cluster
        try:
            meta, _ = await cluster.ledgers.get_ledger(int(item["ledger"]))
        except NoSuchLedger:
            return await self._done(key, v), None
        frags = await admin._visible(client, meta)
        f = next((x for x in frags if x.index == item["fragment"]), None)
        if f is None or remote_only(f):
            return await self._done(key, v), None  # removed by retention, or released to the object store
        live = {r.bookie_id for r in await cluster.refresh_bookies()}
        if not f.sealed:
            if all(b in live for b in f.ensemble):
                return await self._done(key, v), None  # the writer replaced it, or it came back
            if await self._writer_alive(meta):
                if key not in self._deferred:
                    self._deferred.add(key)
                    log.info("%s: stream %r: open fragment %d names a lost bookie; its writer is alive and "
                             "replaces it (no take-over)", self.id, meta.name, f.index)
                self.deferred += 1
                return "wait", self.config.retry_s  # the live writer's to replace (its ensemble change)
            wait = item["since"] + self.config.open_ledger_grace_s - time.time()
            if wait > 0:
                return "wait", wait
            log.warning("%s: stream %r: open fragment %d names a lost bookie past the grace; taking it over",
                        self.id, meta.name, f.index)
            try:
                await admin.force_recovery(client, meta.name)
            except ScrollError as exc:
                await self._note_error(key, v, f"take-over failed: {exc}")
                return "error", None
            self.takeovers += 1
            self._inc("takeovers")
            await self._count(takeovers=1)
            meta, _ = await cluster.ledgers.get_ledger(int(item["ledger"]))
            frags = await admin._visible(client, meta)
            f = next((x for x in frags if x.index == item["fragment"]), None)
            if f is None:
                return await self._done(key, v), None
            if not f.sealed:
                await self._note_error(key, v, "the take-over left the fragment open")
                return "error", None
            live = {r.bookie_id for r in await cluster.refresh_bookies()}
        rep = admin.FragmentReport(meta.name, f.index, f.first_entry_id, f.last_entry_id, list(f.ensemble), True)
        if f.last_entry_id < f.first_entry_id:
            return await self._done(key, v), None
        missing = await admin.inspect_fragment(cluster, meta, f, f.last_entry_id, live, rep)
        if not rep.under_replicated and not rep.gone:
            return await self._done(key, v), None
        copied_bytes = 0

        async def throttle(n: int) -> None:
            nonlocal copied_bytes
            await self._bucket.take(n)
            copied_bytes += n

        try:
            await admin.fix_fragment(client, meta, f, missing, live, rep, throttle=throttle,
                                     before_commit=self.before_commit)
        except (admin.AdminError, BookieError, NotEnoughBookies) as exc:
            self._account(copied_bytes)
            await self._count(bytes=copied_bytes)
            log.warning("%s: stream %r fragment %d: %s (retrying later)", self.id, meta.name, f.index, exc)
            await self._note_error(key, v, str(exc))
            return "error", None
        self._account(copied_bytes)
        self.repaired += 1
        self._inc("repaired")
        await self._count(repaired=1, bytes=copied_bytes)
        log.info("%s: stream %r fragment %d: %s, %d entries copied", self.id, meta.name, f.index, rep.action,
                 rep.copied)
        return await self._done(key, v), None

    async def _writer_alive(self, meta) -> bool:
        """Whether the stream's current writer holds its writer key (its lease is alive)."""
        got = await self.store.get(writer_key(meta.ledger_id))
        if got is None:
            return False
        try:
            return int(json.loads(got.value).get("term", -1)) == meta.term
        except (ValueError, TypeError, AttributeError):
            return False

    def _account(self, n: int) -> None:
        self.bytes_copied += n
        self._inc("bytes", n)

    async def _count(self, **add: int) -> None:
        for _ in range(20):
            cur = await self.store.get(PROGRESS)
            d = json.loads(cur.value) if cur else {}
            for k, n in add.items():
                d[k] = d.get(k, 0) + n
            if await self.store.cas(PROGRESS, json.dumps(d).encode(), cur.version if cur else 0) is not None:
                return


async def status(client) -> dict:
    """What ``scroll autorecovery status`` shows: the auditor, lost bookies, the to-do list, progress."""
    store = client.cluster.store
    aud = await store.get(AUDITOR)
    claims = {k[len(CLAIMS):]: v.value.decode() for k, v in await store.list_prefix(CLAIMS)}
    todo = []
    for k, v in await store.list_prefix(UNDER):
        item = json.loads(v.value)
        item["claimed_by"] = claims.get(k[len(UNDER):])
        todo.append(item)
    prog = await store.get(PROGRESS)
    live = {r.bookie_id for r in await live_bookies(store)}
    return {
        "auditor": json.loads(aud.value) if aud else None,
        "lost_bookies": {k[len(LOST):]: json.loads(v.value) for k, v in await store.list_prefix(LOST)},
        "known_bookies": sorted(k[len(KNOWN):] for k, _ in await store.list_prefix(KNOWN)),
        "live_bookies": sorted(live),
        "underreplicated": sorted(todo, key=lambda i: (i["ledger"], i["fragment"])),
        "progress": json.loads(prog.value) if prog else {},
    }


__all__ = ["AutoRecovery", "AutoRecoveryConfig", "item_key", "status"]
