"""The event loop every Scroll process runs on: uvloop when it can be imported, asyncio's own otherwise.

How this works. Every process entry point (bookie, Kafka listener, ``scroll`` CLI, standalone, the
sync client's and Spark's background loops) creates its loop here instead of calling
``asyncio.run`` / ``asyncio.new_event_loop`` itself. uvloop (libuv) cuts the loop's own cost per
callback and per socket read/write, which is most of what a busy listener or bookie does between
its own lines of Python. When uvloop is not installed (or the platform has no wheel), or when
``SCROLL_EVENT_LOOP=asyncio`` is set (for debugging, or to compare), the standard loop is used;
nothing else changes. grpc.aio runs on either: it drives its own poller from whatever loop is
running.

This module sits in ``fragments`` (the bottom layer) so that every package can import it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

ENV = "SCROLL_EVENT_LOOP"  # "uvloop" (the default) or "asyncio"


def _uvloop():
    """The uvloop module, or None when it is not wanted or cannot be imported."""
    choice = os.environ.get(ENV, "uvloop").strip().lower()
    if choice == "asyncio":
        return None
    if choice not in ("uvloop", ""):
        raise ValueError(f"{ENV} must be 'uvloop' or 'asyncio', not {choice!r}")
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop (uvloop's when available), for a thread that runs one with ``run_forever``."""
    uv = _uvloop()
    return uv.new_event_loop() if uv is not None else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any], *, debug: bool | None = None) -> Any:
    """``asyncio.run(coro)`` on the loop of ``new_event_loop``."""
    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(coro)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """'uvloop' or 'asyncio': the implementation of ``loop`` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
