"""How a produce waits for its partitions' acknowledgements (``broker._all_done``): until all are
acknowledged, or one has failed (the answer carries that error at once), or the request's timeout
(REQUEST_TIMED_OUT) — and a timeout never cancels the writes, which may still be acknowledged."""

import asyncio

from compat_kafka.broker import _all_done


def test_all_acknowledged():
    async def main():
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(3)]
        waiting = asyncio.ensure_future(_all_done(futs, 30.0))
        for f in futs[:2]:
            f.set_result(0)
        await asyncio.sleep(0)
        assert not waiting.done()  # one acknowledgement still missing
        futs[2].set_result(0)
        assert await waiting is True

    asyncio.run(main())


def test_a_failure_answers_at_once_and_cancels_nothing():
    async def main():
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(2)]
        waiting = asyncio.ensure_future(_all_done(futs, 30.0))
        await asyncio.sleep(0)
        futs[1].set_exception(RuntimeError("fenced"))
        assert await waiting is True
        assert not futs[0].done()  # still in flight, not cancelled
        futs[1].exception()

    asyncio.run(main())


def test_timeout_leaves_the_writes_running():
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        assert await _all_done([fut], 0.01) is False
        assert not fut.cancelled()
        fut.set_result(0)  # acknowledged later: nothing left waiting on it
        await asyncio.sleep(0)

    asyncio.run(main())
