"""The torch baselines of ``moe_comm.bench.ops`` (what a framework without moe-comm's fused ops would
run) and the comparisons that check every implementation against them before timing."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from .checks import calc_diff

__all__ = ["GROUP", "TOL", "TorchPermutation", "torch_dispatch_layout", "torch_permute", "torch_quantize",
           "torch_dequantize", "loop_gemm", "loop_gemm_fp8", "loop_gemm_masked", "fp32_gemm_fp8", "fp32_ffn", "swiglu",
           "loop_ffn", "grouped_mm_fn", "torch_unpermute_index_add", "torch_unpermute_loop_k", "round_up", "exact",
           "close", "close_quantized", "close_permutation_fp8"]

GROUP = 128  # channels per FP8 scale (1x128 activations, 128x128 weights)
#: calc_diff bound for float results (DeepEP's dissimilarity). Independent bf16 roundings of the same
#: values give ~1e-6; DeepEP's 1e-4 would pass an output off by 1 % everywhere (calc_diff 5e-5).
TOL = 1e-5


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return (n + m - 1) // m * m


def torch_dispatch_layout(topk_idx: torch.Tensor, num_ranks: int, num_experts: int) -> tuple[torch.Tensor, ...]:
    """bincount + scatter: (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)."""
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=topk_idx.device)
    tokens = torch.arange(topk_idx.shape[0], device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)
    in_rank[tokens[valid], topk_idx[valid] // (num_experts // num_ranks)] = True
    return in_rank.sum(0, dtype=torch.int32), per_expert, in_rank


@dataclass
class TorchPermutation:
    """The fields of ``moe_comm.ops.Permutation``, built with torch index ops."""

    x: torch.Tensor
    scales: Optional[torch.Tensor]
    expert_offsets: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    row_of: torch.Tensor
    source: torch.Tensor
    expert_of_row: torch.Tensor


def torch_permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int) -> TorchPermutation:
    """Sort-based permute: a stable sort by expert keeps (token, slot) ascending within each expert."""
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    counts = torch.bincount(flat[valid], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    offsets[1:] = ((counts + alignment - 1) // alignment * alignment).cumsum(0)
    num_rows, num_valid = offsets[-1].item(), int(valid.sum())  # host syncs: the output size depends on them
    order = torch.sort(torch.where(valid, flat, num_experts), stable=True).indices[:num_valid]  # -1 sorts last
    experts = flat[order]
    first = counts.cumsum(0) - counts  # index in ``order`` of each expert's first entry
    rows = offsets[experts] + torch.arange(num_valid, device=x.device) - first[experts]
    out = x.new_zeros(num_rows, x.shape[1])
    out.index_copy_(0, rows, x.index_select(0, order // K))
    row_of = torch.full((T * K,), -1, dtype=torch.int64, device=x.device)
    row_of[order] = rows
    source = torch.full((num_rows,), -1, dtype=torch.int64, device=x.device)
    source[rows] = order
    expert_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=x.device)
    expert_of_row[rows] = experts.to(torch.int32)
    return TorchPermutation(out, None, offsets, counts.to(torch.int32), row_of.view(T, K), source, expert_of_row)


def torch_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantization in torch: e4m3 with one fp32 dequant scale per 128 channels (DeepEP's
    formula, ``moe_comm.ops.per_token_cast_to_fp8``), int8 with one scale per row."""
    if fmt == "e4m3":
        from moe_comm.ops import per_token_cast_to_fp8
        return per_token_cast_to_fp8(x)
    amax = x.float().abs().amax(dim=1).clamp(min=1e-4)
    scale = amax / 127.0
    return (x.float() / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8), scale


