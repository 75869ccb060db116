"""Dependencies point one way: fragments <- terms <- {bookie, streams} <- {compat_kafka, spark_stream}.

The protocol core (terms/) and the pure parts of fragments/ import no IO libraries. streams may use
the bookie's wire schema and client stub (bookie.proto, bookie.client); a bookie never imports
client-side packages.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("fragments", "terms", "bookie", "streams", "compat_kafka", "spark_stream")
ALLOWED = {
    "fragments": set(),
    "terms": {"fragments"},
    "bookie": {"terms", "fragments"},
    "streams": {"terms", "fragments", "bookie"},
    "compat_kafka": {"streams", "terms", "fragments"},
    "spark_stream": {"streams", "terms", "fragments"},
}
IO_LIBS = {"asyncio", "grpc", "aetcd", "rocksdict", "pyspark", "socket", "threading", "selectors"}
PURE_FRAGMENTS = {"model.py", "placement.py", "rollover.py", "__init__.py"}


def imports_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_dependency_direction():
    bad = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for mod in imports_of(path) & set(PACKAGES):
                if mod != pkg and mod not in ALLOWED[pkg]:
                    bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_protocol_core_is_sans_io():
    bad = []
    paths = list((ROOT / "terms").rglob("*.py")) + [ROOT / "fragments" / n for n in PURE_FRAGMENTS]
    for path in paths:
        for mod in imports_of(path) & IO_LIBS:
            bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_the_checker_sees_a_violation(tmp_path):
    """The scan is not vacuous: a file importing against the direction is reported."""
    f = tmp_path / "x.py"
    f.write_text("import asyncio\nfrom streams.tools.cli import main\n")
    assert imports_of(f) == {"asyncio", "streams"}
