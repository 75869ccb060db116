"""The writer driver over real processes (etcd + bookie processes): an idle open producer keeps no
timer (no periodic tick), and the idle LAC push still makes its last entry visible to readers."""

from __future__ import annotations

import asyncio

import pytest

from terms.writer import Phase

pytestmark = pytest.mark.process


async def _wait_idle(driver, timeout_s: float = 10.0) -> bool:
    """Wait until the driver's writer has nothing time-driven left and no timer armed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    w = driver.writer
    while loop.time() < deadline:
        if not driver.timer_armed and not w.pending and w.lac_pushed == w.lac and w.next_deadline() is None:
            return True
        await asyncio.sleep(0.005)
    return False


def _read(client, name: str, want: int) -> list:
    c = client.consumer(name, start="earliest")
    out: list = []
    while len(out) < want:
        batch = c.read(want - len(out), timeout_s=10.0)
        if not batch:
            break
        out.extend(batch)
    return out


def test_an_idle_producer_arms_no_timer_and_readers_still_see_its_last_entry(client, stream_name):
    client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
    p = client.producer(stream_name)
    try:
        driver = p._p._driver
        for round_ in range(2):  # twice: the timer is armed again by new appends, then dropped again
            for i in range(5):
                p.append(b"r%d-%d" % (round_, i))  # one entry each: waits for its acknowledgement
            assert client.run(_wait_idle(driver)), "the driver kept a timer armed for an idle writer"
            assert driver.writer.phase is Phase.OPEN  # still open: no close published the LAC
            got = _read(client, stream_name, 5 * (round_ + 1))
            assert [r.value for r in got][-1] == b"r%d-4" % round_  # the last entry is visible (idle LAC push)
            assert len(got) == 5 * (round_ + 1)
            assert not driver.timer_armed
    finally:
        p.close()
