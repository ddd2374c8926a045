"""Checks of normal-mode arguments, turning DeepEP's loose inputs into the typed ones a backend takes
(``backends/base.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core.checks import check_int, check_tensor, describe
from ..core.errors import bad_argument
from ..core.limits import check_count, check_fits
from ..core.native import NATIVE_DTYPES
from ..ops import DispatchLayout, dispatch_layout
from ..ops.layout import topk_summary
from ..protocol.handle import NormalHandle

__all__ = ["split_x", "check_topk_idx", "check_num_experts", "check_dispatch_routing", "check_combine_args",
           "DispatchRouting", "TOPK_IDX_T"]

TOPK_IDX_T = torch.int64
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))


def split_x(op: str, x: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` or ``(x_fp8, scales)`` -> (data `[T, H]`, scales `[T, S]` float32/int32 any strides or None)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            bad_argument(op, "x", "a tensor or a 2-tuple (x_fp8, x_scales)", f"a {type(x).__name__} of length {len(x)}",
                         kind=TypeError)
        data, scales = x
        check_tensor(op, "x[0]", data, shape=(None, None), dtype=_FLOAT8)
        check_tensor(op, "x[1] (scales)", scales, shape=(data.shape[0], None), dtype=(torch.float32, torch.int32),
                     device=data.device)
    else:
        data, scales = check_tensor(op, "x", x, shape=(None, None)), None
    if data.stride(1) != 1:
        bad_argument(op, "x", "row-major (stride 1 along hidden)", f"strides {data.stride()}")
    return data, scales


def check_topk_idx(op: str, topk_idx: Any, num_experts: int, num_tokens: Optional[int],
                   device: Optional[torch.device], values: bool = True) -> torch.Tensor:
    """``topk_idx`` `[T, K]` int64 with ids in [-1, num_experts) (the ids only with ``values``: they are
    read on the host)."""
    check_tensor(op, "topk_idx", topk_idx, shape=(num_tokens, None), dtype=TOPK_IDX_T, device=device)
    topk_idx = topk_idx.contiguous()
    if values and topk_idx.numel():
        check_topk_ids(op, topk_summary(topk_idx), num_experts)
    return topk_idx


def check_topk_ids(op: str, summary: tuple[int, int, int, int], num_experts: int) -> None:
    """Ids in [-1, num_experts), from ``ops.layout.topk_summary`` of a non-empty ``topk_idx``."""
    lo, hi = summary[:2]
    if lo < -1 or hi >= num_experts:
        bad_argument(op, "topk_idx", f"expert ids in [-1, {num_experts}) (num_experts={num_experts})",
                     f"values in [{lo}, {hi}]")


@dataclass(frozen=True)
class DispatchRouting:
    layout: DispatchLayout
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]


def check_dispatch_routing(op: str, x: torch.Tensor, num_ranks: int, num_tokens_per_rank: Any,
                           is_token_in_rank: Any, num_tokens_per_expert: Any, topk_idx: Any,
                           topk_weights: Any, expert_alignment: Any, num_worst_tokens: Any,
                           num_experts: Any) -> DispatchRouting:
    """Checks a non-cached dispatch's routing. When the three layout tensors are all None, the
    layout is computed here from ``topk_idx`` and ``num_experts`` (as ``get_dispatch_layout``)."""
    num_tokens, device = x.shape[0], x.device
    check_int(op, "expert_alignment", expert_alignment, minimum=1)
    check_count(op, "expert_alignment", expert_alignment, "per-expert counts are int32")
    check_int(op, "num_worst_tokens", num_worst_tokens, minimum=0)
    check_count(op, "num_worst_tokens", num_worst_tokens, "received rows are numbered with int32 (handle[3])")
    if (topk_idx is None) != (topk_weights is None):
        bad_argument(op, "topk_idx and topk_weights", "given together or both None",
                     f"topk_idx={describe(topk_idx)}, topk_weights={describe(topk_weights)}")
    if num_worst_tokens > 0 and topk_idx is None:
        bad_argument(op, "topk_idx", "given when num_worst_tokens > 0 (as in DeepEP)", "None")
    layout_args = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
    given = [a is not None for a in layout_args]
    if not any(given):
        if topk_idx is None or num_experts is None:
            bad_argument(op, "num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert",
                         "given (from get_dispatch_layout), or topk_idx and num_experts given to compute them",
                         f"all None, with topk_idx={describe(topk_idx)}, num_experts={num_experts!r}")
        check_num_experts(op, num_experts, num_ranks, device)
        topk_idx = check_topk_idx(op, topk_idx, num_experts, num_tokens, device)
        layout = dispatch_layout(topk_idx, num_ranks, num_experts)
    elif not all(given):
        bad_argument(op, "num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert", "all given or all None",
                     ", ".join(describe(a) for a in layout_args))
    else:
        check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, shape=(None,), dtype=torch.int32)
        if num_experts is not None and num_experts != num_tokens_per_expert.shape[0]:
            bad_argument(op, "num_experts", f"len(num_tokens_per_expert) = {num_tokens_per_expert.shape[0]}",
                         num_experts)
        num_experts = check_num_experts(op, num_tokens_per_expert.shape[0], num_ranks, device)
        if topk_idx is not None:
            topk_idx = check_topk_idx(op, topk_idx, num_experts, num_tokens, device)
        check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, shape=(num_ranks,), dtype=torch.int32)
        check_tensor(op, "is_token_in_rank", is_token_in_rank, shape=(num_tokens, num_ranks), dtype=torch.bool,
                     device=device)
        sums = is_token_in_rank.sum(0, dtype=torch.int32)
        if not torch.equal(sums.cpu(), num_tokens_per_rank.cpu()):
            bad_argument(op, "num_tokens_per_rank", f"the column sums of is_token_in_rank {sums.tolist()}",
                         num_tokens_per_rank.tolist())
        layout = DispatchLayout(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)
    if topk_idx is not None:
        check_tensor(op, "topk_weights", topk_weights, shape=tuple(topk_idx.shape), dtype=torch.float32,
                     device=device)
        topk_weights = topk_weights.contiguous()
        # recv_x, recv_topk_idx (int64), recv_topk_weights (float32) and recv_src_idx (int32) per padded row
        row_bytes = x.shape[1] * x.element_size() + 12 * topk_idx.shape[1] + 4
        check_fits(op, "num_worst_tokens", num_worst_tokens, num_worst_tokens * row_bytes, device,
                   f"{num_worst_tokens} padded rows of outputs")
    return DispatchRouting(layout, topk_idx, topk_weights)


def check_num_experts(op: str, num_experts: Any, num_ranks: int, device: torch.device = torch.device("cpu")) -> int:
    """``num_experts``: a positive multiple of the group size whose per-expert counts (on ``device``)
    fit."""
    check_int(op, "num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        bad_argument(op, "num_experts", f"a multiple of the number of ranks ({num_ranks})", num_experts)
    check_count(op, "num_experts", num_experts, "experts are numbered with int32 in counts and records")
    check_fits(op, "num_experts", num_experts, 16 * num_experts, device, "the per-expert counts")
    return num_experts


def check_combine_args(op: str, x: Any, handle: NormalHandle, rank: int, topk_weights: Any,
                       bias: Any) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Checks combine's x `[N, H]` (N = rows received, or the padded num_worst_tokens rows),
    topk_weights `[N, K]` float32 and bias (None, a tensor or a 2-tuple of `[T, H]`)."""
    num_recv, padded = handle.num_recv_rows(rank), handle.recv_src_idx.shape[0]
    check_tensor(op, "x", x, shape=(None, None), dtype=NATIVE_DTYPES)
    if x.shape[0] not in (num_recv, padded):
        bad_argument(op, "x", f"[{num_recv} (rows received by dispatch), hidden]"
                     + (f" or [{padded}, hidden]" if padded != num_recv else ""), describe(x))
    if topk_weights is not None:
        check_tensor(op, "topk_weights", topk_weights, shape=(x.shape[0], None), dtype=torch.float32, device=x.device)
        topk_weights = topk_weights.contiguous()
    return (x, topk_weights, *check_biases(op, bias, handle.is_token_in_rank.shape[0], x))


def check_biases(op: str, bias: Any, num_tokens: int, x: torch.Tensor
                 ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A combine's ``bias`` (None, a tensor, or a 2-tuple of tensors or None, each `[num_tokens, H]` of x's
    dtype and device) as two contiguous tensors or None, the given ones first."""
    if bias is None:
        biases: tuple = ()
    elif isinstance(bias, torch.Tensor):
        biases = (bias,)
    elif isinstance(bias, (tuple, list)) and len(bias) == 2:
        biases = tuple(b for b in bias if b is not None)
    else:
        bad_argument(op, "bias", "None, a tensor or a 2-tuple of tensors", describe(bias), kind=TypeError)
    for i, b in enumerate(biases):
        check_tensor(op, f"bias[{i}]", b, shape=(num_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    padded = tuple(b.contiguous() for b in biases) + (None, None)
    return padded[0], padded[1]
