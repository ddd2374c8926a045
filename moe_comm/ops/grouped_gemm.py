"""Grouped GEMM for MoE experts: ``out[rows of e] = a[rows of e] @ b[e].T`` with fp32 accumulation.

Layouts (DeepGEMM's names):
    contiguous  a `[M, K]`, rows of expert e are ``[expert_offsets[e], expert_offsets[e + 1])`` (``permute``'s
                output); out `[M, N]`, rows outside every expert are zero.
    masked      a `[E, M, K]`, the first ``masked_m[e]`` rows of block e are valid (the low-latency
                dispatch output); out `[E, M, N]`, the other rows are zero.
Precisions: BF16/FP16, or FP8 E4M3 with fp32 scales per row and 128 channels (``a_scales``
`[..., K / 128]`) and per 128x128 weight block (``b_scales`` `[E, ceil(N / 128), K / 128]`).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..core.library import define, op
from ..core.memory import zeros
from .fp8 import GROUP
from . import tilelang_launch
from .impl import kernels, renamed_impl, resolve
from .npu import grouped_gemm_npu, torch_npu_for
from .quant import dequantize
from .weight_cache import fp32_weights

__all__ = ["grouped_gemm", "grouped_gemm_reference"]

_FP8 = (torch.float8_e4m3fn,)


class GemmArgs:
    """Validated grouped-GEMM operands, flattened to 2-D rows with one (expert, start, end) per segment."""

    def __init__(self, op: str, a: torch.Tensor, b: torch.Tensor, expert_offsets: Optional[torch.Tensor],
                 masked_m: Optional[torch.Tensor], a_scales: Optional[torch.Tensor], b_scales: Optional[torch.Tensor],
                 n_out: int) -> None:
        check_gemm(op, a, b, expert_offsets, masked_m, a_scales, b_scales, read_values=True)
        self.masked = masked_m is not None
        self.num_experts, self.b_rows, self.k = b.shape
        self.n_out = n_out
        self.out_shape = (*a.shape[:-1], n_out)
        self.a = a.reshape(-1, self.k)
        self.b = b
        self.a_scales = None if a_scales is None else a_scales.reshape(-1, a_scales.shape[-1])
        self.b_scales = b_scales
        if self.masked:
            rows = a.shape[1]
            starts = torch.arange(self.num_experts, device=a.device, dtype=torch.int64) * rows
            self.starts, self.ends = starts, starts + masked_m.to(torch.int64).clamp(0, rows)
        else:
            offsets = expert_offsets.to(torch.int64)
            self.starts, self.ends = offsets[:-1], offsets[1:]


def check_gemm(op: str, a: torch.Tensor, b: torch.Tensor, expert_offsets: Optional[torch.Tensor],
               masked_m: Optional[torch.Tensor], a_scales: Optional[torch.Tensor], b_scales: Optional[torch.Tensor],
               read_values: bool = False) -> None:
    """Raises ValueError/TypeError naming the argument, the expectation and what was given; ``read_values``
    also checks the values of CPU ``expert_offsets`` (the op does, when it runs)."""
    if not isinstance(b, torch.Tensor) or b.dim() != 3:
        raise ValueError(f"{op}: b must be [E, N, K], got "
                         f"{list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    num_experts, _, k = b.shape
    if (expert_offsets is None) == (masked_m is None):
        raise ValueError(f"{op}: pass exactly one of expert_offsets (contiguous layout) and masked_m (masked layout)")
    want = 3 if masked_m is not None else 2
    if not isinstance(a, torch.Tensor) or a.dim() != want or a.shape[-1] != k or \
            (masked_m is not None and a.shape[0] != num_experts):
        layout = f"[{num_experts}, M, {k}]" if masked_m is not None else f"[M, {k}]"
        raise ValueError(f"{op}: a must be {layout} for this layout and b {list(b.shape)}, got "
                         f"{list(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
    index = masked_m if masked_m is not None else expert_offsets
    name = "masked_m" if masked_m is not None else "expert_offsets"
    length = num_experts if masked_m is not None else num_experts + 1
    if not isinstance(index, torch.Tensor) or index.shape != (length,) or \
            index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be int32/int64 [{length}], got "
                         f"{(index.dtype, list(index.shape)) if isinstance(index, torch.Tensor) else index!r}")
    for tensor, what in ((b, "b"), (index, name)):
        if tensor.device != a.device:
            raise ValueError(f"{op}: {what} must be on a's device {a.device}, got {tensor.device}")
    if read_values and expert_offsets is not None and a.device.type == "cpu" and num_experts:
        steps = expert_offsets[1:] - expert_offsets[:-1]
        if int(expert_offsets[0]) < 0 or int(steps.min()) < 0 or int(expert_offsets[-1]) > a.shape[0]:
            raise ValueError(f"{op}: expert_offsets must be non-decreasing within [0, {a.shape[0]}] (a's rows), "
                             f"got {expert_offsets.tolist()}")
    fp8 = a.dtype in _FP8
    if fp8 != (b.dtype in _FP8) or (not fp8 and a.dtype != b.dtype) or \
            a.dtype not in (*_FP8, torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{op}: a and b must both be bfloat16, float16, float32 or float8_e4m3fn, got {a.dtype} "
                        f"and {b.dtype}")
    if fp8 != (a_scales is not None) or fp8 != (b_scales is not None):
        raise ValueError(f"{op}: a_scales and b_scales are required exactly when a and b are FP8, got a {a.dtype} "
                         f"with a_scales {'set' if a_scales is not None else 'None'} and b_scales "
                         f"{'set' if b_scales is not None else 'None'}")
    if fp8:
        if k % GROUP:
            raise ValueError(f"{op}: FP8 needs K to be a multiple of {GROUP}, got {k}")
        want_a = (*a.shape[:-1], k // GROUP)
        want_b = (num_experts, -(-b.shape[1] // GROUP), k // GROUP)
        for scales, want_shape, what in ((a_scales, want_a, "a_scales"), (b_scales, want_b, "b_scales")):
            if scales.dtype != torch.float32 or tuple(scales.shape) != want_shape or scales.device != a.device:
                raise ValueError(f"{op}: {what} must be float32 {list(want_shape)} on {a.device}, got "
                                 f"{scales.dtype} {list(scales.shape)} on {scales.device}")


def dequantize_weights(b: torch.Tensor, b_scales: torch.Tensor) -> torch.Tensor:
    """FP8 weights `[E, N, K]` times their 128x128 block scales, in fp32."""
    num_experts, n, k = b.shape
    scales = b_scales.repeat_interleave(GROUP, dim=1)[:, :n].repeat_interleave(GROUP, dim=2)
    return b.to(torch.float32) * scales


def row_tiles(args: GemmArgs, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Row tiles of at most ``block_m`` rows, one expert each, computed on the device without reading it
    back: the grid is the upper bound ``cdiv(rows, block_m) + E`` and unused entries name expert -1."""
    counts = args.ends - args.starts
    tiles = (counts + block_m - 1) // block_m
    last = tiles.cumsum(0)
    bound = -(-args.a.shape[0] // block_m) + args.num_experts
    tile = torch.arange(bound, device=counts.device, dtype=torch.int64)
    expert = torch.searchsorted(last, tile, right=True)
    used = expert < args.num_experts
    expert = expert.clamp(max=max(args.num_experts - 1, 0))
    start = args.starts[expert] + (tile - (last - tiles)[expert]) * block_m
    return torch.where(used, expert, -1), start, args.ends[expert], bound


class GemmConfig(NamedTuple):
    """Tile shape and launch options of the Triton grouped GEMM."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_config(fp8: bool, swiglu: bool, interpreting: bool) -> GemmConfig:
    """The tile config ``launch_gemm`` uses: 128-row tiles, 256 output columns per program for BF16 (the
    SwiGLU epilogue's two 128-column accumulators are the same width), 128x128 for FP8. Picked from a
    ``bench/tune_grouped_gemm.py`` sweep on an H200 at DeepSeek-V3 shapes whose numbers were lost
    (bench/RESULTS.md); ``tools/triton_cuda_check.py`` holds each to sm_90's shared memory."""
    if interpreting:  # the interpreter's numpy dots are cheap, its per-program overhead is not
        return GemmConfig(64, 64, GROUP if fp8 else 64, 8, 4, 1)
    if fp8:
        return GemmConfig(128, 128, GROUP, 8, 8, 3 if swiglu else 4)
    return GemmConfig(128, 128 if swiglu else 256, 64, 8, 8, 3)


def launch_gemm(args: GemmArgs, out: torch.Tensor, swiglu: bool, config: Optional[GemmConfig] = None) -> None:
    """Runs the Triton grouped GEMM into ``out`` (zeroed, rows x n_out) with ``config`` (default:
    ``default_config``). FP8 needs ``block_k == 128``."""
    fp8 = args.a_scales is not None
    interpreting = args.a.device.type == "cpu"
    config = config or default_config(fp8, swiglu, interpreting)
    if fp8 and config.block_k != GROUP:
        raise ValueError(f"launch_gemm: FP8 needs block_k == {GROUP} (one scale per step), got {config.block_k}")
    tile_expert, tile_start, tile_end, bound = row_tiles(args, config.block_m)
    if args.a.shape[0] == 0 or args.num_experts == 0 or args.n_out == 0:
        return
    grid = (bound * -(-args.n_out // config.block_n),)
    kernels("grouped_gemm").grouped_gemm_kernel[grid](
        args.a.contiguous(), args.b.contiguous(), out, args.a_scales, args.b_scales, tile_expert, tile_start, tile_end,
        bound, args.n_out, args.k, args.b_rows, FP8=fp8, SWIGLU=swiglu, DOT_FP32=interpreting,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, *, expert_offsets: Optional[torch.Tensor] = None,
                 masked_m: Optional[torch.Tensor] = None, a_scales: Optional[torch.Tensor] = None,
                 b_scales: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                 impl: Optional[str] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``a @ b[e].T`` per expert in the contiguous (``expert_offsets`` `[E + 1]`) or masked (``masked_m``
    `[E]`) layout; fp32 accumulation, rounded to ``out_dtype``. Returns `[M, N]` or `[E, M, N]`; rows
    outside the experts' ranges are zero. Reference ``grouped_gemm_reference`` (fp64)."""
    check_gemm("grouped_gemm", a, b, expert_offsets, masked_m, a_scales, b_scales)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"grouped_gemm: out_dtype must be a torch.dtype, got {out_dtype!r}")
    return op("grouped_gemm")(a, b, expert_offsets, masked_m, a_scales, b_scales, out_dtype,
                              renamed_impl("grouped_gemm", "impl", impl, backend))


def _grouped_gemm_fake(a: torch.Tensor, b: torch.Tensor, expert_offsets: Optional[torch.Tensor],
                       masked_m: Optional[torch.Tensor], a_scales: Optional[torch.Tensor],
                       b_scales: Optional[torch.Tensor], out_dtype: torch.dtype, impl: Optional[str]) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[1]), dtype=out_dtype)


@define("grouped_gemm(Tensor a, Tensor b, Tensor? expert_offsets, Tensor? masked_m, Tensor? a_scales, "
        "Tensor? b_scales, ScalarType out_dtype, str? impl) -> Tensor", _grouped_gemm_fake)
def _grouped_gemm_op(a: torch.Tensor, b: torch.Tensor, expert_offsets: Optional[torch.Tensor],
                     masked_m: Optional[torch.Tensor], a_scales: Optional[torch.Tensor], b_scales: Optional[torch.Tensor],
                     out_dtype: torch.dtype, impl: Optional[str]) -> torch.Tensor:
    args = GemmArgs("grouped_gemm", a, b, expert_offsets, masked_m, a_scales, b_scales, b.shape[1])
    # NOTES: fresh zero pages on CPU: the masked layout's unused rows (most of [E, M, N] at decode) cost nothing
    out = zeros((args.a.shape[0], args.n_out), out_dtype, a.device)
    torch_npu = torch_npu_for(a)
    chosen = resolve("grouped_gemm", a.device, impl)
    if chosen == "triton":
        launch_gemm(args, out, swiglu=False)
    elif chosen == "tilelang":
        tilelang_launch.gemm(args, out, False, row_tiles)
    elif torch_npu is not None and not args.masked and args.a_scales is None:
        grouped_gemm_npu(torch_npu, args.a, args.b, args.starts, args.ends, out)  # segments back to back
    else:
        native_gemm(args, out, swiglu=False)
    return out.view(args.out_shape)


@functools.cache
def _cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): then a bf16 matmul, which
    accumulates in fp32 and rounds once, is several times faster than an fp32 one; elsewhere it is
    emulated and far slower. A fixed property of the machine, so results stay the same run after run."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def native_gemm(args: GemmArgs, out: torch.Tensor, swiglu: bool) -> None:
    """Per-expert matmuls (one device read of the segment bounds), in fp32, or in bf16 with fp32
    accumulation where the CPU has bf16 units and the result is bf16 anyway (not for SwiGLU, whose
    activation reads the fp32 products). The fp32 weights of CPU tensors come from ``weight_cache``."""
    fp8 = args.a_scales is not None
    bf16 = (not swiglu and args.a.dtype == out.dtype == torch.bfloat16 and args.a.device.type == "cpu"
            and _cpu_has_bf16_matmul())
    cached = None
    if not bf16 and args.b.dtype != torch.float32:
        cached = fp32_weights(args.b, args.b_scales, lambda: _all_fp32(args))
    for e, (start, end) in enumerate(zip(args.starts.tolist(), args.ends.tolist())):
        if end <= start:
            continue
        if bf16:
            torch.matmul(args.a[start:end], args.b[e].t(), out=out[start:end])
            continue
        if fp8:
            a = dequantize(args.a[start:end], args.a_scales[start:end], torch.float32, impl="native")
        else:
            a = args.a[start:end].to(torch.float32)
        weights = cached[e] if cached is not None else _expert_fp32(args, e)
        acc = a @ weights.t()
        if swiglu:
            gate, up = acc[:, :args.n_out], acc[:, args.n_out:]
            acc = torch.nn.functional.silu(gate) * up
        out[start:end] = acc.to(out.dtype)


def _expert_fp32(args: GemmArgs, e: int) -> torch.Tensor:
    """Expert ``e``'s weights in fp32; FP8 through the native dequantize (the values of ``dequantize_weights``)."""
    if args.b_scales is None:
        return args.b[e].to(torch.float32)
    row_scales = args.b_scales[e].repeat_interleave(GROUP, dim=0)[:args.b_rows]
    return dequantize(args.b[e], row_scales, torch.float32, impl="native")


def _all_fp32(args: GemmArgs) -> torch.Tensor:
    """Every expert's weights in fp32, `[E, N, K]` (what ``weight_cache`` keeps)."""
    value = torch.empty(args.b.shape, dtype=torch.float32, device=args.b.device)
    for e in range(args.num_experts):
        value[e] = _expert_fp32(args, e)
    return value


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, *, expert_offsets: Optional[torch.Tensor] = None,
                           masked_m: Optional[torch.Tensor] = None, a_scales: Optional[torch.Tensor] = None,
                           b_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp64 specification of ``grouped_gemm`` on the dequantized operands (float64 result)."""
    args = GemmArgs("grouped_gemm", a, b, expert_offsets, masked_m, a_scales, b_scales, b.shape[1])
    return segments_reference(args, args.a, args.a_scales, b, b_scales).view(args.out_shape)


def segments_reference(args: GemmArgs, a: torch.Tensor, a_scales: Optional[torch.Tensor], b: torch.Tensor,
                       b_scales: Optional[torch.Tensor]) -> torch.Tensor:
    """fp64 ``a[rows of e] @ b[e].T`` over ``args``' row segments (``a`` 2-D, any dtype; FP8 operands are
    dequantized with their scales); zero elsewhere."""
    a64, weights = a.to(torch.float64), b.to(torch.float64)
    if a_scales is not None:
        a64 = a64 * a_scales.to(torch.float64).repeat_interleave(GROUP, dim=1)
    if b_scales is not None:
        weights = dequantize_weights(b, b_scales).to(torch.float64)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    for e, (start, end) in enumerate(zip(args.starts.tolist(), args.ends.tolist())):
        out[start:end] = a64[start:end] @ weights[e].t()
    return out
