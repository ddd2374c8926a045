"""Routing (``select_experts``) against a per-token Python reference, and the layer's argument checks:
every bad input raises before any byte moves, naming the argument."""
import math
import warnings

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.moe import Experts, ep_moe, select_experts


def _route_one(logits: list[float], top_k: int, scoring: str, groups, topk_groups, bias, renormalize, scale):
    """One token, in plain Python floats: (experts best first, weights)."""
    if scoring == "softmax":
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        scores = [e / sum(exps) for e in exps]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    biased = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
    allowed = range(len(logits))
    if groups:
        size = len(logits) // groups
        members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
        rank = [sum(sorted((biased[i] for i in m), reverse=True)[:2]) if bias is not None else max(biased[i] for i in m)
                for m in members]
        best = sorted(range(groups), key=lambda g: -rank[g])[:topk_groups]
        allowed = [i for g in best for i in members[g]]
    chosen = sorted(allowed, key=lambda i: -biased[i])[:top_k]
    weights = [scores[i] for i in chosen]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * scale for w in weights]


@pytest.mark.parametrize("scoring,groups,topk_groups,with_bias,renormalize,scale", [
    ("softmax", None, None, False, False, 1.0),         # Mixtral / Qwen-MoE without renormalization
    ("softmax", None, None, False, True, 1.0),          # Mixtral
    ("softmax", 8, 3, False, False, 16.0),              # DeepSeek-V2 (group max)
    ("sigmoid", 8, 4, True, True, 2.5),                 # DeepSeek-V3 (bias, sum of the best two)
    ("sigmoid", None, None, True, True, 1.0),
])
def test_select_experts_matches_per_token_reference(scoring, groups, topk_groups, with_bias, renormalize, scale):
    tokens, experts, top_k = 37, 64, 6
    logits = torch.randn(tokens, experts)
    bias = torch.randn(experts) / 5 if with_bias else None
    idx, weights = select_experts(logits, top_k, scoring=scoring, num_groups=groups, topk_groups=topk_groups,
                                  correction_bias=bias, renormalize=renormalize, scaling_factor=scale)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32 and idx.shape == weights.shape == (tokens, top_k)
    bias_list = None if bias is None else bias.tolist()
    for t in range(tokens):
        chosen, expected = _route_one(logits[t].tolist(), top_k, scoring, groups, topk_groups, bias_list,
                                      renormalize, scale)
        assert idx[t].tolist() == chosen
        assert weights[t].tolist() == pytest.approx(expected, rel=1e-5)
    if groups:  # every token's experts fall in at most topk_groups groups
        assert int((idx // (experts // groups)).sort(dim=1).values.diff(dim=1).ne(0).sum(1).max()) < topk_groups
    again = select_experts(logits, top_k, scoring=scoring, num_groups=groups, topk_groups=topk_groups,
                           correction_bias=bias, renormalize=renormalize, scaling_factor=scale)
    assert torch.equal(again[0], idx) and torch.equal(again[1], weights)


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=0), "top_k must be >= 1"),
    (dict(top_k=2, scoring="relu"), "scoring must be one of"),
    (dict(top_k=2, num_groups=4), "num_groups and topk_groups must be given together"),
    (dict(top_k=2, num_groups=5, topk_groups=1), "num_groups dividing the 16 experts"),
    (dict(top_k=5, num_groups=4, topk_groups=1), "top_k must be at most 4"),
    (dict(top_k=2, correction_bias=torch.zeros(3)), "correction_bias must be shaped [16]"),
])
def test_select_experts_rejects_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=None) as info:
        select_experts(torch.randn(4, 16), **kwargs)
    assert message in str(info.value), str(info.value)


