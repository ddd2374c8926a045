"""The CPU transports every multi-rank test runs on, and worlds of ranks for each."""
from __future__ import annotations

import importlib.util
from typing import Any

from moe_comm.launch import LocalWorld

#: Outputs must be identical on each (tests compare to the same references, and test_shm and
#: test_mpi compare the transports directly).
TRANSPORTS = ("shm", "collective", "mpi")

#: Why the ``mpi`` cases cannot run here, or None.
NO_MPI = None if importlib.util.find_spec("mpi4py") else "mpi4py is not installed (pip install 'moe-comm[mpi]')"


def local_world(world_size: int, transport: str, **kw: Any) -> LocalWorld:
    """A ``LocalWorld`` whose buffers use ``transport``: ``mpi`` ranks are one mpiexec job."""
    env = {"MOE_COMM_TRANSPORT": transport, **kw.pop("env", {})}
    return LocalWorld(world_size, env=env, launcher="mpiexec" if transport == "mpi" else "spawn", **kw)
