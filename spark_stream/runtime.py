"""One asyncio loop thread per Python process and one Scroll client per metadata URL on it.

Spark calls the data source from plain (blocking) Python: the planner process on the driver, the
commit process on the driver, and the reused Python workers on executors. Each of them gets one
background thread running an asyncio loop (the same arrangement as ``streams.sync``) and one
``streams.client.ScrollClient`` per metadata URL and credentials, kept for the life of the process: Spark reuses
its Python workers, so the etcd and bookie connections of one task serve the next. ``run`` submits
a coroutine to the loop and waits for it.

A process forked after the loop thread started (Spark's worker daemon forks workers) has no such
thread in the child: the PID is checked and a child builds its own.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading

from fragments import aioloop
from fragments.security import NO_SECURITY, ClientSecurity
from streams import client as aclient


class Runtime:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = aioloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scroll-spark", daemon=True)
        self.thread.start()
        self._clients: dict[tuple[str, ClientSecurity], aclient.ScrollClient] = {}
        self._lock = threading.Lock()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, url: str, security: ClientSecurity = NO_SECURITY) -> aclient.ScrollClient:
        """The client of ``url`` with these credentials (one per pair, kept for the process)."""
        with self._lock:
            c = self._clients.get((url, security))
            if c is None:
                kw = {} if security.empty else {"security": security}
                c = self.run(aclient.connect(url, **kw), timeout=60)
                self._clients[(url, security)] = c
            return c

    def drop(self, url: str, security: ClientSecurity = NO_SECURITY) -> None:
        """Forget (and close) the client of ``url``, e.g. after an error that may have broken it."""
        with self._lock:
            c = self._clients.pop((url, security), None)
        if c is not None:
            try:
                self.run(c.close(), timeout=10)
            except Exception:  # noqa: BLE001 - closing a broken client is best effort
                pass

    def close(self) -> None:
        for url, security in list(self._clients):
            self.drop(url, security)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = Runtime()
        return _runtime


@atexit.register
def _close_at_exit() -> None:
    rt = _runtime
    if rt is not None and rt.pid == os.getpid():
        try:
            rt.close()
        except Exception:  # noqa: BLE001 - the process is exiting
            pass
