"""The vendor backends against the portable one, inside each rank: the same inputs through a Buffer of
each, every DeepEP-visible output compared (see test_vendor_backends.py). The vendor modules are the
CPU models in ``vendor_models/``, put on ``sys.path`` of the rank process only."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import quantize

from helpers.backend_cases import raised
from helpers.low_latency_cases import ll_buffer, routing

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor_models")


@contextlib.contextmanager
def models(env: Optional[dict[str, str]] = None) -> Iterator[None]:
    """The vendor modules' CPU models importable in this rank process (from now on), with ``env`` set
    for the duration."""
    if MODELS not in sys.path:
        sys.path.insert(0, MODELS)
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _diff(name: str, got: torch.Tensor, want: torch.Tensor, out: list[str]) -> None:
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        out.append(f"{name}: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)}"
                   + ("" if got.shape != want.shape else f", {int((got != want).sum())} elements differ"))


def compare_low_latency(group: dist.ProcessGroup, backend: str, num_tokens: int, hidden: int, num_topk: int,
                 num_experts: int, use_fp8: bool = False, hook: bool = False, zero_copy: bool = False) -> list[str]:
    """Dispatch and combine on ``backend`` and on ``portable``; the differences (none: []). FP8 on a
    backend that quantises to INT8 (ascend) compares with the portable bf16 rows quantised by
    ``moe_comm.ops.quantize(..., "int8")``."""
    rank = dist.get_rank(group)
    torch.manual_seed(rank)
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    topk_idx, topk_weights = routing(num_tokens, num_experts, num_topk, seed=rank)
    results = {}
    for name in ("portable", backend):
        buffer = ll_buffer(group, num_tokens, hidden, num_experts, backend=name)
        try:
            # ascend's INT8 is compared with the portable bf16 rows, quantised below
            fp8 = use_fp8 and (name != "portable" or backend != "ascend")
            recv, count, handle, _, hooked = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                         use_fp8=fp8, return_recv_hook=hook)
            if hook:
                hooked()
            y = (recv[0] if isinstance(recv, tuple) else recv)
            y = (y.float() if y.dtype != torch.int8 else torch.zeros(y.shape)).mul(1.5).to(torch.bfloat16)
            if zero_copy:
                buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
            out, _, hooked = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=zero_copy,
                                                        return_recv_hook=hook)
            if hook:
                hooked()
            results[name] = (recv, count.clone(), handle, out.clone())
        finally:
            buffer.destroy()
    (want_x, want_count, want_handle, want_out), (got_x, got_count, got_handle, got_out) = \
        results["portable"], results[backend]
    diffs: list[str] = []
    _diff("recv_count", got_count, want_count, diffs)
    _diff("handle src_info", got_handle[0], want_handle[0], diffs)
    _diff("handle layout_range", got_handle[1], want_handle[1], diffs)
    if use_fp8 and backend == "ascend":
        q, s = got_x
        local = want_x.shape[0]
        for e in range(local):
            n = int(want_count[e])
            wq, ws = quantize(want_x[e, :n], "int8")
            _diff(f"recv_x int8 expert {e}", q[e, :n], wq, diffs)
            _diff(f"recv_scales expert {e}", s[e, :n], ws.view(n, -1), diffs)
            _diff(f"recv_x int8 expert {e} past the count", q[e, n:], torch.zeros_like(q[e, n:]), diffs)
    else:
        for i, (got, want) in enumerate(zip(got_x if isinstance(got_x, tuple) else (got_x,),
                                            want_x if isinstance(want_x, tuple) else (want_x,))):
            _diff(f"recv_x[{i}]", got, want, diffs)
    if not (use_fp8 and backend == "ascend"):  # INT8 rows feed zeros into the combine above
        _diff("combined_x", got_out, want_out, diffs)
    return [f"rank {rank}: {d}" for d in diffs]


def compare_normal(group: dist.ProcessGroup, backend: str, num_tokens: int, hidden: int, num_topk: int,
            num_experts: int) -> list[str]:
    """Normal-mode dispatch and combine on ``backend`` and on ``portable``; the differences (none: [])."""
    rank = dist.get_rank(group)
    torch.manual_seed(100 + rank)
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    topk_idx, topk_weights = routing(num_tokens, num_experts, num_topk, seed=rank)
    results = {}
    for name in ("portable", backend):
        buffer = moe_comm.Buffer(group, num_nvl_bytes=1 << 24, backend=name, explicitly_destroy=True, timeout_s=30)
        try:
            layout = buffer.get_dispatch_layout(topk_idx, num_experts)
            recv_x, recv_idx, recv_w, per_expert, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                topk_idx=topk_idx, topk_weights=topk_weights)
            combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
            results[name] = (recv_x, recv_idx, recv_w, per_expert, combined, combined_w)
        finally:
            buffer.destroy()
    diffs: list[str] = []
    names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert", "combined_x",
             "combined_topk_weights")
    for name, got, want in zip(names, results[backend], results["portable"]):
        if isinstance(want, list):
            if got != want:
                diffs.append(f"{name}: got {got}, want {want}")
        else:
            _diff(name, got, want, diffs)
    return [f"rank {rank}: {d}" for d in diffs]


def _grow_and_overlap(group: dist.ProcessGroup, backend: str) -> list[str]:
    """Two hooked dispatches (4 then 12 tokens, hidden 128 then 256: the second grows the all-to-all's handle)
    received in reverse order, then each combined, on ``backend`` and on ``portable``; the differences."""
    rank = dist.get_rank(group)
    results = {}
    for name in ("portable", backend):
        buffer = ll_buffer(group, 12, 256, 4 * dist.get_world_size(group), backend=name)
        try:
            calls = []
            for t, h in ((4, 128), (12, 256)):
                torch.manual_seed(10 * rank + t)
                x = torch.randn(t, h).to(torch.bfloat16)
                topk_idx, topk_weights = routing(t, 4 * dist.get_world_size(group), 2, seed=rank + t)
                recv, count, handle, _, hooked = buffer.low_latency_dispatch(
                    x, topk_idx, 12, 4 * dist.get_world_size(group), use_fp8=False, return_recv_hook=True)
                calls.append((recv, count, handle, hooked, topk_idx, topk_weights))
            for call in reversed(calls):
                call[3]()
            outs = []
            for recv, count, handle, _, topk_idx, topk_weights in calls:
                out, _, _ = buffer.low_latency_combine(recv * 2, topk_idx, topk_weights, handle)
                outs += [recv.clone(), count.clone(), out.clone()]
            results[name] = outs
        finally:
            buffer.destroy()
    diffs: list[str] = []
    for i, (got, want) in enumerate(zip(results[backend], results["portable"])):
        _diff(f"output {i}", got, want, diffs)
    return [f"rank {rank}: {d}" for d in diffs]


def _foreign_handle(group: dist.ProcessGroup, backend: str) -> tuple[str, str]:
    """What a low-latency combine raises on ``backend`` given a handle whose tensors are copies of a
    dispatch's (the vendor bookkeeping belongs to the tensors this Buffer returned)."""
    rank = dist.get_rank(group)
    x = torch.randn(4, 128).to(torch.bfloat16)
    topk_idx, topk_weights = routing(4, 4, 2, seed=rank)
    buffer = ll_buffer(group, 4, 128, 4, backend=backend)
    try:
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 4, 4, use_fp8=False)
        copied = (handle[0].clone(), handle[1].clone()) + tuple(handle[2:])
        return raised(lambda: buffer.low_latency_combine(recv, topk_idx, topk_weights, copied))
    finally:
        buffer.destroy()


