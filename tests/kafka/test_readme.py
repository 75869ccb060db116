"""The README's tour works as written: the kcat lines and the Python API block, run against a real
cluster and Kafka listener (only the addresses are replaced by the test cluster's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _block(lang: str, must: str) -> str:
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", README, re.S | re.M):  # fences at line starts, in order
        if m.group(1) == lang and must in m.group(2):
            return m.group(2)
    raise AssertionError(f"no ```{lang} block with {must!r} in README.md")


def _run_kcat(line: str, bootstrap: str) -> str:
    line = line.split("  #")[0].replace("127.0.0.1:9092", bootstrap)
    out = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (line, out.stderr)
    return out.stdout


def _run_python(code: str, url: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code.replace("etcd://127.0.0.1:2379", url)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_readme_tour_one_log_read_by_every_client(kafka_cluster, shim):
    """Written in Python, read with kcat at the same offsets with key and headers; written with
    kcat, read in Python — as the README shows it."""
    write_py = _block("python", "client.create_stream(\"orders\"")
    assert _run_python(write_py, kafka_cluster.metadata_url) == ["0", "[1, 2]"]
    read_kcat = _block("", "-t orders -C")
    lines = [ln for ln in read_kcat.splitlines() if ln.startswith("kcat")]
    got = _run_kcat(lines[0], shim.bootstrap).splitlines()
    assert got[0].startswith('0 customer-1 {"sku": 7} ') and "source=web" in got[0]
    assert [g.split(" ")[0] for g in got] == ["0", "1", "2"]
    assert "orders" in _run_kcat(lines[1], shim.bootstrap)

    produce = _block("", "-t greetings -K: -P")
    _run_kcat(next(ln for ln in produce.splitlines() if ln.startswith("echo")), shim.bootstrap)
    read_py = _block("python", "client.consumer(\"greetings\"")
    connect = "import streams.sync as scroll\nclient = scroll.connect(\"etcd://127.0.0.1:2379\")\n"
    out = _run_python(connect + read_py, kafka_cluster.metadata_url)
    assert out[0].startswith("0 b'k1' b'hello' ")
