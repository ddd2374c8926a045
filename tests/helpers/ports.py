"""How often a test starts a launch again when the port it was given was taken meanwhile
(``moe_comm.launch.ports`` chooses ports that make that rare)."""
from moe_comm.launch.ports import free_port, port_taken

__all__ = ["ATTEMPTS", "free_port", "port_taken"]

ATTEMPTS = 3
