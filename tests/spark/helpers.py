"""Test helpers: produce records with the async client, list a stream, and remove the front of a
stream the way retention does."""

from __future__ import annotations

import asyncio

from streams import client as aclient
from streams.consumer import EARLIEST


def produce(url: str, stream: str, recs, *, create: dict | None = None, per_entry: bool = False) -> list[int]:
    """Append ``recs`` (dicts with value and optional key, headers, timestamp_ms) in one producer
    session; returns their record offsets. ``create``: create the stream first with these settings.
    ``per_entry``: one record per entry (each append waits for the previous one), so that entry
    counts (fragment sizes) follow record counts; otherwise the producer batches them."""

    async def go():
        c = await aclient.connect(url)
        try:
            if create is not None:
                await c.create_stream(stream, **create)
            p = await c.producer(stream)
            try:
                if per_entry:
                    return [await p.append(r["value"], r.get("key"), r.get("headers"), r.get("timestamp_ms"))
                            for r in recs]
                return await p.append_many(recs)
            finally:
                await p.close()
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
    mark, trim on the bookies, drop the records). Returns the new earliest record offset."""
    from streams.tools import retention

    async def go():
        c = await aclient.connect(url)
        try:
            meta, _ = await c.cluster.ledgers.get_ledger(stream)
            frags = await c.cluster.ledgers.fragments(meta.ledger_id, meta.first_fragment_index,
                                                      meta.last_fragment_index)
            assert len(frags) > n and all(f.sealed for f in frags[:n]), [f.to_json() for f in frags]
            cons = await c.consumer(stream, start=EARLIEST)
            keep_from = await cons.first_offset_of(frags[n])
            report = await retention.apply(c, stream, keep_from=keep_from, floors=[])
            assert report.fragments == [f.index for f in frags[:n]], report
            cons = await c.consumer(stream, start=EARLIEST)
            return cons.position
        finally:
            await c.close()

    return asyncio.run(go())


def compact(url: str, stream: str) -> dict:
    """One forced compaction pass of ``stream`` (``streams.tools.compaction``); its report as a dict."""
    from streams.tools import compaction

    async def go():
        c = await aclient.connect(url)
        try:
            return (await compaction.compact_stream(c, stream, force=True)).to_dict()
        finally:
            await c.close()

    return asyncio.run(go())
