"""Helpers for the bookie tests: small configs, running coroutines, real bookie processes.

Every process a test starts is stopped by a finalizer (SIGKILL if SIGTERM is not enough). Real
bookies bind 127.0.0.1 with ``--port 0`` and report the port they got in their readiness line, so
there is no race for a free port. Async tests run their coroutine with ``run`` (no plugin needed).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from bookie.config import BookieConfig

ROOT = Path(__file__).resolve().parents[2]
READY_RE = re.compile(r"bookie ready id=(\S+) address=(\S+).* data_port=(\d+)")
# the `scroll` entry point of this interpreter's environment (.venv/bin/scroll)
_SCRIPT = Path(sys.executable).with_name("scroll")


def _script_runs(script: Path) -> bool:
    """The entry point exists and its interpreter too (a venv shared by worktrees may hold a script
    written by another one's install)."""
    try:
        first = script.read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return False
    return not first.startswith("#!") or Path(first[2:].split()[0]).exists()


SCROLL = [str(_SCRIPT)] if _script_runs(_SCRIPT) else [sys.executable, "-c", "from streams.tools.cli import main; main()"]

# Small files and caches so that rotation, flush and GC paths run in tests.
SMALL = dict(
    max_entry_bytes=64 * 1024,
    max_batch_bytes=512 * 1024,
    max_batch_adds=2000,
    journal_file_bytes=1024 * 1024,
    journal_preallocate="fallocate",
    write_cache_bytes=2 * 1024 * 1024,
    entry_log_bytes_max=256 * 1024,
    read_cache_bytes=256 * 1024,
    min_free_bytes=0,
    flush_interval_s=0.2,
    gc_interval_s=3600.0,
    disk_check_interval_s=3600.0,
)


def small_config(data_dir: Path, **overrides) -> BookieConfig:
    return BookieConfig(data_dir=data_dir, **{**SMALL, **overrides})


def run(coro, timeout: float = 60.0):
    """Run a coroutine to completion in a fresh event loop (with an overall bound)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class BookieProcess:
    """A ``scroll bookie`` subprocess on 127.0.0.1 with a free port."""

    def __init__(self, data_dir: Path, overrides: dict[str, object] | None = None, extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.overrides = {**SMALL, **(overrides or {})}
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.bookie_id = ""
        self.port = 0
        self.data_port = 0
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []

    def start(self, port: int | None = None, timeout: float = 30.0) -> BookieProcess:
        args = [*SCROLL, "bookie", "--data-dir", str(self.data_dir),
                "--port", str(self.port if port is None else port), "--log-level", "WARNING", *self.extra]
        for key, value in self.overrides.items():
            args += ["--set", f"{key}={value}"]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._drain(self.proc.stderr, self.stderr_lines)
        ready = threading.Event()

        def watch_stdout(stream, proc=self.proc) -> None:
            for line in stream:
                self.stdout_lines.append(line.rstrip("\n"))
                m = READY_RE.search(line)
                if m:
                    self.bookie_id, self.address, self.data_port = m.group(1), m.group(2), int(m.group(3))
                    ready.set()
            ready.set()  # EOF: the process died

        threading.Thread(target=watch_stdout, args=(self.proc.stdout,), daemon=True).start()
        if not ready.wait(timeout) or not self.address:
            self.kill()
            raise RuntimeError(f"bookie did not become ready (exit {self.proc.poll()}): {self.stderr_lines[-20:]}")
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    @staticmethod
    def _drain(stream, sink: list[str]) -> None:
        def pump() -> None:
            for line in stream:
                sink.append(line.rstrip("\n"))

        threading.Thread(target=pump, daemon=True).start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total
