"""Permute tokens into expert-major order: the contiguous grouped-GEMM layout (DeepGEMM's aligned
``m_indices``, vLLM's ``moe_align_block_size``), optionally quantized in the same pass."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.library import define, no_tensor, op
from ..core.native import NATIVE_DTYPES
from .impl import kernels, renamed_impl, resolve
from .npu import permute_npu, torch_npu_for
from .quant import FORMATS, check_quant_args, launch_rows, native_rows, quantize_reference, scales_shape, tilelang_rows
from .rows import take_rows

__all__ = ["Permutation", "permute", "permute_reference", "max_permuted_rows"]

_INDEX_BLOCK = 128  # the [BLOCK, BLOCK] rank matrix stays within on-chip memory (Ascend A2: 192 KB)


@dataclass(frozen=True)
class Permutation:
    """Rows in expert-major order. Expert e owns rows ``[expert_offsets[e], expert_offsets[e + 1])``:
    its ``num_tokens_per_expert[e]`` routed (token, slot) pairs in flat ``t * K + k`` order, then zero
    padding up to a multiple of the alignment; rows past ``expert_offsets[E]`` are padding too."""

    x: torch.Tensor                    # [rows, H] x's dtype, or float8 / int8 when quantized
    scales: Optional[torch.Tensor]     # FP8 [rows, H / 128] fp32 (UE8M0: int32 [rows, H / 512]); INT8 [rows] fp32
    expert_offsets: torch.Tensor       # [E + 1] int64, expert_offsets[0] == 0
    num_tokens_per_expert: torch.Tensor  # [E] int32, rows before padding
    row_of: torch.Tensor               # [T, K] int64: the row of (t, k), -1 where topk_idx[t, k] == -1
    source: torch.Tensor               # [rows] int64: t * K + k of the row, -1 for padding
    expert_of_row: torch.Tensor        # [rows] int32: expert of the row, -1 for padding (DeepGEMM's m_indices)


def max_permuted_rows(num_tokens: int, num_topk: int, num_experts: int, alignment: int = 1) -> int:
    """The most rows any routing of ``num_tokens x num_topk`` can need: a fixed ``num_rows`` for
    ``permute`` that avoids reading the exact count back from the device (CUDA graphs)."""
    return num_tokens * num_topk + num_experts * (alignment - 1)


def _check(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"permute: x must be a 2-D tensor [T, H], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"permute: topk_idx must be [T, K] with T = {x.shape[0]} (x's rows), got "
                         f"{list(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"permute: topk_idx must be int64, got {topk_idx.dtype}")
    if topk_idx.device != x.device:
        raise ValueError(f"permute: topk_idx must be on x's device {x.device}, got {topk_idx.device}")
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"permute: num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"permute: alignment must be a positive int, got {alignment!r}")


def _check_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    if topk_idx.numel():
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < -1 or high >= num_experts:
            raise ValueError(f"permute: topk_idx entries must be -1 or in [0, {num_experts}), got values in "
                             f"[{low}, {high}]")


def _offsets(per_expert: torch.Tensor, alignment: int) -> torch.Tensor:
    aligned = (per_expert.to(torch.int64) + alignment - 1) // alignment * alignment
    return torch.cat([aligned.new_zeros(1), aligned.cumsum(0)])


def _num_rows(offsets: torch.Tensor, num_rows: Optional[int]) -> int:
    needed = int(offsets[-1])  # reads the device once when num_rows is not given
    if num_rows is None:
        return needed
    if not isinstance(num_rows, int) or num_rows < needed:
        raise ValueError(f"permute: num_rows must be an int >= {needed} (the rows this routing needs), "
                         f"got {num_rows!r}")
    return num_rows


def permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, *, alignment: int = 1,
            quant: Optional[str] = None, round_scale: bool = False, use_ue8m0: bool = False,
            num_rows: Optional[int] = None, impl: Optional[str] = None, backend: Optional[str] = None
            ) -> Permutation:
    """Gathers ``x`` `[T, H]` into expert-major rows by ``topk_idx`` `[T, K]` int64 (ids in
    ``[0, num_experts)``, -1 = skip). ``quant`` (``e4m3``, ``e5m2``, ``int8``) casts in the same pass,
    with the same bits as ``quantize`` of the unquantized permutation. ``num_rows`` fixes the output
    size (at least the rows needed; ``max_permuted_rows`` is always enough); None sizes it exactly.
    Deterministic; reference ``permute_reference`` (tests compare every field exactly). Runs as
    ``torch.ops.moe_comm.permute`` (without ``num_rows`` a compiled graph sizes the rows when it runs)."""
    _check(x, topk_idx, num_experts, alignment)
    check_quant_args("permute", x.shape[1], quant, round_scale, use_ue8m0)
    if num_rows is not None and (isinstance(num_rows, bool) or not isinstance(num_rows, int)):
        raise ValueError(f"permute: num_rows must be an int or None, got {num_rows!r}")
    impl = renamed_impl("permute", "impl", impl, backend)
    out, scales, *rest = op("permute")(x, topk_idx, num_experts, alignment, quant, round_scale, use_ue8m0, num_rows,
                                       impl)
    return Permutation(out, scales if quant is not None else None, *rest)


def _permute_fake(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int, quant: Optional[str],
                  round_scale: bool, use_ue8m0: bool, num_rows: Optional[int], impl: Optional[str]) -> tuple:
    rows = torch.library.get_ctx().new_dynamic_size() if num_rows is None else num_rows
    hidden = x.shape[-1]
    if quant is None:
        scales = no_tensor(x, torch.float32)
    else:
        shape, dtype = scales_shape(rows, hidden, quant, use_ue8m0)
        scales = x.new_empty(shape, dtype=dtype)
    index = topk_idx.new_empty
    return (x.new_empty(rows, hidden, dtype=FORMATS[quant] if quant else x.dtype), scales,
            index(num_experts + 1, dtype=torch.int64), index(num_experts, dtype=torch.int32),
            index(topk_idx.shape, dtype=torch.int64), index(rows, dtype=torch.int64), index(rows, dtype=torch.int32))


@define("permute(Tensor x, Tensor topk_idx, int num_experts, int alignment, str? quant, bool round_scale, "
        "bool use_ue8m0, SymInt? num_rows, str? impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        _permute_fake)
def _permute_op(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int, quant: Optional[str],
                round_scale: bool, use_ue8m0: bool, num_rows: Optional[int], impl: Optional[str]) -> tuple:
    """``permute``'s fields as a tuple (scales empty without ``quant``), after every check (an op may be called
    directly), those that read ``topk_idx`` included."""
    _check(x, topk_idx, num_experts, alignment)
    check_quant_args("permute", x.shape[1], quant, round_scale, use_ue8m0)
    if topk_idx.device.type == "cpu":  # elsewhere it would cost a host sync
        _check_ids(topk_idx, num_experts)
    chosen = resolve("permute", x.device, impl)
    if chosen == "triton":
        fields = _permute_triton(x, topk_idx, num_experts, alignment, quant, round_scale, use_ue8m0, num_rows)
    elif chosen == "tilelang":
        fields = _permute_tilelang(x, topk_idx, num_experts, alignment, quant, round_scale, use_ue8m0, num_rows)
    else:
        fields = _permute_native(x, topk_idx, num_experts, alignment, quant, round_scale, use_ue8m0, num_rows)
    return (fields[0], no_tensor(x, torch.float32) if fields[1] is None else fields[1], *fields[2:])


def _permute_native(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int,
                    quant: Optional[str], round_scale: bool, use_ue8m0: bool, num_rows: Optional[int]) -> tuple:
    torch_npu = torch_npu_for(x)
    if torch_npu is not None and alignment == 1 and quant in (None, "int8"):
        return permute_npu(torch_npu, x, topk_idx, num_experts, quant, lambda offsets: _num_rows(offsets, num_rows))
    index = _sorted_indices(topk_idx, num_experts, alignment, num_rows)
    source = index[3]  # Permutation.source
    rows = source.shape[0]
    scales = None
    if quant is not None and x.device.type == "cpu" and x.dtype in NATIVE_DTYPES:  # gather and cast in one pass
        out, scales = native_rows(x, rows, quant, round_scale, use_ue8m0, source=source, source_div=topk_idx.shape[1])
    else:
        out = x.new_empty(rows, x.shape[1])
        take_rows(out, x, torch.where(source >= 0, source // topk_idx.shape[1], -1))
        if quant is not None:
            out, scales = quantize_reference(out, quant, round_scale=round_scale, use_ue8m0=use_ue8m0)
    return (out, scales, *index)


def _sorted_indices(topk_idx: torch.Tensor, num_experts: int, alignment: int, num_rows: Optional[int]) -> tuple:
    """The index fields of a permutation, in ``Permutation``'s order (expert_offsets, num_tokens_per_expert,
    row_of, source, expert_of_row), by a stable sort of the flat ids."""
    flat = topk_idx.reshape(-1)
    experts, order = torch.sort(flat, stable=True)  # -1 first, then by expert, flat order within
    skipped = int((flat < 0).sum())
    per_expert = torch.bincount(experts[skipped:], minlength=num_experts)
    offsets = _offsets(per_expert, alignment)
    rows = _num_rows(offsets, num_rows)
    routed = order[skipped:]
    expert = experts[skipped:]
    first_of_expert = (per_expert.cumsum(0) - per_expert)[expert]
    row = offsets[expert] + torch.arange(routed.numel(), device=flat.device) - first_of_expert
    row_of = torch.full_like(flat, -1).index_put_((routed,), row)
    source = torch.full((rows,), -1, dtype=torch.int64, device=flat.device).index_put_((row,), routed)
    expert_of_row = torch.full((rows,), -1, dtype=torch.int32, device=flat.device).index_put_((row,),
                                                                                             expert.to(torch.int32))
    return offsets, per_expert.to(torch.int32), row_of.view_as(topk_idx), source, expert_of_row


def _permute_tilelang(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int,
                      quant: Optional[str], round_scale: bool, use_ue8m0: bool, num_rows: Optional[int]) -> tuple:
    """The indices by the native sort (index arithmetic, a small share of the bytes), the rows and their
    FP8 cast in one pass of the TileLang rows program."""
    index = _sorted_indices(topk_idx, num_experts, alignment, num_rows)
    source = index[3]  # Permutation.source
    out, scales = tilelang_rows("permute", x, source.shape[0], quant, round_scale, use_ue8m0, source=source,
                                source_div=topk_idx.shape[1])
    return (out, scales, *index)


def _permute_triton(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, alignment: int,
                    quant: Optional[str], round_scale: bool, use_ue8m0: bool, num_rows: Optional[int]) -> tuple:
    k = kernels("permute")
    flat = topk_idx.contiguous().reshape(-1)
    blocks = max(1, -(-flat.numel() // _INDEX_BLOCK))
    counts = torch.zeros(blocks, num_experts, dtype=torch.int32, device=x.device)
    if flat.numel():
        k.block_histogram_kernel[(blocks,)](flat, counts, flat.numel(), NUM_EXPERTS=num_experts, BLOCK=_INDEX_BLOCK)
    per_expert = counts.sum(0, dtype=torch.int64)
    offsets = _offsets(per_expert, alignment)
    rows = _num_rows(offsets, num_rows)
    block_base = offsets[:-1] + counts.to(torch.int64).cumsum(0) - counts  # first row of each (block, expert)
    row_of = torch.empty_like(flat)
    source = torch.full((rows,), -1, dtype=torch.int64, device=x.device)
    expert_of_row = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
    if flat.numel():
        k.permute_index_kernel[(blocks,)](flat, block_base.contiguous(), row_of, source, expert_of_row, flat.numel(),
                                          NUM_EXPERTS=num_experts, BLOCK=_INDEX_BLOCK)
    out, scales = launch_rows(x, rows, quant, round_scale, use_ue8m0, source=source, source_div=topk_idx.shape[1])
    return (out, scales, offsets, per_expert.to(torch.int32), row_of.view_as(topk_idx), source, expert_of_row)


def permute_reference(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, *, alignment: int = 1,
                      quant: Optional[str] = None, round_scale: bool = False, use_ue8m0: bool = False,
                      num_rows: Optional[int] = None) -> Permutation:
    """Plain specification of ``permute``: one expert at a time, in flat (t, k) order."""
    _check_ids(topk_idx, num_experts)
    num_tokens, num_topk = topk_idx.shape
    flat = topk_idx.reshape(-1).tolist()
    sources, experts, row_of = [], [], [-1] * len(flat)
    offsets, per_expert = [0], []
    for e in range(num_experts):
        mine = [i for i, expert in enumerate(flat) if expert == e]
        padded = -(-len(mine) // alignment) * alignment
        for i in mine:
            row_of[i] = len(sources)
            sources.append(i)
            experts.append(e)
        sources += [-1] * (padded - len(mine))
        experts += [-1] * (padded - len(mine))
        offsets.append(offsets[-1] + padded)
        per_expert.append(len(mine))
    rows = len(sources) if num_rows is None else num_rows
    sources += [-1] * (rows - len(sources))
    experts += [-1] * (rows - len(experts))
    out = x.new_zeros(rows, x.shape[1])
    for row, i in enumerate(sources):
        if i >= 0:
            out[row] = x[i // num_topk]
    scales = None
    if quant is not None:
        out, scales = quantize_reference(out, quant, round_scale=round_scale, use_ue8m0=use_ue8m0)
    device = x.device
    return Permutation(out, scales, torch.tensor(offsets, device=device),
                       torch.tensor(per_expert, dtype=torch.int32, device=device),
                       torch.tensor(row_of, dtype=torch.int64, device=device).view(num_tokens, num_topk),
                       torch.tensor(sources, dtype=torch.int64, device=device),
                       torch.tensor(experts, dtype=torch.int32, device=device))

