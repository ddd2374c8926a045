"""DeepEP's test_low_latency checks, run inside each rank over gloo: its inputs (rank-valued rows whose
last columns carry the token index, -1 slots), per-expert counts, received blocks and combine limits."""
from __future__ import annotations

import hashlib
import random

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import per_token_cast_back, per_token_cast_to_fp8

from helpers.deepep_utils import calc_diff

RANK_OFFSET = 128
INT_MASK = (1 << 32) - 1


def ll_buffer(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_experts: int, **kw) -> moe_comm.Buffer:
    num_ranks = dist.get_world_size(group)
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    return moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks,
                           explicitly_destroy=True, timeout_s=kw.pop("timeout_s", 30), **kw)


def routing(num_tokens: int, num_experts: int, num_topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's generator: top-k of |randn| + 1 scores, sorted, with 10 random -1 entries."""
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32).abs()
    rng = random.Random(seed)
    for _ in range(10 if num_tokens else 0):
        topk_idx[rng.randint(0, num_tokens - 1), rng.randint(0, num_topk - 1)] = -1
    return topk_idx, topk_weights


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[R, *t.shape]``: every rank's ``t`` (same shape everywhere)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def _dequant(packed_recv_x, use_fp8: bool, hidden: int) -> torch.Tensor:
    """[E_loc, R * M, H] bf16 of what was received (DeepEP's simulated GEMM input)."""
    if not use_fp8:
        return packed_recv_x.clone()
    q, scales = packed_recv_x[0], packed_recv_x[1].contiguous()
    per_row = scales.view(-1, scales.shape[-1])
    return per_token_cast_back(q.view(-1, hidden), per_row).view(q.shape)


