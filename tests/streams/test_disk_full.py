"""Full disks, for real: three bookie processes whose data and journal live on small tmpfs mounts
fill up under a producer. Every bookie turns read-only; the producer's appends wait (the writer
says why, once, and re-places the refusing bookies with a back-off instead of re-writing the
ledger's metadata in a loop); once space is freed they go on by themselves, and every acknowledged
record is read back once, in order. Needs root (mount)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")

MiB = 1 << 20
SIZE = 64 * MiB
BALLAST = 16 * MiB
RECORD = 4096


def _mount(path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def full_disk_cluster(tmp_path):
    from streams.tools.localcluster import LocalCluster

    dirs = [tmp_path / f"bookie-{i}" for i in range(3)]
    mounted = []
    cluster = None
    try:
        for d in dirs:
            _mount(d)
            mounted.append(d)
            (d / "ballast").write_bytes(b"\0" * BALLAST)  # freed later: the space an operator adds
        cluster = LocalCluster(tmp_path, bookies=3, bookie_args=[
            # small files and caches for a small disk; batch limits at the client's (4 MiB, 2,000 adds)
            "--set", f"min_free_bytes={8 * MiB}", "--set", "disk_check_interval_s=0.1",
            "--set", f"journal_file_bytes={6 * MiB}", "--set", f"write_cache_bytes={4 * MiB}",
            "--set", f"entry_log_bytes_max={4 * MiB}", "--set", f"read_cache_bytes={4 * MiB}",
            "--set", f"max_batch_bytes={4 * MiB}", "--set", "max_batch_adds=2000",
        ])
        cluster.start()
        yield cluster, dirs
    finally:
        if cluster is not None:
            cluster.stop()
        for d in mounted:
            _umount(d)


async def _wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (await r if asyncio.iscoroutine(r := cond()) else r):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_a_producer_waits_on_full_disks_and_goes_on_once_space_is_freed(full_disk_cluster, caplog):
    cluster, dirs = full_disk_cluster
    caplog.set_level(logging.INFO, logger="terms.writer")

    async def body():
        from streams.client import connect
        from streams.driver import ProducerOptions

        client = await connect(cluster.metadata_url, add_timeout_s=10, call_timeout_s=10)
        try:
            await client.create_stream("full", ensemble=3, write_quorum=3, ack_quorum=2)
            p = await client.producer("full", ProducerOptions(batch_bytes=64 * 1024, buffer_bytes=1 * MiB))
            acked: list[int] = []
            sent = 0
            more_after_space = asyncio.Event()
            space_freed = False

            async def produce() -> None:
                nonlocal sent
                pending = []
                while True:
                    value = b"%08d" % sent + b"." * (RECORD - 8)
                    pending.append((sent, await p.append_future(value)))
                    sent += 1
                    done = [(i, f) for i, f in pending if f.done()]
                    for i, f in done:
                        f.result()
                        acked.append(i)
                    pending = [(i, f) for i, f in pending if not f.done()]
                    if space_freed and len(acked) > acked_at_free + 200:
                        more_after_space.set()
                        for i, f in pending:
                            await f
                            acked.append(i)
                        return

            acked_at_free = 0
            task = asyncio.create_task(produce())

            async def all_read_only() -> bool:
                infos = [await client.cluster.client(f"bookie-{i}").info() for i in range(3)]
                return all(x.read_only for x in infos)

            await _wait_for(all_read_only, "every bookie to turn read-only")
            await _wait_for(lambda: _said(caplog, "appends wait"), "the writer to say why appends wait")
            assert not task.done()
            reason = next(r.getMessage() for r in caplog.records if "appends wait" in r.getMessage())
            assert "READ_ONLY" in reason, reason

            acked_at_free = len(acked)
            for d in dirs:
                (d / "ballast").unlink()
            space_freed = True
            await asyncio.wait([task, asyncio.ensure_future(more_after_space.wait())], timeout=120,
                               return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # the producer failed: say how
            assert more_after_space.is_set(), (len(acked), sent, [await client.cluster.client(f"bookie-{i}").info()
                                                                   for i in range(3)])
            await asyncio.wait_for(task, 60)
            assert _said(caplog, "appends go on")
            await p.close()

            c = await client.consumer("full", start="earliest")
            got = []
            while batch := await c.read(1000):
                got.extend(int(r.value[:8]) for r in batch)
            assert got == list(range(len(got))) and set(acked) <= set(got), (len(got), len(acked))
            return len(acked)
        finally:
            await client.close()

    assert asyncio.run(body()) > 200


def _said(caplog, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)
