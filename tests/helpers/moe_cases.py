"""EP-MoE forwards run inside each rank: every rank draws every rank's inputs and the global experts
from one seed, so it can compute its own expected output with the single-process references."""
from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import accuracy
from moe_comm.moe import LOW_LATENCY_MODES, Experts, ep_moe, ep_moe_reference, select_experts

from helpers.low_latency_cases import ll_buffer


def global_experts(num_experts: int, hidden: int, inter: int, fp8: bool, seed: int) -> Experts:
    """All experts, scaled so activations stay O(1) through both projections."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / math.sqrt(inter)
    return Experts.quantized(w13, w2) if fp8 else Experts(w13.bfloat16(), w2.bfloat16())


def rank_inputs(num_tokens: list[int], hidden: int, topk: int, num_experts: int, seed: int, unused: int = 2
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's (x, topk_idx, topk_weights): distinct experts per token drawn from all but the last
    ``unused`` experts (which stay empty), and about one slot in eight set to -1."""
    gen = torch.Generator().manual_seed(seed + 1)
    xs, idxs, weights = [], [], []
    for t in num_tokens:
        xs.append(torch.randn(t, hidden, generator=gen).bfloat16())
        scores = torch.rand(t, num_experts - unused, generator=gen)
        idx = scores.topk(topk, dim=1).indices
        idx[torch.rand(t, topk, generator=gen) < 0.125] = -1
        idxs.append(idx)
        weights.append(torch.rand(t, topk, generator=gen))
    return xs, idxs, weights


