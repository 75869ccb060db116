"""A block of consecutive free loopback ports, for tests that start servers on fixed ports
(``scroll standalone`` takes a base port per service)."""

from __future__ import annotations

import random
import socket


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000, 16)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports")
