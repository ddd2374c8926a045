"""How often a test starts a launch again when the port it was given was taken meanwhile
(``moe_comm.launch.ports`` chooses ports that make that rare)."""
import os
import sys

from moe_comm.launch.ports import free_port, port_taken

__all__ = ["ATTEMPTS", "free_port", "launcher_env", "port_taken"]

ATTEMPTS = 3


def launcher_env(transport: str) -> dict[str, str]:
    """This process's environment as a launcher gives its ranks (rank 0 hosts the store on a free port), their
    buffers on ``transport``, one thread each, and this test session's import path."""
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "MOE_COMM_TRANSPORT": transport, "MOE_COMM_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
