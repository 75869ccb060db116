"""A request's handler runs up to its first wait as it is started (``server._start_eagerly``, as
Python 3.12's eager tasks): its effects are applied before the next request is looked at, and
during that first step it is its own task, so ``asyncio.timeout`` and cancellation reach the
request, never the connection's read loop that started it."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from compat_kafka.server import _start_eagerly
from fragments import aioloop

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("eager_test", default="unset")


def test_the_first_step_runs_at_once_and_a_handler_done_by_then_is_answered() -> None:
    async def main() -> None:
        seen = []

        async def handler():
            seen.append("applied")
            return b"answer"

        task = _start_eagerly(handler(), contextvars.copy_context())
        assert seen == ["applied"]  # before _start_eagerly returned: no loop turn
        assert await task == b"answer"

    aioloop.run(main())


def test_a_timeout_entered_in_the_first_step_cancels_the_request_not_its_starter() -> None:
    async def main() -> None:
        starter = asyncio.current_task()
        seen = {}

        async def handler():
            seen["task"] = asyncio.current_task()
            _VAR.set("request")
            async with asyncio.timeout(0.01):
                await asyncio.get_running_loop().create_future()  # never answered

        task = _start_eagerly(handler(), contextvars.copy_context())
        assert seen["task"] is task and asyncio.current_task() is starter
        assert _VAR.get() == "unset"  # the request's context is its own
        with pytest.raises(TimeoutError):
            await task
        await asyncio.sleep(0)  # the starter carries on: it was not cancelled
        assert not starter.cancelled()

    aioloop.run(main())


def test_a_started_request_resumes_in_its_context_and_can_be_cancelled() -> None:
    async def main() -> None:
        release = asyncio.get_running_loop().create_future()
        cancelled = asyncio.Event()

        async def handler():
            _VAR.set("request")
            value = await release
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return value

        task = _start_eagerly(handler(), contextvars.copy_context())
        release.set_result(1)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled.is_set()

        async def failing():
            raise ValueError("bad request")

        with pytest.raises(ValueError, match="bad request"):
            await _start_eagerly(failing(), contextvars.copy_context())

        async def reads_var():
            await asyncio.sleep(0)
            return _VAR.get()

        ctx = contextvars.copy_context()
        ctx.run(_VAR.set, "request")
        assert await _start_eagerly(reads_var(), ctx) == "request"

    aioloop.run(main())
