"""The metrics endpoint every process serves (``fragments.metrics_http``): it answers scrapes like
prometheus_client's own server, its thread waits for a connection with no timeout (prometheus'
polls every 0.5 s: two wake-ups a second in every idle process, issue 26), and ``shutdown`` /
``server_close`` stop it at once and free the port."""

from __future__ import annotations

import platform
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from fragments.metrics_http import serve_metrics

# x86_64 syscall numbers of the waits a selector thread blocks in, and the index of their timeout
_WAITS = {7: 2, 232: 3, 281: 3}  # poll(fds, n, timeout_ms), epoll_wait / epoll_pwait(fd, evs, n, timeout_ms)


def _blocked_wait(tid: int) -> tuple[int, int] | None:
    """(syscall number, timeout in ms) of the wait thread ``tid`` is blocked in, else None."""
    fields = open(f"/proc/self/task/{tid}/syscall").read().split()
    if not fields or not fields[0].isdigit() or int(fields[0]) not in _WAITS:
        return None
    nr = int(fields[0])
    timeout = int(fields[1 + _WAITS[nr]], 16) & 0xFFFFFFFF
    return nr, timeout - (1 << 32) if timeout >= 1 << 31 else timeout


def test_serves_scrapes_waits_without_a_timeout_and_shuts_down():
    registry = CollectorRegistry()
    Counter("scroll_test_things", "things", registry=registry).inc(2)
    server = serve_metrics(0, "127.0.0.1", registry)
    port = server.server_port
    try:
        base = f"http://127.0.0.1:{port}/metrics"
        assert "scroll_test_things_total 2.0" in urllib.request.urlopen(base, timeout=10).read().decode()
        only = urllib.request.urlopen(base + "?name[]=scroll_test_things_total", timeout=10).read().decode()
        assert "scroll_test_things_total 2.0" in only and "scroll_test_things_created" not in only
        if platform.machine() == "x86_64":
            thread = next(t for t in threading.enumerate() if t.name == f"metrics-http-{port}")
            deadline = time.monotonic() + 10
            while (wait := _blocked_wait(thread.native_id)) is None:  # back in its wait after the scrapes
                assert time.monotonic() < deadline, "the metrics thread never blocked in a wait"
                time.sleep(0.01)
            assert wait[1] == -1, f"the metrics thread wakes every {wait[1]} ms (syscall {wait[0]})"
    finally:
        server.shutdown()
        server.server_close()
    assert not [t for t in threading.enumerate() if t.name == f"metrics-http-{port}"]
    with socket.socket() as s, pytest.raises(OSError):
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
