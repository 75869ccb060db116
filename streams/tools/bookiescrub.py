"""``scroll bookie scrub``: start scrub passes on bookies, wait for them, show what they found, and
optionally repair the bad copies from good replicas.

How this works. A bookie scrubs by itself (``bookie/scrub.py``: a throttled background pass, its
position and totals kept in its own index); this asks each chosen live bookie for a pass now (the
Scrub RPC), polls its Info until that pass has ended (``wait``), and with ``repair`` runs what
``scroll check --fix`` does on the streams whose entries a bookie found bad (the bookie removed
those copies, so they show as missing copies; the fix writes good ones back from another replica,
which the bookie then counts as repaired). The answer is one dict per bookie (or its ``error``: a
bookie that does not answer) plus the repairs, and ``ok``: every bookie answered and no bad copy
is still waiting for its repair.
"""

from __future__ import annotations

import asyncio
import time

from bookie.errors import BookieError
from fragments.ledgers import NoSuchLedger

from ..errors import ScrollError
from . import admin

POLL_S = 0.25  # how often --wait asks a bookie for its Info


class ScrubCommandError(ScrollError):
    pass


def _view(bookie_id: str, info, started: bool | None) -> dict:
    return {
        "bookie": bookie_id, "started": bool(started), "running": info.scrub_running,
        "passes": info.scrub_passes, "entries": info.scrub_entries, "corrupt": info.scrub_corrupt,
        "repaired": info.scrub_repaired, "awaiting_repair": info.scrub_awaiting_repair,
        "last_pass_start": info.scrub_last_pass_start, "last_pass_end": info.scrub_last_pass_end,
        "pass_started": info.scrub_pass_started, "pass_entries": info.scrub_pass_entries,
        "position": list(info.scrub_position) if info.scrub_position else None,
        "findings": [{"ledger": f[0], "entry": f[1], "reason": f[2], "found_by": f[3], "at": f[4], "removed": f[5]}
                     for f in info.scrub_findings],
    }


async def _one(cluster, bookie_id: str, start: bool, wait: bool, deadline: float) -> dict:
    try:
        return await _ask(cluster, bookie_id, start, wait, deadline)
    except BookieError as exc:  # one bookie that does not answer must not hide the others
        return {"bookie": bookie_id, "error": f"{type(exc).__name__}: {exc}"}


async def _ask(cluster, bookie_id: str, start: bool, wait: bool, deadline: float) -> dict:
    bc = cluster.client(bookie_id)
    if bc is None:
        raise ScrubCommandError(f"bookie {bookie_id} is not registered")
    before = await bc.info()
    started = await bc.scrub() if start else None
    info = before
    if wait:
        # the pass this call started (or the one already under way, which counts) ends when the
        # pass count moves and nothing runs
        while True:
            info = await bc.info()
            if info.scrub_passes > before.scrub_passes and not info.scrub_running:
                break
            if not start and not info.scrub_running:
                break
            if time.monotonic() > deadline:
                raise ScrubCommandError(f"bookie {bookie_id}: the scrub pass did not end in time "
                                        f"({info.scrub_pass_entries} entries checked so far)")
            await asyncio.sleep(POLL_S)  # polling the bookie's progress
    elif start:
        info = await bc.info()
    return _view(bookie_id, info, started)


async def scrub_bookies(client, bookie_ids: list[str] | None = None, *, start: bool = True, wait: bool = False,
                        repair: bool = False, timeout_s: float = 3600.0) -> dict:
    cluster = client.cluster
    live = sorted(r.bookie_id for r in await cluster.refresh_bookies())
    ids = bookie_ids or live
    unknown = [b for b in ids if b not in live]
    if unknown:
        raise ScrubCommandError(f"not registered: {', '.join(unknown)} (live bookies: {', '.join(live) or 'none'})")
    deadline = time.monotonic() + timeout_s
    views = list(await asyncio.gather(*(_one(cluster, b, start, wait, deadline) for b in ids)))
    repairs: list[dict] = []
    if repair and any(v.get("awaiting_repair") for v in views):
        ledgers = sorted({f["ledger"] for v in views for f in v.get("findings", ()) if f["removed"]})
        for lid in ledgers:
            try:
                meta, _ = await cluster.ledgers.get_ledger(lid)
            except NoSuchLedger:
                continue  # deleted since: nothing to repair
            for r in await admin.check(client, True, meta.name):
                repairs.append({"stream": r["stream"], "fragment": r["fragment"], "copied": r["copied"],
                                "action": r["action"], "error": r["error"]})
        views = [v if "error" in v else _view(v["bookie"], await cluster.client(v["bookie"]).info(), v["started"])
                 for v in views]
    return {"bookies": views, "repairs": repairs,
            "ok": not any(v.get("awaiting_repair") or "error" in v for v in views)}


__all__ = ["scrub_bookies", "ScrubCommandError"]