def torch_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp32 ``q * scale`` rounded to ``dtype``; scales `[T]` (per row) or `[T, H/128]` (per 128 channels)."""
    if scales.dim() == 1:
        return (q.float() * scales.unsqueeze(1)).to(dtype)
    T, H = q.shape
    return (q.float().view(T, H // GROUP, GROUP) * scales.unsqueeze(2)).view(T, H).to(dtype)


def _dequant_weights(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of ``per_block_cast_to_fp8`` for one expert `[N, K]`, in bf16."""
    N, K = q.shape
    return (q.float().view(N // GROUP, GROUP, K // GROUP, GROUP) * s[:, None, :, None]).view(N, K).bfloat16()


def loop_gemm(a: torch.Tensor, b: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Per-expert ``a[rows of e] @ b[e].T``; ``bounds`` is expert_offsets as a host list (given, not synced)."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    for e in range(b.shape[0]):
        if bounds[e + 1] > bounds[e]:
            torch.matmul(a[bounds[e]:bounds[e + 1]], b[e].T, out=out[bounds[e]:bounds[e + 1]])
    return out


def loop_gemm_fp8(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                  bounds: list[int]) -> torch.Tensor:
    """What a framework without a block-scaled grouped GEMM does: dequantize to bf16, then ``loop_gemm``."""
    a = torch_dequantize(a, a_s)
    out = a.new_zeros(a.shape[0], b.shape[1])
    for e in range(b.shape[0]):
        if bounds[e + 1] > bounds[e]:
            torch.matmul(a[bounds[e]:bounds[e + 1]], _dequant_weights(b[e], b_s[e]).T,
                         out=out[bounds[e]:bounds[e + 1]])
    return out


def loop_gemm_masked(a: torch.Tensor, b: torch.Tensor, m: list[int]) -> torch.Tensor:
    """Per-expert ``a[e, :m[e]] @ b[e].T`` into a zeroed `[E, M, N]`."""
    out = a.new_zeros(a.shape[0], a.shape[1], b.shape[1])
    for e in range(a.shape[0]):
        if m[e]:
            torch.matmul(a[e, :m[e]], b[e].T, out=out[e, :m[e]])
    return out


def fp32_gemm_fp8(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                  bounds: list[int]) -> torch.Tensor:
    """Check reference, not timed: the FP8 GEMM on operands dequantized in fp32, rounded once to bf16."""
    T, K = a.shape
    a = (a.float().view(T, K // GROUP, GROUP) * a_s.unsqueeze(2)).view(T, K)
    out = torch.zeros(T, b.shape[1], dtype=torch.bfloat16, device=a.device)
    for e in range(b.shape[0]):
        if bounds[e + 1] > bounds[e]:
            w = (b[e].float().view(-1, GROUP, K // GROUP, GROUP) * b_s[e][:, None, :, None]).view(b.shape[1], K)
            out[bounds[e]:bounds[e + 1]] = (a[bounds[e]:bounds[e + 1]] @ w.T).bfloat16()
    return out


def fp32_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Check reference, not timed: fp32 products, the activation rounded once to bf16 (the op's contract)."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            h = swiglu(x[lo:hi].float() @ w13[e].float().T)
            out[lo:hi] = (h.float() @ w2[e].float().T).bfloat16()
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to bf16 (the input of the down projection)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).bfloat16()


def loop_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Per-expert SwiGLU FFN: ``swiglu(x @ w13[e].T) @ w2[e].T``."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(swiglu(x[lo:hi] @ w13[e].T), w2[e].T, out=out[lo:hi])
    return out


def grouped_mm_fn() -> Optional[Callable[..., torch.Tensor]]:
    """torch's grouped GEMM (``b`` is `[E, K, N]`, ``offs`` int32 cumulative ends), public name first."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def torch_unpermute_index_add(y: torch.Tensor, row_of: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """index_add of the weighted rows into an fp32 `[T, H]` (order of the adds is torch's)."""
    valid = row_of >= 0
    tokens = torch.arange(row_of.shape[0], device=y.device).unsqueeze(1).expand_as(row_of)[valid]
    out = torch.zeros(row_of.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, tokens, y[row_of[valid]].float() * w[valid].unsqueeze(1))
    return out.to(y.dtype)


def torch_unpermute_loop_k(y: torch.Tensor, row_of: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gather one top-k slot at a time, k ascending, fp32 accumulation: the op's specification."""
    out = torch.zeros(row_of.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(row_of.shape[1]):
        rows = row_of[:, k]
        picked = y.index_select(0, rows.clamp(min=0)).float() * w[:, k:k + 1]
        out += torch.where((rows >= 0).unsqueeze(1), picked, 0.0)
    return out.to(y.dtype)



#: Permutation fields besides the rows and scales: all index data, compared exactly
_LAYOUT_FIELDS = ("expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row")


def exact(got: Any, want: Any) -> tuple[bool, str]:
    """Data movement: every tensor equal (index tensors by value, whatever their integer dtype)."""
    for name, g, w in _pairs(got, want):
        if g.shape != w.shape:
            return False, f"{name}: shape {list(g.shape)} != {list(w.shape)}"
        if g.is_floating_point() or w.is_floating_point():
            same = g.dtype == w.dtype and torch.equal(_bits(g), _bits(w))
        else:
            same = torch.equal(g.long(), w.long())
        if not same:
            return False, f"{name} differs"
    return True, "equal"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers (bitwise equality; also where torch.equal lacks the dtype)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _pairs(got: Any, want: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(field, got, want) for tensors, tuples of tensors, or Permutation-like records."""
    if isinstance(want, torch.Tensor):
        return [("out", got, want)]
    if isinstance(got, torch.Tensor):  # a baseline that produces the rows only
        return [("x", got, want.x)]
    if isinstance(want, tuple):
        return [(f"[{i}]", g, w) for i, (g, w) in enumerate(zip(got, want))]
    return [(n, getattr(got, n), getattr(want, n)) for n in ("x",) + _LAYOUT_FIELDS]


def close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """Float results: same shape and calc_diff < TOL."""
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)} != {list(want.shape)}"
    diff = calc_diff(got.float(), want.float())
    return diff < TOL, f"calc_diff {diff:.1e}"


def close_quantized(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[bool, str]:
    """Quantized results: dtypes equal, dequantized values within TOL."""
    if got[0].dtype != want[0].dtype:
        return False, f"dtype {got[0].dtype} != {want[0].dtype}"
    return close(torch_dequantize(*got), torch_dequantize(*want))


def close_permutation_fp8(got: Any, want: TorchPermutation) -> tuple[bool, str]:
    """Fused quantizing permute: layout fields exact, rows dequantized within TOL."""
    ok, what = exact(tuple(getattr(got, n) for n in _LAYOUT_FIELDS), tuple(getattr(want, n) for n in _LAYOUT_FIELDS))
    if not ok:
        return ok, what
    return close_quantized((got.x, got.scales), (want.x, want.scales))
