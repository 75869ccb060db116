"""The asyncio driver of a ``terms.writer.LedgerWriter``: commands become gRPC calls and metadata
transactions; answers come back as events.

How this works. The writer is a plain object; this driver owns the sockets and the clock. Adds
produced by one step of the writer are grouped per bookie and handed to that bookie's client in
one ``submit`` (the client batches further while a message is in flight). When the results come
back, each is fed to the writer with the ``send_id`` of its command, and whatever the writer
answers is executed in turn. Fences, recovery reads and LAC writes run as tasks; metadata CASes
run as one transaction each. Callers hold one future per appended entry, resolved in order when
the writer says ``Acknowledge``.

Time. The writer says when it next needs a ``Tick`` (``next_deadline``: the idle LAC push, a retry
of an ensemble change); the driver keeps at most one timer for it, re-armed after each step, and
tells the writer the time (``advance_clock``) before appends and answers. An idle writer (LAC
pushed, nothing pending) has no timer at all. The view of the live bookies the writer places from
is refreshed when there is activity and it is older than ``PLACEMENT_REFRESH_S`` (from the timer
and from appends), or ``PLACEMENT_REFRESH_FAILED_S`` while a failed bookie waits for a replacement.
With it, at most every ``CAPS_REFRESH_S``, the ledger record is read again and its rollover caps
(a topic's segment.bytes / segment.ms changed by an admin) are handed to the writer
(``LedgerWriter.update_caps``): a live writer honours a changed cap within about that long while
it is active, and at its next metadata write in any case.

Nothing protocol-related is decided here: every rule lives in ``terms``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from dataclasses import dataclass

from bookie.client import LacWritten
from fragments.ledgers import LedgerStore
from fragments.placement import BookieInfo, Placement
from fragments.store import MetadataUnavailable
from terms.commands import (
    Aborted,
    Acknowledge,
    CasLedger,
    Closed,
    Opened,
    SendAdd,
    SendFence,
    SendLacWrite,
    SendRecoveryRead,
    Withdraw,
    WriterConfig,
)
from terms.messages import CasConflict, CasOk, FenceFailed, InvalidTerm, ReadFailed, Tick, WriteFailed
from terms.writer import LedgerWriter, Phase

from .errors import StaleTermError, TakeOverFailed, WriterWithdrawn

log = logging.getLogger(__name__)

PLACEMENT_REFRESH_S = 5.0  # how old the writer's view of the live bookies may get
PLACEMENT_REFRESH_FAILED_S = 0.5  # ... while a failed bookie waits for a replacement
CAPS_REFRESH_S = 30.0  # how old the writer's view of the ledger's rollover caps may get


@dataclass(frozen=True, slots=True)
class ProducerOptions:
    """How a producer batches and how its writer pipelines.

    Records accumulate into a batch (one entry) while earlier batches are in flight: a batch goes
    out when it reaches ``batch_bytes``, or when the loop is idle (no added delay; after
    ``linger_ms`` if set) and fewer than ``eager_inflight_batches`` batches are in flight, or else
    when one is acknowledged; at most ``max_inflight_batches`` are in flight, so under load batches
    grow instead of multiplying. ``buffer_bytes`` bounds records waiting to be sent (appends wait
    for space beyond it). ``compression``: none, gzip, snappy, lz4 or zstd."""

    batch_bytes: int = 1 << 20
    linger_ms: float = 0.0
    compression: str = "none"
    max_inflight_batches: int = 5
    eager_inflight_batches: int = 1
    buffer_bytes: int = 32 << 20
    max_inflight_entries: int = 20_000
    max_inflight_bytes: int = 64 * 1024 * 1024
    lac_push_idle_s: float = 0.002
    # push the LAC as soon as it advances with no add in flight to carry it (tail readers see an
    # entry one bookie hop after its acknowledgement); False: only after lac_push_idle_s
    lac_push_eager: bool = True
    tick_s: float = 0.002  # while a failed bookie waits for a replacement, retry placing one this often
    takeover_attempts: int = 20
    takeover_backoff_s: float = 0.05

    def __post_init__(self) -> None:
        from .batches import COMPRESSION

        if self.compression not in COMPRESSION:
            raise ValueError(f"compression must be one of {sorted(COMPRESSION)}, not {self.compression!r}")
        if self.batch_bytes < 1024 or self.linger_ms < 0 or self.max_inflight_batches < 1 \
                or not 1 <= self.eager_inflight_batches <= self.max_inflight_batches \
                or self.buffer_bytes < self.batch_bytes:
            raise ValueError(f"invalid producer options {self}")


class WriterDriver:
    def __init__(self, cluster, ledger_name: str, options: ProducerOptions | None = None):
        self.cluster = cluster
        self.ledgers: LedgerStore = cluster.ledgers
        self.name = ledger_name
        self.options = options or ProducerOptions()
        self.writer: LedgerWriter | None = None
        self._acks: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._space = asyncio.Event()
        self._opened: asyncio.Future | None = None
        self._closed: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None  # at most one: feeds Tick at next_deadline
        self._timer_at = 0.0
        self._placed_at = 0.0  # loop time of the last refresh of the live bookies
        self._caps_at = 0.0  # loop time of the last read of the ledger's rollover caps
        self._refreshing = False
        self._stopped = False  # closed: no more ticks
        self._tasks: set[asyncio.Task] = set()
        self.failure: Exception | None = None
        self.ledger_id: int | None = None
        self._queued_adds: dict[tuple[int, str], tuple[LedgerWriter, list[SendAdd]]] = {}
        self._adds_flush_scheduled = False
        self._absent_once: set[str] = set()  # bookies missing from the last registry listing
        self.on_space: list = []  # callbacks run whenever in-flight space may have freed

    # ---------------------------------------------------------------- life cycle
    async def open(self) -> None:
        """Take the ledger over (a new term), retrying when another writer races us."""
        delay = self.options.takeover_backoff_s
        last_reason = ""
        self._stopped = False
        for _ in range(self.options.takeover_attempts):
            meta, version = await self.ledgers.get_ledger(self.name)
            self.ledger_id = meta.ledger_id
            last = await self.ledgers.get_fragment(meta.ledger_id, meta.last_fragment_index)
            await self.cluster.refresh_bookies()
            self._placed_at = self._caps_at = self._now()
            placement = Placement(random.Random(), [BookieInfo(b.bookie_id, b.rack) for b in self.cluster.live()])
            cfg = WriterConfig(
                max_inflight_entries=self.options.max_inflight_entries,
                max_inflight_bytes=self.options.max_inflight_bytes,
                lac_push_idle_s=self.options.lac_push_idle_s,
                lac_push_eager=self.options.lac_push_eager,
                ensemble_retry_s=self.options.tick_s,
            )
            self.writer = LedgerWriter(meta, version, last, placement, cfg, now=self._now())
            self.failure = None
            self._opened = asyncio.get_running_loop().create_future()
            self._execute(self.writer.start())
            outcome = await self._opened
            if outcome is True:
                log.info("stream=%s ledger=%s term=%s open", self.name, meta.ledger_id, self.writer.term)
                return
            last_reason = outcome
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)
        raise TakeOverFailed(f"could not take over stream {self.name!r}: {last_reason}")

    async def close(self, seal: bool = False) -> None:
        """Wait for everything appended, then stop (``seal``: also CLOSE the ledger in metadata)."""
        w = self.writer
        if w is not None and w.phase is Phase.OPEN:
            await self.flush()
            await self._publish_lac(w)  # readers see the last entries once close returns
            if seal:
                self._closed = asyncio.get_running_loop().create_future()
                self._execute(w.close())
                await self._closed
        self._stopped = True
        self._cancel_timer()
        for t in list(self._tasks):
            t.cancel()

    async def _publish_lac(self, w: LedgerWriter) -> None:
        """Leave the final LAC on every member of the last fragment (a reader asks any one of
        them). A metadata change in flight (rollover, ensemble change) holds pushes back, so it is
        let land first; LAC writes that fail (a timeout under load) are retried until the deadline,
        since the idle push counts a LAC as pushed once it is sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(5.0, 2 * self.cluster.call_timeout_s)
        while w.phase is Phase.OPEN and w.cas_reason is not None and loop.time() < deadline:
            await asyncio.sleep(0.005)
        cmds = w.push_lac(force=True)
        todo = [c for c in cmds if isinstance(c, SendLacWrite)]
        self._execute([c for c in cmds if not isinstance(c, SendLacWrite)])
        while todo and w is self.writer and w.phase is Phase.OPEN:
            results = await asyncio.gather(*(self._lac_write_once(c) for c in todo))
            for ev in results:
                if isinstance(ev, InvalidTerm):
                    self._feed(w, ev)
                    return
            todo = [c for c, ev in zip(todo, results) if not isinstance(ev, LacWritten)]
            if not todo or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        if todo:
            log.warning("stream=%s: the final LAC %d did not reach %s; readers of those bookies see it after the "
                        "next write or take-over", self.name, w.lac, [c.bookie for c in todo])

    async def _lac_write_once(self, c: SendLacWrite):
        r = c.request
        client = self.cluster.client(c.bookie)
        if client is None:
            return None
        try:
            return await client.write_lac(r.ledger_id, r.term, r.lac, r.lafr)
        except Exception as exc:  # noqa: BLE001 - a failed attempt is retried
            log.debug("stream=%s LAC write to %s failed: %s", self.name, c.bookie, exc)
            return None

    # ---------------------------------------------------------------- appends
    def append_nowait(self, data: bytes, offsets: tuple[int, int] | None = None) -> asyncio.Future:
        """Queue one entry; the future resolves to its entry id once acknowledged. ``offsets``:
        (first record offset of the entry, first offset after it), recorded in new fragments."""
        w = self.writer
        if self.failure is not None:
            raise self.failure
        if w is None or w.phase is not Phase.OPEN:
            raise WriterWithdrawn(f"stream {self.name!r} has no open writer")
        now = self._now()
        w.advance_clock(now)
        self._maybe_refresh(w, now)
        entry_id, cmds = w.append(data, offsets)
        fut = asyncio.get_running_loop().create_future()
        self._acks.append((entry_id, fut))
        self._execute(cmds)
        return fut

    async def append(self, data: bytes) -> int:
        while not self.can_append(len(data)):
            await self.wait_for_space()
        fut = self.append_nowait(data)
        return await fut

    def can_append(self, nbytes: int) -> bool:
        """Whether an append fits now; raises if the writer was withdrawn (a producer waiting for
        space must learn it was taken over instead of waiting for space that never comes)."""
        if self.failure is not None:
            raise self.failure
        return self.writer is not None and self.writer.can_append(nbytes)

    async def wait_for_space(self) -> None:
        self._space.clear()
        await self._space.wait()

    async def flush(self) -> None:
        if self._acks:
            await asyncio.gather(*(f for _, f in list(self._acks)), return_exceptions=True)

    # ---------------------------------------------------------------- commands
    def _execute(self, cmds) -> None:
        if self._stopped:  # answers that come after close start nothing (as after a crash: the next
            # take-over repairs what this writer left), and no task outlives the client's store
            cmds = [c for c in cmds if isinstance(c, (Acknowledge, Opened, Aborted, Withdraw, Closed))]
        adds: dict[str, list[SendAdd]] = {}
        for c in cmds:
            if isinstance(c, SendAdd):
                adds.setdefault(c.bookie, []).append(c)
            elif isinstance(c, SendFence):
                self._spawn(self._fence(self.writer, c))
            elif isinstance(c, SendRecoveryRead):
                self._spawn(self._recovery_read(self.writer, c))
            elif isinstance(c, SendLacWrite):
                self._spawn(self._lac_write(self.writer, c))
            elif isinstance(c, CasLedger):
                self._spawn(self._cas(self.writer, c))
            elif isinstance(c, Acknowledge):
                self._acknowledge(c.last_entry_id)
            elif isinstance(c, Opened):
                self._settle(self._opened, True)
            elif isinstance(c, Aborted):
                self._settle(self._opened, c.reason)
            elif isinstance(c, Withdraw):
                self._withdrawn(c)
            elif isinstance(c, Closed):
                self._settle(self._closed, True)
        for bookie, sends in adds.items():
            self._queue_adds(self.writer, bookie, sends)
        self._arm()

    def _queue_adds(self, w: LedgerWriter, bookie: str, sends: list[SendAdd]) -> None:
        """Adds go out once per event-loop turn, per bookie: a producer appending in a loop (or a
        batch of answers releasing a window) costs one submission per bookie, not one per entry.
        Order per bookie is kept: every add to a bookie passes through here."""
        key = (id(w), bookie)
        queued = self._queued_adds.get(key)
        if queued is None:
            self._queued_adds[key] = (w, list(sends))
        else:
            queued[1].extend(sends)
        if not self._adds_flush_scheduled:
            self._adds_flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_adds)

    def flush_adds_now(self) -> None:
        """Send the adds queued this loop turn now rather than at the scheduled flush (a caller
        that knows nothing more comes this turn, like the producer's idle hand-off, saves a turn)."""
        if self._queued_adds:
            self._flush_adds()

    def _flush_adds(self) -> None:
        self._adds_flush_scheduled = False
        queued, self._queued_adds = self._queued_adds, {}
        for (_, bookie), (w, sends) in queued.items():
            self._submit(w, bookie, sends)

    def _submit(self, w: LedgerWriter, bookie: str, sends: list[SendAdd]) -> None:
        client = self.cluster.client(bookie)
        reqs = [s.request for s in sends]
        if client is None:
            self._feed_adds(w, [WriteFailed(bookie, r.ledger_id, r.entry_id, r.term) for r in reqs], sends)
            return

        def done(results) -> None:  # called as the answer is read: no future, no loop hop
            self._feed_adds(w, results.events(reqs, bookie), sends)

        client.submit(reqs, on_done=done)

    def _feed_adds(self, w: LedgerWriter, events, sends: list[SendAdd]) -> None:
        w.advance_clock(self._now())
        out = []
        for ev, s in zip(events, sends):
            out.extend(w.handle_add_answer(ev, s.send_id))
        if w is self.writer:
            self._execute(out)
            # In-flight space frees up when entries reach WQ (LAFR), which can come after their
            # acknowledgement: wake anyone waiting for space on every batch of answers.
            self._space.set()
            for cb in self.on_space:
                cb()

    def _feed(self, w: LedgerWriter, ev) -> None:
        w.advance_clock(self._now())
        cmds = w.handle(ev)
        if w is self.writer:
            self._execute(cmds)

    async def _fence(self, w: LedgerWriter, c: SendFence) -> None:
        client = self.cluster.client(c.bookie)
        ev = await client.fence(c.request.ledger_id, c.request.term) if client else FenceFailed(
            c.bookie, c.request.ledger_id, c.request.term)
        self._feed(w, ev)

    async def _recovery_read(self, w: LedgerWriter, c: SendRecoveryRead) -> None:
        r = c.request
        client = self.cluster.client(c.bookie)
        ev = await client.recovery_read(r.ledger_id, r.entry_id, r.term) if client else ReadFailed(
            c.bookie, r.ledger_id, r.entry_id, r.term)
        self._feed(w, ev)

    async def _lac_write(self, w: LedgerWriter, c: SendLacWrite) -> None:
        r = c.request
        client = self.cluster.client(c.bookie)
        if client is None:
            return
        ev = await client.write_lac(r.ledger_id, r.term, r.lac, r.lafr)
        if isinstance(ev, InvalidTerm):
            self._feed(w, ev)

    async def _cas(self, w: LedgerWriter, c: CasLedger) -> None:
        try:
            version = await self.ledgers.cas_ledger(c.ledger, c.fragments, c.expected_version)
        except MetadataUnavailable as exc:
            # The outcome is unknown: treat it as lost. The writer aborts or withdraws and a new
            # take-over re-reads the metadata, which is safe whichever way the CAS went.
            log.warning("stream=%s metadata CAS (%s) failed: %s", self.name, c.reason, exc)
            version = None
        if version is not None:
            self._feed(w, CasOk(version))
            return
        current = None
        try:  # tell the writer what won: a change by a non-writer (retention, extra) is rebased over
            current = await self.ledgers.get_ledger(c.ledger.ledger_id)
        except Exception as exc:  # noqa: BLE001 - any failure: the writer treats the conflict as a take-over
            log.debug("stream=%s re-reading the ledger after a CAS conflict failed: %s", self.name, exc)
        self._feed(w, CasConflict(*current) if current is not None else CasConflict())

    # ---------------------------------------------------------------- outcomes
    def _acknowledge(self, last: int) -> None:
        acks = self._acks
        while acks and acks[0][0] <= last:
            entry_id, fut = acks.popleft()
            if not fut.done():
                fut.set_result(entry_id)
        self._space.set()

    def _withdrawn(self, c: Withdraw) -> None:
        if c.stale_term:
            err: Exception = StaleTermError(f"stream {self.name!r}: {c.reason}")
        else:
            err = WriterWithdrawn(f"stream {self.name!r}: {c.reason}")
        self.failure = err
        self._cancel_timer()
        while self._acks:
            _, fut = self._acks.popleft()
            if not fut.done():
                fut.set_exception(err)
        self._space.set()
        for cb in self.on_space:
            cb()
        self._settle(self._closed, err)

    @staticmethod
    def _settle(fut: asyncio.Future | None, value) -> None:
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("stream=%s driver task failed", self.name, exc_info=t.exception())

    def bookie_left(self, bookie: str) -> None:
        """``bookie`` left the registry (its lease expired, or it stopped; the caller refreshed the
        cluster's view of the live bookies, once for all writers): if it is a member of the open
        fragment, replace it now, as a failed write would, even when no append is coming (an idle
        writer otherwise never notices, and its open fragment would stay on a lost bookie). The
        written prefix becomes a sealed fragment that autorecovery re-replicates."""
        w = self.writer
        if w is None or w.phase is not Phase.OPEN or self._stopped or self.failure is not None:
            return
        if bookie not in w.fragment.ensemble or bookie in w.failed:
            return
        log.info("stream=%s ledger=%s term=%s: bookie %s of the open ensemble left the registry; replacing it",
                 self.name, w.ledger.ledger_id, w.term, bookie)
        self._placed_at = self._now()
        self._update_placement(w)
        w.advance_clock(self._now())
        # as the answer to a send made now (a bookie that joined by an ensemble change ignores
        # answers to sends older than its joining)
        ev = WriteFailed(bookie, w.ledger.ledger_id, w.lac + 1, w.term, "left the bookie registry")
        self._execute(w.handle_add_answer(ev, w.next_send_id))

    # ---------------------------------------------------------------- time
    @property
    def timer_armed(self) -> bool:
        """Whether a timer is set to feed the writer a Tick (an idle writer has none)."""
        return self._timer is not None

    def _arm(self) -> None:
        """Keep one timer at the writer's next deadline. When the deadline moves (each send moves
        the idle LAC push later) the timer moves with it: a timer left at the old deadline would
        wake the loop for nothing, and on this kind of host a wake-up costs more CPU (~100 us)
        than a cancelled handle (~2 us)."""
        w = self.writer
        deadline = w.next_deadline() if w is not None and not self._stopped and self.failure is None else None
        if deadline is None:
            self._cancel_timer()
            return
        if self._timer is not None:
            if self._timer_at == deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_at(deadline, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        w = self.writer
        if w is None or not w.engaged:
            return
        now = self._now()
        self._maybe_refresh(w, now)
        deadline = w.next_deadline()
        if deadline is not None and deadline <= now:
            self._feed(w, Tick(now))  # re-arms from the writer's next deadline
        else:
            self._arm()

    def _maybe_refresh(self, w: LedgerWriter, now: float) -> None:
        """The writer places replacements and new fragments from the live bookies: refresh that
        view now and then while it is active, and often while a failed bookie waits for a
        replacement (a bookie that registered after the take-over, or one that came back, can then
        be used)."""
        wait = PLACEMENT_REFRESH_FAILED_S if w.failed else PLACEMENT_REFRESH_S
        if self._refreshing or now - self._placed_at < wait:
            return
        self._placed_at = now
        self._refreshing = True
        self._spawn(self._refresh_placement(w, wait))

    async def _refresh_placement(self, w: LedgerWriter, wait: float) -> None:
        try:
            await self.cluster.refresh_bookies(max_age_s=wait / 2)
        except Exception as exc:  # noqa: BLE001 - the metadata store may be down: keep the old view
            log.debug("stream=%s refreshing the live bookies failed: %r", self.name, exc)
            return
        finally:
            self._refreshing = False
        if self.writer is not w or not w.engaged:
            return
        self._update_placement(w)
        if self._now() - self._caps_at >= CAPS_REFRESH_S:
            self._caps_at = self._now()
            try:
                meta, _ = await self.ledgers.get_ledger(w.ledger.ledger_id)
            except Exception as exc:  # noqa: BLE001 - keep the caps we have; the next refresh retries
                log.debug("stream=%s re-reading the ledger's caps failed: %r", self.name, exc)
            else:
                if self.writer is w and w.engaged and meta.term == w.term:
                    w.advance_clock(self._now())
                    self._execute(w.update_caps(meta.config))
        if w.failed:
            self._feed(w, Tick(self._now()))  # a replacement may be placeable now

    def _update_placement(self, w: LedgerWriter) -> None:
        """The registry's live bookies become the writer's view; one that is missing from a single
        listing (a lease being renewed) stays until it is missing twice in a row."""
        view = {b.bookie_id: BookieInfo(b.bookie_id, b.rack) for b in self.cluster.live()}
        for bid, info in w.placement.bookies.items():
            if bid not in view and bid not in self._absent_once:
                view[bid] = info
                self._absent_once.add(bid)
        self._absent_once &= set(w.placement.bookies) - {b.bookie_id for b in self.cluster.live()}
        w.placement.set_bookies(list(view.values()))

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
