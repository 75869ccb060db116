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


def test_an_idle_tailing_reader_of_a_long_stream_re_reads_only_the_last_fragments(cluster, stream_name,
                                                                                 monkeypatch) -> None:
    """An idle caught-up reader re-reads the fragments now and then (a rollover onto other
    bookies). On a stream of many fragments that re-read is the last one or two records, not every
    record: with 10,000 fragments a full one cost ~0.25 s of CPU every 2 s per idle reader. It still
    follows rollovers, drops what retention removed, and reads back into the sealed ones it kept."""
    from streams import consumer as consumer_mod
    from streams.tools.retention import apply

    monkeypatch.setattr(consumer_mod, "IDLE_REFRESH_S", 0.0)  # every empty poll re-reads

    async def scenario() -> None:
        client = await connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
        try:
            await client.create_stream(stream_name, fragment_entries_max=1)  # one fragment per append
            producer = await client.producer(stream_name)
            for i in range(60):
                await producer.append(b"v%d" % i)
            consumer = await client.consumer(stream_name, start="latest")
            store = client.cluster.ledgers.store
            read = {"records": 0, "refreshes": 0}
            real_list, real_many = store.list_prefix, store.get_many

            async def list_prefix(prefix):
                got = await real_list(prefix)
                read["records"] += sum("/fragments/" in k for k, _ in got)
                return got

            async def get_many(keys):
                got = await real_many(keys)
                read["records"] += sum(v is not None and "/fragments/" in k for k, v in zip(keys, got, strict=True))
                return got

            real_refresh = consumer._refresh

            async def refresh(*args, **kwargs):
                read["refreshes"] += 1
                await real_refresh(*args, **kwargs)

            monkeypatch.setattr(store, "list_prefix", list_prefix)
            monkeypatch.setattr(store, "get_many", get_many)
            monkeypatch.setattr(consumer, "_refresh", refresh)
            for _ in range(4):
                assert await consumer.read(10, timeout_s=0.05) == []
            assert read["refreshes"] >= 3
            assert read["records"] <= 2 * read["refreshes"], read  # 60+ each before

            for i in range(60, 65):  # five more fragments: the idle reader follows them
                await producer.append(b"v%d" % i)
            got = []
            while len(got) < 5:
                got += await consumer.read(10, timeout_s=5.0)
            assert [r.value for r in got] == [b"v%d" % i for i in range(60, 65)]

            await apply(client, stream_name, 30, floors=[], respect_consumers=False)  # the first half goes
            assert await consumer.read(10, timeout_s=0.05) == []
            meta = (await client.describe_stream(stream_name)).meta
            assert consumer.fragments[0].index >= meta.first_fragment_index  # none retention removed
            await consumer.seek(40)  # back into sealed fragments the idle re-reads kept
            back = []
            while len(back) < 25:
                back += await consumer.read(100, timeout_s=5.0)
            assert [r.value for r in back] == [b"v%d" % i for i in range(40, 65)]
            await consumer.close()
            await producer.close()
        finally:
            await client.close()

    asyncio.run(scenario())
