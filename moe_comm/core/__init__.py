"""Leaf utilities every layer may import: the native extensions (``native``), ``Config``, environment
variables (``env``), errors, argument checks, memory, topology, limits and guarded vendor imports.
Nothing here imports another part of moe_comm."""
