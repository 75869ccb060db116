"""Fixtures for the bookie tests: engines on temporary directories and real bookie processes.

Every engine is closed and every process is killed by a finalizer, whatever the test did.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bookie.storage import Engine

from .helpers import BookieProcess, small_config


@pytest.fixture
def make_engine(tmp_path: Path) -> Callable[..., Engine]:
    """Open engines on tmp_path/data; every engine still open at the end is closed."""
    opened: list[Engine] = []

    def make(**overrides) -> Engine:
        engine = Engine(small_config(tmp_path / "data", **overrides))
        engine.open()
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        if engine._opened:
            engine.close()


@pytest.fixture
def bookie_process(tmp_path: Path) -> Callable[..., BookieProcess]:
    started: list[BookieProcess] = []

    def make(data_dir: Path | None = None, overrides: dict | None = None, extra: list[str] | None = None) -> BookieProcess:
        bp = BookieProcess(data_dir or tmp_path / "bookie", overrides, extra)
        started.append(bp)
        return bp

    yield make
    for bp in started:
        bp.kill()


