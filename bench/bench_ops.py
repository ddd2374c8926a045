"""Benchmark of the fused MoE ops in ``moe_comm.ops`` against the device's measured ceilings and torch baselines.

    python bench/bench_ops.py                                   # CUDA when available, else CPU; sizes per device
    python bench/bench_ops.py --device cpu --reps 5             # tokens 512, hidden 2048, I 256, 64 experts, top-8
    python bench/bench_ops.py --device cuda --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8

One process, one device. Shapes are one EP rank's share: ``tokens`` tokens routed by random top-k
over the ``experts`` local experts. Every op runs each of our backends ("native"; on CUDA also
"triton") next to torch baselines and two ceilings measured in the same run (a large tensor copy,
one dense bf16 matmul). Every output is checked against a torch baseline before anything is
timed; a backend of ours that disagrees stops the run, so no number is published for a wrong kernel.
Prints the table, the byte and FLOP rules and the ceilings; writes JSON to bench/out/bench_ops.json.
``--ranks`` shapes dispatch_layout only (experts map to ranks in contiguous blocks).
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

# sys.path[0] is bench/ when this file runs as a script, so the shared helpers import by name.
from common import calc_diff, format_table, summarize, time_calls, write_json

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
#: calc_diff bound for float results (DeepEP's dissimilarity). Independent bf16 roundings of the same
#: values give ~1e-6; DeepEP's 1e-4 would pass an output off by 1 % everywhere (calc_diff 5e-5).
TOL = 1e-5
#: Sizes per device: one EP rank's share at DeepSeek-V3 scale on CUDA; on CPU small enough that the
#: whole run takes about a minute on two cores (bf16 matmul there runs at ~0.02 TFLOP/s).
DEFAULTS = {
    "cuda": dict(tokens=4096, hidden=7168, intermediate=2048, experts=32, topk=8, ranks=8, alignment=128,
                 warmup=3, reps=20),
    "cpu": dict(tokens=512, hidden=2048, intermediate=256, experts=64, topk=8, ranks=8, alignment=32,
                warmup=1, reps=5),
}
GROUP = 128  # channels per FP8 scale (1x128 activations, 128x128 weights)
NOTES = [
    "vs_torch = the fastest complete torch baseline's median in the same op and case / this median",
    "torch_loop*: per-expert matmuls with the expert bounds already on the host (no device read timed)",
    "torch_index_copy: the row copy alone with precomputed indices (not a complete permute; no vs_torch)",
    "torch_grouped_mm masked: one 3-D grouped_mm over all E*M rows; TFLOP/s still counts valid rows only",
    "permute native_unfused: ops.permute then ops.quantize on the same backend (what the fused pass saves)",
    "checks: data movement bitwise; float results calc_diff < TOL against a torch baseline, or an fp32 "
    "reference of the op's contract for FP8 GEMM and the FFN",
]


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


@dataclass
class Group:
    """The impls of one (op, case), checked against ``want`` (a torch baseline, or for FP8 and the FFN
    an fp32 reference of the op's contract) before any timing."""

    op: str
    case: str
    want: Callable[[], Any]
    compare: Callable[[Any, Any], tuple[bool, str]]   # (got, want) -> (ok, what was measured)
    cases: list[Case] = field(default_factory=list)


# ----------------------------------------------------------------------------- torch baselines

def _round_up(n: int, m: int) -> int:
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
            h = _swiglu(x[lo:hi].float() @ w13[e].float().T)
            out[lo:hi] = (h.float() @ w2[e].float().T).bfloat16()
    return out


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to bf16 (the input of the down projection)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).bfloat16()


def loop_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Per-expert SwiGLU FFN: ``swiglu(x @ w13[e].T) @ w2[e].T``."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(w13.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.matmul(_swiglu(x[lo:hi] @ w13[e].T), w2[e].T, out=out[lo:hi])
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


# ----------------------------------------------------------------------------- comparisons

#: Permutation fields besides the rows and scales: all index data, compared exactly
_LAYOUT_FIELDS = ("expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row")


def _exact(got: Any, want: Any) -> tuple[bool, str]:
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


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """Float results: same shape and calc_diff < TOL."""
    if got.shape != want.shape:
        return False, f"shape {list(got.shape)} != {list(want.shape)}"
    diff = calc_diff(got.float(), want.float())
    return diff < TOL, f"calc_diff {diff:.1e}"


