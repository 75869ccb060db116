"""A block of consecutive free loopback ports, for tests that start servers on fixed ports
(``scroll standalone`` takes a base port per service)."""

from __future__ import annotations

import random
import socket

from streams.tools.localcluster import _ephemeral_low


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now, below the kernel's ephemeral range:
    a server started some seconds later (SeaweedFS binds its S3 port last, after its own
    components have made their connections) must not find its port taken by an outgoing
    connection's local port meanwhile (seen in CI: "bind: address already in use")."""
    hi = max(20000 + 16 * 64, min(26000, _ephemeral_low()) - n)  # free_port takes 26000 and up
    for _ in range(200):
        base = random.randrange(20000, hi, 16)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports")
