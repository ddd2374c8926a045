"""A port for launches that must be told one in advance (torchrun's and mpirun's MASTER_PORT).

``bind(("", 0))`` hands out a port from the kernel's ephemeral range, the range every outgoing
connection and every ``TCPStore(port=0)`` of the tests' own worlds draws from too: a port found free
that way can be taken by one of them before the launched rank binds it (EADDRINUSE, seen on a loaded
machine). Ports below the ephemeral range are never handed out implicitly, so a free one stays free
unless another test picks the same one on purpose, which the random choice makes unlikely; a test
that loses the race anyway sees EADDRINUSE in the launch's output (``port_taken``) and starts again.
"""
from __future__ import annotations

import random
import socket

#: How often a test starts a launch again when its port was taken meanwhile.
ATTEMPTS = 3
_LOWEST = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, outside the kernel's ephemeral range."""
    high = max(_LOWEST + 1000, _ephemeral_start())
    for _ in range(1000):
        port = random.randrange(_LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in [{_LOWEST}, {high}) after 1000 tries")


def port_taken(output: str) -> bool:
    """Whether a launch failed because its rendezvous port was in use."""
    return "EADDRINUSE" in output or "ddress already in use" in output
