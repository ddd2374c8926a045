"""The CPU transports and backends every multi-rank test runs on, and worlds of ranks for each."""
from __future__ import annotations

import importlib.util
from typing import Any

from moe_comm.launch import LocalWorld

#: Outputs must be identical on each (tests compare to the same references, and test_shm and
#: test_mpi compare the transports directly).
TRANSPORTS = ("shm", "collective", "mpi")

#: What the ``worlds`` fixture runs every multi-rank test on: each transport under the portable
#: backend, and the cuda_host backend (the CUDA kernels' host build; its handshakes use shm).
WORLD_KINDS = TRANSPORTS + ("cuda_host",)

#: Why the ``mpi`` cases cannot run here, or None.
NO_MPI = None if importlib.util.find_spec("mpi4py") else "mpi4py is not installed (pip install 'moe-comm[mpi]')"


def local_world(world_size: int, transport: str, **kw: Any) -> LocalWorld:
    """A ``LocalWorld`` whose buffers use ``transport`` (a name from ``WORLD_KINDS``): ``mpi`` ranks
    are one mpiexec job; ``cuda_host`` buffers run on that backend."""
    kind = {"MOE_COMM_BACKEND": "cuda_host", "MOE_COMM_TRANSPORT": "shm"} if transport == "cuda_host" else \
        {"MOE_COMM_TRANSPORT": transport}
    env = {**kind, **kw.pop("env", {})}
    return LocalWorld(world_size, env=env, launcher="mpiexec" if transport == "mpi" else "spawn", **kw)