def low_latency(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                seed: int = 0) -> dict:
    """The full DeepEP matrix: structured and random x x hook x fp8 x round_scale x ue8m0, dispatch
    once or twice (alternating buffers), combine with and without zero copy, into ``out``."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(seed + rank)
    buffer = ll_buffer(group, num_tokens, hidden, num_experts)
    local = num_experts // num_ranks
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    x_rand = (torch.randn((num_tokens, hidden), dtype=torch.float32) * 0.1).to(torch.bfloat16)
    topk_idx, topk_weights = routing(num_tokens, num_experts, num_topk, seed * 1000 + rank)
    all_topk_idx = _gather(topk_idx, group)
    all_x_rand = _gather(x_rand, group)

    checks = num_times = 0
    for current_x in (x, x_rand):
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale and hidden % 512 == 0 else (False,)):
                        num_times += 1
                        for _ in range(num_times % 2 + 1):
                            stats = torch.zeros((local,), dtype=torch.int32)
                            wait = torch.zeros((num_ranks,), dtype=torch.int64)
                            packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                current_x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait,
                                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                        assert int(wait.min()) > 0, wait
                        if use_fp8:
                            q, scales = packed_recv_x
                            assert q.dtype == torch.float8_e4m3fn and q.shape == (local, num_ranks * num_tokens, hidden)
                            width = hidden // (512 if use_ue8m0 else 128)
                            assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
                            assert scales.shape == (local, num_ranks * num_tokens, width)
                            assert scales.stride(1) == 1, scales.stride()  # DeepEP's column-major view
                        else:
                            assert packed_recv_x.shape == (local, num_ranks * num_tokens, hidden)
                        simulated_gemm_x = _dequant(packed_recv_x, use_fp8, hidden)
                        checks += _check_dispatch(rank, num_ranks, num_tokens, local, packed_recv_x, packed_recv_count,
                                                  handle, stats, all_topk_idx, all_x_rand, current_x is x, use_fp8,
                                                  round_scale, use_ue8m0, hidden)
                        for zero_copy in (False, True):
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated_gemm_x
                            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                            combined_x, event, hook = buffer.low_latency_combine(
                                simulated_gemm_x, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else event.current_stream_wait()
                            assert combined_x.data_ptr() == out.data_ptr()
                            if not round_scale:
                                ref = current_x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)
                                assert not torch.isnan(combined_x.float()).any()
                                diff = calc_diff(ref, combined_x.float()) if num_tokens else 0.0
                                assert diff < (9e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy)
                                checks += 1
    buffer.destroy()
    return {"rank": rank, "checks": checks, "num_times": num_times}


def _check_dispatch(rank: int, num_ranks: int, num_tokens: int, local: int, packed_recv_x, packed_recv_count,
                    handle, stats, all_topk_idx, all_x_rand, structured: bool, use_fp8: bool, round_scale: bool,
                    use_ue8m0: bool, hidden: int) -> int:
    """DeepEP's per-expert checks, plus: every received row is the reference quantizer's output for
    its source token, byte for byte (FP8 data and scales)."""
    checks = 0
    src_info_all, layout_range_all = handle[0], handle[1]
    for i in range(local):
        expert_id = rank * local + i
        num_valid = int(packed_recv_count[i])
        layout_range = layout_range_all[i]
        assert int(stats[i]) == num_valid
        assert num_valid == int((layout_range & INT_MASK).sum())
        assert num_valid == int((all_topk_idx == expert_id).sum())
        src_info = src_info_all[i, :num_valid]
        assert torch.all(src_info_all[i, num_valid:] == -1)
        if use_fp8:
            q, scales = packed_recv_x[0][i], packed_recv_x[1][i]
            recv_x = per_token_cast_back(q, scales)
        else:
            q, scales = packed_recv_x[i], None
            recv_x = q
        assert not recv_x[num_valid:].any(), "rows past recv_count must be zero"
        recv_x = recv_x[:num_valid]
        begin_expected = 0
        for j in range(num_ranks):
            begin, count = int(layout_range[j] >> 32), int(layout_range[j] & INT_MASK)
            # deterministic order: blocks by source rank ascending, tokens ascending inside a block
            assert begin == begin_expected, (begin, begin_expected)
            begin_expected += count
            tokens = (all_topk_idx[j] == expert_id).any(dim=1).nonzero().view(-1)
            assert torch.equal(src_info[begin:begin + count].long(), tokens)
            if structured and not round_scale:
                assert (recv_x[begin:begin + count, :-128] - j + RANK_OFFSET).abs().sum().item() == 0
            if not structured and count:
                want = all_x_rand[j][tokens]
                got = q[begin:begin + count]
                if use_fp8:
                    want_q, want_s = per_token_cast_to_fp8(want, round_scale, use_ue8m0)
                    assert torch.equal(got.view(torch.uint8), want_q.view(torch.uint8))
                    assert torch.equal(scales[begin:begin + count], want_s)
                else:
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        if structured and num_valid and hidden > 128:  # hidden 128 has only the token-index group
            amin = recv_x[:, :-128].amin(dim=-1)
            assert torch.equal(amin, recv_x[:, :-128].amax(dim=-1))
            if round_scale:
                assert calc_diff(recv_x[:, -1], src_info.float()) < 0.007
            else:
                assert (recv_x[:, -128:] - src_info.view(-1, 1) % num_tokens).abs().sum().item() == 0
                for j in range(num_ranks):
                    assert int((amin == j - RANK_OFFSET).sum()) == int((all_topk_idx[j] == expert_id).sum())
        checks += 1
    return checks


def ll_digest(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
              use_fp8: bool) -> str:
    """Hash of every output byte of one dispatch + combine on seeded inputs (padding included)."""
    rank = dist.get_rank(group)
    torch.manual_seed(7 + rank)
    buffer = ll_buffer(group, num_tokens, hidden, num_experts)
    x = torch.randn((num_tokens, hidden), dtype=torch.float32).to(torch.bfloat16)
    topk_idx, topk_weights = routing(num_tokens, num_experts, num_topk, 99 + rank)
    h = hashlib.sha256()
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts,
                                                                   use_fp8=use_fp8)
    parts = list(recv_x) if use_fp8 else [recv_x]
    for t in parts + [recv_count, handle[0], handle[1]]:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    y = _dequant(recv_x, use_fp8, hidden) * 1.5
    combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    h.update(combined.view(torch.uint8).numpy().tobytes())
    buffer.destroy()
    return h.hexdigest()


def ll_uneven(group: dist.ProcessGroup, hidden: int, num_topk: int, num_experts: int, m: int) -> dict:
    """Ranks send different numbers of tokens (rank 0 none, the last one M): counts, source blocks
    and the BF16 combine still match the references."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(rank)
    buffer = ll_buffer(group, m, hidden, num_experts)
    counts = [0] + [max(1, m * r // max(num_ranks - 1, 1)) for r in range(1, num_ranks)]
    num_tokens = counts[rank]
    x = torch.randn((num_tokens, hidden)).to(torch.bfloat16)
    topk_idx, topk_weights = routing(num_tokens, num_experts, num_topk, rank)
    padded = torch.full((m, num_topk), -1, dtype=torch.int64)
    padded[:num_tokens] = topk_idx
    all_idx = [idx[:c] for idx, c in zip(_gather(padded, group), counts)]  # gloo gathers equal shapes only
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, m, num_experts, use_fp8=False)
    local = num_experts // num_ranks
    for i in range(local):
        expert_id = rank * local + i
        assert int(recv_count[i]) == sum(int((idx == expert_id).sum()) for idx in all_idx)
        for j in range(num_ranks):
            count = int(handle[1][i, j] & INT_MASK)
            assert count == int((all_idx[j] == expert_id).sum())
    combined, _, _ = buffer.low_latency_combine(recv_x, topk_idx, topk_weights, handle)
    ref = x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(1, keepdim=True)
    assert combined.shape == (num_tokens, hidden)
    diff = calc_diff(ref, combined.float()) if num_tokens else 0.0
    assert diff < 1e-5, diff
    buffer.destroy()
    return {"rank": rank, "tokens": num_tokens}


def ll_empty(group: dist.ProcessGroup) -> list:
    """Every rank sends nothing (no tokens, then only -1 routing): zero counts, zero outputs."""
    buffer = ll_buffer(group, 4, 256, 8 * dist.get_world_size(group))
    experts = 8 * dist.get_world_size(group)
    out = []
    for x, idx in ((torch.zeros(0, 256, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64)),
                   (torch.ones(3, 256, dtype=torch.bfloat16), torch.full((3, 2), -1, dtype=torch.int64))):
        for use_fp8 in (False, True):
            recv_x, count, handle, _, hook = buffer.low_latency_dispatch(x, idx, 4, experts, use_fp8=use_fp8,
                                                                         return_recv_hook=True)
            hook()
            y = _dequant(recv_x, use_fp8, 256)
            combined, _, _ = buffer.low_latency_combine(y, idx, torch.ones(idx.shape), handle)
            out.append((int(count.sum()), bool((handle[1] == 0).all()), tuple(combined.shape),
                        float(combined.float().abs().sum())))
    buffer.destroy()
    return out
