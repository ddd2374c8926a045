"""Routing histograms (DeepEP's ``get_dispatch_layout``): one program per block of tokens."""
import triton
import triton.language as tl


@triton.jit
def dispatch_layout_kernel(topk_ptr, per_rank_ptr, per_expert_ptr, in_rank_ptr, num_tokens,
                           NUM_TOPK: tl.constexpr, NUM_RANKS: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr,
                           BLOCK_T: tl.constexpr):
    """``topk_ptr`` [T, K] int64 (-1 = none); adds into zeroed ``per_rank`` [R] and ``per_expert`` [E]
    int32 and sets zeroed ``in_rank`` [T, R] uint8. A token counts once per rank: only at the first of
    its slots that names the rank. Integer atomics, so any program order gives the same counts."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tokens < num_tokens
    row = tokens.to(tl.int64) * NUM_TOPK
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_ptr + row + k, mask=live, other=-1)
        valid = expert >= 0
        rank = expert // EXPERTS_PER_RANK
        tl.atomic_add(per_expert_ptr + expert, 1, mask=valid)
        first = valid
        for j in tl.static_range(k):
            earlier = tl.load(topk_ptr + row + j, mask=live, other=-1)
            first = first & ((earlier < 0) | (earlier // EXPERTS_PER_RANK != rank))
        tl.atomic_add(per_rank_ptr + rank, 1, mask=first)
        tl.store(in_rank_ptr + tokens.to(tl.int64) * NUM_RANKS + rank, 1, mask=first)