def _close_quantized(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[bool, str]:
    """Quantized results: dtypes equal, dequantized values within TOL."""
    if got[0].dtype != want[0].dtype:
        return False, f"dtype {got[0].dtype} != {want[0].dtype}"
    return _close(torch_dequantize(*got), torch_dequantize(*want))


def _close_permutation_fp8(got: Any, want: TorchPermutation) -> tuple[bool, str]:
    """Fused quantizing permute: layout fields exact, rows dequantized within TOL."""
    ok, what = _exact(tuple(getattr(got, n) for n in _LAYOUT_FIELDS), tuple(getattr(want, n) for n in _LAYOUT_FIELDS))
    if not ok:
        return ok, what
    return _close_quantized((got.x, got.scales), (want.x, want.scales))


# ----------------------------------------------------------------------------- timing

def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int,
            flush: Optional[torch.Tensor]) -> list[float]:
    """Seconds per call. CUDA: events around each call (ops that sync the host inside still measure
    end to end), with L2 flushed before each so inputs come from HBM as in a real layer; CPU: perf_counter."""
    if device.type != "cuda":
        return time_calls(fn, warmup, reps)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e-3 for start, end in events]


# ----------------------------------------------------------------------------- cases

def _inputs(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
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
    M = _round_up(max(max(counts), 1), A)
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


def _ours(name: str, backends: Sequence[str]) -> list[tuple[str, Optional[Callable[..., Any]], str]]:
    """(backend, op or None, reason) for each of our backends."""
    op = getattr(importlib.import_module("moe_comm.ops"), name, None)
    return [(b, op, "" if op else f"moe_comm.ops has no {name}") for b in backends]


def _add_ours(g: Group, name: str, backends: Sequence[str], work: float, unit: str,
              call: Callable[[Callable[..., Any], str], Any]) -> None:
    """One row per backend of ours; ``call(op, backend)`` runs the op."""
    for backend, op, reason in _ours(name, backends):
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
    g = Group("dispatch_layout", f"R{R}", lambda: torch_dispatch_layout(topk_idx, R, E), _exact)
    _add_ours(g, "dispatch_layout", backends, nbytes, "GB/s", lambda op, b: _fields(op(topk_idx, R, E, backend=b)))
    g.cases.append(Case(g.op, g.case, "torch", lambda: torch_dispatch_layout(topk_idx, R, E), nbytes, "GB/s"))
    groups.append(g)

    nbytes = T * H * 2 + rows * H * 2 + meta
    g = Group("permute", "bf16", lambda: torch_permute(x, topk_idx, E, A), _exact)
    _add_ours(g, "permute", backends, nbytes, "GB/s", lambda op, b: op(x, topk_idx, E, alignment=A, backend=b))
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
    g = Group("permute", "fp8 e4m3", torch_permute_fp8, _close_permutation_fp8)
    _add_ours(g, "permute", backends, nbytes, "GB/s",
              lambda op, b: op(x, topk_idx, E, alignment=A, quant="e4m3", backend=b))
    quantize = getattr(importlib.import_module("moe_comm.ops"), "quantize", None)
    permute = getattr(importlib.import_module("moe_comm.ops"), "permute", None)
    for b in backends:
        def unfused(b: str = b) -> Any:
            p = permute(x, topk_idx, E, alignment=A, backend=b)
            q, s = quantize(p.x, "e4m3", backend=b)
            return TorchPermutation(q, s, p.expert_offsets, p.num_tokens_per_expert, p.row_of, p.source,
                                    p.expert_of_row)
        g.cases.append(Case(g.op, g.case, f"{b}_unfused", unfused if quantize and permute else None, nbytes, "GB/s",
                            ours=True, note="permute then quantize" if quantize and permute else "op missing"))
    g.cases.append(Case(g.op, g.case, "torch_sort", torch_permute_fp8, nbytes, "GB/s"))
    groups.append(g)

    for fmt, scale_bytes in (("e4m3", T * (H // GROUP) * 4), ("int8", T * 4)):
        nbytes = T * H * 2 + T * H + scale_bytes
        g = Group("quantize", fmt, lambda fmt=fmt: torch_quantize(x, fmt), _close_quantized)
        _add_ours(g, "quantize", backends, nbytes, "GB/s", lambda op, b, fmt=fmt: op(x, fmt, backend=b))
        g.cases.append(Case(g.op, g.case, "torch", lambda fmt=fmt: torch_quantize(x, fmt), nbytes, "GB/s"))
        groups.append(g)
    for fmt, scale_bytes in (("e4m3", T * (H // GROUP) * 4), ("int8", T * 4)):
        q, s = torch_quantize(x, fmt)
        nbytes = T * H + scale_bytes + T * H * 2
        g = Group("dequantize", fmt, lambda q=q, s=s: torch_dequantize(q, s), _close)
        _add_ours(g, "dequantize", backends, nbytes, "GB/s", lambda op, b, q=q, s=s: op(q, s, backend=b))
        g.cases.append(Case(g.op, g.case, "torch", lambda q=q, s=s: torch_dequantize(q, s), nbytes, "GB/s"))
        groups.append(g)

    a, offs = perm.x, perm.expert_offsets
    flops = 2 * valid * (2 * I) * H
    g = Group("grouped_gemm", "contig bf16", lambda: loop_gemm(a, w13, bounds), _close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(a, w13, expert_offsets=offs, backend=b))
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm",
                        (lambda: gmm(a, w13.transpose(1, 2), offs=d["offs32"])) if gmm else None, flops, "TFLOP/s",
                        note="" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_gemm(a, w13, bounds), flops, "TFLOP/s",
                        note="bounds on host"))
    groups.append(g)

    a_q, a_s, w_q, w_s = d["a_q"], d["a_s"], d["w13_q"], d["w13_s"]
    g = Group("grouped_gemm", "contig fp8 blk", lambda: fp32_gemm_fp8(a_q, a_s, w_q, w_s, bounds), _close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(a_q, w_q, expert_offsets=offs, a_scales=a_s, b_scales=w_s, backend=b))
    g.cases.append(Case(g.op, g.case, "torch_scaled_grouped_mm", _scaled_grouped_mm(a_q, a_s, w_q, w_s, d["offs32"]),
                        flops, "TFLOP/s", note="1x128 x 128x128 block scales"))
    g.cases.append(Case(g.op, g.case, "torch_loop_dequant", lambda: loop_gemm_fp8(a_q, a_s, w_q, w_s, bounds), flops,
                        "TFLOP/s", note="dequant to bf16 per call; bounds on host"))
    groups.append(g)

    xm, masked_m, counts = d["xm"], d["masked_m"], d["counts"]
    g = Group("grouped_gemm", f"masked bf16 M{d['M']}", lambda: loop_gemm_masked(xm, w13, counts), _close)
    _add_ours(g, "grouped_gemm", backends, flops, "TFLOP/s",
              lambda op, b: op(xm, w13, masked_m=masked_m, backend=b))
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm", (lambda: gmm(xm, w13.transpose(1, 2))) if gmm else None,
                        flops, "TFLOP/s", note="computes all E*M rows" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_gemm_masked(xm, w13, counts), flops, "TFLOP/s",
                        note="masked_m on host"))
    groups.append(g)

    flops = 2 * valid * (2 * I) * H + 2 * valid * H * I
    g = Group("expert_ffn", "contig bf16 swiglu", lambda: fp32_ffn(a, w13, w2, bounds), _close)
    _add_ours(g, "expert_ffn", backends, flops, "TFLOP/s", lambda op, b: op(a, w13, w2, expert_offsets=offs, backend=b))
    offs32 = d["offs32"]
    g.cases.append(Case(g.op, g.case, "torch_grouped_mm",
                        (lambda: gmm(_swiglu(gmm(a, w13.transpose(1, 2), offs=offs32)), w2.transpose(1, 2),
                                     offs=offs32)) if gmm else None,
                        flops, "TFLOP/s", note="2 grouped_mm + swiglu" if gmm else "torch has no grouped_mm"))
    g.cases.append(Case(g.op, g.case, "torch_loop", lambda: loop_ffn(a, w13, w2, bounds), flops, "TFLOP/s",
                        note="bounds on host"))
    groups.append(g)

    weights, row_of = d["weights"], perm.row_of
    nbytes = valid * H * 2 + T * K * 12 + T * H * 2
    g = Group("unpermute_reduce", "bf16", lambda: torch_unpermute_loop_k(a, row_of, weights), _close)
    _add_ours(g, "unpermute_reduce", backends, nbytes, "GB/s", lambda op, b: op(a, row_of, weights, backend=b))
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


# ----------------------------------------------------------------------------- run

def _reason(e: BaseException) -> str:
    """An exception as a short table note: its first sentence."""
    return f"n/a: {type(e).__name__}: {str(e).splitlines()[0].split('. ')[0]}"[:100]


def check(groups: list[Group]) -> list[dict[str, Any]]:
    """Runs every impl once against its group's baseline. Ours disagreeing or failing: error. A torch
    baseline that fails or disagrees: its row becomes 'n/a' with the reason. Returns the check records."""
    records, broken = [], []
    for g in groups:
        want = g.want()
        for c in g.cases:
            if c.fn is None:
                continue
            try:
                got = c.fn()
            except NotImplementedError as e:  # a backend that declines a case says so; not a wrong result
                c.fn, c.note = None, _reason(e)
                continue
            except Exception as e:  # noqa: BLE001 -- a torch baseline unsupported on this device/dtype
                if c.ours:
                    raise
                c.fn, c.note = None, _reason(e)
                continue
            ok, what = g.compare(got, want)
            records.append({"op": g.op, "case": g.case, "impl": c.impl, "ok": ok, "check": what})
            if not ok and c.ours:
                broken.append(f"{g.op} [{g.case}] {c.impl}: {what}")
            elif not ok:
                c.fn, c.note = None, f"n/a: disagrees with the baseline ({what})"
        del want
    if broken:
        raise SystemExit("bench_ops: our outputs disagree with the torch baselines; refusing to time them:\n  "
                         + "\n  ".join(broken))
    return records


def run(cfg: dict[str, Any], device: torch.device, backends: Sequence[str]
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Checks, then times, the ceilings and every case; returns (rows, check records)."""
    d = _inputs(cfg, device)
    ceilings = ceiling_cases(cfg, device, d["valid"])
    groups = build_groups(d, cfg, backends)
    records = check(groups)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    rows = []
    for c in ceilings + [c for g in groups for c in g.cases]:
        row = {"op": c.op, "case": c.case, "impl": c.impl, "unit": c.unit, "work": c.work, "ours": c.ours,
               "full": c.full, "note": c.note}
        if c.fn is not None:
            secs = time_fn(c.fn, device, cfg["warmup"], cfg["reps"], flush)
            stats = summarize(secs)
            row.update(stats, rate=c.work / (stats["median_us"] * 1e-6) / (1e9 if c.unit == "GB/s" else 1e12),
                       times_us=[s * 1e6 for s in secs])
        rows.append(row)
    return rows, records


def add_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``pct_ceiling`` against this run's ceiling of the row's unit; ``vs_torch`` = the fastest complete
    torch baseline's median in the same (op, case) / this median. Returns the ceilings."""
    ceil = {r["unit"]: r["rate"] for r in rows if r["impl"] in ("copy", "matmul_bf16")}
    for r in rows:
        if "median_us" not in r:
            continue
        r["pct_ceiling"] = 100.0 * r["rate"] / ceil[r["unit"]]
        if r["op"] == "ceiling":
            continue
        base = [b["median_us"] for b in rows if (b["op"], b["case"]) == (r["op"], r["case"]) and not b["ours"]
                and b["full"] and "median_us" in b]
        r["vs_torch"] = min(base) / r["median_us"] if base else None
    return ceil


def report(rows: list[dict[str, Any]], records: list[dict[str, Any]], cfg: dict[str, Any], device: torch.device,
           skipped: list[str], json_path: str) -> None:
    """Prints the table, the rules and the ceilings; writes JSON."""
    ceil = add_ratios(rows)
    for r in rows:
        r["p10_p90"] = f"{r['p10_us']:.0f}/{r['p90_us']:.0f}" if "p10_us" in r else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    print(f"{where}; tokens={cfg['tokens']} hidden={cfg['hidden']} intermediate={cfg['intermediate']} "
          f"experts={cfg['experts']} topk={cfg['topk']} ranks={cfg['ranks']} alignment={cfg['alignment']}; "
          f"warmup {cfg['warmup']}, reps {cfg['reps']}")
    columns = [("op", "op"), ("case", "case"), ("impl", "impl"), ("median_us", "median_us"),
               ("p10_p90", "p10/p90_us"), ("rate", "rate"), ("unit", "unit"), ("pct_ceiling", "%ceiling"),
               ("vs_torch", "vs_torch(x)"), ("note", "note")]
    print(format_table(columns, rows))
    fp32 = next(r.get("rate") for r in rows if r["impl"] == "matmul_fp32")
    print(f"\nceilings (this run): memory {ceil['GB/s']:.1f} GB/s (copy); compute {ceil['TFLOP/s']:.3f} TFLOP/s "
          f"(bf16 matmul), the %ceiling of every GEMM row, FP8 included; fp32 matmul {fp32:.3f} TFLOP/s")
    print(f"bytes: {BYTE_RULE}\nflops: {FLOP_RULE}")
    print("vs_torch: the fastest complete torch baseline of the same op and case / this median (>1: faster)")
    diffs = [float(c["check"].split()[-1]) for c in records if c["check"].startswith("calc_diff")]
    print(f"checks before timing: {sum(c['ok'] for c in records)} of {len(records)} outputs agree with their torch "
          f"baseline (data movement exactly; float results calc_diff <= {max(diffs, default=0):.1e}, bound {TOL:g}); "
          f"JSON 'checks' has each")
    for s in skipped:
        print(f"skipped: {s}")
    for r in rows:
        r.pop("p10_p90", None)
    write_json(json_path, {"bench": "bench_ops", "command": " ".join([Path(sys.executable).name] + sys.argv),
                           "config": cfg, "device": where, "byte_rule": BYTE_RULE, "flop_rule": FLOP_RULE,
                           "ceilings": {"memory_GBps": ceil["GB/s"], "bf16_matmul_TFLOPs": ceil["TFLOP/s"],
                                        "fp32_matmul_TFLOPs": fp32},
                           "timing": ("CUDA: events around each call, L2 flushed before each"
                                      if device.type == "cuda" else "CPU: perf_counter around each call"),
                           "notes": NOTES, "checks": records, "skipped": skipped, "results": rows})
    print(f"wall time {cfg['wall_s']} s; wrote {json_path}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    for k in ("tokens", "hidden", "intermediate", "experts", "topk", "ranks", "alignment", "warmup", "reps"):
        p.add_argument(f"--{k}", type=int, default=None, help=f"default: {DEFAULTS['cuda'][k]} on cuda, "
                                                               f"{DEFAULTS['cpu'][k]} on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "out" / "bench_ops.json"))
    args = p.parse_args(argv)
    cfg = {k: v if (v := getattr(args, k, None)) is not None else d for k, d in DEFAULTS[args.device].items()}
    cfg["seed"] = args.seed
    if cfg["hidden"] % GROUP or (2 * cfg["intermediate"]) % GROUP or cfg["experts"] % cfg["ranks"]:
        raise SystemExit(f"bench_ops: --hidden ({cfg['hidden']}) and 2 x --intermediate ({2 * cfg['intermediate']}) "
                         f"must be multiples of {GROUP}, --experts ({cfg['experts']}) a multiple of --ranks "
                         f"({cfg['ranks']})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_ops: --device cuda, but torch sees no CUDA device")
    device = torch.device(args.device)
    if device.type == "cuda":  # the native GEMMs multiply in fp32: TF32 decides whether that uses tensor cores
        cfg["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    from moe_comm.ops import triton_usable

    backends, skipped = ["native"], []
    usable, why = triton_usable(device)
    if device.type == "cpu":
        skipped.append("backend 'triton' on CPU: Triton runs CPU tensors only in its interpreter "
                       "(TRITON_INTERPRET=1), which says nothing about kernel speed")
    elif not usable:
        skipped.append(f"backend 'triton': {why}")
    else:
        backends.insert(0, "triton")
    for s in skipped:
        print(f"skipped: {s}")
    t0 = time.perf_counter()
    rows, records = run(cfg, device, backends)
    cfg["wall_s"] = round(time.perf_counter() - t0, 1)
    report(rows, records, cfg, device, skipped, args.json)


if __name__ == "__main__":
    main()
