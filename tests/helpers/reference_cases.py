"""Dispatch/combine against an independent reference: every rank rebuilds every rank's inputs from
seeds and computes, with plain Python loops, exactly what it must receive and what combine returns."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

import moe_comm

SCENARIOS = ("random", "empty_rank", "all_minus_one_rows", "hot_expert", "one_target_rank")


def make_inputs(src: int, num_ranks: int, scenario: str, seed: int, hidden: int, experts: int, topk: int):
    """Rank ``src``'s (x bf16 [T, H], topk_idx int64 [T, K], topk_weights f32 [T, K])."""
    g = torch.Generator().manual_seed(seed * 1009 + src)
    tokens = int(torch.randint(0, 24, (1,), generator=g))
    if scenario == "empty_rank" and src == num_ranks // 2:
        tokens = 0
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.int64)
    if scenario == "random" and tokens:
        idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    elif scenario == "all_minus_one_rows" and tokens:
        idx[torch.rand(tokens, generator=g) < 0.5] = -1
    elif scenario == "hot_expert" and tokens:
        idx[:, 0] = 0
        idx[:, 1:] = -1
    elif scenario == "one_target_rank" and tokens:
        per_rank = experts // num_ranks
        idx = (num_ranks - 1) * per_rank + idx % per_rank
        idx[:, 1:][idx[:, 1:] == idx[:, :1]] = -1  # keep ids distinct within a row
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    return x, idx, torch.rand(tokens, topk, generator=g)


def expected_for(me: int, inputs: list, experts: int):
    """What rank ``me`` must receive, by DeepEP's definition of a normal dispatch: rows grouped by
    source rank ascending, each source's tokens ascending, once per destination rank; top-k ids
    made local (-1, weight 0 off this rank); counts per expert."""
    num_ranks = len(inputs)
    per_rank = experts // num_ranks
    rows, idx_rows, w_rows, src_idx = [], [], [], []
    counts = [[0] * num_ranks for _ in range(num_ranks)]
    per_expert = [0] * per_rank
    for src, (x, idx, w) in enumerate(inputs):
        for t in range(x.shape[0]):
            dests = {int(e) // per_rank for e in idx[t].tolist() if e >= 0}
            for d in dests:
                counts[src][d] += 1
            if me not in dests:
                continue
            rows.append(x[t])
            local = [int(e) - me * per_rank if e >= 0 and int(e) // per_rank == me else -1 for e in idx[t].tolist()]
            idx_rows.append(local)
            w_rows.append([float(w[t, k]) if local[k] >= 0 else 0.0 for k in range(len(local))])
            src_idx.append(t)
            for e in local:
                if e >= 0:
                    per_expert[e] += 1
    hidden, topk = inputs[0][0].shape[1], inputs[0][1].shape[1]
    recv_x = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=torch.bfloat16)
    prefix = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return (recv_x, torch.tensor(idx_rows, dtype=torch.int64).view(-1, topk),
            torch.tensor(w_rows, dtype=torch.float32).view(-1, topk), per_expert, prefix,
            torch.tensor(src_idx, dtype=torch.int32))


def expert_fn(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in expert that depends on the rank, so combine's sum order is visible."""
    return (recv_x.float() * (rank + 1) + 0.25).to(torch.bfloat16)


def expected_combine(me: int, inputs: list, experts: int) -> torch.Tensor:
    """combine(expert_fn(recv_x)) for rank ``me``'s tokens: fp32 sum over ranks ascending, bf16 once."""
    x, idx, _ = inputs[me]
    per_rank = experts // len(inputs)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        dests = sorted({int(e) // per_rank for e in idx[t].tolist() if e >= 0})
        acc = torch.zeros(x.shape[1], dtype=torch.float32)
        for r in dests:
            acc += expert_fn(x[t:t + 1], r)[0].float()
        out[t] = acc
    return out.to(torch.bfloat16)


def check_against_reference(group: dist.ProcessGroup, scenario: str, seeds: list[int], hidden: int,
                            experts: int, topk: int) -> int:
    """Runs every seed; asserts exact equality with the reference; returns the number of checks."""
    me, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    buf = moe_comm.Buffer(group, timeout_s=30)
    checks = 0
    for seed in seeds:
        inputs = [make_inputs(src, num_ranks, scenario, seed, hidden, experts, topk) for src in range(num_ranks)]
        x, idx, w = inputs[me]
        want_x, want_idx, want_w, want_list, want_prefix, want_src = expected_for(me, inputs, experts)
        recv_x, recv_idx, recv_w, recv_list, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                      num_experts=experts)
        assert torch.equal(recv_x, want_x), (scenario, seed)
        assert torch.equal(recv_idx, want_idx) and torch.equal(recv_w, want_w), (scenario, seed)
        assert recv_list == want_list and torch.equal(handle[0], want_prefix), (scenario, seed)
        assert torch.equal(handle[3], want_src), (scenario, seed)
        combined, _, _ = buf.combine(expert_fn(recv_x, me), handle)
        assert torch.equal(combined.view(torch.int16), expected_combine(me, inputs, experts).view(torch.int16))
        checks += 1
    return checks


def digest(group: dist.ProcessGroup, scenario: str, seed: int, async_finish: bool) -> str:
    """SHA-256 of every output of one dispatch + combine (with FP8, weights and biases)."""
    me, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    buf = moe_comm.Buffer(group, timeout_s=30)
    x, idx, w = make_inputs(me, num_ranks, scenario, seed, 256, 12, 4)
    scales = torch.rand(x.shape[0], 2, generator=torch.Generator().manual_seed(seed + me))
    h = hashlib.sha256()
    recv, recv_idx, recv_w, recv_list, handle, event = buf.dispatch(
        (x.float().to(torch.float8_e4m3fn), scales), topk_idx=idx, topk_weights=w, num_experts=12,
        async_finish=async_finish)
    if async_finish:
        event.current_stream_wait()
    recv_x, _, _, _, handle, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12,
                                                  async_finish=async_finish)
    if async_finish:
        event.current_stream_wait()
    bias = torch.randn(x.shape, generator=torch.Generator().manual_seed(me)).to(torch.bfloat16)
    y, y_w, event = buf.combine(expert_fn(recv_x, me), handle, topk_weights=recv_w, bias=bias,
                                async_finish=async_finish)
    if async_finish:
        event.current_stream_wait()
    for t in (*recv, recv_idx, recv_w, recv_x, *handle, y, y_w):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr(recv_list).encode())
    return h.hexdigest()
