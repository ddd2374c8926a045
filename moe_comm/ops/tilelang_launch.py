"""Launching the TileLang programs (``moe_comm.ops.tilelang``) on torch tensors: the dtype names, the
integer views a CPU build takes narrow floats in, the tile configurations, and one function per program
that the ops call with ``impl="tilelang"``. Programs compile on first use per shape family and process
(``ops/tilelang/build.py``)."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .fp8 import AMAX_FLOOR
from .impl import tilelang_programs

__all__ = ["DTYPES", "GemmTiles", "gemm_tiles", "rows", "dequant", "unpermute", "gemm", "dtype_name"]

#: torch dtypes the programs take, by TileLang's names.
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
          torch.float8_e4m3fn: "float8_e4m3", torch.float8_e5m2: "float8_e5m2"}
_STORAGE = {1: torch.uint8, 2: torch.uint16}


def dtype_name(op: str, dtype: torch.dtype) -> str:
    """TileLang's name of ``dtype``; ValueError naming the op and the dtypes it takes otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"{op}: impl 'tilelang' takes {[str(d).replace('torch.', '') for d in DTYPES]}, "
                         f"got {dtype}")
    return DTYPES[dtype]


def _arg(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the built program takes it: contiguous; on the CPU narrow floats as their integer bits."""
    t = t.contiguous()
    if t.device.type == "cpu" and t.dtype in DTYPES and t.dtype != torch.float32:
        return t.view(_STORAGE[t.element_size()])
    return t


def _kernel(device: torch.device, program: Any, *params: Any) -> Any:
    build = tilelang_programs("build")
    return build.cpu_kernel(program, *params) if device.type == "cpu" else build.cuda_kernel(program, *params)


def rows(x: torch.Tensor, out: torch.Tensor, scales: Optional[torch.Tensor], source: torch.Tensor,
         source_div: int, code: Optional[torch.dtype], round_scale: bool, use_ue8m0: bool) -> None:
    """``out`` row r = ``x[source[r] // source_div]`` (zeros for a negative source), cast to FP8 ``code``
    with ``scales`` (fp32 [rows, H / 128], or the int32 UE8M0 packing) when ``code`` is given."""
    hidden = x.shape[1]
    program = tilelang_programs("rows").rows_program
    kernel = _kernel(x.device, program, hidden, DTYPES[x.dtype], None if code is None else DTYPES[code],
                     round_scale, use_ue8m0)
    q_max = torch.tensor(torch.finfo(code).max if code is not None else 1.0, dtype=torch.float32)
    if scales is None:
        scales = torch.empty(out.shape[0], -(-hidden // 128), dtype=torch.float32, device=x.device)
    elif use_ue8m0:
        scales = scales.view(torch.uint8)
    kernel(_arg(x), source.contiguous(), _arg(out), scales, source_div, AMAX_FLOOR, float(q_max),
           float(torch.tensor(1.0, dtype=torch.float32) / q_max))


def dequant(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, use_ue8m0: bool) -> None:
    """``out = q * scale`` per 128-channel group (fp32 scales or the UE8M0 packing), rounded to out's dtype."""
    program = tilelang_programs("rows").dequant_program
    kernel = _kernel(q.device, program, q.shape[1], DTYPES[q.dtype], DTYPES[out.dtype], use_ue8m0)
    kernel(_arg(q), scales.contiguous().view(torch.uint8) if use_ue8m0 else scales.contiguous(), _arg(out))


def unpermute(y: torch.Tensor, row_of: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] = sum_k weights[t, k] * y[row_of[t, k]]`` in fp32, k ascending, rounded to out's dtype."""
    program = tilelang_programs("unpermute").unpermute_program
    kernel = _kernel(y.device, program, y.shape[1], row_of.shape[1], DTYPES[y.dtype], DTYPES[out.dtype])
    kernel(_arg(y), row_of.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous(), _arg(out))


class GemmTiles(NamedTuple):
    """Tile shape and pipeline depth of the TileLang grouped GEMM."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int


def gemm_tiles(device_type: str, fp8: bool, swiglu: bool) -> GemmTiles:
    """The tiles ``gemm`` uses. CUDA: one warpgroup's 64 rows (wgmma's M), 64 deep (128 with FP8: one scale
    per step), 3 stages; 128 columns with BF16, fewer with FP8, whose per-step partial product is one more
    accumulator (64, and 32 with SwiGLU's third): the widest that sm_100 compiles without spilling at
    DeepSeek-V3's shapes (``tools/tilelang_cuda_check.py``). CPU: small tiles for the scalar loop nest, one
    stage (no asynchronous copies)."""
    k = 128 if fp8 else 64
    if device_type == "cpu":
        return GemmTiles(32, 64, k, 1)
    if fp8:
        return GemmTiles(64, 32 if swiglu else 64, k, 3)
    return GemmTiles(64, 128, k, 3)


def gemm(args: Any, out: torch.Tensor, swiglu: bool, tiles_of: Any) -> None:
    """Runs the TileLang grouped GEMM of ``args`` (``grouped_gemm.GemmArgs``) into ``out`` (zeroed, rows x
    n_out); ``tiles_of(args, block_m)`` is the tile table (``grouped_gemm.row_tiles``)."""
    fp8 = args.a_scales is not None
    device = args.a.device
    config = gemm_tiles(device.type, fp8, swiglu)
    if args.a.shape[0] == 0 or args.num_experts == 0 or args.n_out == 0:
        return
    tile_expert, tile_start, tile_end, _ = tiles_of(args, config.block_m)
    program = tilelang_programs("grouped_gemm").gemm_program
    kernel = _kernel(device, program, args.n_out, args.k, args.num_experts, args.b_rows,
                     dtype_name("grouped_gemm", args.a.dtype), dtype_name("grouped_gemm", out.dtype), fp8, swiglu,
                     *config)
    if fp8:
        a_scales, b_scales = args.a_scales.contiguous(), args.b_scales.contiguous()
    else:
        a_scales = torch.zeros(1, 1, device=device)
        b_scales = torch.zeros(1, 1, 1, device=device)
    kernel(_arg(args.a), _arg(args.b), _arg(out), a_scales, b_scales, tile_expert, tile_start, tile_end)