def max_tokens(mode: str, tokens: list[int]) -> int:
    """The low-latency M that fits every rank's micro-batches in ``mode``."""
    return max(max(-(-t // 2) for t in tokens) if mode == "two_batch" else max(tokens), 1)


def make_buffer(group: dist.ProcessGroup, mode: str, m: int, hidden: int, num_experts: int) -> moe_comm.Buffer:
    if mode not in LOW_LATENCY_MODES:
        return moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
    return ll_buffer(group, m, hidden, num_experts, timeout_s=60)


def moe_forward(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """One forward in ``cfg["mode"]``, twice; returns how it compares with the references."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    tokens, hidden, inter, topk, experts = cfg["tokens"], cfg["hidden"], cfg["inter"], cfg["topk"], cfg["experts"]
    mode, chunks, fp8, impl = cfg["mode"], cfg.get("num_chunks", 2), cfg.get("fp8", False), cfg.get("impl")
    m = max_tokens(mode, tokens)
    device = torch.device(cfg.get("device", "cpu"))
    everything = global_experts(experts, hidden, inter, fp8, cfg["seed"]).to(device)
    local = experts // ranks
    mine = everything.select(rank * local, local)
    xs, idxs, weights = ([t.to(device) for t in ts] for ts in rank_inputs(tokens, hidden, topk, experts, cfg["seed"],
                                                                          cfg.get("unused", 2)))
    buffer = make_buffer(group, mode, m, hidden, experts)
    try:
        outs = [ep_moe(buffer, xs[rank], idxs[rank], weights[rank], mine, experts, mode=mode, num_chunks=chunks,
                       num_max_dispatch_tokens_per_rank=m, ops_impl=impl) for _ in range(2)]
    finally:
        buffer.destroy()
    expected = ep_moe_reference(xs, idxs, weights, everything, mode, chunks, impl=impl)[rank]
    spec = ep_moe_reference(xs, idxs, weights, everything, mode, chunks, fp64=True, impl=impl)[rank]
    report = accuracy.check(f"ep_moe[{mode}]", outs[0], spec, torch.bfloat16, raise_on_fail=False)
    return {"rank": rank, "shape": list(outs[0].shape), "dtype": str(outs[0].dtype),
            "bitwise_reference": torch.equal(outs[0].view(torch.int16), expected.view(torch.int16)),
            "repeatable": torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)),
            "accuracy": report.passed, "reason": report.reason, "metrics": report.metrics,
            "nonzero_rows": int((outs[0].float().abs().sum(1) > 0).sum()),
            "digest": hashlib.sha256(outs[0].view(torch.int16).cpu().numpy().tobytes()).hexdigest()}


def layer_from_logits(group: dist.ProcessGroup, mode: str) -> dict[str, Any]:
    """``EPMoE`` routed by DeepSeek-V3-style logits (sigmoid, bias, groups) equals ``ep_moe`` routed by
    ``select_experts`` of the same logits, and the reference."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    experts, hidden, tokens = 8 * ranks, 256, [12 + 5 * r for r in range(ranks)]
    everything = global_experts(experts, hidden, 128, False, seed=7)
    local = experts // ranks
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(t, hidden, generator=gen).bfloat16() for t in tokens]
    logits = [torch.randn(t, experts, generator=gen) for t in tokens]
    bias = torch.randn(experts, generator=gen) / 10
    routing = dict(top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2, renormalize=True, scaling_factor=2.5)
    m = max_tokens(mode, tokens)
    buffer = make_buffer(group, mode, m, hidden, experts)
    try:
        layer = moe_comm.EPMoE(buffer, everything.select(rank * local, local), experts, correction_bias=bias,
                               mode=mode, num_chunks=2, num_max_dispatch_tokens_per_rank=m, **routing)
        out = layer(xs[rank], router_logits=logits[rank])
        routed = [select_experts(lg, correction_bias=bias, **routing) for lg in logits]
        direct = ep_moe(buffer, xs[rank], *routed[rank], layer.experts, experts, mode=mode, num_chunks=2,
                        num_max_dispatch_tokens_per_rank=m)
    finally:
        buffer.destroy()
    expected = ep_moe_reference(xs, [r[0] for r in routed], [r[1] for r in routed], everything, mode, 2)[rank]
    return {"layer_equals_functional": torch.equal(out.view(torch.int16), direct.view(torch.int16)),
            "equals_reference": torch.equal(out.view(torch.int16), expected.view(torch.int16)),
            "buffers": sorted(name for name, _ in layer.named_buffers())}


def mismatched_chunks(group: dist.ProcessGroup) -> str:
    """Ranks that disagree on the number of chunks get an error, not a hang."""
    rank = dist.get_rank(group)
    everything = global_experts(4 * dist.get_world_size(group), 128, 128, False, seed=3)
    xs, idxs, weights = rank_inputs([8] * dist.get_world_size(group), 128, 2, everything.num_experts, seed=3)
    buffer = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=5)
    try:
        ep_moe(buffer, xs[rank], idxs[rank], weights[rank], everything.select(rank * 4, 4), everything.num_experts,
               mode="chunked", num_chunks=2 + rank)
    except Exception as exc:  # every rank must fail with a clear error
        return f"{type(exc).__name__}: {exc}"
    finally:
        buffer.destroy()
    return "no error"


def skip_forward(group: dist.ProcessGroup, mode: str, timeout_s: float) -> Any:
    """The last rank never calls the layer; the others must time out (buffers of deadline
    ``timeout_s``) naming it, not hang."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    everything = global_experts(4 * ranks, 128, 128, False, seed=4)
    xs, idxs, weights = rank_inputs([8] * ranks, 128, 2, everything.num_experts, seed=4)
    buffer = ll_buffer(group, 8, 128, everything.num_experts, timeout_s=timeout_s)
    if rank == ranks - 1:
        return "skipped"
    start = time.monotonic()
    try:
        ep_moe(buffer, xs[rank], idxs[rank], weights[rank], everything.select(rank * 4, 4), everything.num_experts,
               mode=mode, num_chunks=3, num_max_dispatch_tokens_per_rank=8)
    except moe_comm.CommTimeoutError as exc:
        return time.monotonic() - start, str(exc), exc.missing_ranks
    return "no timeout"
