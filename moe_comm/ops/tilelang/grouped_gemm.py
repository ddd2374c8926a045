"""Grouped GEMM over row tiles that each belong to one expert: ``c[rows] = a[rows] @ b[e].T``, fp32
accumulation, BF16/fp32 or FP8 E4M3 (per-128-channel activation scales, 128x128 weight block scales), with an
optional SwiGLU epilogue (the expert FFN's first GEMM). The contiguous and the masked layout differ only in
the tile table the wrapper builds (``moe_comm/ops/grouped_gemm.py``, shared with the Triton kernel).

One source for both builds; the dialects force two differences. Staging: on CUDA ``T.copy`` moves a tile
into shared memory (TMA on sm_90/sm_100) and ``T.gemm`` runs on the tensor cores in the operands' own type;
the C target has no bf16/FP8 type, so the CPU build decodes each element into an fp32 tile (bounded by the
tile's rows, which the GPU's copy bounds by the tensor) and its ``T.gemm`` is TileLang's scalar loop nest.
"""
from .dialect import Dialect
import tilelang.language as T

__all__ = ["SCALE_BLOCK", "gemm_program"]

SCALE_BLOCK = 128  # channels per FP8 scale (ops.fp8.GROUP; a test checks the copy)


def gemm_program(d: Dialect, n: int, k: int, num_experts: int, b_rows: int, dtype: str, out_dtype: str,
                 fp8: bool, swiglu: bool, block_m: int, block_n: int, block_k: int, num_stages: int):
    """Tile program (i, j): rows ``[tile_start[i], tile_end[i])`` (at most ``block_m``, of expert
    ``tile_expert[i]``; -1 = no tile) by output columns ``[j * block_n, ...)``.

    a [rows, k] and b [E, b_rows, k] row-major; c [rows, n]. ``swiglu``: b_rows == 2n, gate rows [0, n) and
    up rows [n, 2n); c = silu(a @ gate.T) * (a @ up.T) from the fp32 accumulators. ``fp8``: block_k == 128,
    a_scales fp32 [rows, k / 128], b_scales fp32 [E, ceil(b_rows / 128), k / 128]; each 128-deep partial
    product is scaled before it is added (DeepGEMM's order)."""
    rows, tiles = T.dynamic("rows"), T.dynamic("tiles")
    tile_dtype = "float32" if d.cpu else dtype  # the CPU build multiplies decoded fp32 tiles
    k_steps = -(-k // block_k)
    # Without FP8 the scale arguments are unused [1, 1] and [1, 1, 1] tensors.
    a_scales_shape = (rows, k // SCALE_BLOCK) if fp8 else (1, 1)
    b_scales_shape = (num_experts, -(-b_rows // SCALE_BLOCK), k // SCALE_BLOCK) if fp8 else (1, 1, 1)

    @T.macro
    def zero(tile):
        for i, j in d.parallel(block_m, block_n):
            tile[i, j] = T.float32(0)

    @T.macro
    def stage_a(a, first_row, row_end, col, tile):
        """Rows ``[first_row, first_row + block_m)`` of ``a`` from column ``col`` into ``tile``."""
        if d.cpu:
            for ii, kk in T.grid(block_m, block_k):
                tile[ii, kk] = T.if_then_else(first_row + ii < row_end and col + kk < k,
                                              d.load(a[T.min(first_row + ii, row_end - 1), col + kk], dtype),
                                              T.float32(0))
        else:
            T.copy(a[first_row, col], tile)

    @T.macro
    def stage_b(b, experts, tile_index, first_row, row_end, col, tile):
        """Rows ``[first_row, first_row + block_n)`` of expert ``expert``'s weights from column ``col``."""
        if d.cpu:
            for jj, kk in T.grid(block_n, block_k):
                row = T.min(first_row + jj, row_end - 1)
                tile[jj, kk] = T.if_then_else(first_row + jj < row_end and col + kk < k,
                                              d.load(b[experts[tile_index], row, col + kk], dtype), T.float32(0))
        else:
            T.copy(b[experts[tile_index], first_row, col], tile)

    @T.macro
    def partial(a_tile, b_tile, acc, part, scale_rows, a_scales, b_scales, experts, starts, tile_index, col0, step):
        """``acc += a_tile @ b_tile.T``, scaled per 128-deep step with FP8."""
        if fp8:
            zero(part)
            T.gemm(a_tile, b_tile, part, transpose_B=True)
            for i, j in d.parallel(block_m, block_n):
                acc[i, j] = acc[i, j] + part[i, j] * a_scales[T.min(starts[tile_index] + i, scale_rows - 1), step] * \
                    b_scales[experts[tile_index], (col0 + j) // SCALE_BLOCK, step]
        else:
            T.gemm(a_tile, b_tile, acc, transpose_B=True)

    @T.prim_func
    def gemm(a: T.Tensor((rows, k), d.storage(dtype)), b: T.Tensor((num_experts, b_rows, k), d.storage(dtype)),
             c: T.Tensor((rows, n), d.storage(out_dtype)), a_scales: T.Tensor(a_scales_shape, "float32"),
             b_scales: T.Tensor(b_scales_shape, "float32"),
             tile_expert: T.Tensor((tiles,), "int64"), tile_start: T.Tensor((tiles,), "int64"),
             tile_end: T.Tensor((tiles,), "int64")):
        with d.kernel(T.ceildiv(n, block_n), tiles) as (j, i):
            a_tile = d.tile((block_m, block_k), tile_dtype)
            b_tile = d.tile((block_n, block_k), tile_dtype)
            up_tile = d.tile((block_n, block_k), tile_dtype)
            acc = d.accumulator((block_m, block_n))
            acc_up = d.accumulator((block_m, block_n))
            part = d.accumulator((block_m, block_n))
            if tile_expert[i] >= 0:
                zero(acc)
                zero(acc_up)
                for step in T.Pipelined(k_steps, num_stages=num_stages):
                    stage_a(a, tile_start[i], tile_end[i], step * block_k, a_tile)
                    stage_b(b, tile_expert, i, j * block_n, n, step * block_k, b_tile)
                    partial(a_tile, b_tile, acc, part, rows, a_scales, b_scales, tile_expert, tile_start, i,
                            j * block_n, step)
                    if swiglu:
                        stage_b(b, tile_expert, i, n + j * block_n, 2 * n, step * block_k, up_tile)
                        partial(a_tile, up_tile, acc_up, part, rows, a_scales, b_scales, tile_expert, tile_start,
                                i, n + j * block_n, step)
                for ii, jj in d.parallel(block_m, block_n):
                    if tile_start[i] + ii < tile_end[i] and j * block_n + jj < n:
                        if swiglu:
                            c[tile_start[i] + ii, j * block_n + jj] = d.store(
                                acc[ii, jj] / (T.float32(1) + T.exp(T.float32(0) - acc[ii, jj])) * acc_up[ii, jj],
                                out_dtype)
                        else:
                            c[tile_start[i] + ii, j * block_n + jj] = d.store(acc[ii, jj], out_dtype)

    return gemm
