"""What the engine tests share, run inside each rank: the MoE problem (every rank draws every
rank's inputs and all experts from one seed), the experts an engine would run on what a dispatch
delivered, the verdict against moe-comm's single-process references, and the replays: each
engine's calls into ``deep_ep.Buffer``, made exactly as ``engine_calls.py`` lists them, on a
recording moe-comm ``Buffer`` (the real-engine tests in ``tests/integrations/engines`` make the same
calls through the engines' own code)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_comm import EventHandle, EventOverlap, accuracy
from moe_comm.moe import Experts, ep_moe_reference
from moe_comm.moe.stages import local_expert_rows
from moe_comm.testing.contract import Recorder, recording_buffer

from helpers.moe_cases import global_experts, rank_inputs


@dataclass
class Problem:
    """One rank's view: its tokens and routing, its experts, and everything needed for references."""

    rank: int
    ranks: int
    num_experts: int
    xs: list[torch.Tensor]
    idxs: list[torch.Tensor]
    weights: list[torch.Tensor]
    experts: Experts   # all experts
    mine: Experts      # this rank's share

    @property
    def x(self) -> torch.Tensor:
        return self.xs[self.rank]

    @property
    def topk_idx(self) -> torch.Tensor:
        return self.idxs[self.rank]

    @property
    def topk_weights(self) -> torch.Tensor:
        return self.weights[self.rank]

    @property
    def local(self) -> int:
        return self.num_experts // self.ranks

    @property
    def offset(self) -> int:
        return self.rank * self.local

    @property
    def max_tokens(self) -> int:
        return max(max(x.shape[0] for x in self.xs), 1)


