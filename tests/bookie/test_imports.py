"""The bookie depends only on terms (and libraries): never on the client side of Scroll."""

from __future__ import annotations

import ast
from pathlib import Path

import bookie

FORBIDDEN = ("streams", "compat_kafka", "spark_stream")


def test_bookie_never_imports_client_packages() -> None:
    root = Path(bookie.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
