"""The SwiGLU expert FFN on the grouped GEMM: ``(silu(x @ gate.T) * (x @ up.T)) @ down.T`` per expert,
with the activation fused into the first GEMM's epilogue (the gate and up products never reach memory)."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.library import define, op
from ..core.memory import zeros
from .fp8 import GROUP
from . import tilelang_launch
from .grouped_gemm import GemmArgs, row_tiles, check_gemm, grouped_gemm, launch_gemm, native_gemm, segments_reference
from .impl import renamed_impl, resolve
from .quant import quantize

__all__ = ["expert_ffn", "expert_ffn_reference"]


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, expert_offsets: Optional[torch.Tensor] = None,
               masked_m: Optional[torch.Tensor] = None, x_scales: Optional[torch.Tensor] = None,
               w13_scales: Optional[torch.Tensor] = None, w2_scales: Optional[torch.Tensor] = None,
               impl: Optional[str] = None, backend: Optional[str] = None) -> torch.Tensor:
    """SwiGLU experts on ``x`` in either grouped-GEMM layout (see ``grouped_gemm``). ``w13`` `[E, 2I, H]`
    holds gate rows ``[0, I)`` then up rows ``[I, 2I)`` (vLLM's w13); ``w2`` `[E, H, I]`. The activation is
    computed from the fp32 products and rounded once to bf16; with FP8 (all three scales given, I a
    multiple of 128) it is quantized per 128 channels (E4M3) before the second GEMM. Returns bf16 with
    x's leading shape and H columns; rows outside the experts are zero. Reference ``expert_ffn_reference``."""
    _check_weights(w13, w2, x_scales)
    check_gemm("expert_ffn", x, w13, expert_offsets, masked_m, x_scales, w13_scales)
    return op("expert_ffn")(x, w13, w2, expert_offsets, masked_m, x_scales, w13_scales, w2_scales,
                            renamed_impl("expert_ffn", "impl", impl, backend))


def _check_weights(w13: torch.Tensor, w2: torch.Tensor, x_scales: Optional[torch.Tensor]) -> None:
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"expert_ffn: w13 must be [E, 2I, H], got "
                         f"{list(w13.shape) if isinstance(w13, torch.Tensor) else type(w13).__name__}")
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if not isinstance(w2, torch.Tensor) or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"expert_ffn: w2 must be [{num_experts}, {hidden}, {inter}] for w13 {list(w13.shape)}, got "
                         f"{list(w2.shape) if isinstance(w2, torch.Tensor) else type(w2).__name__}")
    if x_scales is not None and inter % GROUP:
        raise ValueError(f"expert_ffn: FP8 needs the intermediate size I to be a multiple of {GROUP}, got {inter}")
    if w2.device != w13.device:
        raise ValueError(f"expert_ffn: w2 must be on w13's device {w13.device}, got {w2.device}")


def _expert_ffn_fake(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert_offsets: Optional[torch.Tensor],
                     masked_m: Optional[torch.Tensor], x_scales: Optional[torch.Tensor],
                     w13_scales: Optional[torch.Tensor], w2_scales: Optional[torch.Tensor],
                     impl: Optional[str]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w2.shape[1]), dtype=torch.bfloat16)


@define("expert_ffn(Tensor x, Tensor w13, Tensor w2, Tensor? expert_offsets, Tensor? masked_m, Tensor? x_scales, "
        "Tensor? w13_scales, Tensor? w2_scales, str? impl) -> Tensor", _expert_ffn_fake)
def _expert_ffn_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert_offsets: Optional[torch.Tensor],
                   masked_m: Optional[torch.Tensor], x_scales: Optional[torch.Tensor],
                   w13_scales: Optional[torch.Tensor], w2_scales: Optional[torch.Tensor],
                   impl: Optional[str]) -> torch.Tensor:
    _check_weights(w13, w2, x_scales)
    inter = w13.shape[1] // 2
    first = GemmArgs("expert_ffn", x, w13, expert_offsets, masked_m, x_scales, w13_scales, inter)
    h = zeros((first.a.shape[0], inter), torch.bfloat16, x.device)
    chosen = resolve("expert_ffn", x.device, impl)
    if chosen == "triton":
        launch_gemm(first, h, swiglu=True)
    elif chosen == "tilelang":
        tilelang_launch.gemm(first, h, True, row_tiles)
    else:
        native_gemm(first, h, swiglu=True)
    h = h.view(first.out_shape)
    h_scales = None
    if x_scales is not None:
        q, h_scales = quantize(h.reshape(-1, inter), "e4m3", impl=chosen)
        h, h_scales = q.view(h.shape), h_scales.view(*h.shape[:-1], inter // GROUP)
    return grouped_gemm(h, w2, expert_offsets=expert_offsets, masked_m=masked_m, a_scales=h_scales,
                        b_scales=w2_scales, impl=chosen)


def expert_ffn_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                         expert_offsets: Optional[torch.Tensor] = None, masked_m: Optional[torch.Tensor] = None,
                         x_scales: Optional[torch.Tensor] = None, w13_scales: Optional[torch.Tensor] = None,
                         w2_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp64 specification of ``expert_ffn`` (float64 result). The intermediate is rounded as the op defines
    it (bf16, then E4M3 per 128 channels with FP8), so the error left is the two GEMMs' own."""
    inter = w13.shape[1] // 2
    first = GemmArgs("expert_ffn", x, w13, expert_offsets, masked_m, x_scales, w13_scales, inter)
    both = segments_reference(first, first.a, first.a_scales, w13, w13_scales)
    h = (torch.nn.functional.silu(both[:, :inter]) * both[:, inter:]).to(torch.bfloat16)
    h_scales = None
    if w2_scales is not None:
        h, h_scales = quantize(h, "e4m3", impl="native")
    out = segments_reference(first, h, h_scales, w2, w2_scales)
    return out.view(*first.out_shape[:-1], w2.shape[1])
