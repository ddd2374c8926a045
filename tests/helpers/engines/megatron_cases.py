"""Megatron-Core 0.16.1 on CPU ranks: ``moe_comm.integrations.megatron.patch()``, then the flex
dispatcher's unmodified ``fused_dispatch``/``fused_combine`` (autograd functions over
``deep_ep.Buffer``), forward and backward, around linear experts, against a dense autograd
reference: the training path (cached dispatch and weight-summing combine in the backward)."""
from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from moe_comm.testing.contract import Recorder, recording_buffer

from helpers.engine_cases import problem


def _experts(x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum over k with topk_idx[t, k] >= 0 of probs[t, k] * x[t] @ weights[topk_idx[t, k]]`` (fp32)."""
    out = torch.zeros_like(x)
    for k in range(topk_idx.shape[1]):
        routed = topk_idx[:, k] >= 0
        chosen = weights[topk_idx[:, k].clamp(min=0)]
        term = probs[:, k, None] * torch.bmm(x[:, None, :], chosen)[:, 0]
        out = out + torch.where(routed[:, None], term, torch.zeros_like(term))
    return out


def megatron_train_step(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """One forward and backward; ``cfg["import_first"]``: Megatron's MoE modules are imported before
    ``patch()`` (so it must reload ``fused_a2a`` and rebind the token dispatcher's names)."""
    if cfg["import_first"]:
        importlib.import_module("megatron.core.transformer.moe.token_dispatcher")  # binds fused_dispatch = None
    from moe_comm.integrations import megatron as integration

    integration.patch()
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    recorder = Recorder()
    fused_a2a.Buffer = recording_buffer(recorder)  # what fused_a2a.get_buffer constructs
    p = problem(group, cfg)
    gen = torch.Generator().manual_seed(cfg["seed"] + 7)
    weights = torch.randn(p.num_experts, cfg["hidden"], cfg["hidden"], generator=gen) / cfg["hidden"] ** 0.5
    grad_out = torch.randn(p.x.shape, generator=gen)

    x = p.x.float().requires_grad_()
    probs = p.topk_weights.clone().requires_grad_()
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = token_dispatcher.fused_dispatch(
        x, p.topk_idx, probs, p.num_experts, group, async_finish=True)
    y = _experts(recv_x, recv_idx, recv_probs, weights[p.offset:p.offset + p.local])
    out, _ = token_dispatcher.fused_combine(y, group, handle, async_finish=True)
    (out * grad_out).sum().backward()

    x_ref = p.x.float().requires_grad_()
    probs_ref = p.topk_weights.clone().requires_grad_()
    out_ref = _experts(x_ref, p.topk_idx, probs_ref, weights)
    (out_ref * grad_out).sum().backward()

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    local_counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=p.local)
    return {"forms": recorder.forms(), "out": close(out, out_ref), "grad_x": close(x.grad, x_ref.grad),
            "grad_probs": close(probs.grad, probs_ref.grad), "tokens_per_expert": torch.equal(tokens_per_expert,
                                                                                               local_counts),
            "have_deep_ep": fused_a2a.HAVE_DEEP_EP, "rebound": token_dispatcher.fused_dispatch is fused_a2a.fused_dispatch,
            "deep_ep": getattr(sys.modules["deep_ep"], "MOE_COMM", False)}
