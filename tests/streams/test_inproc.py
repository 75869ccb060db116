"""The client over real gRPC bookie servers running in this process and the in-process metadata
store: fast checks of the driver and the consumer (the multi-process tests are in test_e2e.py)."""

from __future__ import annotations

import asyncio

import pytest

from bookie.config import BookieConfig
from bookie.server import BookieServer
from fragments.memstore import MemoryStore
from fragments.registry import BookieRegistration, register_bookie
from streams.client import ScrollClient
from streams.cluster import Cluster
from streams.errors import StaleTermError


async def start_cluster(tmp_path, n=4):
    store = MemoryStore()
    servers, regs = [], []
    for i in range(n):
        cfg = BookieConfig(data_dir=tmp_path / f"b{i}", bookie_id=f"b{i}").with_overrides({"min_free_bytes": "0"})
        s = BookieServer(cfg, port=0)
        await s.start()
        servers.append(s)
        regs.append(await register_bookie(store, BookieRegistration(f"b{i}", s.address), ttl_s=30))
    client = ScrollClient(Cluster(store, add_timeout_s=5.0, call_timeout_s=5.0))
    return client, servers, regs


async def stop_cluster(client, servers, regs):
    for r in regs:
        await r.close()
    await client.close()
    for s in servers:
        await s.stop()


def test_produce_consume_take_over_in_process(tmp_path):
    async def body():
        client, servers, regs = await start_cluster(tmp_path)
        try:
            await client.create_stream("s", ensemble=3, write_quorum=2, ack_quorum=2, fragment_entries_max=50)
            p1 = await client.producer("s")
            futs = [await p1.append_future(b"a%d" % i) for i in range(200)]
            positions = await asyncio.gather(*futs)
            assert positions == list(range(1, 201))
            assert p1.lac == 200 and p1.stream_id == (await client.describe_stream("s")).meta.ledger_id
            p2 = await client.producer("s")  # take-over
            assert p2.term == p1.term + 1
            with pytest.raises(StaleTermError):
                await p1.append(b"late")
            await p2.append(b"b")
            c = await client.consumer("s", start="earliest")
            got = []
            while batch := await c.read(1000):
                got.extend(batch)
            assert [r.value for r in got] == [b"a%d" % i for i in range(200)] + [b"b"]
            info = await client.describe_stream("s")
            assert len(info.fragments) >= 4  # rollover every 50 entries, striped over E=3 WQ=2
            await p2.close()
        finally:
            await stop_cluster(client, servers, regs)

    asyncio.run(body())
