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
    for m in re.finditer(rf"```{lang}\n(.*?)```", README, re.S):
        if must in m.group(1):
            return m.group(1)
    raise AssertionError(f"no ```{lang} block with {must!r} in README.md")


def test_readme_tour_kcat_and_python_api(kafka_cluster, shim):
    kcat_lines = [ln for ln in _block("", "kcat -b").splitlines() if ln.startswith(("echo", "kcat")) and "-G" not in ln]
    for line in kcat_lines:
        line = line.split("#")[0].replace("127.0.0.1:9092", shim.bootstrap)
        out = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (line, out.stderr)
    assert subprocess.run(kcat_lines[-1].split("#")[0].replace("127.0.0.1:9092", shim.bootstrap), shell=True,
                          capture_output=True, text=True, timeout=60).stdout.splitlines() == ["hello"]
    code = _block("python", "streams.sync").replace("etcd://127.0.0.1:2379", kafka_cluster.metadata_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "1 b'customer-1' b'{\"sku\": 7}'"
    assert lines[-1] == "[b'hello']"
