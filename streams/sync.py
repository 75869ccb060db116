"""A blocking wrapper of the async client, for scripts and Spark executors.

    from streams.sync import connect
    with connect("etcd://127.0.0.1:2379") as client:
        with client.producer("orders") as p:
            p.append(b"hello")
        for r in client.consumer("orders").read(100): ...

    # a secured cluster: connect("etcds://...", security=ClientSecurity(tls_ca="ca.pem", token="..."))
    # or with a settings file: connect_properties("scroll-data/scroll-client.properties")

One background thread runs an asyncio loop; every call is submitted to it and waited for.
"""

from __future__ import annotations

import asyncio
import threading

from fragments import aioloop

from . import client as aclient
from .consumer import EARLIEST


class _Loop:
    def __init__(self):
        self.loop = aioloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scroll-client", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what is still running on the loop and wait for it (as asyncio.run does), then
        stop: no task is left pending to be reported at exit."""
        async def finish() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        if self.thread.is_alive():
            try:
                self.run(finish(), timeout=5)
            except Exception:  # a stuck task must not keep the process from exiting
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class SyncProducer:
    def __init__(self, loop: _Loop, producer: aclient.Producer):
        self._loop, self._p = loop, producer

    @property
    def term(self) -> int:
        return self._p.term

    def append(self, value: bytes, key: bytes | None = None, headers=None, timestamp_ms: int | None = None):
        """The record's offset (a stream), or (partition, offset) (a topic of several partitions)."""
        return self._loop.run(self._p.append(value, key, headers, timestamp_ms))

    def append_many(self, records) -> list[int]:
        """Append many records (values, ``(value, key, headers, timestamp_ms)`` tuples or dicts) in
        as few batches as fit; returns their offsets in order once all are acknowledged."""
        return self._loop.run(self._p.append_many(records))

    @property
    def next_offset(self) -> int:
        return self._p.next_offset

    def flush(self) -> None:
        self._loop.run(self._p.flush())

    def close(self, seal: bool = False) -> None:
        self._loop.run(self._p.close(seal))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SyncConsumer:
    def __init__(self, loop: _Loop, consumer):
        self._loop, self._c = loop, consumer

    @property
    def position(self) -> int:
        """The record offset of the next record ``read`` returns."""
        return self._c.position

    def seek(self, offset: int) -> None:
        self._loop.run(self._c.seek(offset))

    def seek_timestamp(self, timestamp_ms: int) -> int:
        return self._loop.run(self._c.seek_timestamp(timestamp_ms))

    def read(self, max_records: int = 100, timeout_s: float = 0.0):
        return self._loop.run(self._c.read(max_records, timeout_s))

    def end_position(self) -> int:
        return self._loop.run(self._c.end_position())

    def earliest(self) -> int:
        return self._loop.run(self._c.earliest_offset())


class SyncClient:
    def __init__(self, metadata_url: str | None, properties=None, **options):
        self._loop = _Loop()
        try:
            self._c = self._loop.run(aclient.connect_properties(properties, **options) if properties is not None
                                     else aclient.connect(metadata_url, **options))
        except BaseException:
            self._loop.stop()
            raise

    def create_stream(self, name: str, **kw):
        return self._loop.run(self._c.create_stream(name, **kw))

    def describe_stream(self, name: str):
        return self._loop.run(self._c.describe_stream(name))

    def list_streams(self):
        return self._loop.run(self._c.list_streams())

    def delete_stream(self, name: str) -> None:
        self._loop.run(self._c.delete_stream(name))

    def create_topic(self, name: str, partitions: int = 1, configs=None, **kw):
        return self._loop.run(self._c.create_topic(name, partitions, configs, **kw))

    def describe_topic(self, name: str):
        return self._loop.run(self._c.describe_topic(name))

    def list_topics(self):
        return self._loop.run(self._c.list_topics())

    def delete_topic(self, name: str) -> None:
        self._loop.run(self._c.delete_topic(name))

    def add_partitions(self, name: str, total: int):
        return self._loop.run(self._c.add_partitions(name, total))

    def alter_topic_configs(self, name: str, set_configs=None, delete=()):
        return self._loop.run(self._c.alter_topic_configs(name, set_configs, delete))

    def set_tier_policy(self, stream: str, **kw):
        return self._loop.run(self._c.set_tier_policy(stream, **kw))

    def live_bookies(self):
        return self._loop.run(self._c.live_bookies())

    def producer(self, stream: str, options=None) -> SyncProducer:
        return SyncProducer(self._loop, self._loop.run(self._c.producer(stream, options)))

    def consumer(self, stream: str, start=EARLIEST, **options) -> SyncConsumer:
        return SyncConsumer(self._loop, self._loop.run(self._c.consumer(stream, start, **options)))

    @property
    def aclient(self) -> aclient.ScrollClient:
        """The async client underneath (its coroutines run on ``run``)."""
        return self._c

    def run(self, coro, timeout: float | None = None):
        return self._loop.run(coro, timeout)

    def close(self) -> None:
        try:
            self._loop.run(self._c.close(), timeout=10)
        finally:
            self._loop.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(metadata_url: str, **options) -> SyncClient:
    return SyncClient(metadata_url, **options)


def connect_properties(path, **options) -> SyncClient:
    """Connect with a client settings file (``scroll-client.properties`` of ``scroll standalone --secure``)."""
    return SyncClient(None, properties=path, **options)
