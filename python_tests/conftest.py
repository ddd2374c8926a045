"""Shared fixtures: one pool of local gloo ranks per world size, reused across tests."""
from __future__ import annotations

import os
from typing import Callable

import pytest

from moe_comm.launch import LocalWorld

# Keep each rank single-threaded: several ranks share 2 cores.
os.environ.setdefault("MOE_COMM_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def worlds() -> Callable[[int], LocalWorld]:
    """``worlds(n)`` returns a live ``LocalWorld`` of n ranks, starting (or restarting) it on demand."""
    pool: dict[int, LocalWorld] = {}

    def get(n: int) -> LocalWorld:
        if n not in pool or pool[n].closed:
            pool[n] = LocalWorld(n, timeout_s=240, threads_per_rank=1)
        return pool[n]

    yield get
    for world in pool.values():
        world.close()
