"""SIGKILL a real bookie at random moments while a client streams adds to it.

Each cycle: start ``scroll bookie`` on the same data dir; check that every acknowledged entry reads
back with its bytes and its term, that whatever is readable above the acknowledged prefix is
something that was really sent for that id (no torn or foreign bytes), that the bookie's LAC never
exceeds the acknowledged prefix and that fenced terms survived; then take the ledgers over with a
new term (fence + truncating no-op at the next id, as the protocol does), stream pipelined adds on
two ledgers, and SIGKILL the process after a random delay. ``SCROLL_KILL_SEED`` replays a run;
``SCROLL_KILLS`` sets the number of kills (20 in CI).
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from bookie.client import BookieClient
from bookie.errors import NoSuchEntryError
from terms.messages import AddRequest, FenceOk, InvalidTerm

from .helpers import run

pytestmark = pytest.mark.process

LEDGERS = (11, 12)
MAX_OUTSTANDING = 6  # groups in flight per ledger
OVERRIDES = {
    "journal_file_bytes": 1024 * 1024,
    "entry_log_bytes_max": 512 * 1024,
    "write_cache_bytes": 1024 * 1024,
    "flush_interval_s": 0.05,  # flushes and checkpoints happen during the run, so kills hit them too
}


class History:
    def __init__(self) -> None:
        self.acked: dict[int, list[tuple[int, bytes]]] = {lid: [] for lid in LEDGERS}  # index = entry id
        self.sent: dict[tuple[int, int], set[tuple[int, bytes]]] = {}
        self.term = 0

    def top(self, lid: int) -> int:
        return len(self.acked[lid]) - 1


async def verify(address: str, h: History) -> None:
    async with BookieClient(address) as c:
        for lid in LEDGERS:
            top = h.top(lid)
            if top < 0:
                continue  # nothing acknowledged yet (the ledger may not even exist)
            got: list = []
            while len(got) <= top:
                res = await c.read(lid, len(got), top)
                assert res.lac <= top, f"ledger {lid}: LAC {res.lac} above the acknowledged prefix {top}"
                got += [(e.entry_term, e.data) for e in res.entries]
            assert got[: top + 1] == h.acked[lid], f"ledger {lid}: an acknowledged entry changed or vanished"
            await check_above(c, lid, top, h)
            if h.term > 1:
                assert isinstance(await c.fence(lid, h.term - 1), InvalidTerm), "a fenced term was lost"


async def check_above(c: BookieClient, lid: int, top: int, h: History) -> None:
    try:
        res = await c.read(lid, top + 1, top + 100_000)
    except NoSuchEntryError:
        return
    for e in res.entries:
        assert (e.entry_term, e.data) in h.sent.get((lid, e.entry_id), ()), (
            f"ledger {lid} entry {e.entry_id}: readable bytes that were never sent")


async def write_until_killed(address: str, h: History, rng: random.Random, kill) -> None:
    h.term += 1
    term = h.term
    async with BookieClient(address, add_timeout_s=10) as c:
        for lid in LEDGERS:
            assert isinstance(await c.fence(lid, term), FenceOk)
        writers = [asyncio.ensure_future(ledger_writer(c, lid, term, h, rng)) for lid in LEDGERS]
        await asyncio.sleep(rng.uniform(0.02, 0.35))  # the random moment of the kill
        await asyncio.get_running_loop().run_in_executor(None, kill)
        await asyncio.gather(*writers)


async def ledger_writer(c: BookieClient, lid: int, term: int, h: History, rng: random.Random) -> None:
    next_id = h.top(lid) + 1
    reqs = [AddRequest(lid, next_id, term, h.top(lid), h.top(lid), b"noop-%d" % term, truncate=True)]
    outstanding: list[tuple[asyncio.Future, list[AddRequest]]] = []
    while True:
        for r in reqs:
            h.sent.setdefault((lid, r.entry_id), set()).add((term, r.data))
        outstanding.append((c.submit(reqs), reqs))
        next_id += len(reqs)
        if len(outstanding) >= MAX_OUTSTANDING or not reqs:
            fut, done = outstanding.pop(0)
            res = await fut
            if not res.all_ok:
                for other, _ in outstanding:
                    await other
                return  # the bookie died: everything not acknowledged is in `sent` only
            h.acked[lid] += [(r.term, r.data) for r in done]
        lac = h.top(lid)
        reqs = [AddRequest(lid, i, term, lac, lac, rng.randbytes(rng.randint(1, 300))) for i in range(next_id, next_id + rng.randint(1, 16))]


KILLS = int(os.environ.get("SCROLL_KILLS", "20"))


@pytest.mark.timeout(max(240, 12 * KILLS))  # a kill cycle takes a few seconds on a loaded machine
def test_acknowledged_adds_survive_sigkill(bookie_process) -> None:
    seed = int(os.environ.get("SCROLL_KILL_SEED", random.randrange(1 << 30)))
    kills = KILLS
    print(f"SCROLL_KILL_SEED={seed}")
    rng = random.Random(seed)
    h = History()
    bp = bookie_process(overrides=OVERRIDES)
    for _ in range(kills):
        bp.start()
        run(verify(bp.address, h))
        run(write_until_killed(bp.address, h, rng, bp.kill))
        assert not bp.alive()
    bp.start()
    run(verify(bp.address, h))
    assert all(h.top(lid) > kills for lid in LEDGERS), "too few adds were acknowledged to mean anything"
    assert bp.terminate() == 0
