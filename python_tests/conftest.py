"""Shared fixtures: one pool of local gloo ranks per world size, reused across tests."""
from __future__ import annotations

import os
from typing import Callable

import pytest

from moe_comm.launch import LocalWorld
from transports import NO_MPI, TRANSPORTS, local_world

# Keep each rank single-threaded: several ranks share 2 cores.
os.environ.setdefault("MOE_COMM_NUM_THREADS", "1")


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's CPU interpreter, which Triton reads when a kernel
# module is imported (so before any test runs). With a GPU they compile, and the CPU-interpreter
# cases skip with that reason.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test draws the same random data on every run (MOE_COMM_TEST_SEED picks another draw)."""
    import torch
    torch.manual_seed(int(os.environ.get("MOE_COMM_TEST_SEED", "0")))


@pytest.fixture(scope="session")
def _world_pool():
    pool: dict[tuple[int, str], LocalWorld] = {}
    yield pool
    for world in pool.values():
        world.close()


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """The transport ``Buffer(transport="auto")`` picks in the ranks of ``worlds``."""
    if request.param == "mpi" and NO_MPI:
        pytest.skip(NO_MPI)
    return request.param


@pytest.fixture
def worlds(_world_pool, transport) -> Callable[[int], LocalWorld]:
    """``worlds(n)`` returns a live ``LocalWorld`` of n ranks whose buffers use ``transport``,
    starting (or restarting) it on demand; worlds are shared across tests."""

    def get(n: int) -> LocalWorld:
        key = (n, transport)
        if key not in _world_pool or _world_pool[key].closed:
            _world_pool[key] = local_world(n, transport, timeout_s=240, threads_per_rank=1)
        return _world_pool[key]

    return get
