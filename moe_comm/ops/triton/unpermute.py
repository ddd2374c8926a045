"""Weighted unpermute-reduce: each token's top-k expert rows, weighted, summed in slot order."""
import triton
import triton.language as tl

from .rounding import cast


@triton.jit
def unpermute_reduce_kernel(y_ptr, row_of_ptr, weights_ptr, out_ptr, hidden, NUM_TOPK: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """``out[t] = sum_{k = 0..K-1, row_of[t, k] >= 0} weights[t, k] * y[row_of[t, k]]``: fp32, k ascending
    (a fixed order, so results repeat bit for bit), rounded to out's dtype. Grid (T, cdiv(H, BLOCK_H))."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(NUM_TOPK):
        row = tl.load(row_of_ptr + token * NUM_TOPK + k)
        if row >= 0:
            weight = tl.load(weights_ptr + token * NUM_TOPK + k)
            acc += tl.load(y_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * hidden + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)
