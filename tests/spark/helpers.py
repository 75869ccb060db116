"""Test helpers: produce records with the async client, list a stream, and remove the front of a
stream the way retention does."""

from __future__ import annotations

import asyncio

from streams import client as aclient
from streams.consumer import EARLIEST


def produce(url: str, stream: str, recs, *, create: dict | None = None) -> list[int]:
    """Append ``recs`` (dicts with value and optional key, headers, timestamp_ms) in one producer
    session; returns their positions. ``create``: create the stream first with these settings."""

    async def go():
        c = await aclient.connect(url)
        try:
            if create is not None:
                await c.create_stream(stream, **create)
            p = await c.producer(stream)
            futs = [await p.append_future(r["value"], r.get("key"), r.get("headers"), r.get("timestamp_ms"))
                    for r in recs]
            positions = list(await asyncio.gather(*futs))
            await p.close()
            return positions
        finally:
            await c.close()

    return asyncio.run(go())


def read_all(url: str, stream: str):
    """Every record of ``stream`` (below the LAC), in order."""

    async def go():
        c = await aclient.connect(url)
        try:
            cons = await c.consumer(stream, start=EARLIEST)
            out = []
            while True:
                batch = await cons.read(1000, 0.0)
                if not batch:
                    return out
                out.extend(batch)
        finally:
            await c.close()

    return asyncio.run(go())


def stream_names(url: str) -> list[str]:
    async def go():
        c = await aclient.connect(url)
        try:
            return [m.name for m in await c.list_streams()]
        finally:
            await c.close()

    return asyncio.run(go())


def remove_front_fragments(url: str, stream: str, n: int) -> int:
    """Remove the first ``n`` fragments of ``stream`` with the retention job (``streams.tools.retention.apply``:
    mark, trim on the bookies, drop the records). Returns the new earliest position."""
    from streams.tools import retention

    async def go():
        c = await aclient.connect(url)
        try:
            meta, _ = await c.cluster.ledgers.get_ledger(stream)
            frags = await c.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                      meta.last_fragment_index)
            assert len(frags) > n and all(f.sealed for f in frags[:n]), [f.to_json() for f in frags]
            report = await retention.apply(c, stream, keep_from=frags[n].first_entry_id, floors=[])
            assert report.fragments == [f.index for f in frags[:n]], report
            return report.new_earliest
        finally:
            await c.close()

    return asyncio.run(go())
