"""The LogFMT low-latency combine inside each rank: identity experts, so every expert returns its
token's own row and the exact reference is local: ``bf16(sum over k ascending of w[t, k] *
decode(encode(x[t])))`` in fp32, multiply then add."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import logfmt_decode, logfmt_encode

from helpers.deepep_utils import calc_diff


def logfmt_combine(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_experts: int, num_topk: int) -> dict:
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True, timeout_s=60)
    torch.manual_seed(rank)
    # DeepEP's LogFMT inputs: small random rows (most chunks cast) and rank-valued rows (none cast)
    inputs = [(torch.randn(num_tokens, hidden) * 0.3).to(torch.bfloat16),
              torch.full((num_tokens, hidden), float(rank - 3), dtype=torch.bfloat16)]
    scores = torch.randn(num_tokens, num_experts).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1).indices
    topk_idx[torch.rand(num_tokens, num_topk) < 0.1] = -1
    weights = torch.rand(num_tokens, num_topk)
    diffs, digests = [], []
    try:
        for x in inputs:
            for hook in (False, True):
                recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts, use_fp8=False)
                combined, event, recv = buffer.low_latency_combine(recv_x, topk_idx, weights, handle, use_logfmt=True,
                                                                   return_recv_hook=hook, async_finish=not hook)
                recv() if hook else event.current_stream_wait()
                decoded = logfmt_decode(logfmt_encode(x), hidden)
                acc = torch.zeros(num_tokens, hidden)
                for k in range(num_topk):
                    w = torch.where(topk_idx[:, k:k + 1] >= 0, weights[:, k:k + 1], 0.0)
                    acc = torch.where(topk_idx[:, k:k + 1] >= 0, acc + w * decoded, acc)
                assert torch.equal(combined, acc.to(torch.bfloat16)), (hook, (combined != acc.to(torch.bfloat16)).sum())
                exact = (x.float() * torch.where(topk_idx >= 0, weights, 0.0).sum(1, keepdim=True))
                diffs.append(float(calc_diff(exact, combined)))
                digests.append(int(combined.view(torch.int16).to(torch.int64).sum()))
    finally:
        buffer.destroy()
    return dict(rank=rank, diffs=diffs, digests=digests)
