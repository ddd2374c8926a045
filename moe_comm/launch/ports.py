"""A port for a launch that must be told one in advance (torchrun's and mpirun's ``MASTER_PORT``).

``bind(("", 0))`` hands out a port from the kernel's ephemeral range, the range every outgoing
connection and every ``TCPStore(port=0)`` draws from too: a port found free that way can be taken by
one of them before the launched rank binds it (EADDRINUSE). Ports below the ephemeral range are never
handed out implicitly, so one found free stays free unless another launcher picks the same one on
purpose, which the random choice makes unlikely; ``port_taken`` recognises the launch that lost anyway.
"""
from __future__ import annotations

import random
import socket

__all__ = ["free_port", "port_taken"]

_LOWEST = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, outside the kernel's ephemeral range."""
    high = max(_LOWEST + 1000, _ephemeral_start())
    for _ in range(1000):
        port = random.randrange(_LOWEST, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in [{_LOWEST}, {high}) on {host} after 1000 tries")


def port_taken(output: str) -> bool:
    """Whether a launch's output says its rendezvous port was in use (start it again on another)."""
    return "EADDRINUSE" in output or "ddress already in use" in output
