"""The cases of ``moe_comm.bench.ops``: one rank's routed inputs, and per (op, case) our backends beside
the torch baselines with the work (bytes or FLOPs) each row is credited with, plus the device's
copy and matmul ceilings."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .ops_baselines import (GROUP, TorchPermutation, close, close_permutation_fp8, close_quantized, exact,
                            fp32_ffn, fp32_gemm_fp8, grouped_mm_fn, loop_ffn, loop_gemm, loop_gemm_fp8,
                            loop_gemm_masked, round_up, swiglu, torch_dequantize, torch_dispatch_layout, torch_permute,
                            torch_quantize, torch_unpermute_index_add, torch_unpermute_loop_k)

__all__ = ["BYTE_RULE", "FLOP_RULE", "Case", "Group", "inputs", "build_groups", "ceiling_cases"]

BYTE_RULE = ("bytes that must be read + written once each: dispatch_layout: topk_idx (T*K*8) + counts (R*4 + E*4) "
             "+ is_token_in_rank (T*R); permute: x read once (T*H*2) + rows written (rows*H*2 bf16, or rows*H + "
             "rows*H/128*4 fp8) + index metadata (topk_idx and row_of T*K*8 each, source and expert_of_row rows*12, "
             "offsets and counts); quantize: T*H*2 + T*H + scales (T*H/128*4 e4m3, T*4 int8), dequantize the "
             "reverse; unpermute_reduce: valid rows of y (T*K*H*2) + row_of and weights (T*K*12) + out (T*H*2); "
             "rows = padded permuted rows; memory ceiling: bytes read + written by one copy. "
             "GB/s = bytes / median time / 1e9")
FLOP_RULE = ("grouped_gemm: 2*M*N*K with M = valid rows (padding and masked-off rows excluded); expert_ffn (SwiGLU): "
             "2*M*2I*H + 2*M*H*I; compute ceiling: 2*M*N*K of one dense bf16 torch.matmul. TFLOP/s = FLOPs / median "
             "time / 1e12")


@dataclass
class Case:
    """One timed row. ``fn`` None: not run, ``note`` says why."""

    op: str
    case: str
    impl: str
    fn: Optional[Callable[[], Any]]
    work: float            # bytes (unit "GB/s") or FLOPs (unit "TFLOP/s"), by BYTE_RULE / FLOP_RULE
    unit: str
    ours: bool = False     # a backend of moe_comm: a failed check stops the run
    full: bool = True      # a complete implementation of the op (only these set vs_torch)
    note: str = ""
    first_s: Optional[float] = None  # ours: the first call's seconds (TileLang's compile), set by the check


@dataclass
class Group:
    """The impls of one (op, case), checked against ``want`` (a torch baseline, or for FP8 and the FFN
    an fp32 reference of the op's contract) before any timing."""

    op: str
    case: str
    want: Callable[[], Any]
    compare: Callable[[Any, Any], tuple[bool, str]]   # (got, want) -> (ok, what was measured)
    cases: list[Case] = field(default_factory=list)



def inputs(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Routing, activations, weights (bf16 and FP8) and the torch permutation every later op consumes."""
    T, H, I, E, K, A = (cfg[k] for k in ("tokens", "hidden", "intermediate", "experts", "topk", "alignment"))
    gen = torch.Generator(device=device).manual_seed(cfg["seed"])
    x = torch.randn(T, H, generator=gen, device=device).bfloat16()
    topk_idx = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices  # distinct experts per token
    weights = torch.rand(T, K, generator=gen, device=device)
    # scaled so that activations stay O(1) through both projections
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=device) / math.sqrt(H)).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen, device=device) / math.sqrt(I)).bfloat16()
    perm = torch_permute(x, topk_idx, E, A)
    bounds = perm.expert_offsets.tolist()
    counts = perm.num_tokens_per_expert.tolist()
    # masked layout (DeepEP low-latency): [E, M, H], expert e's rows first, the rest zero
    M = round_up(max(max(counts), 1), A)
    rows = torch.nonzero(perm.source >= 0).squeeze(1)
    experts = perm.expert_of_row[rows].long()
    xm = x.new_zeros(E, M, H)
    xm[experts, rows - perm.expert_offsets[experts]] = perm.x[rows]
    a_q, a_s = torch_quantize(perm.x, "e4m3")
    from moe_comm.ops import per_block_cast_to_fp8
    w13_q, w13_s = per_block_cast_to_fp8(w13)
    return dict(x=x, topk_idx=topk_idx, weights=weights, w13=w13, w2=w2, perm=perm, bounds=bounds, counts=counts,
                xm=xm, masked_m=perm.num_tokens_per_expert.clone(), M=M, a_q=a_q, a_s=a_s, w13_q=w13_q, w13_s=w13_s,
                offs32=perm.expert_offsets[1:].to(torch.int32), valid=sum(counts))


def _ours(name: str, backends: Sequence[str], fmt: Optional[str] = None
          ) -> list[tuple[str, Optional[Callable[..., Any]], str]]:
    """(backend, op or None, reason) for each of our backends; TileLang has programs for some ops, FP8 only."""
    from moe_comm.ops.impl import tilelang_covers
    op = getattr(importlib.import_module("moe_comm.ops"), name, None)
    found = []
    for b in backends:
        if b == "tilelang" and not tilelang_covers(name, fmt):
            found.append((b, None, f"no TileLang program for {name}{f' {fmt}' if tilelang_covers(name) else ''}"))
        else:
            found.append((b, op, "" if op else f"moe_comm.ops has no {name}"))
    return found


def _add_ours(g: Group, name: str, backends: Sequence[str], work: float, unit: str,
              call: Callable[[Callable[..., Any], str], Any], fmt: Optional[str] = None) -> None:
    """One row per backend of ours; ``call(op, backend)`` runs the op (of format ``fmt``, where it has one)."""
    for backend, op, reason in _ours(name, backends, fmt):
        fn = (lambda op=op, backend=backend: call(op, backend)) if op else None
        g.cases.append(Case(g.op, g.case, backend, fn, work, unit, ours=True, note=reason))


def _fields(layout: Any) -> tuple[torch.Tensor, ...]:
    """A DispatchLayout as the torch baseline's tuple."""
    return layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank


def build_groups(d: dict[str, Any], cfg: dict[str, Any], backends: Sequence[str]) -> list[Group]:
    """Every (op, case) with its impls: ours first, then the torch baselines."""
    T, H, I, E, K, R, A = (cfg[k] for k in ("tokens", "hidden", "intermediate", "experts", "topk", "ranks",
                                            "alignment"))
    x, topk_idx, perm, bounds, w13, w2 = d["x"], d["topk_idx"], d["perm"], d["bounds"], d["w13"], d["w2"]
    rows, valid = perm.x.shape[0], d["valid"]
    meta = 2 * T * K * 8 + rows * 12 + (E + 1) * 8 + E * 4
    gmm = grouped_mm_fn()
    groups = []

    nbytes = T * K * 8 + R * 4 + E * 4 + T * R
    g = Group("dispatch_layout", f"R{R}", lambda: torch_dispatch_layout(topk_idx, R, E), exact)
    _add_ours(g, "dispatch_layout", backends, nbytes, "GB/s", lambda op, b: _fields(op(topk_idx, R, E, impl=b)))
    g.cases.append(Case(g.op, g.case, "torch", lambda: torch_dispatch_layout(topk_idx, R, E), nbytes, "GB/s"))
    groups.append(g)

    nbytes = T * H * 2 + rows * H * 2 + meta
    g = Group("permute", "bf16", lambda: torch_permute(x, topk_idx, E, A), exact)
    _add_ours(g, "permute", backends, nbytes, "GB/s", lambda op, b: op(x, topk_idx, E, alignment=A, impl=b))
    g.cases.append(Case(g.op, g.case, "torch_sort", lambda: torch_permute(x, topk_idx, E, A), nbytes, "GB/s"))
    src_tok, dst_rows = perm.source[perm.source >= 0] // K, torch.nonzero(perm.source >= 0).squeeze(1)
    out = torch.zeros_like(perm.x)
    g.cases.append(Case(g.op, g.case, "torch_index_copy", lambda: out.index_copy_(0, dst_rows, x[src_tok]), nbytes,
                        "GB/s", full=False, note="rows only, indices precomputed"))
    groups.append(g)

    def torch_permute_fp8() -> TorchPermutation:
        p = torch_permute(x, topk_idx, E, A)
        p.x, p.scales = torch_quantize(p.x, "e4m3")
        return p

    nbytes = T * H * 2 + rows * H + rows * (H // GROUP) * 4 + meta
    g = Group("permute", "fp8 e4m3", torch_permute_fp8, close_permutation_fp8)
    _add_ours(g, "permute", backends, nbytes, "GB/s",
              lambda op, b: op(x, topk_idx, E, alignment=A, quant="e4m3", impl=b))
    quantize = getattr(importlib.import_module("moe_comm.ops"), "quantize", None)
    permute = getattr(importlib.import_module("moe_comm.ops"), "permute", None)
    for b in backends:
        def unfused(b: str = b) -> Any:
            p = permute(x, topk_idx, E, alignment=A, impl=b)
            q, s = quantize(p.x, "e4m3", impl=b)
            return TorchPermutation(q, s, p.expert_offsets, p.num_tokens_per_expert, p.row_of, p.source,
                                    p.expert_of_row)
        g.cases.append(Case(g.op, g.case, f"{b}_unfused", unfused if quantize and permute else None, nbytes, "GB/s",
                            ours=True, note="permute then quantize" if quantize and permute else "op missing"))
    g.cases.append(Case(g.op, g.case, "torch_sort", torch_permute_fp8, nbytes, "GB/s"))
    groups.append(g)

    for fmt, scale_bytes in (("e4m3", T * (H // GROUP) * 4), ("int8", T * 4)):
        nbytes = T * H * 2 + T * H + scale_bytes
        g = Group("quantize", fmt, lambda fmt=fmt: torch_quantize(x, fmt), close_quantized)
        _add_ours(g, "quantize", backends, nbytes, "GB/s", lambda op, b, fmt=fmt: op(x, fmt, impl=b), fmt)
        g.cases.append(Case(g.op, g.case, "torch", lambda fmt=fmt: torch_quantize(x, fmt), nbytes, "GB/s"))
        groups.append(g)
    for fmt, scale_bytes in (("e4m3", T * (H // GROUP) * 4), ("int8", T * 4)):
        q, s = torch_quantize(x, fmt)
        nbytes = T * H + scale_bytes + T * H * 2
        g = Group("dequantize", fmt, lambda q=q, s=s: torch_dequantize(q, s), close)
        _add_ours(g, "dequantize", backends, nbytes, "GB/s", lambda op, b, q=q, s=s: op(q, s, impl=b), fmt)
        g.cases.append(Case(g.op, g.case, "torch", lambda q=q, s=s: torch_dequantize(q, s), nbytes, "GB/s"))
        groups.append(g)

    a, offs = perm.x, perm.expert_offsets
    flops = 2 * valid * (2 * I) * H
    g = Group("grouped_gemm", "contig bf16", lambda: loop_gemm(a, w13, bounds), close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(a, w13, expert_offsets=offs, impl=b))
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm",
                        (lambda: gmm(a, w13.transpose(1, 2), offs=d["offs32"])) if gmm else None, flops, "TFLOP/s",
                        note="" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_gemm(a, w13, bounds), flops, "TFLOP/s",
                        note="bounds on host"))
    groups.append(g)

    a_q, a_s, w_q, w_s = d["a_q"], d["a_s"], d["w13_q"], d["w13_s"]
    g = Group("grouped_gemm", "contig fp8 blk", lambda: fp32_gemm_fp8(a_q, a_s, w_q, w_s, bounds), close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(a_q, w_q, expert_offsets=offs, a_scales=a_s, b_scales=w_s, impl=b))
    g.cases.append(Case(g.op, g.case, "torch_scaled_grouped_mm", _scaled_grouped_mm(a_q, a_s, w_q, w_s, d["offs32"]),
                        flops, "TFLOP/s", note="1x128 x 128x128 block scales"))
    g.cases.append(Case(g.op, g.case, "torch_loop_dequant", lambda: loop_gemm_fp8(a_q, a_s, w_q, w_s, bounds), flops,
                        "TFLOP/s", note="dequant to bf16 per call; bounds on host"))
    groups.append(g)

    xm, masked_m, counts = d["xm"], d["masked_m"], d["counts"]
    g = Group("grouped_gemm", "masked bf16", lambda: loop_gemm_masked(xm, w13, counts), close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(xm, w13, masked_m=masked_m, impl=b))
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm", (lambda: gmm(xm, w13.transpose(1, 2))) if gmm else None,
                        flops, "TFLOP/s", note="computes all E*M rows" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_gemm_masked(xm, w13, counts), flops, "TFLOP/s",
                        note="masked_m on host"))
    groups.append(g)

    flops = 2 * valid * (2 * I) * H + 2 * valid * H * I
    g = Group("expert_ffn", "contig bf16 swiglu", lambda: fp32_ffn(a, w13, w2, bounds), close)
    _add_ours(g, "expert_ffn", backends, flops, "TFLOP/s", lambda op, b: op(a, w13, w2, expert_offsets=offs, impl=b))
    offs32 = d["offs32"]
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm",
                        (lambda: gmm(swiglu(gmm(a, w13.transpose(1, 2), offs=offs32)), w2.transpose(1, 2),
                                     offs=offs32)) if gmm else None,
                        flops, "TFLOP/s", note="2 grouped_mm + swiglu" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_ffn(a, w13, w2, bounds), flops, "TFLOP/s",
                        note="bounds on host"))
    groups.append(g)

    weights, row_of = d["weights"], perm.row_of
    nbytes = valid * H * 2 + T * K * 12 + T * H * 2
    g = Group("unpermute_reduce", "bf16", lambda: torch_unpermute_loop_k(a, row_of, weights), close)
    _add_ours(g, "unpermute_reduce", backends, nbytes, "GB/s", lambda op, b: op(a, row_of, weights, impl=b))
    g.cases.append(Case(g.op, g.case, "torch_index_add", lambda: torch_unpermute_index_add(a, row_of, weights), nbytes,
                        "GB/s"))
    g.cases.append(Case(g.op, g.case, "torch_loop_k", lambda: torch_unpermute_loop_k(a, row_of, weights), nbytes,
                        "GB/s"))
    groups.append(g)
    return groups


def _scaled_grouped_mm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                       offs32: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
    """torch's block-scaled FP8 grouped GEMM, when this torch has it; whether the device supports
    these scale recipes shows at the check (an error there becomes the row's 'n/a' reason)."""
    if not hasattr(F, "scaled_grouped_mm"):
        return None
    return lambda: F.scaled_grouped_mm(a_q, w_q.transpose(1, 2), a_s, F.ScalingType.BlockWise1x128, w_s,
                                       F.ScalingType.BlockWise128x128, offs=offs32, output_dtype=torch.bfloat16)


def ceiling_cases(cfg: dict[str, Any], device: torch.device, valid: int) -> list[Case]:
    """Memory: one copy of a large tensor. Compute: one dense matmul the size of the w13 GEMM, with the
    weight stored [N, K] as the experts' are (torch's CPU bf16 GEMM is far slower on a [K, N] operand);
    bf16 is the ceiling, fp32 is shown beside it because the native GEMMs multiply in fp32."""
    nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    M, N, K = valid, 2 * cfg["intermediate"], cfg["hidden"]
    a = torch.randn(M, K, device=device)
    b = torch.randn(N, K, device=device)
    a16, b16 = a.bfloat16(), b.bfloat16()
    return [Case("ceiling", f"copy {nbytes >> 20} MiB", "copy", lambda: dst.copy_(src), 2 * nbytes, "GB/s"),
            Case("ceiling", f"{M}x{N}x{K}", "matmul_bf16", lambda: a16 @ b16.T, 2 * M * N * K, "TFLOP/s"),
            Case("ceiling", f"{M}x{N}x{K}", "matmul_fp32", lambda: a @ b.T, 2 * M * N * K, "TFLOP/s",
                 note="for the fp32 native GEMMs")]
