"""The weights of a set of SwiGLU experts (BF16, or FP8 with 128x128 block scales) and their FFN."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.checks import describe
from ..core.errors import bad_argument
from ..ops import expert_ffn, per_block_cast_to_fp8
from ..ops.fp8 import FP8_DTYPE, GROUP

__all__ = ["Experts"]


@dataclass(frozen=True)
class Experts:
    """``w13`` `[E, 2I, H]` (gate rows ``[0, I)``, then up rows, vLLM's layout) and ``w2`` `[E, H, I]`, both
    bf16, or both float8_e4m3fn with fp32 block scales ``w13_scales`` `[E, ceil(2I / 128), H / 128]` and
    ``w2_scales`` `[E, ceil(H / 128), I / 128]`. Expert e computes ``w2[e] @ (silu(gate @ x) * (up @ x))``."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: Optional[torch.Tensor] = None
    w2_scales: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        op = "Experts"
        if not isinstance(self.w13, torch.Tensor) or self.w13.dim() != 3 or self.w13.shape[1] % 2:
            bad_argument(op, "w13", "a [E, 2I, H] tensor", describe(self.w13))
        e, two_i, h = self.w13.shape
        if not isinstance(self.w2, torch.Tensor) or tuple(self.w2.shape) != (e, h, two_i // 2):
            bad_argument(op, "w2", f"a [{e}, {h}, {two_i // 2}] tensor (for w13 {list(self.w13.shape)})",
                         describe(self.w2))
        if self.w13.dtype != self.w2.dtype or self.w13.dtype not in (torch.bfloat16, FP8_DTYPE):
            bad_argument(op, "w13 and w2", "both bfloat16 or both float8_e4m3fn",
                         f"{self.w13.dtype} and {self.w2.dtype}", kind=TypeError)
        if self.w2.device != self.w13.device:
            bad_argument(op, "w2", f"on w13's device {self.w13.device}", describe(self.w2))
        if self.fp8:
            if h % GROUP or (two_i // 2) % GROUP:
                bad_argument(op, "w13", f"FP8 with H and I multiples of {GROUP}", describe(self.w13))
            for name, scales, rows, cols in (("w13_scales", self.w13_scales, two_i, h),
                                             ("w2_scales", self.w2_scales, h, two_i // 2)):
                want = (e, -(-rows // GROUP), cols // GROUP)
                if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != want or \
                        scales.dtype != torch.float32 or scales.device != self.w13.device:
                    bad_argument(op, name, f"float32 {list(want)} on {self.w13.device}", describe(scales))
        elif self.w13_scales is not None or self.w2_scales is not None:
            bad_argument(op, "w13_scales and w2_scales", "None for bfloat16 weights",
                         f"{describe(self.w13_scales)} and {describe(self.w2_scales)}")

    @classmethod
    def quantized(cls, w13: torch.Tensor, w2: torch.Tensor) -> "Experts":
        """FP8 experts from high-precision weights, one scale per 128x128 block (``per_block_cast_to_fp8``)."""
        (q13, s13), (q2, s2) = per_block_cast_to_fp8(w13), per_block_cast_to_fp8(w2)
        return cls(q13, q2, s13, s2)

    @property
    def fp8(self) -> bool:
        return self.w13.dtype == FP8_DTYPE

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def to(self, device: torch.device) -> "Experts":
        """The same experts on ``device``."""
        return Experts(*(None if t is None else t.to(device) for t in (self.w13, self.w2, self.w13_scales,
                                                                        self.w2_scales)))

    def select(self, first: int, count: int) -> "Experts":
        """Experts ``[first, first + count)`` (views, no copy): one rank's share of a global set."""
        part = slice(first, first + count)
        return Experts(self.w13[part], self.w2[part], None if self.w13_scales is None else self.w13_scales[part],
                       None if self.w2_scales is None else self.w2_scales[part])

    def ffn(self, x: torch.Tensor, *, expert_offsets: Optional[torch.Tensor] = None,
            masked_m: Optional[torch.Tensor] = None, x_scales: Optional[torch.Tensor] = None,
            impl: Optional[str] = None) -> torch.Tensor:
        """``moe_comm.ops.expert_ffn`` with these weights: bf16 rows in either grouped-GEMM layout (FP8
        experts need FP8 ``x`` with per-128-channel ``x_scales``)."""
        return expert_ffn(x, self.w13, self.w2, expert_offsets=expert_offsets, masked_m=masked_m, x_scales=x_scales,
                          w13_scales=self.w13_scales, w2_scales=self.w2_scales, impl=impl)
