"""What a client knows of the cluster: the metadata store, the live bookies and one connection
per bookie.

Bookies register themselves under a lease (``fragments.registry``); fragments name bookies by id,
so a bookie that restarts on the same id and address is found again. A bookie that is no longer
registered gets no client: sends to it fail at once, which the writer treats as a failed write.
Every bookie client gets the cluster's ``ClientSecurity`` (TLS, client certificate, token).

Tiered storage: ``tier_reader()`` builds the object store client and reader for offloaded fragments
from the cluster's tier config (``fragments.tier.TIER_CONFIG_KEY``; secrets come from the
environment or the credentials file it names), once, on first use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from bookie.client import BookieClient
from bookie.errors import BookieAuthError, BookieError
from fragments.ledgers import LedgerStore
from fragments.registry import BookieRegistration, live_bookies
from fragments.security import ClientSecurity
from fragments.store import MetadataStore
from fragments.tier import TIER_CONFIG_KEY

from .errors import AuthenticationFailed

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, store: MetadataStore, *, add_timeout_s: float = 10.0, call_timeout_s: float = 10.0,
                 max_entry_bytes: int = 1 << 20, security: ClientSecurity | None = None):
        self.store = store
        self.security = security or ClientSecurity()
        self.ledgers = LedgerStore(store)
        self.add_timeout_s = add_timeout_s
        self.call_timeout_s = call_timeout_s
        self.max_entry_bytes = max_entry_bytes
        self._regs: dict[str, BookieRegistration] = {}
        self._known: dict[str, str] = {}  # bookie id -> address, kept after a bookie disappears
        self._clients: dict[str, BookieClient] = {}
        self._refreshed = 0.0
        self._refreshing: asyncio.Future | None = None  # the listing of the bookies in flight
        self._tier = None  # the TierReader, once built
        self._tier_checked = -1e9  # monotonic time of the last look at the tier config (when absent)
        self._tier_lock = asyncio.Lock()
        self._unresponsive: dict[str, float] = {}  # bookie id -> monotonic time its last call failed

    TIER_RECHECK_S = 30.0
    UNRESPONSIVE_S = 30.0  # a bookie whose call failed is asked last for this long

    def failed_call(self, bookie_id: str) -> None:
        """A call to ``bookie_id`` failed or timed out: ask it last for a while (``rank``)."""
        self._unresponsive[bookie_id] = time.monotonic()

    def rank(self, bookies) -> list[str]:
        """``bookies`` in the order to ask them when any one will do (a LAC read, a tail poll):
        registered ones first, then ones that failed a call lately, then ones the registry no
        longer lists (stable otherwise). A bookie that stopped answering (SIGSTOP, a hung disk, a
        cut link) keeps accepting connections, and asking it first costs a whole call timeout."""
        now = time.monotonic()
        lately = {b for b, t in self._unresponsive.items() if now - t < self.UNRESPONSIVE_S}

        def key(b: str) -> int:
            return 2 if self._regs and b not in self._regs else 1 if b in lately else 0

        return sorted(bookies, key=key)

    async def tier_reader(self):
        """The reader of offloaded fragments (``streams.tier.reader.TierReader``), built once from
        the cluster's tier config; None when no object store is configured (looked up again at
        most every TIER_RECHECK_S seconds)."""
        if self._tier is not None:
            return self._tier
        async with self._tier_lock:
            if self._tier is not None:
                return self._tier
            if time.monotonic() - self._tier_checked < self.TIER_RECHECK_S:
                return None
            self._tier_checked = time.monotonic()
            got = await self.store.get(TIER_CONFIG_KEY)
            if got is None:
                return None
            from .tier.objstore import ObjectStore, TierConfig  # only clusters with a tier load the client
            from .tier.reader import TierReader

            config = TierConfig.from_dict(json.loads(got.value))
            store = ObjectStore(config)
            self._tier = TierReader(store, **_reader_options(config))
            return self._tier

    async def refresh_bookies(self, max_age_s: float = 0.0) -> list[BookieRegistration]:
        if max_age_s and time.monotonic() - self._refreshed < max_age_s:
            return list(self._regs.values())
        if self._refreshing is None:  # callers at once (take-overs of many streams) share one listing
            self._refreshing = asyncio.ensure_future(self._refresh_bookies())
            self._refreshing.add_done_callback(lambda _f: setattr(self, "_refreshing", None))
        return list(await asyncio.shield(self._refreshing))

    async def _refresh_bookies(self) -> list[BookieRegistration]:
        regs = await live_bookies(self.store)
        self._regs = {r.bookie_id: r for r in regs}
        for r in regs:
            old = self._known.get(r.bookie_id)
            if old is not None and old != r.address and r.bookie_id in self._clients:
                await self._clients.pop(r.bookie_id).close()
            self._known[r.bookie_id] = r.address
        self._refreshed = time.monotonic()
        return regs

    def live(self) -> list[BookieRegistration]:
        return [r for r in self._regs.values() if not r.read_only]

    def client(self, bookie_id: str) -> BookieClient | None:
        c = self._clients.get(bookie_id)
        if c is not None:
            return c
        addr = self._known.get(bookie_id)
        if addr is None:
            return None
        c = BookieClient(
            addr, bookie=bookie_id, add_timeout_s=self.add_timeout_s, call_timeout_s=self.call_timeout_s,
            max_entry_bytes=self.max_entry_bytes + 64, security=self.security,
        )
        self._clients[bookie_id] = c
        return c

    async def check_credentials(self, timeout_s: float = 2.0) -> None:
        """Ask one live bookie for its Info: a bookie that refuses our credentials raises
        ``AuthenticationFailed`` now, rather than every write and read failing later. A bookie that
        does not answer in time proves nothing either way and is let be."""
        regs = await self.refresh_bookies()
        if not regs:
            return
        client = self.client(regs[0].bookie_id)
        if client is None:
            return
        try:
            await asyncio.wait_for(client.info(), timeout_s)
        except BookieAuthError as exc:
            raise AuthenticationFailed(f"{exc} (connect(..., security=ClientSecurity(...)); the scroll CLI: "
                                       f"--tls-ca/--tls-cert/--tls-key/--token-file)") from exc
        except (BookieError, TimeoutError):
            pass

    async def close(self) -> None:
        live = getattr(self, "_writer_liveness", None)  # producers' writer lease and registry watch
        if live is not None:
            await live.stop()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        tier, self._tier = self._tier, None
        if tier is not None:
            await tier.close()
            close = getattr(tier.store, "close", None)
            if close is not None:
                await close()
        await self.store.close()


def _reader_options(config) -> dict:
    """TierReader options from the tier config: a read waits at most the store's own deadline for a
    call (its retries included), so a silent store fails the read rather than hanging it."""
    return {"timeout_s": config.deadline_s + 1.0}
