"""Expert-major permutation indices, in two passes of independent programs (no program waits on
another): per-block expert histograms, then each item's row from its block's prefix. The small
cross-block prefix sum between them runs on the host side (``moe_comm/ops/permute.py``)."""
import triton
import triton.language as tl


@triton.jit
def block_histogram_kernel(topk_ptr, counts_ptr, num_items, NUM_EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """``counts[b, e]`` (zeroed int32 [blocks, E]) += items of flat block b of ``topk`` (int64, -1 = none)
    routed to expert e."""
    block = tl.program_id(0)
    items = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(topk_ptr + items, mask=items < num_items, other=-1)
    tl.atomic_add(counts_ptr + block * NUM_EXPERTS + expert, 1, mask=expert >= 0)


@triton.jit
def permute_index_kernel(topk_ptr, block_base_ptr, row_of_ptr, source_ptr, expert_of_row_ptr, num_items,
                         NUM_EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """Item i (flat ``t * K + k``) of expert e goes to row ``block_base[b, e] + #{j < i in block b : e_j == e}``
    where ``block_base`` already holds the expert's first row plus earlier blocks' counts; so rows keep
    flat order within an expert. Writes ``row_of[i]`` (-1 when unrouted), ``source[row] = i`` and
    ``expert_of_row[row] = e``."""
    block = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    items = block.to(tl.int64) * BLOCK + offs
    expert = tl.load(topk_ptr + items, mask=items < num_items, other=-1)
    valid = expert >= 0
    earlier = (expert[:, None] == expert[None, :]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = tl.load(block_base_ptr + block * NUM_EXPERTS + expert, mask=valid, other=0)
    row = tl.where(valid, base + rank, -1)
    tl.store(row_of_ptr + items, row, mask=items < num_items)
    tl.store(source_ptr + row, items, mask=valid)
    tl.store(expert_of_row_ptr + row, expert.to(tl.int32), mask=valid)
