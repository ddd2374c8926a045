"""Faults inside ranks: cross-rank mismatches, a rank that skips a call, a rank that dies."""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_comm


def _routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.int64)
    return idx, torch.rand(tokens, topk, generator=g)


def _dispatch_form(buf: moe_comm.Buffer, hidden: int = 64, dtype: torch.dtype = torch.bfloat16, experts: int = 12,
                   topk: int = 2, tokens: int = 6, layout: bool = False, **kw: Any) -> tuple:
    """A dispatch of made-up tokens; with ``layout`` in DeepEP's form (the layout tensors given), else with
    moe-comm's ``num_experts`` keyword."""
    idx, w = _routing(tokens, experts, topk, buf.rank)
    x = torch.full((tokens, hidden), float(buf.rank), dtype=dtype)
    if layout:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **kw)
    return buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, **kw)


def _outcome(call: Callable[[], Any], still_works: Callable[[], torch.Tensor]) -> tuple[str, str, bool]:
    """(exception name, message) of ``call`` and whether ``still_works()`` then returns finite values."""
    try:
        call()
        outcome = ("no exception", "")
    except Exception as exc:  # the test compares across ranks
        outcome = (type(exc).__name__, str(exc))
    return outcome + (bool(torch.isfinite(still_works().float()).all()),)


def mismatch(group: dist.ProcessGroup, kind: str, warm: bool = False) -> tuple[str, str, bool]:
    """Rank 0 and the others disagree in one way; returns (exception, message, buffer still works). ``warm``:
    every rank first makes the calls the others make (DeepEP's form), so they meet the disagreement on their
    prepared calls."""
    buf = moe_comm.Buffer(group, timeout_s=20)
    odd = buf.rank == 0
    _dispatch = functools.partial(_dispatch_form, layout=warm)
    if warm:
        recv_x, _, _, _, handle, _ = _dispatch(buf, num_worst_tokens=100 if kind == "worst" else 0)
        buf.combine(recv_x, handle)

    def call() -> None:
        if kind == "hidden":
            _dispatch(buf, hidden=32 if odd else 64)
        elif kind == "dtype":
            _dispatch(buf, dtype=torch.float32 if odd else torch.bfloat16)
        elif kind == "num_experts":
            _dispatch(buf, experts=24 if odd else 12)
        elif kind == "topk":
            _dispatch(buf, topk=3 if odd else 2)
        elif kind == "worst":
            _dispatch(buf, num_worst_tokens=1 if odd else 100)
        elif kind == "op":
            recv_x, _, _, _, handle, _ = _dispatch(buf)
            if odd:
                _dispatch(buf)
            else:
                buf.combine(recv_x, handle)
        elif kind == "handle":
            recv_x, _, _, _, handle, _ = _dispatch(buf, tokens=6)
            recv_x2, _, _, _, handle2, _ = _dispatch(buf, tokens=9)
            buf.combine(recv_x if odd else recv_x2, handle if odd else handle2)
        else:
            raise ValueError(kind)

    def still_works() -> torch.Tensor:  # the group is still in step
        recv_x, _, _, _, handle, _ = _dispatch(buf)
        return buf.combine(recv_x, handle)[0]

    return _outcome(call, still_works)


_dispatch = _dispatch_form


