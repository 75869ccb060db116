"""The offsets mapping: dense Kafka offsets across take-overs, recovery of next_offset from the log,
the entry index and its binary search."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from compat_kafka.broker import Broker, BrokerConfig
from compat_kafka.errors import OffsetOutOfRange
from compat_kafka.partition import OffsetIndex
from streams.client import connect


def test_offset_index_bracket_and_thinning():
    ix = OffsetIndex(max_points=16)
    for eid in range(1, 41):  # entry e holds offsets 10(e-1) .. 10e-1
        ix.add((eid, 10 * (eid - 1), 10 * eid))
    assert len(ix.eids) <= 17 and ix.eids[-1] == 40
    lo, hi, holds = ix.bracket(395)
    assert (lo, holds) == (40, True)
    lo, hi, holds = ix.bracket(5)
    assert lo == 1 and holds
    lo, hi, holds = ix.bracket(25)  # a thinned-out point: bracketed, not held
    assert lo is not None and hi is not None and lo < 3 < hi + 1
    assert ix.bracket(-1) == (None, 1, False)


@pytest.mark.process
def test_take_over_recovers_dense_offsets(shim, kafka_cluster, topic):
    def kcat(*args, input=None):
        return subprocess.run(["kcat", "-b", shim.bootstrap, *args], input=input, capture_output=True, text=True,
                              timeout=30, check=True).stdout

    kcat("-P", "-t", topic, input="a\nb\nc\n")
    kcat("-P", "-t", topic, input="d\n")

    async def second_broker():
        # Another broker (a restarted shim) takes the partition over: it must recover next_offset from
        # the log, find every offset through the index-less binary search, and add no holes.
        client = await connect(kafka_cluster.metadata_url, add_timeout_s=5, call_timeout_s=5)
        broker = Broker(client, BrokerConfig())
        try:
            plog = await broker.partition(topic, 0)
            assert (plog.log_start, plog.next_offset, plog.high_watermark) == (0, 4, 4)
            plog.index = OffsetIndex(16)  # forget the recovered point: force the search
            for off in range(4):
                eid = await plog.locate(off)
                assert eid >= 1
            data = await plog.read(3, 1 << 20)
            assert int.from_bytes(data[:8], "big") == 3  # base offset patched in
            assert await plog.read(4, 1 << 20) == b""
            with pytest.raises(OffsetOutOfRange):
                await plog.read(5, 1 << 20)
        finally:
            await broker.close()
            await client.close()

    asyncio.run(second_broker())
    # The shim's writer was fenced by that take-over: its next produce fails, the client retries,
    # the shim takes the stream over again and carries on at offset 4.
    kcat("-P", "-t", topic, input="e\n")
    out = kcat("-C", "-t", topic, "-e", "-f", "%s@%o\n")
    assert out.splitlines() == ["a@0", "b@1", "c@2", "d@3", "e@4"]
