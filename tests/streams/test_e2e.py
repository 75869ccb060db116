"""End to end over real processes: etcd, 4 bookie processes, producers in this and other processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from streams.driver import ProducerOptions
from streams.errors import (
    InvalidArgument,
    NoSuchStream,
    PayloadTooLarge,
    StaleTermError,
    StreamExists,
    WriterWithdrawn,
)
from streams.sync import connect
from terms import entry as entry_codec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def read_all(client, name):
    c = client.consumer(name, start="earliest")
    out = []
    while True:
        batch = c.read(1000)
        if not batch:
            return out
        out.extend(batch)


def replicas_agree(client, cluster, name):
    """Every replica of every entry up to the LAC holds the same bytes (no-ops included)."""
    import asyncio

    from bookie.client import BookieClient
    from terms.quorum import write_set

    info = client.describe_stream(name)
    end = client.consumer(name, start="latest")._c.lac + 1  # entry ids: a protocol-level check

    async def go():
        ports = {f"bookie-{i}": p for i, p in enumerate(cluster.bookie_ports)}
        out = {}
        for f in info.fragments:
            last = min(f.last_entry_id if f.sealed else end - 1, end - 1)
            for b in set(f.ensemble):
                async with BookieClient(f"127.0.0.1:{ports[b]}", bookie=b) as bc:
                    eid = f.first_entry_id
                    while eid <= last:
                        r = await bc.read(info.meta.ledger_id, eid, last, max_entries=1000)
                        for e in r.entries:
                            if b in write_set(e.entry_id, f.ensemble, info.meta.config.write_quorum) and e.entry_term >= f.created_term:
                                out.setdefault(e.entry_id, set()).add(e.data)
                        eid = r.entries[-1].entry_id + 1
        return out

    copies = asyncio.run(go())
    assert all(len(v) == 1 for v in copies.values()), {k: v for k, v in copies.items() if len(v) > 1}
    return copies


def test_create_describe_list_delete_and_bad_arguments(client, stream_name):
    info = client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
    assert info.meta.name == stream_name and len(info.fragments[0].ensemble) == 3
    assert stream_name in [m.name for m in client.list_streams()]
    with pytest.raises(StreamExists):
        client.create_stream(stream_name)
    with pytest.raises(InvalidArgument, match="write_quorum"):
        client.create_stream(stream_name + "-bad", ensemble=2, write_quorum=3, ack_quorum=2)
    with pytest.raises(NoSuchStream):
        client.producer("no-such-stream")
    with pytest.raises(NoSuchStream):
        client.consumer("no-such-stream")
    with client.producer(stream_name) as p:
        with pytest.raises(PayloadTooLarge):
            p.append(b"x" * (2 << 20))
        assert p.append(b"still fine") == 0  # the oversized append lost nothing and broke nothing
    assert [r.value for r in read_all(client, stream_name)] == [b"still fine"]
    client.delete_stream(stream_name)
    with pytest.raises(NoSuchStream):
        client.describe_stream(stream_name)


def test_produce_consume_keys_headers_and_offsets(client, cluster, stream_name):
    client.create_stream(stream_name)
    with client.producer(stream_name) as p:
        offsets = p.append_many([b"v%d" % i for i in range(500)])
        keyed = p.append(b"with-key", key=b"k", headers={"h": b"1", "none": None})
    assert offsets == list(range(500)) and keyed == 500
    got = read_all(client, stream_name)
    assert [r.value for r in got] == [b"v%d" % i for i in range(500)] + [b"with-key"]
    assert [r.offset for r in got] == list(range(501))
    assert got[-1].key == b"k" and dict(got[-1].headers) == {"h": b"1", "none": None}
    c = client.consumer(stream_name, start=250)
    assert c.read(1)[0].offset == 250
    copies = replicas_agree(client, cluster, stream_name)
    assert entry_codec.is_noop(next(iter(copies[0])))  # the first take-over's truncate point


def test_two_producers_fight_every_append_acked_once_or_failed(client, cluster, stream_name):
    client.create_stream(stream_name)
    acked: list[bytes] = []
    failed: list[bytes] = []
    lock = threading.Lock()

    def run(tag: str, rounds: int):
        with connect(cluster.metadata_url, add_timeout_s=5.0) as c:
            for r in range(rounds):
                p = c.producer(stream_name)  # a take-over each round
                for i in range(40):
                    v = f"{tag}-{r}-{i}".encode()
                    try:
                        p.append(v)
                        with lock:
                            acked.append(v)
                    except (StaleTermError, WriterWithdrawn):
                        with lock:
                            failed.append(v)
                        break
                try:
                    p.close()
                except Exception:
                    pass

    threads = [threading.Thread(target=run, args=(t, 6)) for t in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    values = [r.value for r in read_all(client, stream_name)]
    counts = Counter(values)
    assert all(counts[v] == 1 for v in acked), "an acknowledged append is missing or duplicated"
    assert len(values) == len(set(values))  # nothing twice; a failed append may or may not be present
    # the take-overs happened and every replica agrees on every entry
    info = client.describe_stream(stream_name)
    assert info.meta.term >= 12
    replicas_agree(client, cluster, stream_name)
    print(f"\n{len(acked)} acknowledged, {len(failed)} failed by take-over, term {info.meta.term}")


def test_sigkill_a_bookie_the_writer_changes_ensemble_and_loses_nothing(client, cluster, stream_name):
    client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
    victim_name = client.describe_stream(stream_name).fragments[0].ensemble[1]
    victim = int(victim_name.split("-")[1])
    n = 200_000  # ~100 MB: batched appends run for seconds, so the kill lands mid-run

    def value(i):
        return b"v-%d-" % i + b"x" * 512

    result = {}
    with connect(cluster.metadata_url, add_timeout_s=5.0) as writer_client, writer_client.producer(stream_name) as p:
        def run():
            try:
                result["offsets"] = p.append_many(value(i) for i in range(n))
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                result["error"] = exc

        runner = threading.Thread(target=run)
        runner.start()
        cons = client.consumer(stream_name, start="earliest")  # an observer with its own connection
        while cons.end_position() < 1000:  # the run is under way
            time.sleep(0.005)
        cluster.kill_bookie(victim)  # SIGKILL with appends in flight
        killed_at = cons.end_position()
        runner.join(180)
        assert not runner.is_alive(), "the append run did not finish"
    cluster.start_bookie(victim)
    assert killed_at < n, "the kill must land while appends are in flight"
    assert "error" not in result, result.get("error")
    assert result["offsets"] == list(range(n))  # every append acknowledged, in order
    info = client.describe_stream(stream_name)
    # the writer changed the ensemble away from the victim; a later change may bring it back in
    # (with 4 bookies, when a second member times out on a loaded machine, a bookie that failed
    # before is the only candidate left), so look at every fragment after the first
    assert len(info.fragments) >= 2 and any(victim_name not in f.ensemble for f in info.fragments[1:])
    got = read_all(client, stream_name)
    assert [r.offset for r in got] == list(range(n)) and all(r.value == value(r.offset) for r in got)
    print(f"\nkilled {victim_name} at LAC {killed_at}; ensemble change at entry {info.fragments[-1].first_entry_id}: "
          f"{info.fragments[-2].ensemble} -> {info.fragments[-1].ensemble}")


def test_a_bookie_that_joins_after_the_take_over_replaces_a_failed_member(client, cluster, stream_name):
    """An open writer's view of the live bookies is not frozen at its take-over: a bookie that
    registers later (here: the only spare, restarted) is chosen when a member dies."""
    client.create_stream(stream_name, ensemble=3, write_quorum=3, ack_quorum=2)
    ensemble = client.describe_stream(stream_name).fragments[0].ensemble
    spare = next(i for i in range(len(cluster.bookies)) if f"bookie-{i}" not in ensemble)
    victim = int(ensemble[1].split("-")[1])
    cluster.bookies[spare].stop()  # a clean stop deregisters it
    try:
        with connect(cluster.metadata_url, add_timeout_s=5.0) as wc, wc.producer(stream_name) as p:
            p.append_many([b"before-%d" % i for i in range(20)])  # open: the spare is not live now
            cluster.start_bookie(spare)
            cluster.kill_bookie(victim)
            deadline = time.monotonic() + 60
            i = 0
            while time.monotonic() < deadline:
                p.append(b"after-%d" % i)
                i += 1
                last = client.describe_stream(stream_name).fragments[-1]
                if f"bookie-{spare}" in last.ensemble:
                    break
                time.sleep(0.05)
            assert f"bookie-{spare}" in last.ensemble and f"bookie-{victim}" not in last.ensemble, last
            p.append_many([b"more-%d" % j for j in range(20)])
        values = [r.value for r in read_all(client, stream_name)]
        assert values == [b"before-%d" % j for j in range(20)] + [b"after-%d" % j for j in range(i)] + \
            [b"more-%d" % j for j in range(20)]
    finally:
        for b in (spare, victim):
            if not cluster.bookies[b].alive:
                cluster.start_bookie(b)


def test_stopped_producer_is_fenced_by_a_take_over_from_another_process(client, cluster, stream_name, tmp_path):
    client.create_stream(stream_name)
    script = tmp_path / "zombie.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from streams.sync import connect
        from streams.errors import StaleTermError
        with connect({cluster.metadata_url!r}, add_timeout_s=5.0) as c:
            p = c.producer({stream_name!r})
            for i in range(10):
                p.append(b"zombie-before-%d" % i)
            print("ready", flush=True)
            sys.stdin.readline()
            try:
                p.append(b"zombie-after")
                print("appended", flush=True)
            except StaleTermError as exc:
                print("stale:", exc, flush=True)
    """))
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        with client.producer(stream_name) as p:
            p.append(b"new-owner")
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line.startswith("stale:"), line
        child.wait(30)
    finally:
        child.kill()
    values = [r.value for r in read_all(client, stream_name)]
    assert values == [b"zombie-before-%d" % i for i in range(10)] + [b"new-owner"]
    assert b"zombie-after" not in values


