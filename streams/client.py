"""The client API: streams, producers and consumers.

    client = await streams.connect("etcd://127.0.0.1:2379")
    await client.create_stream("orders", ensemble=3, write_quorum=3, ack_quorum=2)
    async with await client.producer("orders") as p:
        offset = await p.append(b"hello", key=b"k1", headers={"source": b"web"})
    c = await client.consumer("orders", start="earliest")
    async for record in c: ...

A stream is one unbounded ledger whose entries are record batches with dense record offsets (see
``streams.batches``). Opening a producer takes the stream over (a new term): from then on it is the
only writer and assigns the offsets, and a producer that was taken over fails its next append with
``StaleTermError``. See ``streams.sync`` for the blocking form.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from fragments.ledgers import LedgerExists, NoSuchLedger
from fragments.model import Fragment, InvalidConfig, LedgerConfig, LedgerMeta
from fragments.placement import BookieInfo, NotEnoughBookies, Placement
from fragments.stores import open_store

from .cluster import Cluster
from .consumer import EARLIEST, Consumer
from .driver import ProducerOptions, WriterDriver
from .errors import InvalidArgument, NoBookiesAvailable, NoSuchStream, StreamExists
from .producer import Producer

MAX_ENTRY_BYTES = 1 << 20


@dataclass(frozen=True)
class StreamInfo:
    meta: LedgerMeta
    fragments: list[Fragment]

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def bytes(self) -> int:
        return sum(f.size_bytes or 0 for f in self.fragments)


class ScrollClient:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    # ---------------------------------------------------------------- streams
    async def create_stream(
        self,
        name: str,
        ensemble: int = 3,
        write_quorum: int = 3,
        ack_quorum: int = 2,
        fragment_bytes_max: int = 64 << 20,
        fragment_entries_max: int = 1_000_000,
        retention: dict | None = None,
    ) -> StreamInfo:
        if not name or "/" in name or len(name) > 249:
            raise InvalidArgument(f"invalid stream name {name!r} (1-249 characters, no '/')")
        try:
            config = LedgerConfig(ensemble, write_quorum, ack_quorum, fragment_bytes_max, fragment_entries_max)
        except InvalidConfig as exc:
            raise InvalidArgument(str(exc)) from exc
        await self.cluster.refresh_bookies()
        live = self.cluster.live()
        try:
            ens = Placement(random.Random(), [BookieInfo(b.bookie_id, b.rack) for b in live]).choose(ensemble)
        except NotEnoughBookies as exc:
            raise NoBookiesAvailable(f"cannot create {name!r}: {exc}") from exc
        try:
            meta, _ = await self.cluster.ledgers.create_ledger(name, config, ens, retention)
        except LedgerExists as exc:
            raise StreamExists(f"stream {name!r} already exists") from exc
        return StreamInfo(meta, await self.cluster.ledgers.fragments(meta.ledger_id))

    async def describe_stream(self, name: str) -> StreamInfo:
        meta = await self._meta(name)
        frags = await self.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index, meta.last_fragment_index)
        return StreamInfo(meta, frags)

    async def list_streams(self) -> list[LedgerMeta]:
        return await self.cluster.ledgers.list_ledgers()

    async def delete_stream(self, name: str) -> None:
        await self._meta(name)
        await self.cluster.ledgers.delete_ledger(name)

    async def _meta(self, name: str) -> LedgerMeta:
        try:
            meta, _ = await self.cluster.ledgers.get_ledger(name)
        except NoSuchLedger as exc:
            raise NoSuchStream(f"no stream named {name!r}") from exc
        return meta

    # ---------------------------------------------------------------- producers and consumers
    async def producer(self, stream: str, options: ProducerOptions | None = None) -> Producer:
        await self._meta(stream)
        driver = WriterDriver(self.cluster, stream, options)
        await driver.open()
        try:
            meta, _ = await self.cluster.ledgers.get_ledger(driver.ledger_id)
            reader = Consumer(self.cluster, meta)
            next_offset = await reader.offset_after(driver.writer.lac)  # from the last batch at or below the LAC
        except BaseException:
            await driver.close()
            raise
        return Producer(driver, self.cluster.max_entry_bytes, next_offset, options)

    async def consumer(self, stream: str, start=EARLIEST, **options) -> Consumer:
        meta = await self._meta(stream)
        c = Consumer(self.cluster, meta, **options)
        await c.start_at(start)
        return c

    async def live_bookies(self):
        return await self.cluster.refresh_bookies()

    async def close(self) -> None:
        await self.cluster.close()

    async def __aenter__(self) -> ScrollClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def connect(metadata_url: str, *, add_timeout_s: float = 10.0, call_timeout_s: float = 10.0,
                  max_entry_bytes: int = MAX_ENTRY_BYTES) -> ScrollClient:
    """Connect to a Scroll cluster through its metadata store (``etcd://host:port`` or ``memory://``)."""
    store = await open_store(metadata_url)
    return ScrollClient(Cluster(store, add_timeout_s=add_timeout_s, call_timeout_s=call_timeout_s,
                                max_entry_bytes=max_entry_bytes))
