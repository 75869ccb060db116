"""Tailing over real processes (etcd + bookie processes): a consumer at the end of a stream gets
every record the producer appends at a fixed rate, in order, nothing missing, and never before the
producer was told the record is acknowledged (readers see only what is below the LAC)."""

from __future__ import annotations

import asyncio

import pytest

from streams.client import connect

pytestmark = pytest.mark.process

N = 400
RATE = 400.0  # appends/s: one record per entry, so each append is its own add, ack and LAC step


def test_a_tailing_consumer_gets_each_append_after_its_acknowledgement_in_order(cluster, stream_name) -> None:
    async def scenario() -> None:
        client = await connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
        try:
            await client.create_stream(stream_name)
            producer = await client.producer(stream_name)
            consumer = await client.consumer(stream_name, start="latest")
            futures: dict[int, asyncio.Future] = {}
            delivered: list[tuple[int, bytes, bool]] = []  # (offset, value, acknowledged when delivered)

            async def tail() -> None:
                while len(delivered) < N:
                    for r in await consumer.read(100, timeout_s=10.0):
                        fut = futures.get(r.offset)
                        delivered.append((r.offset, r.value, fut is not None and fut.done()))

            reader = asyncio.create_task(tail())
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i in range(N):
                delay = start + i / RATE - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                fut = await producer.append_future(b"v%d" % i)
                futures[i] = fut  # offsets are dense from 0: record i gets offset i
            offsets = await asyncio.gather(*futures.values())
            assert offsets == list(range(N))
            await asyncio.wait_for(reader, 60)
            assert [d[0] for d in delivered] == list(range(N))
            assert [d[1] for d in delivered] == [b"v%d" % i for i in range(N)]
            early = [d[0] for d in delivered if not d[2]]
            assert not early, f"records delivered before their acknowledgement: {early[:10]}"
            await consumer.close()
            await producer.close()
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_an_entry_followed_by_silence_reaches_a_tailing_reader_without_the_idle_lac_push(cluster, stream_name) -> None:
    """The producer appends one record and then nothing: the bookies learn its LAC from the
    writer's eager push (no add follows to carry it), not from the idle push, which is set to
    30 s here. A tailing reader that is already waiting gets the record well before that; the
    writer never pushed a LAC above what it acknowledged."""
    from streams.driver import ProducerOptions

    async def scenario() -> None:
        client = await connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
        try:
            await client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
            producer = await client.producer(stream_name, ProducerOptions(lac_push_idle_s=30.0))
            consumer = await client.consumer(stream_name, start="latest")
            waiting = asyncio.create_task(consumer.read(10, timeout_s=10.0))
            for i in range(3):  # each record alone, after the reader's long poll is parked
                offset = await producer.append(b"alone-%d" % i)
                got = await (waiting if i == 0 else consumer.read(10, timeout_s=10.0))
                assert [(r.offset, r.value) for r in got] == [(offset, b"alone-%d" % i)]
                w = producer._driver.writer
                assert w.lac_pushed == w.lac  # pushed at once, and never beyond the acknowledged LAC
            await consumer.close()
            await producer.close()
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_caught_up_read_hands_over_its_records_without_asking_a_bookie_again(cluster, stream_name) -> None:
    """Once a tail read brings records and the consumer is caught up, ``read`` returns them at
    once: it does not first poll another bookie (a round trip added to every delivery). Shown
    with the other members of the ensemble paused (SIGSTOP: they accept connections but never
    answer) while the record is delivered by the member the consumer is parked on."""
    import signal

    async def scenario() -> None:
        client = await connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=30.0)
        stopped = []
        try:
            await client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
            producer = await client.producer(stream_name)
            await producer.append(b"first")
            consumer = await client.consumer(stream_name, start="latest")
            polls = consumer._rotate  # one per tail read: a non-waiting one, then the parked one
            waiting = asyncio.create_task(consumer.read(10, timeout_s=20.0))
            while consumer._rotate < polls + 2:
                await asyncio.sleep(0.005)
            ensemble = list(consumer.fragments[-1].ensemble)
            parked = ensemble[consumer._rotate % len(ensemble)]
            offset = await producer.append(b"second")  # acknowledged by all three before the pause
            for b in ensemble:
                if b != parked:
                    proc = cluster.bookies[int(b.rsplit("-", 1)[1])]
                    proc.signal(signal.SIGSTOP)
                    stopped.append(proc)
            # a second poll would wait for the 30 s call timeout; the bound stays under the bookies'
            # 5 s registration lease so that even a failure leaves the shared cluster whole
            got = await asyncio.wait_for(waiting, 4.0)
            assert [(r.offset, r.value) for r in got] == [(offset, b"second")]
        finally:
            for proc in stopped:
                proc.signal(signal.SIGCONT)
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 90))