def test_a_large_stream_spreads_over_all_bookies(client, cluster, stream_name):
    client.create_stream(stream_name, fragment_bytes_max=1 << 20)
    # every bookie registered when the producer takes over (on a loaded machine a bookie restarted by
    # an earlier test, or one whose lease lapsed and came back, may be missing for a moment)
    deadline = time.monotonic() + 60
    while len(client.live_bookies()) < len(cluster.bookies):
        assert time.monotonic() < deadline, client.live_bookies()
        time.sleep(0.05)
    value = os.urandom(60 * 1024)
    with client.producer(stream_name, ProducerOptions(batch_bytes=64 << 10)) as p:  # a record per entry
        p.append_many([value] * 850)  # ~50 MB
    info = client.describe_stream(stream_name)
    placement = Counter(b for f in info.fragments for b in f.ensemble)
    print(f"\n{len(info.fragments)} fragments; placement {dict(placement)}")
    assert len(info.fragments) >= 40
    assert set(placement) == {f"bookie-{i}" for i in range(4)}
    assert max(placement.values()) - min(placement.values()) <= len(info.fragments) // 2
    assert all(f.size_bytes is None or f.size_bytes <= (1 << 20) + len(value) + 64 for f in info.fragments)


def test_tailing_consumer_is_woken_by_the_long_poll(cluster, stream_name):
    with connect(cluster.metadata_url) as c:
        c.create_stream(stream_name)
        with c.producer(stream_name) as p:
            p.append(b"first")
            cons = c.consumer(stream_name, start="earliest", long_poll_s=60.0)
            assert [r.value for r in cons.read(10, timeout_s=10.0)] == [b"first"]  # caught up
            got = {}

            def wait():
                t0 = time.monotonic()
                got["records"] = cons.read(10, timeout_s=60.0)
                got["elapsed"] = time.monotonic() - t0

            t = threading.Thread(target=wait)
            t.start()
            time.sleep(0.3)  # let the consumer park in its long poll
            p.append(b"second")
            t.join(60)
    assert [r.value for r in got["records"]] == [b"second"]
    # woken by the write, far inside the 60 s long-poll timeout
    assert got["elapsed"] < 30, got["elapsed"]
    print(f"\nlong-poll delivery after {got['elapsed'] * 1000:.0f} ms (timeout 60 s)")


