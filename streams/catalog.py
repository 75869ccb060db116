"""A watched, in-memory catalog of every ledger: its meta record and its fragments' sizes.

How this works. ``StreamCatalog.start()`` lists the ledger keys once (``/scroll/ledgers/``: the
meta records, the fragment records and the names) and then follows one watch on that prefix, so
whoever runs periodic work (``scroll standalone``'s gauges and its retention, compaction and
offload schedules) reads the catalog instead of listing the metadata store on a timer: at rest
the cost is one idle watch, whatever is stored.

Each key's version is kept, and a watch event whose version is not above the known one is
skipped, so the listing and the watch may overlap (``MetadataStore.list_and_watch``). When the
watch ends with an error (etcd compacted the revision it had to resume from, the connection broke
for longer than the store's own fail-over) the catalog lists once again and watches from that new
listing (``relists`` counts those), after a short back-off while the store stays unreachable.

Listeners (``subscribe``) are called with the ledger id after every change of that ledger's keys,
and with ``None`` after a re-listing (anything may have changed then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fragments.compaction import DATA_LEDGER_PREFIX
from fragments.ledgers import LEDGERS, CorruptMetadata, _parse_fragment, _parse_meta
from fragments.model import LedgerMeta
from fragments.store import MetadataError, MetadataStore, WatchEvent

log = logging.getLogger(__name__)

_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # back-off while the store stays unreachable


def _parse_key(key: str) -> tuple[int, int | None] | None:
    """(ledger id, fragment index or None for the meta record) of a ledger key; None for others
    (the names under by-name/)."""
    rest = key[len(LEDGERS):]
    head, _, tail = rest.partition("/")
    if not head.isdigit():
        return None
    if tail == "meta":
        return int(head), None
    if tail.startswith("fragments/") and tail[10:].isdigit():
        return int(head), int(tail[10:])
    return None


class StreamCatalog:
    """Every ledger's meta record and fragment sizes, kept up to date from one watch."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._metas: dict[int, LedgerMeta] = {}
        self._sizes: dict[int, dict[int, int]] = {}  # ledger id -> fragment index -> size_bytes (0: unknown)
        self._versions: dict[str, int] = {}  # key -> version of what is held
        self._revision: dict[int, int] = {}  # ledger id -> the newest version of any of its keys
        self._listeners: list[Callable[[int | None], None]] = []
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._closed = False
        self.relists = 0  # listings after the first (the watch ended with an error)
        self.events = 0  # watch events applied

    # ---------------------------------------------------------------- reading
    def metas(self) -> list[LedgerMeta]:
        """Every ledger (streams and compaction's data ledgers), by id."""
        return [self._metas[i] for i in sorted(self._metas)]

    def streams(self) -> list[LedgerMeta]:
        """Every stream (not compaction's data ledgers), by id."""
        return [m for m in self.metas() if not m.name.startswith(DATA_LEDGER_PREFIX)]

    def meta(self, ledger_id: int) -> LedgerMeta | None:
        return self._metas.get(ledger_id)

    def stream_bytes(self, ledger_id: int) -> int:
        """Bytes in the ledger's fragments first..last (sealed ones have their size; the open one 0)."""
        meta = self._metas.get(ledger_id)
        if meta is None:
            return 0
        sizes = self._sizes.get(ledger_id, {})
        return sum(v for i, v in sizes.items() if meta.first_fragment_index <= i <= meta.last_fragment_index)

    def revision(self, ledger_id: int) -> int:
        """The newest version among the ledger's keys held (grows with every change of the ledger)."""
        return self._revision.get(ledger_id, 0)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    def subscribe(self, fn: Callable[[int | None], None]) -> None:
        """``fn(ledger_id)`` after each change of a ledger's keys; ``fn(None)`` after a (re)listing."""
        self._listeners.append(fn)

    # ---------------------------------------------------------------- life cycle
    async def start(self) -> None:
        """List once (errors propagate) and follow the watch in a task of its own."""
        items, watch = await self.store.list_and_watch(LEDGERS)
        self._load(items)
        self._task = asyncio.create_task(self._follow(watch), name="stream-catalog")

    async def close(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            # cancelled again until it ends: a store call that retries may swallow one cancellation
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()

    async def _follow(self, watch) -> None:
        while not self._closed:
            try:
                async for event in watch:
                    self._apply(event)
                raise MetadataError("the watch ended")
            except (MetadataError, CorruptMetadata) as exc:
                log.warning("stream catalog: watch on %s ended (%s); listing again", LEDGERS, exc)
            finally:
                with contextlib.suppress(Exception):
                    await watch.aclose()
            for attempt in range(10**9):
                if self._closed:
                    return
                try:
                    items, watch = await self.store.list_and_watch(LEDGERS)
                    break
                except MetadataError as exc:
                    delay = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                    log.warning("stream catalog: listing %s failed (%s); again in %g s", LEDGERS, exc, delay)
                    await asyncio.sleep(delay)
            self.relists += 1
            self._load(items)

    # ---------------------------------------------------------------- state
    def _load(self, items) -> None:
        self._metas.clear()
        self._sizes.clear()
        self._versions.clear()
        self._revision.clear()
        for key, v in items:
            self._put(key, v.value, v.version)
        self._ready.set()
        self._notify(None)

    def _apply(self, event: WatchEvent) -> None:
        known = self._versions.get(event.key, 0)
        if event.version <= known:
            return  # already in the listing
        self.events += 1
        lid = self._put(event.key, event.value, event.version) if event.value is not None else \
            self._delete(event.key, event.version)
        if lid is not None:
            self._notify(lid)

    def _put(self, key: str, value: bytes, version: int) -> int | None:
        parsed = _parse_key(key)
        if parsed is None:
            return None
        lid, index = parsed
        try:
            if index is None:
                self._metas[lid] = _parse_meta(value, key)
            else:
                self._sizes.setdefault(lid, {})[index] = _parse_fragment(value, key).size_bytes or 0
        except CorruptMetadata as exc:  # a foreign or broken record: the jobs report it when they read it
            log.warning("stream catalog: %s", exc)
            return None
        self._versions[key] = version
        self._revision[lid] = max(self._revision.get(lid, 0), version)
        return lid

    def _delete(self, key: str, version: int) -> int | None:
        parsed = _parse_key(key)
        if parsed is None or self._versions.pop(key, None) is None:
            return None
        lid, index = parsed
        if index is None:
            self._metas.pop(lid, None)
        else:
            sizes = self._sizes.get(lid)
            if sizes is not None:
                sizes.pop(index, None)
                if not sizes:
                    del self._sizes[lid]
        if lid in self._metas or lid in self._sizes:
            self._revision[lid] = max(self._revision.get(lid, 0), version)
        else:
            self._revision.pop(lid, None)
        return lid

    def _notify(self, lid: int | None) -> None:
        for fn in self._listeners:
            try:
                fn(lid)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the catalog
                log.exception("stream catalog listener failed")