def _refused(group: dist.ProcessGroup, backend: str, **call: Any) -> tuple[str, str]:
    """What a low-latency dispatch of ``call`` (num_tokens, hidden, num_topk, num_experts, use_fp8,
    round_scale) raises on ``backend``; the Buffer then still works (a second, valid call)."""
    rank = dist.get_rank(group)
    t, h, k, e = call["num_tokens"], call["hidden"], call["num_topk"], call["num_experts"]
    x = torch.randn(t, h).to(torch.bfloat16)
    topk_idx, _ = routing(t, e, k, seed=rank)
    buffer = ll_buffer(group, t, h, e, backend=backend)
    try:
        return raised(lambda: buffer.low_latency_dispatch(x, topk_idx, t, e, use_fp8=call.get("use_fp8", False),
                                                           round_scale=call.get("round_scale", False)))
    finally:
        buffer.destroy()


def _construct(group: dist.ProcessGroup, backend: str, **kw: Any) -> tuple[str, str]:
    """What building a Buffer on ``backend`` raises ("none" when it works)."""

    def build() -> None:
        moe_comm.Buffer(group, backend=backend, explicitly_destroy=True, timeout_s=30, **kw).destroy()
    return raised(build)



def low_latency(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any) -> list[str]:
    with models(env):
        return compare_low_latency(group, *args, **kw)


def normal(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any) -> list[str]:
    with models(env):
        return compare_normal(group, *args, **kw)


def grow_and_overlap(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any
                     ) -> list[str]:
    with models(env):
        return _grow_and_overlap(group, *args, **kw)


def foreign_handle(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any
                   ) -> tuple[str, str]:
    with models(env):
        return _foreign_handle(group, *args, **kw)


def refused(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any) -> tuple[str, str]:
    with models(env):
        return _refused(group, *args, **kw)


def construct(group: dist.ProcessGroup, *args: Any, env: Optional[dict[str, str]] = None, **kw: Any
              ) -> tuple[str, str]:
    with models(env):
        return _construct(group, *args, **kw)
