"""vLLM 0.32 on CPU ranks, as ``vllm serve --data-parallel-size W --enable-expert-parallel
--all2all-backend deepep_*`` sets it up (with torchrun's ``external_launcher``): the plugin loaded
by vLLM's own loader, vLLM's parallel state, the EP group's communicator and its DeepEP all2all
manager, ``maybe_make_prepare_finalize``, and the unmodified DeepEP prepare/finalize classes;
and the experts vLLM's oracle picks there: moe-comm's (``integrations/vllm_experts.py``), since vLLM's CPU
experts take neither format."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from moe_comm.testing.contract import Recorder, recording_buffer

from helpers.engine_cases import problem, verdict


def _vllm_state(group: dist.ProcessGroup, backend: str) -> Any:
    """Loads vLLM's general plugins (MOE_COMM_DEEP_EP=1) and builds its parallel state; returns the
    ParallelConfig. Once per process: each test runs in its own ranks."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MOE_COMM_DEEP_EP="1")
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    parallel = ParallelConfig(data_parallel_size=ranks, data_parallel_rank=rank, enable_expert_parallel=True,
                              all2all_backend=backend, distributed_executor_backend="external_launcher")
    context = set_current_vllm_config(VllmConfig(parallel_config=parallel))
    context.__enter__()  # for the life of the process, as in a vLLM worker
    parallel_state.init_distributed_environment(world_size=ranks, rank=rank, local_rank=rank, backend="gloo")
    parallel_state.initialize_model_parallel(1, 1, backend="gloo")
    return parallel


def _moe_config(parallel: Any, p: Any, cfg: dict[str, Any]) -> Any:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    moe_parallel = FusedMoEParallelConfig.make(tp_size_=1, pcp_size_=1, dp_size_=p.ranks, sp_size_=1,
                                               vllm_parallel_config=parallel)
    return FusedMoEConfig(num_experts=p.num_experts, experts_per_token=cfg["topk"], hidden_dim=cfg["hidden"],
                          intermediate_size=cfg["inter"], num_local_experts=p.local, num_logical_experts=p.num_experts,
                          activation=MoEActivation.SILU, device="cpu", routing_method=RoutingMethodType.Renormalize,
                          moe_parallel_config=moe_parallel, in_dtype=torch.bfloat16, max_num_tokens=cfg["max_tokens"])


def _experts(moe: Any, prepare_finalize: Any) -> Any:
    """The experts vLLM's unquantized oracle picks for this configuration, built as vLLM builds them."""
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend

    _, experts_cls = select_unquantized_moe_backend(moe)
    batched = {} if prepare_finalize.max_num_tokens_per_rank() is None else dict(
        max_num_tokens=prepare_finalize.max_num_tokens_per_rank(), num_dispatchers=prepare_finalize.num_dispatchers())
    return experts_cls(moe, FUSED_MOE_UNQUANTIZED_CONFIG, **batched)


def _refusals(moe: Any) -> dict[str, Any]:
    """What vLLM's oracle does, under the same DeepEP configuration, with a layer moe-comm's experts do not
    take (expert biases: left to vLLM, with one warning) and with 7 experts over 2 ranks (refused)."""
    import dataclasses
    import logging

    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("moe_comm.integrations.vllm").addHandler(handler)
    picks = []
    for _ in range(2):  # high-throughput: vLLM's CPU experts; low-latency: vLLM has none and raises
        try:
            picks.append(select_unquantized_moe_backend(dataclasses.replace(moe, has_bias=True))[1].__name__)
        except NotImplementedError as error:
            picks.append(f"NotImplementedError: {error}")
    try:
        select_unquantized_moe_backend(dataclasses.replace(moe, num_experts=7, num_logical_experts=7))
        uneven = None
    except ValueError as error:
        uneven = str(error)
    return {"bias_picks": picks, "warnings": warnings, "uneven": uneven}


def vllm_forward(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg["backend"]``: deepep_high_throughput or deepep_low_latency. Two forwards through the
    prepare/finalize vLLM builds; returns the verdict, the recorded call forms and what was built."""
    parallel = _vllm_state(group, cfg["backend"])  # first: the plugin runs before vLLM's MoE modules load
    import deep_ep
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.utils.import_utils import has_deep_ep, has_deep_ep_v2

    recorder = Recorder()
    deep_ep.Buffer = recording_buffer(recorder)  # what vLLM's manager constructs
    p = problem(group, cfg)
    manager = parallel_state.get_ep_group().device_communicator.all2all_manager
    moe = _moe_config(parallel, p, cfg)
    prepare_finalize = all2all_utils.maybe_make_prepare_finalize(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
    experts = _experts(moe, prepare_finalize)
    expert_map = torch.full((p.num_experts,), -1, dtype=torch.int32)  # global to local ids, as vLLM's layer has it
    expert_map[p.offset:p.offset + p.local] = torch.arange(p.local, dtype=torch.int32)
    outs = []
    for _ in range(2):
        expert_x, scale, meta, recv_ids, recv_weights = prepare_finalize.prepare(
            p.x, p.topk_weights, p.topk_idx, p.num_experts, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        topk_ids = p.topk_idx if recv_ids is None else recv_ids
        topk_weights = p.topk_weights if recv_weights is None else recv_weights
        # what vLLM's modular kernel does between prepare and finalize
        _, m, n, k, topk = experts.moe_problem_size(expert_x, p.mine.w13, p.mine.w2, topk_ids)
        y = torch.empty(experts.workspace_shapes(m, n, k, topk, p.num_experts, p.local, meta, MoEActivation.SILU)[2],
                        dtype=torch.bfloat16)
        experts.apply(y, expert_x, p.mine.w13, p.mine.w2, topk_weights, topk_ids, MoEActivation.SILU, p.num_experts,
                      expert_map, scale, None, torch.empty(0), torch.empty(0), meta, False)
        out = torch.empty_like(p.x)
        prepare_finalize.finalize(out, y, topk_weights, topk_ids, False, experts.finalize_weight_and_reduce_impl())
        outs.append(out)
    manager.destroy()
    result = verdict(p, outs[0], "sequential" if cfg["backend"] == "deepep_high_throughput" else "low_latency")
    return {**result, "forms": recorder.forms(), "repeatable": torch.equal(outs[0], outs[1]),
            "manager": type(manager).__name__, "prepare_finalize": type(prepare_finalize).__name__,
            "experts": type(experts).__name__, **_refusals(moe),
            "buffer_is_moe_comm": isinstance(prepare_finalize.buffer, deep_ep.Buffer),
            "has_deep_ep": has_deep_ep(), "has_deep_ep_v2": has_deep_ep_v2()}

