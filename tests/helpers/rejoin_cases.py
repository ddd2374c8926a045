"""``Buffer(rejoin=...)`` and ``Buffer(min_ranks=...)`` inside ranks: what they refuse, a replacement that nobody
invites, and a start short of ranks that too few ranks come to."""
from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

import moe_comm

M, H, E = 8, 256, 8


def _error(make: Any) -> str:
    try:
        make()
    except Exception as exc:  # the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no exception"


def refusals(group: dist.ProcessGroup, timeout_s: float) -> dict[str, Any]:
    """The error of each refused ``rejoin`` form, and how long an uninvited replacement waited."""
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, dist.get_world_size(group), E)

    def make(**kw: Any) -> Any:
        return lambda: moe_comm.Buffer(group, num_rdma_bytes=hint, timeout_s=timeout_s, **kw)

    out = {"no_shrink": _error(make(low_latency_mode=True, rejoin=True)),
           "no_low_latency": _error(make(enable_shrink=True, rejoin=True)),
           "mpi": _error(make(low_latency_mode=True, enable_shrink=True, rejoin=True, transport="mpi")),
           "not_bool": _error(make(low_latency_mode=True, enable_shrink=True, rejoin=1))}
    os.environ["MOE_COMM_REJOIN"] = "maybe"
    try:
        out["bad_env"] = _error(make(low_latency_mode=True, enable_shrink=True))
    finally:
        del os.environ["MOE_COMM_REJOIN"]
    start = time.monotonic()
    out["uninvited"] = _error(make(low_latency_mode=True, enable_shrink=True, rejoin=True))
    out["uninvited_s"] = time.monotonic() - start
    ranks = dist.get_world_size(group)
    out.update(min_too_many=_error(make(low_latency_mode=True, enable_shrink=True, min_ranks=ranks + 1)),
               min_negative=_error(make(low_latency_mode=True, enable_shrink=True, min_ranks=-1)),
               min_no_shrink=_error(make(low_latency_mode=True, min_ranks=ranks)),
               min_mpi=_error(make(low_latency_mode=True, enable_shrink=True, min_ranks=ranks, transport="mpi")))
    os.environ["MOE_COMM_MIN_RANKS"] = "two"
    try:
        out["min_bad_env"] = _error(make(low_latency_mode=True, enable_shrink=True))
    finally:
        del os.environ["MOE_COMM_MIN_RANKS"]
    # a start of every rank from the store (nothing reserved): a working Buffer, its epoch the start's
    buf = moe_comm.Buffer(group, num_rdma_bytes=hint, timeout_s=timeout_s, low_latency_mode=True, enable_shrink=True,
                          explicitly_destroy=True, min_ranks=ranks)
    out["min_all_epoch"] = buf.membership.committed
    buf.destroy()
    return out