def test_experts_check_their_weights():
    w13, w2 = torch.randn(2, 256, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()
    assert Experts(w13, w2).intermediate == 128
    with pytest.raises(ValueError, match="w2 must be a \\[2, 128, 128\\] tensor"):
        Experts(w13, w2[:, :64])
    with pytest.raises(TypeError, match="both bfloat16 or both float8_e4m3fn"):
        Experts(w13, w2.float())
    q = Experts.quantized(w13.float(), w2.float())
    assert q.fp8 and q.w13_scales.shape == (2, 2, 1) and q.w2_scales.shape == (2, 1, 1)
    with pytest.raises(ValueError, match="w13_scales must be float32"):
        Experts(q.w13, q.w2, q.w13_scales[:, :1], q.w2_scales)
    with pytest.raises(ValueError, match="None for bfloat16 weights"):
        Experts(w13, w2, q.w13_scales, q.w2_scales)


def _bad_calls(group: dist.ProcessGroup) -> list[str]:
    """Each bad call's error, on a 1-rank group."""
    experts = Experts(torch.randn(4, 256, 128).bfloat16(), torch.randn(4, 128, 128).bfloat16())
    x, idx, w = torch.randn(6, 128).bfloat16(), torch.rand(6, 4).topk(2).indices, torch.rand(6, 2)
    normal = moe_comm.Buffer(group, explicitly_destroy=True)
    calls = [
        lambda: ep_moe(normal, x, idx, w, experts, 4, mode="pipelined"),
        lambda: ep_moe(normal, x, idx, w, experts, 8),
        lambda: ep_moe(normal, x.float(), idx, w, experts, 4),
        lambda: ep_moe(normal, x, idx.int(), w, experts, 4),
        lambda: ep_moe(normal, x, idx, w[:3], experts, 4),
        lambda: ep_moe(normal, x, idx, w, experts, 4, mode="chunked", num_chunks=0),
        lambda: ep_moe(normal, x, idx, w, experts, 4, mode="low_latency", num_max_dispatch_tokens_per_rank=8),
        lambda: ep_moe("buffer", x, idx, w, experts, 4),
        lambda: moe_comm.EPMoE(normal, experts, 4)(x),
        lambda: moe_comm.EPMoE(normal, experts, 4)(x, router_logits=torch.randn(6, 4)),
        lambda: moe_comm.EPMoE(normal, experts, 4, mode="fast"),
        lambda: ep_moe(normal, x, idx, w, experts, 4, ops_impl="native", backend="triton"),
    ]
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(4, 128, 1, 4)
    ll = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    calls += [lambda: ep_moe(ll, x, idx, w, experts, 4, mode="low_latency"),
              lambda: ep_moe(ll, x, idx, w, experts, 4, mode="low_latency", num_max_dispatch_tokens_per_rank=4),
              lambda: ep_moe(ll, x, idx, w, experts, 4, mode="two_batch", num_max_dispatch_tokens_per_rank=2)]
    errors = []
    for call in calls:
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    ok = ep_moe(ll, x, idx, w, experts, 4, mode="two_batch", num_max_dispatch_tokens_per_rank=4)
    errors.append(str(list(ok.shape)))
    with warnings.catch_warnings(record=True) as seen:  # backend= is ops_impl='s old name
        warnings.simplefilter("always")
        layer = moe_comm.EPMoE(normal, experts, 4, backend="native")
    errors.append(f"{layer.ops_impl}: " + "; ".join(str(w.message) for w in seen))
    normal.destroy()
    ll.destroy()
    return errors


def test_layer_rejects_bad_arguments(worlds):
    errors = worlds(1).run(_bad_calls)[0]
    expected = [
        "ValueError: ep_moe: mode must be one of ['sequential', 'chunked', 'two_batch', 'low_latency'], got 'pipelined'",
        "ValueError: ep_moe: num_experts must be the group size (1) times this rank's 4 experts, got 8",
        "TypeError: ep_moe: x must be of dtype bfloat16",
        "TypeError: ep_moe: topk_idx must be of dtype int64",
        "ValueError: ep_moe: topk_weights must be shaped [6, 2]",
        "ValueError: ep_moe: num_chunks must be >= 1, got 0",
        "ValueError: ep_moe: buffer must be a Buffer with low_latency_mode=True for mode 'low_latency'",
        "TypeError: ep_moe: buffer must be a moe_comm.Buffer",
        "ValueError: EPMoE.forward: routing must be either topk_idx and topk_weights, or router_logits",
        "ValueError: EPMoE.forward: router_logits must be used only by an EPMoE built with top_k",
        "ValueError: EPMoE: mode must be one of",
        "ValueError: ep_moe: ops_impl='native' and its deprecated name backend='triton' disagree",
        "ValueError: ep_moe: num_max_dispatch_tokens_per_rank must be an int for mode 'low_latency', got None",
        "ValueError: ep_moe: x must be [T, H] with T <= 4 in mode 'low_latency' (1 micro-batch(es) of at most "
        "num_max_dispatch_tokens_per_rank=4 tokens), got [6, 128]",
        "ValueError: ep_moe: x must be [T, H] with T <= 4 in mode 'two_batch' (2 micro-batch(es)",
        "[6, 128]",
        "native: EPMoE: the keyword backend= is deprecated, use ops_impl= (backend= names a Buffer backend)",
    ]
    assert len(errors) == len(expected)
    for got, want in zip(errors, expected):
        assert got.startswith(want), (got, want)