def skip_dispatch(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """The last rank never dispatches; the others must time out naming it."""
    buf = moe_comm.Buffer(group, timeout_s=timeout_s)
    if buf.rank == buf.group_size - 1:
        return "skipped"
    start = time.monotonic()
    try:
        _dispatch(buf)
    except moe_comm.CommTimeoutError as exc:
        return time.monotonic() - start, str(exc), exc.missing_ranks, exc.op, exc.rank
    return "no timeout"


def die_before_dispatch(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """The last rank's process exits; the others must report it instead of hanging."""
    buf = moe_comm.Buffer(group, timeout_s=timeout_s)
    if buf.rank == buf.group_size - 1:
        os._exit(3)
    start = time.monotonic()
    try:
        _dispatch(buf)
    except (moe_comm.CommTimeoutError, RuntimeError) as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return "no error"


def die_before_buffer(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """The last rank's process exits after one Buffer; the others build another: they must name it."""
    moe_comm.Buffer(group, timeout_s=timeout_s, explicitly_destroy=True).destroy()
    if dist.get_rank(group) == dist.get_world_size(group) - 1:
        os._exit(3)
    time.sleep(0.5)  # it has exited by now
    start = time.monotonic()
    try:
        moe_comm.Buffer(group, timeout_s=timeout_s)
    except (moe_comm.CommTimeoutError, RuntimeError) as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return "no error"


def _ll_buffer(group: dist.ProcessGroup, timeout_s: float = 20, m: int = 8, hidden: int = 256,
               experts: int = 12) -> moe_comm.Buffer:
    size = moe_comm.Buffer.get_low_latency_rdma_size_hint(2 * m, 2 * hidden, 1, 2 * experts)  # room for every variant
    return moe_comm.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, timeout_s=timeout_s)


def _ll_dispatch(buf: moe_comm.Buffer, m: int = 8, hidden: int = 256, experts: int = 12, **kw: Any) -> tuple:
    idx, _ = _routing(6, experts, 2, buf.rank)
    x = torch.full((6, hidden), float(buf.rank), dtype=torch.bfloat16)
    return buf.low_latency_dispatch(x, idx, m, experts, **kw)


def ll_mismatch(group: dist.ProcessGroup, kind: str, warm: bool = False) -> tuple[str, str, bool]:
    """Rank 0 and the others disagree in one low-latency way; returns (exception, message, buffer
    still works). ``warm``: every rank first makes the call the others make, so they meet the disagreement
    on their prepared calls."""
    buf = _ll_buffer(group)
    odd = buf.rank == 0
    if warm:  # the calls ranks 1 and 2 make below
        bf16 = kind in ("ll_fp8", "ll_combine_routing")
        recv_x, _, handle, _, _ = _ll_dispatch(buf, use_fp8=not bf16)
        if bf16:
            idx, w = _routing(6, 12, 2, buf.rank)
            buf.low_latency_combine(recv_x, idx, w, handle)

    def call() -> None:
        if kind == "ll_m":
            _ll_dispatch(buf, m=16 if odd else 8)
        elif kind == "ll_hidden":
            _ll_dispatch(buf, hidden=512 if odd else 256)
        elif kind == "ll_experts":
            _ll_dispatch(buf, experts=24 if odd else 12)
        elif kind == "ll_fp8":
            _ll_dispatch(buf, use_fp8=odd)
        elif kind == "ll_op":
            if odd:
                _dispatch(buf)
            else:
                _ll_dispatch(buf)
        elif kind == "ll_combine_routing":
            recv_x, _, handle, _, _ = _ll_dispatch(buf, use_fp8=False)
            idx, w = _routing(6, 12, 2, buf.rank + (100 if odd else 0))  # rank 0 combines other routing
            buf.low_latency_combine(recv_x, idx, w, handle)
        else:
            raise ValueError(kind)

    def still_works() -> torch.Tensor:  # the group is still in step
        recv_x, _, handle, _, _ = _ll_dispatch(buf, use_fp8=False)
        idx, w = _routing(6, 12, 2, buf.rank)
        return buf.low_latency_combine(recv_x, idx, w, handle)[0]

    return _outcome(call, still_works)


def skip_ll_dispatch(group: dist.ProcessGroup, timeout_s: float, hook: bool, warm: bool = False) -> Any:
    """The last rank never calls low_latency_dispatch; the others must time out naming it (``warm``: after a
    first call of the signature on every rank, so they wait on their prepared calls)."""
    buf = _ll_buffer(group, timeout_s)
    if warm:
        recv_hook = _ll_dispatch(buf, return_recv_hook=hook)[-1]
        if hook:
            recv_hook()
    if buf.rank == buf.group_size - 1:
        return "skipped"
    start = time.monotonic()
    try:
        _, _, _, _, recv_hook = _ll_dispatch(buf, return_recv_hook=hook)
        recv_hook()
    except moe_comm.CommTimeoutError as exc:
        return time.monotonic() - start, str(exc), exc.missing_ranks, exc.op, exc.rank
    return "no timeout"
