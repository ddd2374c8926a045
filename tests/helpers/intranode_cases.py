"""DeepEP's test_intranode checks, run inside each rank over gloo: its inputs and assertions (rank-major
blocks via handle[0], top-k remapping, counts, worst-token padding, cached dispatch, combine)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import per_token_cast_back, per_token_cast_to_fp8

from helpers.deepep_utils import all_reduce_sum, calc_diff, inplace_unique


def _close(x: torch.Tensor, y: torch.Tensor, limit: float) -> bool:
    """calc_diff(x, y) < limit; vacuously true for empty tensors (a rank that received nothing)."""
    return x.numel() == 0 or calc_diff(x, y) < limit


def _check_rank_blocks(recv_x: torch.Tensor, prefix: torch.Tensor, rank: int) -> None:
    """Every row is constant and rows of source block i equal i (rank-major order)."""
    if recv_x.numel() == 0:
        return
    assert torch.equal(recv_x.amin(dim=1), recv_x.amax(dim=1)), "a received row is not constant"
    start = 0
    for i in range(prefix.shape[0]):
        end = int(prefix[i, rank])
        block = recv_x[start:end, 0]
        assert torch.all(block == i), f"rows [{start}, {end}) should come from rank {i}, got {block.unique().tolist()}"
        start = end


def intranode(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
              variant: str, expert_alignment: int) -> dict:
    """variant: "plain" (DeepEP's), "minus_one" (random -1 ids), "silent_last" (last rank sends
    nothing: all ids -1), "empty_first" (rank 0 has 0 tokens)."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    buffer = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=20)
    torch.manual_seed(rank)
    experts_per_rank = num_experts // num_ranks
    worst = num_tokens * num_ranks  # rows any rank can receive: every rank's tokens, once each
    if variant == "empty_first" and rank == 0:
        num_tokens = 0

    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP's test
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1]
    if variant == "minus_one" and num_tokens:
        topk_idx.view(-1)[torch.randperm(topk_idx.numel())[: topk_idx.numel() // 5]] = -1
        topk_idx[0] = -1  # one row with no expert at all
    if variant == "silent_last" and rank == num_ranks - 1:
        topk_idx.fill_(-1)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32)

    # Python reference layout, as DeepEP's test computes it.
    rank_idx = topk_idx // experts_per_rank
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, num_ranks)
    num_tokens_per_expert = torch.zeros((num_experts,), dtype=torch.int)
    for i in range(num_experts):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = all_reduce_sum(num_tokens_per_expert, group)
    num_tokens_per_rank = torch.empty((num_ranks,), dtype=torch.int)
    token_idx_in_rank = torch.full((num_ranks, num_tokens), -1, dtype=torch.long)
    for i in range(num_ranks):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0] if num_tokens else torch.zeros(0, dtype=torch.bool)
        count = int(token_sel.sum())
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1][:count]
        token_idx_in_rank[i][tokens] = torch.arange(count, dtype=torch.long)
    is_token_in_rank = (token_idx_in_rank >= 0).T.contiguous()
    gbl_num_tokens_per_rank = all_reduce_sum(num_tokens_per_rank, group)

    ref_rank, _, ref_exp, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.equal(ref_rank, num_tokens_per_rank)
    assert torch.equal(ref_exp, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)

    config = moe_comm.Config(24, 8, 256)
    num_sent_rows = int(is_token_in_rank.sum(1).clamp(min=1).numel())
    count_per_token = is_token_in_rank.sum(dim=1).unsqueeze(1)
    routed = count_per_token.squeeze(1) > 0
    checks = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    is_rand = current_x is x_pure_rand
                    is_fp8 = isinstance(current_x, tuple)
                    args = dict(x=current_x, num_tokens_per_rank=num_tokens_per_rank,
                                is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                config=config, async_finish=async_mode, expert_alignment=expert_alignment)
                    if with_topk:
                        args.update(topk_idx=topk_idx,
                                    topk_weights=topk_weights_pure_rand if is_rand else topk_weights)
                    if previous_mode:
                        args.update(previous_event=buffer.capture())
                    recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(**args)
                    if async_mode:
                        event.current_stream_wait()
                    else:
                        assert event.event is None
                    recv_x = per_token_cast_back(*recv_x) if is_fp8 else recv_x

                    # Counts and order
                    assert recv_x.size(0) == int(gbl_num_tokens_per_rank[rank])
                    expected_list = gbl_num_tokens_per_expert.view(num_ranks, -1)[rank]
                    expected_list = (expected_list + expert_alignment - 1) // expert_alignment * expert_alignment
                    assert recv_list == expected_list.tolist(), (recv_list, expected_list.tolist())
                    assert torch.equal(handle[4], is_token_in_rank)
                    if not is_rand:
                        _check_rank_blocks(recv_x, handle[0], rank)
                    if with_topk:
                        assert recv_topk_idx.eq(-1).logical_or(recv_topk_idx.ge(0) & recv_topk_idx.lt(experts_per_rank)).all()
                        for i in range(experts_per_rank):
                            got = int(recv_topk_idx.eq(i).sum())
                            want = int(gbl_num_tokens_per_expert.view(num_ranks, -1)[rank, i])
                            assert got == want, (i, got, want)
                        assert torch.all(recv_topk_weights[recv_topk_idx.eq(-1)] == 0)
                        if not is_rand and recv_x.size(0):
                            filled = recv_topk_weights.clone()
                            amax = filled.amax(dim=1, keepdim=True).expand_as(filled)
                            filled[recv_topk_idx.eq(-1)] = amax[recv_topk_idx.eq(-1)]
                            _check_rank_blocks(filled, handle[0], rank)

                    # num_worst_tokens: fixed shapes, same prefix, -1 padding, empty list
                    if with_topk:
                        w_x, w_idx, w_w, w_list, w_handle, w_event = buffer.dispatch(
                            num_worst_tokens=worst, **args)
                        if async_mode:
                            w_event.current_stream_wait()
                        w_x = per_token_cast_back(*w_x) if is_fp8 else w_x
                        n = recv_x.size(0)
                        assert w_x.size(0) == worst and w_idx.size(0) == worst and w_w.size(0) == worst
                        assert torch.equal(w_x[:n], recv_x) and torch.equal(w_idx[:n], recv_topk_idx)
                        assert torch.equal(w_w[:n], recv_topk_weights) and w_list == []
                        assert torch.all(w_idx[n:] == -1) and torch.all(w_w[n:] == 0)
                        assert torch.all(w_handle[3][n:] == -1)

                    # Cached dispatch reproduces the same rows
                    if not with_topk:
                        cached_args = dict(x=current_x, handle=handle, config=config, async_finish=async_mode)
                        if previous_mode:
                            cached_args.update(previous_event=buffer.capture())
                        c_x, c_idx, c_w, c_list, c_handle, c_event = buffer.dispatch(**cached_args)
                        if async_mode:
                            c_event.current_stream_wait()
                        c_x = per_token_cast_back(*c_x) if is_fp8 else c_x
                        assert c_idx is None and c_w is None and c_list is None and c_handle is None
                        assert torch.equal(c_x, recv_x)

                    # Combine: unweighted sum over ranks, weights reduced the same way
                    send_x = recv_x.to(torch.bfloat16)
                    combine_args = dict(x=send_x, handle=handle, config=config, async_finish=async_mode)
                    if with_topk:
                        combine_args.update(topk_weights=recv_topk_weights)
                    if previous_mode:
                        combine_args.update(previous_event=buffer.capture())
                    combined_x, combined_w, c_event = buffer.combine(**combine_args)
                    if async_mode:
                        c_event.current_stream_wait()
                    ref_x = x_pure_rand if is_rand else x
                    assert torch.all(combined_x[~routed] == 0)
                    check_x = combined_x.float()[routed] / count_per_token[routed]
                    assert _close(check_x, ref_x[routed], 5e-6)
                    if with_topk:
                        ref_w = topk_weights_pure_rand if is_rand else topk_weights
                        # each slot's weight survives on exactly the rank owning its expert; -1 slots sum to 0
                        ref_w = ref_w.masked_fill(topk_idx.eq(-1), 0)
                        check_w = combined_w
                        assert _close(check_w, ref_w, 1e-9)
                        assert torch.equal(check_w, ref_w)  # one nonzero term per slot: exact

                    # Combine with two biases: (combined - b0 - b1) / count == x
                    bias0 = torch.ones((num_tokens, hidden), dtype=torch.bfloat16)
                    bias1 = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
                    b_x, _, _ = buffer.combine(send_x, handle, bias=(bias0, bias1), config=config)
                    unbiased = b_x.float() - bias0.float() - bias1.float()
                    check_b = unbiased[routed] / count_per_token[routed]
                    limit = 5e-4 if is_fp8 and is_rand else 5e-6
                    assert _close(check_b, ref_x[routed] if not is_fp8 else x[routed].float(), limit)
                    checks += 1
    buffer.destroy()
    return {"rank": rank, "checks": checks, "tokens": num_tokens, "sent_rows": num_sent_rows}
