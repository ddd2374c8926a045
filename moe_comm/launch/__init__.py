"""Starting process groups: from a launcher's environment (torchrun, mpirun) or as local ranks.

``launcher_env``: ``init_from_env`` / ``launcher_rank`` under torchrun or mpirun. ``local_world``:
``LocalWorld`` / ``spawn``, N ranks on this host that run picklable functions, started by
``spawned`` (multiprocessing children) or ``mpiexec`` (one MPI job); each rank runs ``worker``'s loop.
"""
from .launcher_env import init_from_env, launcher_rank
from .local_world import LocalWorld, RankFailure, spawn

__all__ = ["init_from_env", "launcher_rank", "LocalWorld", "spawn", "RankFailure"]
