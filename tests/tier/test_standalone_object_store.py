"""``scroll standalone`` runs its object store (SeaweedFS) only once something offloads (issue 26:
an idle platform with no offloading topic pays nothing for it): its start leaves it off when no
stream turns remote storage on, and its offload job starts it the first time one does; the
fragments of that stream then reach the object store and read back from there. Real etcd, a real
bookie, real SeaweedFS; standalone's own loop, with a short offload interval. A killed bookie is
restarted and registers again at once (its stale registration deleted, not left to its lease); a
killed store is restarted like any child."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from fragments import tier as tp
from fragments.registry import live_bookies
from streams.client import connect
from streams.tools.standalone import Standalone, StandaloneConfig
from tests.ports import port_block

pytestmark = pytest.mark.process


def _weed_processes(directory) -> list[int]:
    """Pids of live SeaweedFS processes working in ``directory`` (from /proc: no psutil in tests)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and cmd and b"weed" in cmd[0] and any(str(directory).encode() in c for c in cmd):
            out.append(int(d.name))
    return out


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def test_the_object_store_starts_when_a_stream_turns_remote_storage_on(tmp_path):
    base = port_block(6)
    sa = Standalone(StandaloneConfig(data_dir=tmp_path / "sa", etcd_port=base, etcd_peer_port=base + 1,
                                     bookie_base_port=base + 2, metrics_port=base + 3, bookies=1,
                                     object_store_port=port_block(8), autorecovery=False, tier_interval_s=0.2,
                                     retention_interval_s=3600, compaction_interval_s=3600, console=False,
                                     registration_ttl_s=300))
    cluster = sa.cluster  # standalone's own etcd and bookie (no Kafka listener, no console)

    async def registered_since(t: float) -> bool:
        regs = await live_bookies(client.cluster.store)
        return any(r.bookie_id == "bookie-0" and r.started_at > t for r in regs)

    async def main():
        nonlocal client
        client = await connect(cluster.metadata_url)
        stop = asyncio.Event()
        loop = None
        try:
            await client.create_stream("plain", ensemble=1, write_quorum=1, ack_quorum=1)
            await asyncio.to_thread(sa.prepare_object_store, 60.0)
            assert sa.seaweed.proc is None and not _weed_processes(sa.seaweed.dir)  # nothing offloads: off
            assert "starts on demand" in "\n".join(sa._tier_lines())
            loop = asyncio.create_task(sa.run_forever(stop))
            # a bookie killed is restarted and registers again at once: standalone deletes its stale
            # registration (the lease would keep it for its 300 s TTL)
            killed_at = time.time()
            cluster.bookies[0].kill()
            await _until(lambda: registered_since(killed_at), "the restarted bookie to register again")
            assert sa.restarts.get("bookie-0") == 1
            await client.create_stream("archive", ensemble=1, write_quorum=1, ack_quorum=1, fragment_entries_max=5,
                                       retention={"remote_storage_enable": True, "local_retention_ms": 0})
            p = await client.producer("archive")
            values = [b"a-%d" % i for i in range(12)]
            for v in values:
                await p.append(v)
            await p.close()

            async def remote_only() -> list:
                meta, _ = await client.cluster.ledgers.get_ledger("archive")
                frags = await client.cluster.ledgers.fragments(meta.ledger_id)
                return [f for f in frags if tp.remote_only(f)]

            await _until(remote_only, "a sealed fragment of 'archive' to be offloaded and released")
            assert sa.seaweed.alive and _weed_processes(sa.seaweed.dir)
            c = await client.consumer("archive")
            got: list[bytes] = []
            while len(got) < len(values):
                batch = await c.read(100, timeout_s=10.0)
                assert batch, f"nothing more to read after {got}"
                got += [r.value for r in batch]
            await c.close()
            assert got == values  # the released fragments read back from the object store
            # a store started on demand is supervised like the other children: killed, it is
            # restarted (standalone learns of the exit from its pidfd)
            os.kill(sa.seaweed.pid, signal.SIGKILL)

            async def restarted() -> bool:
                return sa.restarts.get("seaweedfs") == 1 and sa.seaweed.alive

            await _until(restarted, "standalone to restart the killed SeaweedFS")
        finally:
            stop.set()
            if loop is not None:
                with contextlib.suppress(Exception):
                    await loop
            await client.close()

    client = None
    try:
        cluster.start(60, before_bookies=sa.forget_bookies)
        asyncio.run(main())
    finally:
        sa.stop()
    assert not _weed_processes(sa.seaweed.dir)