def test_the_last_entry_becomes_visible_without_another_append(client, stream_name):
    client.create_stream(stream_name)
    with client.producer(stream_name) as p:
        p.append(b"only")
        cons = client.consumer(stream_name, start="earliest")
        assert [r.value for r in cons.read(10, timeout_s=10.0)] == [b"only"]


def test_metadata_store_down_is_a_clear_error():
    from fragments.store import MetadataUnavailable
    from streams.tools.localcluster import free_port

    with pytest.raises(MetadataUnavailable, match="127.0.0.1"):
        with connect(f"etcd://127.0.0.1:{free_port()}") as c:
            c.list_streams()


def test_noop_entries_never_reach_consumers(client, stream_name):
    client.create_stream(stream_name)
    for _ in range(3):  # three take-overs: three truncate no-ops
        with client.producer(stream_name) as p:
            p.append(b"x")
    records = read_all(client, stream_name)
    assert [r.value for r in records] == [b"x", b"x", b"x"]
    # each take-over's no-op keeps its entry id (0, 2, 4) but takes no record offset
    assert [r.offset for r in records] == [0, 1, 2]


def test_after_close_every_member_of_the_last_fragment_shows_the_final_lac(client, cluster, stream_name):
    """A reader asks any one member of the last fragment for the LAC, so a closing producer must
    leave it visible through all of them — also when the close races a rollover (a pending
    metadata change holds LAC pushes back) and a member is briefly unreachable (retried)."""

    client.create_stream(stream_name, fragment_entries_max=20)
    p = client.producer(stream_name)
    for i in range(59):  # one record per entry (each waits for the last): entries 1..59
        p.append(b"r%d" % i)  # the close lands right at a rollover (entry 60)
    info = client.describe_stream(stream_name)
    victim = cluster.bookie_ports.index(cluster.bookie_ports[int(info.fragments[-1].ensemble[0].split("-")[1])])
    cluster.bookies[victim].signal(signal.SIGSTOP)
    resume = threading.Timer(1.5, lambda: cluster.bookies[victim].signal(signal.SIGCONT))
    resume.start()
    try:
        p.close()
    finally:
        resume.join()
        cluster.bookies[victim].signal(signal.SIGCONT)
    # whichever member of the last fragment a reader asks for the LAC, it sees every record at once
    # (the close raced the rollover at 60: the last fragment's members new to it hold an older LAC,
    # which the reader lifts to the fragment's first entry - 1)
    c = client.consumer(stream_name, start="earliest")
    for k in range(3):
        c._c.lac, c._c._rotate = -1, k  # start over, asking the next member
        assert c.end_position() == 59  # offsets 0..58
    assert len(c.read(100)) == 59
    assert len(read_all(client, stream_name)) == 59


def test_closing_a_client_leaves_no_call_or_task_running(cluster, stream_name):
    """`scroll produce` printed "Task was destroyed but it is pending" (a gRPC call's status task)
    at exit: a closed client must have finished every call it opened, so that its owner can stop
    the event loop at once."""
    import asyncio

    c = connect(cluster.metadata_url, add_timeout_s=5.0, call_timeout_s=5.0)
    try:
        c.create_stream(stream_name)
        with c.producer(stream_name) as p:
            p.append_many([b"a", b"b", b"c"])
        assert [r.value for r in c.consumer(stream_name).read(10)] == [b"a", b"b", b"c"]
        c._loop.run(c._c.close(), timeout=10)

        async def still_running():
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

        left = c._loop.run(still_running(), timeout=10)
        assert left == [], [(t, t.get_stack()) for t in left]
    finally:
        c._loop.stop()
