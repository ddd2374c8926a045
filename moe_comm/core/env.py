"""Every environment variable moe-comm reads, in one place. The library never writes any; only
``moe_comm.launch.LocalWorld`` sets MOE_COMM_NUM_THREADS (and what its ``env`` argument names) in
the worker processes it starts.

MOE_COMM_BACKEND     backend for ``Buffer(backend="auto")``: a name in ``moe_comm.backends.KNOWN`` (unset:
                     the native backend of the group's device when built, else ``portable``).
MOE_COMM_TRANSPORT   transport for ``Buffer(transport="auto")``: a name listed by
                     ``moe_comm.transport.available()`` (unset: ``shm`` on gloo, ``mpi`` on the mpi
                     backend or with ``comm=``, else ``collective``).
MOE_COMM_TIMEOUT_S   deadline in seconds for every wait (default 300); ``Buffer(timeout_s=...)``
                     overrides it.
MOE_COMM_NUM_THREADS threads the CPU kernels of ``moe_comm._C`` may use (default: all cores).
MOE_COMM_POOL_BYTES  idle bytes the CPU output pool (``moe_comm.core.memory.empty``) may keep (default 2 GiB;
                     0 disables recycling).
MOE_COMM_WEIGHT_CACHE_BYTES  bytes of fp32 expert-weight copies the native CPU GEMM may keep across calls
                     (``moe_comm.ops.weight_cache``; default 1 GiB; 0 disables).
MOE_COMM_OPS_IMPL    implementation of the ops in ``moe_comm.ops`` when a call passes none: ``native`` or
                     ``triton`` (unset: ``native`` on CPU tensors, ``triton`` elsewhere when it imports).
                     The old name MOE_COMM_OPS_BACKEND is read too, with a DeprecationWarning.
TRITON_INTERPRET     (Triton's own) ``1`` runs Triton kernels in its CPU interpreter; read by Triton when
                     a kernel module is imported, and by ``moe_comm.ops.impl`` to allow CPU tensors.
MOE_COMM_DEEP_EP     ``1``: the vLLM and SGLang plugin entry points make ``import deep_ep`` give moe-comm
                     (``moe_comm.integrations.install_deep_ep_alias``); ``force``: even over another
                     ``deep_ep`` already imported; unset, empty or ``0``: the plugins do nothing.
MOE_COMM_ASCEND_COMM_ALG  ``comm_alg`` of the ascend backend's MC2 v2 calls (unset: ``""``, the operators'
                     default; Atlas A2: ``fullmesh``/``hierarchy``, A3: ``fullmesh_v1``/``fullmesh_v2``/``hierarchy``).
HCCL_BUFFSIZE        (HCCL's own) MB of each HCCL communicator's buffers (default 200); the ascend
                     backend checks it against MC2's documented need before a low-latency call.
MOE_COMM_RANKS_PER_NODE  ranks of one node where one machine stands for several: each host's ranks are split
                     into nodes of global ranks ``r // MOE_COMM_RANKS_PER_NODE``, between which the transports
                     move rows as between hosts and DeepEP's internode forms apply (tests and benchmarks that
                     emulate several nodes). Unset: a node is a host. ``LOCAL_WORLD_SIZE`` is not read for
                     this: launchers and engines set it to other things (vLLM's CPU platform: the
                     tensor-parallel size), and the ranks of one host always share its memory.
MOE_COMM_REJOIN      ``1``: this process replaces a rank of a running job; ``Buffer(rejoin=None)`` reads it
                     (docs/elastic-ep.md). Unset or ``0``: a Buffer meets its group as usual.
MOE_COMM_MIN_RANKS   ``n``: an elastic Buffer starts once ``n`` of its ranks have (waiting up to its deadline for
                     the rest); the others' slots are reserved, and a rank that starts later joins as a
                     replacement does. ``Buffer(min_ranks=None)`` reads it (docs/elastic-ep.md). Unset or ``0``: a
                     Buffer meets its whole group.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

__all__ = ["backend", "transport", "timeout_s", "num_threads", "pool_bytes", "weight_cache_bytes", "ranks_per_node",
           "ops_impl", "triton_interpret", "deep_ep_alias", "ascend_comm_alg", "hccl_buffsize_mb"]

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_POOL_BYTES = 2 << 30
DEFAULT_WEIGHT_CACHE_BYTES = 1 << 30
DEFAULT_HCCL_BUFFSIZE_MB = 200  # HCCL's documented default


def backend() -> Optional[str]:
    """The backend named by ``MOE_COMM_BACKEND``, or None when unset or empty."""
    value = os.environ.get("MOE_COMM_BACKEND", "").strip()
    return value or None


def transport() -> Optional[str]:
    """The transport named by ``MOE_COMM_TRANSPORT``, or None when unset or empty."""
    value = os.environ.get("MOE_COMM_TRANSPORT", "").strip()
    return value or None


def _positive(name: str, value: str, cast: type) -> float:
    try:
        parsed = cast(value)
    except ValueError:
        parsed = None
    if parsed is None or not 0 < parsed < float("inf"):
        raise ValueError(f"environment variable {name} must be a positive {cast.__name__}, got {value!r}")
    return parsed


def timeout_s() -> float:
    """Deadline for waits from ``MOE_COMM_TIMEOUT_S``, else the default (300 s)."""
    value = os.environ.get("MOE_COMM_TIMEOUT_S")
    return DEFAULT_TIMEOUT_S if value is None else float(_positive("MOE_COMM_TIMEOUT_S", value, float))


def num_threads() -> Optional[int]:
    """Thread count for CPU kernels from ``MOE_COMM_NUM_THREADS``, or None (use all cores)."""
    value = os.environ.get("MOE_COMM_NUM_THREADS")
    return None if value is None else int(_positive("MOE_COMM_NUM_THREADS", value, int))


def _byte_count(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise ValueError(f"environment variable {name} must be a non-negative int, got {value!r}")
    return int(value)


def pool_bytes() -> int:
    """Idle bytes the CPU output pool may keep, from ``MOE_COMM_POOL_BYTES`` (0 allowed), else 2 GiB."""
    return _byte_count("MOE_COMM_POOL_BYTES", DEFAULT_POOL_BYTES)


def weight_cache_bytes() -> int:
    """Bytes of cached fp32 expert weights, from ``MOE_COMM_WEIGHT_CACHE_BYTES`` (0 allowed), else 1 GiB."""
    return _byte_count("MOE_COMM_WEIGHT_CACHE_BYTES", DEFAULT_WEIGHT_CACHE_BYTES)


def rejoin() -> bool:
    """``MOE_COMM_REJOIN``: 1 when this process replaces a rank of a running job (``Buffer(rejoin=...)``)."""
    value = os.environ.get("MOE_COMM_REJOIN", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable MOE_COMM_REJOIN must be 1 or 0, got {value!r}")


def min_ranks() -> int:
    """``MOE_COMM_MIN_RANKS``: the ranks an elastic Buffer starts with at least (``Buffer(min_ranks=...)``), 0 when
    unset (the whole group); ValueError naming the variable for anything but an int >= 0."""
    value = os.environ.get("MOE_COMM_MIN_RANKS", "").strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(f"environment variable MOE_COMM_MIN_RANKS must be an int >= 0, got {value!r}")
    return int(value)


def ranks_per_node() -> Optional[int]:
    """Ranks per emulated node from ``MOE_COMM_RANKS_PER_NODE``, or None when unset or empty; ValueError naming
    the variable for anything but a positive int."""
    value = os.environ.get("MOE_COMM_RANKS_PER_NODE", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"MOE_COMM_RANKS_PER_NODE must be a positive int (ranks per emulated node), got {value!r}")
    return int(value)


def ops_impl() -> tuple[Optional[str], str]:
    """(the ops implementation named by ``MOE_COMM_OPS_IMPL``, or None when unset or empty; the variable's
    name). The deprecated ``MOE_COMM_OPS_BACKEND`` is read when the new one is unset, with a warning."""
    value = os.environ.get("MOE_COMM_OPS_IMPL", "").strip()
    if value:
        return value, "MOE_COMM_OPS_IMPL"
    old = os.environ.get("MOE_COMM_OPS_BACKEND", "").strip()
    if old:
        warnings.warn("MOE_COMM_OPS_BACKEND is deprecated: set MOE_COMM_OPS_IMPL", DeprecationWarning, stacklevel=3)
        return old, "MOE_COMM_OPS_BACKEND"
    return None, "MOE_COMM_OPS_IMPL"


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton for its CPU interpreter (Triton's own truthy spellings)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def deep_ep_alias() -> Optional[str]:
    """``MOE_COMM_DEEP_EP``: None (unset, empty or ``0``: off), ``"1"`` or ``"force"``."""
    value = os.environ.get("MOE_COMM_DEEP_EP", "").strip().lower()
    if value in ("", "0"):
        return None
    if value not in ("1", "force"):
        raise ValueError(f"environment variable MOE_COMM_DEEP_EP must be 1, force, 0 or unset, got {value!r}")
    return value


def ascend_comm_alg() -> str:
    """``MOE_COMM_ASCEND_COMM_ALG`` (default ``""``: MC2's own default algorithm)."""
    return os.environ.get("MOE_COMM_ASCEND_COMM_ALG", "")


def hccl_buffsize_mb() -> int:
    """``HCCL_BUFFSIZE`` in MB (HCCL's default 200 when unset)."""
    value = os.environ.get("HCCL_BUFFSIZE")
    return DEFAULT_HCCL_BUFFSIZE_MB if not value else int(_positive("HCCL_BUFFSIZE", value, int))
