"""What the distributed benchmarks compare side by side: the portable backend on each CPU
transport, and the cuda_host backend (the CUDA kernels' host build, its handshakes on shm)."""
from __future__ import annotations

import importlib.util
from typing import Optional

from ..launch import launcher_rank

__all__ = ["TRANSPORTS", "runs_on", "default_transports", "split_case"]

TRANSPORTS = ("collective", "shm", "mpi", "cuda_host")


def runs_on(name: str) -> dict[str, str]:
    """``Buffer`` keywords for a name from ``TRANSPORTS``."""
    return {"backend": "cuda_host", "transport": "shm"} if name == "cuda_host" else {"transport": name}


def default_transports() -> list[str]:
    """Every name of ``TRANSPORTS`` that can run in this launch: ``mpi`` needs mpi4py and ranks that are
    one MPI job (mpirun, or the ``mpiexec`` local launch ``ranks.launch`` then uses), so not under torchrun."""
    found = launcher_rank()
    mpi = importlib.util.find_spec("mpi4py") is not None and (found is None or found[2].startswith("mpirun"))
    return [t for t in TRANSPORTS if t != "mpi" or mpi]


def split_case(case: str) -> Optional[tuple[str, str]]:
    """``(transport, op)`` of a case named ``<transport>_<op>`` for a transport of ``TRANSPORTS``
    (``cuda_host_combine_bf16`` -> ``("cuda_host", "combine_bf16")``), else None (baselines, ceilings)."""
    for name in sorted(TRANSPORTS, key=len, reverse=True):
        if case.startswith(name + "_"):
            return name, case[len(name) + 1:]
    return None
