"""The README's quick start, as a newcomer runs it: ``make run`` (``scroll standalone``) in the
foreground, wait for it to say it is ready, produce and consume with kcat and with the Python API
as its "try it" lines show, Ctrl-C it (SIGINT to the whole process group, as a terminal does),
start it again on the same data directory and find everything still there."""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.standalone_run import Run
from tests.standalone_run import ports as _ports

ROOT = Path(__file__).resolve().parents[1]
PY = str(Path(sys.executable))

pytestmark = pytest.mark.process


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _left_behind(data: Path, ports: dict[str, int]) -> list[str]:
    """Command lines of live processes that belong to this run (its data dir or its Kafka port)."""
    marks = (str(data), f"--port {ports['kafka']}")
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(m in cmd for m in marks) and "pytest" not in cmd:
            out.append(cmd)
    return out


def kcat(port: int, *args, input: str | None = None) -> str:
    return subprocess.run(["kcat", "-b", f"127.0.0.1:{port}", *args], input=input, capture_output=True, text=True,
                          timeout=60, check=True).stdout


def python(code: str) -> str:
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT).stdout


def test_quick_start_run_produce_consume_stop_restart_keeps_data(tmp_path):
    ports = _ports()
    data = tmp_path / "scroll-data"
    url = f"etcd://127.0.0.1:{ports['etcd']}"
    run = Run(data, ports)
    try:
        banner = run.wait_ready()
        assert f"kafka            127.0.0.1:{ports['kafka']}" in banner
        assert re.search(r"kcat -b 127\.0\.0\.1:\d+ -t greetings -P", banner)
        # the web console, its URL in the banner, shows the cluster (tests/console/ drives it in a browser)
        console = f"http://127.0.0.1:{ports['console']}/"
        assert f"console          {console}  (no login: loopback only)" in banner
        page = urllib.request.urlopen(console, timeout=30).read().decode()
        assert "bookie-0" in page and f"127.0.0.1:{ports['kafka']}" in page
        # the "try it" lines, then more of the same
        kcat(ports["kafka"], "-t", "greetings", "-P", input="hello\n")
        assert kcat(ports["kafka"], "-t", "greetings", "-C", "-e").splitlines() == ["hello"]
        kcat(ports["kafka"], "-t", "greetings", "-P", "-K:", input="k1:one\nk2:two\n")
        python(f"import streams.sync as s; c = s.connect({url!r}); c.create_stream('orders'); "
               "p = c.producer('orders'); [p.append(b'order-%d' % i, key=b'c%d' % (i % 2)) for i in range(100)]; "
               "p.close()")
        got = python(f"import streams.sync as s; c = s.connect({url!r}); "
                     "print([(r.offset, r.value) for r in c.consumer('greetings').read(10)])")
        assert got.strip() == "[(0, b'hello'), (1, b'one'), (2, b'two')]"
        # scheduled retention: a stream of 10-entry fragments (one record each: entry 0 is the
        # take-over's no-op, so fragment k starts at offset 10k - 1) that keeps offsets >= 30
        python(f"import streams.sync as s; c = s.connect({url!r}); c.create_stream('logs', fragment_entries_max=10); "
               "p = c.producer('logs'); [p.append(b'line-%d' % i) for i in range(50)]; p.close()")
        subprocess.run([str(ROOT / ".venv/bin/scroll"), "retention", "set", "logs", "--keep-from", "30",
                        "--metadata", url], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while True:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
            m = re.search(r"^scroll_retention_removed_fragments_total (\S+)$", metrics, re.M)
            if m and float(m.group(1)) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert 'scroll_process_up{process="kafka"} 1.0' in metrics
        assert m and float(m.group(1)) >= 2, metrics
        got = python(f"import streams.sync as s; c = s.connect({url!r}); print(c.consumer('logs').earliest())")
        assert int(got) == 29  # the first offset of the first fragment kept
        # scheduled compaction: a compacted stream of 10-entry fragments, 5 keys written over and over
        python(f"import streams.sync as s; c = s.connect({url!r}); "
               "c.create_stream('profiles', fragment_entries_max=10, retention={'cleanup_policy': 'compact'}); "
               "p = c.producer('profiles'); [p.append(b'v%d' % i, key=b'k%d' % (i % 5)) for i in range(50)]; p.close()")
        deadline = time.monotonic() + 60
        while True:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
            m = re.search(r"^scroll_compaction_reclaimed_bytes_total (\S+)$", metrics, re.M)
            if m and float(m.group(1)) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert m and float(m.group(1)) > 0, metrics
        assert re.search(r'^scroll_compaction_dirty_ratio\{stream="profiles"\} ', metrics, re.M), metrics
        got = python(f"import streams.sync as s; c = s.connect({url!r}); "
                     "print([(r.offset, r.value) for r in c.consumer('profiles').read(100)])")
        kept = ast.literal_eval(got.strip())
        assert len(kept) < 50 and kept[-5:] == [(o, b"v%d" % o) for o in range(45, 50)]
        # scheduled offload to the embedded object store: a stream with remote storage on and no
        # local retention; its sealed fragments end up in objects only, and kcat reads them back
        assert f"object store     http://127.0.0.1:{ports['objectstore']}" in banner
        python(f"import streams.sync as s; c = s.connect({url!r}); c.create_stream('archive', fragment_entries_max=10, "
               "retention={'remote_storage_enable': True, 'local_retention_ms': 0}); "
               "p = c.producer('archive'); [p.append(b'a-%d' % i) for i in range(50)]; p.close()")
        deadline = time.monotonic() + 90
        while True:
            status = subprocess.run([str(ROOT / ".venv/bin/scroll"), "tier", "status", "--stream", "archive", "--json",
                                     "--metadata", url], check=True, capture_output=True, text=True, timeout=60).stdout
            row = json.loads(status)[0]
            if row["remote_only"] >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert row["remote_only"] >= 4, row
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=10).read().decode()
        assert re.search(r"^scroll_tier_offloaded_fragments_total [1-9]", metrics, re.M), metrics
        archive = [f"a-{i}" for i in range(50)]
        assert kcat(ports["kafka"], "-t", "archive", "-C", "-e").splitlines() == archive
        assert "stopped; data kept in" in run.ctrl_c()
        for p in (ports["etcd"], ports["kafka"], ports["bookie"], ports["bookie"] + 2, ports["metrics"],
                  ports["objectstore"], ports["console"]):
            assert not _listening(p), f"something still listens on port {p} after Ctrl-C"
    finally:
        run.kill()

    run = Run(data, ports)  # again, on the same directory
    try:
        run.wait_ready()
        out = kcat(ports["kafka"], "-t", "greetings", "-C", "-e", "-f", "%k=%s@%o\n")
        assert out.splitlines() == ["=hello@0", "k1=one@1", "k2=two@2"]
        got = python(f"import streams.sync as s; c = s.connect({url!r}); "
                     "print(len([r for r in c.consumer('orders').read(1000)]))")
        assert got.strip() == "100"
        assert kcat(ports["kafka"], "-t", "archive", "-C", "-e").splitlines() == archive  # objects kept too
        kcat(ports["kafka"], "-t", "greetings", "-P", input="after restart\n")
        assert kcat(ports["kafka"], "-t", "greetings", "-C", "-e", "-o", "3").splitlines() == ["after restart"]
        # kill -9 of `make run` and scroll standalone (a closed terminal, an OOM kill): the children
        # it started notice that their parent is gone and stop; nothing keeps the ports
        run.kill()
        served = (ports["etcd"], ports["kafka"], ports["bookie"], ports["bookie"] + 2, ports["metrics"],
                  ports["objectstore"])

        def remains() -> list:
            # a process that is exiting has an empty /proc cmdline before its sockets close: wait
            # for both the processes and the ports to be gone
            return _left_behind(data, ports) + [p for p in served if _listening(p)]

        deadline = time.monotonic() + 45
        while remains() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _left_behind(data, ports), "still running after kill -9 of scroll standalone"
        for p in served:
            assert not _listening(p), f"something still listens on port {p}"
    finally:
        run.kill()
