"""Grouped GEMM over row tiles that each belong to one expert: ``c[rows] = a[rows] @ b[e].T``, fp32
accumulation, BF16 or FP8 (per-128-channel activation scales, 128x128 weight block scales), with an
optional SwiGLU epilogue. The contiguous and the masked layout differ only in the tile table the
wrapper builds (``moe_comm/ops/grouped_gemm.py``)."""
import triton
import triton.language as tl

from .rounding import cast

SCALE_BLOCK = tl.constexpr(128)


@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scales_ptr, b_scales_ptr, tile_expert_ptr, tile_start_ptr,
                        tile_end_ptr, num_tiles, N, K, b_rows, FP8: tl.constexpr, SWIGLU: tl.constexpr,
                        DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Row tile i: rows ``[tile_start[i], tile_end[i])`` (at most BLOCK_M, expert ``tile_expert[i]``; -1 = no
    tile) by output columns ``[j * BLOCK_N, ...)``. A 1-D grid of ``num_tiles * cdiv(N, BLOCK_N)`` programs
    walks GROUP_M row tiles (about one expert) across every column block before moving on, so their
    rows of ``a`` and the expert's weights stay in L2 instead of being read once per column block.

    a [rows, K] and b [E, b_rows, K] row-major; c [rows, N]. SWIGLU: b_rows == 2N, gate rows [0, N) and up
    rows [N, 2N); c = silu(a @ gate.T) * (a @ up.T) from the fp32 accumulators. FP8: BLOCK_K == 128,
    a_scales fp32 [rows, K / 128], b_scales fp32 [E, cdiv(b_rows, 128), K / 128]; each 128-deep partial
    product is scaled before it is added. DOT_FP32 multiplies in fp32 (the interpreter has no bf16 math).
    """
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_tiles - first, GROUP_M)
    tile = first + (pid % per_group) % size
    col_block = (pid % per_group) // size
    expert = tl.load(tile_expert_ptr + tile)
    if expert >= 0:
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        b_expert = b_ptr + expert.to(tl.int64) * b_rows * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            a = tl.load(a_ptr + rows[:, None] * K + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(b_expert + cols[None, :].to(tl.int64) * K + (k0 + ks)[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            part = _dot(a, b, DOT_FP32)
            if FP8:
                a_scale = tl.load(a_scales_ptr + rows * (K // BLOCK_K) + k0 // BLOCK_K, mask=row_ok, other=0.0)
                b_scale = tl.load(b_scales_ptr + (expert * tl.cdiv(b_rows, SCALE_BLOCK) + cols // SCALE_BLOCK)
                                  * (K // BLOCK_K) + k0 // BLOCK_K, mask=col_ok, other=0.0)
                part = part * a_scale[:, None] * b_scale[None, :]
            acc += part
            if SWIGLU:
                b_up = tl.load(b_expert + (N + cols[None, :]).to(tl.int64) * K + (k0 + ks)[:, None],
                               mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                part_up = _dot(a, b_up, DOT_FP32)
                if FP8:
                    b_up_scale = tl.load(b_scales_ptr + (expert * tl.cdiv(b_rows, SCALE_BLOCK) + (N + cols) // SCALE_BLOCK)
                                         * (K // BLOCK_K) + k0 // BLOCK_K, mask=col_ok, other=0.0)
                    part_up = part_up * a_scale[:, None] * b_up_scale[None, :]
                acc_up += part_up
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], cast(acc, c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)
