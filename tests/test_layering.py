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


def kafka_imports(path: pathlib.Path) -> set[str]:
    """The compat_kafka modules ``path`` imports, as dotted names, counting imports inside functions
    (a lazy import hides a cycle from Python, not from a reader)."""
    pkg = ".".join(path.relative_to(ROOT).parent.parts)  # what a relative import starts from
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                up = parts[: len(parts) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m.split(".")[0] == "compat_kafka"}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def kafka_graph(root: pathlib.Path) -> dict[str, set[str]]:
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (root / "compat_kafka").rglob("*.py")}
    # a package's __init__ imports nothing here: an edge to a package stands for nothing, only modules count
    return {m: {n for n in kafka_imports(p) if n in paths and n != m and not paths[n].name == "__init__.py"}
            for m, p in paths.items()}


def test_compat_kafka_has_no_import_cycle():
    """No compat_kafka module imports itself back through others, lazily or not: the sub-packages
    (wire, security, cluster, partitions, transactions, groups, cli) layer, broker.py composes them."""
    assert import_cycle(kafka_graph(ROOT)) is None, import_cycle(kafka_graph(ROOT))


def test_the_cycle_check_sees_a_cycle():
    """The check is not vacuous: it finds the edges of relative and lazy imports, and a cycle."""
    graph = kafka_graph(ROOT)
    assert "compat_kafka.groups.records" in graph["compat_kafka.groups.consumer_group_apis"]
    assert "compat_kafka.groups.consumer_group_apis" in graph["compat_kafka.groups.coordinator"]  # lazy
    assert "compat_kafka.wire.codec" in graph["compat_kafka.broker"]  # `from .wire import codec`
    graph["compat_kafka.wire.codec"] = graph["compat_kafka.wire.codec"] | {"compat_kafka.broker"}
    assert import_cycle(graph) is not None