def problem(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Problem:
    """``cfg``: tokens (per rank), hidden, inter, topk, experts, seed, optional fp8 and unused."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    everything = global_experts(cfg["experts"], cfg["hidden"], cfg["inter"], cfg.get("fp8", False), cfg["seed"])
    xs, idxs, weights = rank_inputs(cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["seed"],
                                    cfg.get("unused", 2))
    local = cfg["experts"] // ranks
    return Problem(rank, ranks, cfg["experts"], xs, idxs, weights, everything, everything.select(rank * local, local))


def local_ids(p: Problem, global_ids: torch.Tensor) -> torch.Tensor:
    """Global expert ids to this rank's local ids, -1 for other ranks' experts (vLLM's expert_map)."""
    local = global_ids - p.offset
    return torch.where((local >= 0) & (local < p.local), local, -1)


def normal_experts(p: Problem, recv_x: torch.Tensor, recv_local_idx: torch.Tensor, recv_weights: torch.Tensor,
                   recv_scales: Any = None) -> torch.Tensor:
    """This rank's experts on normal-mode rows, each row reduced over its local slots: `[N, H]` bf16."""
    return local_expert_rows(p.mine, recv_x, recv_local_idx, recv_weights, recv_scales)


def masked_experts(p: Problem, recv_x: torch.Tensor, count: torch.Tensor, recv_scales: Any = None) -> torch.Tensor:
    """This rank's experts on low-latency blocks: `[E_loc, R * M, H]` bf16."""
    return p.mine.ffn(recv_x, masked_m=count, x_scales=recv_scales)


def verdict(p: Problem, out: torch.Tensor, mode: str) -> dict[str, Any]:
    """How ``out`` compares with moe-comm's references for ``mode`` (``sequential``: normal mode's
    two-level sum; ``low_latency``: one weighted sum)."""
    expected = ep_moe_reference(p.xs, p.idxs, p.weights, p.experts, mode)[p.rank]
    spec = ep_moe_reference(p.xs, p.idxs, p.weights, p.experts, mode, fp64=True)[p.rank]
    report = accuracy.check(f"engine[{mode}]", out, spec, torch.bfloat16, raise_on_fail=False)
    return {"rank": p.rank, "shape": list(out.shape), "dtype": str(out.dtype),
            "bitwise": out.shape == expected.shape and torch.equal(out.view(torch.int16), expected.view(torch.int16)),
            "accuracy": report.passed, "reason": report.reason,
            "max_abs_err": float((out.double() - spec.double()).abs().max()) if out.numel() else 0.0}


# ---------------------------------------------------------------------------------------------- replays

def vllm_ht_replay(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's DeepEPHTAll2AllManager.get_handle, then DeepEPHTPrepareAndFinalize prepare/finalize."""
    p, recorder = problem(group, cfg), Recorder()
    buffer_cls = recording_buffer(recorder)
    buffer = buffer_cls(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=0, low_latency_mode=False,
                        num_qps_per_rank=1, explicitly_destroy=True)
    try:
        num_tokens_per_rank, num_tokens_per_rdma_rank, per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
            topk_idx=p.topk_idx, num_experts=p.num_experts, previous_event=None, async_finish=False,
            allocate_on_comm_stream=False)
        recv_x, recv_idx, recv_weights, _, handle, event = buffer.dispatch(
            x=p.x, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=per_expert, topk_idx=p.topk_idx, topk_weights=p.topk_weights, expert_alignment=1,
            config=buffer_cls.get_dispatch_config(p.ranks), previous_event=None, async_finish=True,
            allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        # vLLM moves ids to the global space (-1 to an expert of another rank), its expert_map back.
        remapped = torch.where(recv_idx == -1, p.num_experts - 1 if p.offset == 0 else 0, recv_idx + p.offset)
        y = normal_experts(p, recv_x, local_ids(p, remapped), recv_weights)
        out = torch.empty_like(p.x)
        combined, _, _ = buffer.combine(x=y, handle=handle, topk_weights=None,
                                        config=buffer_cls.get_combine_config(p.ranks), previous_event=None,
                                        async_finish=False, allocate_on_comm_stream=False)
        out.copy_(combined)
    finally:
        buffer.destroy()
    return {"forms": recorder.forms(), **verdict(p, out, "sequential")}


def _ll_buffer_kwargs(group: dist.ProcessGroup, buffer_cls: type, p: Problem, hidden: int) -> dict[str, Any]:
    """vLLM 0.32's DeepEPLLAll2AllManager._make_all2all_kwargs."""
    rdma = buffer_cls.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=p.max_tokens, hidden=hidden,
                                                     num_ranks=p.ranks, num_experts=p.num_experts)
    return dict(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                num_qps_per_rank=p.local, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                explicitly_destroy=True, enable_shrink=False)


def vllm_ll_replay(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM 0.32's DeepEPLLAll2AllManager.get_handle, then DeepEPLLPrepareAndFinalize (hook receive,
    weighted combine into ``out``)."""
    p, recorder = problem(group, cfg), Recorder()
    buffer_cls = recording_buffer(recorder)
    buffer = buffer_cls(**_ll_buffer_kwargs(group, buffer_cls, p, cfg["hidden"]))
    try:
        recv_x, count, handle, _, hook = buffer.low_latency_dispatch(
            p.x, p.topk_idx, p.max_tokens, p.num_experts, use_fp8=False, round_scale=False, use_ue8m0=False,
            async_finish=False, return_recv_hook=True)
        hook()
        y = masked_experts(p, recv_x, count)
        out = torch.empty_like(p.x)
        buffer.low_latency_combine(y, p.topk_idx, p.topk_weights, handle, async_finish=False, zero_copy=False,
                                   return_recv_hook=False, out=out)
    finally:
        buffer.destroy()
    return {"forms": recorder.forms(), **verdict(p, out, "low_latency")}


def sglang_ll_replay(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.23's DeepEPBuffer.get_deepep_buffer (low-latency mode) and DeepEPDispatcher's
    dispatch_a/b and combine_a/b with receive hooks; FP8 dispatch when the experts are FP8."""
    p, recorder = problem(group, cfg), Recorder()
    buffer_cls = recording_buffer(recorder)
    rdma = buffer_cls.get_low_latency_rdma_size_hint(p.max_tokens, cfg["hidden"], p.ranks, p.num_experts)
    buffer = buffer_cls(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=p.local, allow_mnnvl=False)
    fp8 = p.mine.fp8
    scale_opts = dict(round_scale=False, use_ue8m0=False) if fp8 else {}
    recv, count, handle, _, hook = buffer.low_latency_dispatch(
        p.x, p.topk_idx, p.max_tokens, p.num_experts, use_fp8=fp8, async_finish=False, return_recv_hook=True,
        **scale_opts)
    hook()
    recv_x, recv_scales = recv if fp8 else (recv, None)
    y = masked_experts(p, recv_x, count, recv_scales)
    out, _, hook = buffer.low_latency_combine(x=y, topk_idx=p.topk_idx, topk_weights=p.topk_weights, handle=handle,
                                              async_finish=False, return_recv_hook=True)
    hook()
    return {"forms": recorder.forms(), "group_size": buffer.group_size, **verdict(p, out, "low_latency")}


def megatron_replay(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """Megatron-Core 0.16.1's fused_a2a: get_buffer, FusedDispatch and FusedCombine forward (async),
    and their backward calls: a cached dispatch (here of x, which must give the first dispatch's rows)
    and a combine that also sums top-k weights (here the received weights, which must give back each
    token's weights where its slot is routed)."""
    p, recorder = problem(group, cfg), Recorder()
    buffer_cls = recording_buffer(recorder)
    hidden_bytes = p.x.shape[1] * max(p.x.element_size(), 2)
    nvl = rdma = 0
    for config in (buffer_cls.get_dispatch_config(p.ranks), buffer_cls.get_combine_config(p.ranks)):
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, p.ranks), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, p.ranks), rdma)
    buffer = buffer_cls(group, nvl, rdma)

    def previous() -> EventOverlap:
        return EventOverlap(EventHandle())

    per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
        p.topk_idx, p.num_experts, previous_event=previous(), async_finish=True, allocate_on_comm_stream=False)
    recv_x, recv_idx, recv_weights, _, handle, after = buffer.dispatch(
        p.x, topk_idx=p.topk_idx, topk_weights=p.topk_weights, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        previous_event=event, async_finish=True, allocate_on_comm_stream=False)
    after.current_stream_wait()
    y = normal_experts(p, recv_x, recv_idx, recv_weights)
    out, _, after = buffer.combine(y, handle=handle, async_finish=True, previous_event=previous(),
                                   allocate_on_comm_stream=False)
    after.current_stream_wait()
    again, _, _, _, _, after = buffer.dispatch(p.x, handle=handle, previous_event=previous(), async_finish=True,
                                               allocate_on_comm_stream=False)
    after.current_stream_wait()
    _, summed_weights, after = buffer.combine(recv_x, handle, topk_weights=recv_weights, previous_event=previous(),
                                              async_finish=True, allocate_on_comm_stream=False)
    after.current_stream_wait()
    routed = torch.where(p.topk_idx >= 0, p.topk_weights, torch.zeros_like(p.topk_weights))
    return {"forms": recorder.forms(), "cached_dispatch_equal": torch.equal(again, recv_x),
            "weights_summed": torch.equal(summed_weights, routed), **verdict(p, out, "sequential")}
