"""Weighted unpermute-reduce: each token's top-k expert rows, weighted, summed in slot order."""
from .dialect import Dialect
import tilelang.language as T

__all__ = ["BLOCK_H", "unpermute_program"]

BLOCK_H = 128  # channels per tile program


def unpermute_program(d: Dialect, hidden: int, num_topk: int, dtype: str, out_dtype: str):
    """``out[t] = sum_{k ascending, row_of[t, k] >= 0} weights[t, k] * y[row_of[t, k]]`` in fp32 (a fixed
    order, so results repeat bit for bit), rounded to ``out_dtype``. One tile program per (channel block,
    token)."""
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")

    @T.prim_func
    def unpermute(y: T.Tensor((rows, hidden), d.storage(dtype)), row_of: T.Tensor((tokens, num_topk), "int64"),
                  weights: T.Tensor((tokens, num_topk), "float32"),
                  out: T.Tensor((tokens, hidden), d.storage(out_dtype))):
        with d.kernel(T.ceildiv(hidden, BLOCK_H), tokens) as (b, t):
            acc = d.accumulator((BLOCK_H,))
            for c in d.parallel(BLOCK_H):
                acc[c] = T.float32(0)
            for k in T.serial(num_topk):
                if row_of[t, k] >= 0:
                    for c in d.parallel(BLOCK_H):
                        if b * BLOCK_H + c < hidden:
                            acc[c] = acc[c] + d.load(y[row_of[t, k], b * BLOCK_H + c], dtype) * weights[t, k]
            for c in d.parallel(BLOCK_H):
                if b * BLOCK_H + c < hidden:
                    out[t, b * BLOCK_H + c] = d.store(acc[c], out_dtype)

    return unpermute
