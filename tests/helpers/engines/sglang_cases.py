"""SGLang 0.5.23 on CPU ranks: the plugin loaded by SGLang's own loader, then SGLang's unmodified
``DeepEPDispatcher`` in low-latency mode (receive hooks, as ``--moe-a2a-backend deepep
--deepep-mode low_latency`` builds it) with moe-comm's experts on the masked layout."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from moe_comm.testing.contract import Recorder, recording_buffer

from helpers.engine_cases import masked_experts, problem, verdict


def sglang_low_latency(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two dispatch/combine rounds; ``cfg["fp8"]``: SGLang's default FP8 dispatch (with FP8 experts),
    else ``--deepep-dispatcher-output-dtype bf16``."""
    os.environ["MOE_COMM_DEEP_EP"] = "1"
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(cfg["max_tokens"])
    from sglang.srt.plugins import load_plugins

    load_plugins()  # first: the plugin runs before SGLang's dispatcher module loads
    import deep_ep
    from sglang.srt.layers.moe.token_dispatcher import deepep
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", device="cpu", deepep_dispatcher_output_dtype="auto" if cfg.get("fp8") else "bf16"))
    recorder = Recorder()
    deepep.Buffer = recording_buffer(recorder)  # the name DeepEPBuffer.get_deepep_buffer constructs
    p = problem(group, cfg)
    dispatcher = deepep.DeepEPDispatcher(
        group=group, router_topk=cfg["topk"], permute_fusion=True, num_experts=p.num_experts,
        num_local_experts=p.local, hidden_size=cfg["hidden"], params_dtype=torch.bfloat16,
        deepep_mode=DeepEPMode.LOW_LATENCY, async_finish=True, return_recv_hook=True)
    outs, formats = [], set()
    for _ in range(2):
        dispatched = dispatcher.dispatch(p.x, StandardTopKOutput(p.topk_weights, p.topk_idx, None))
        formats.add(dispatched.format.name)
        y = masked_experts(p, dispatched.hidden_states, dispatched.masked_m, dispatched.hidden_states_scale)
        outs.append(dispatcher.combine(deepep.DeepEPLLCombineInput(y, dispatched.topk_ids, dispatched.topk_weights)))
    return {**verdict(p, outs[0], "low_latency"), "forms": recorder.forms(), "formats": sorted(formats),
            "repeatable": torch.equal(outs[0], outs[1]), "use_deepep": deepep.use_deepep,
            "buffer_is_moe_comm": isinstance(deepep.DeepEPBuffer._state().buffer, deep_ep.Buffer),
            "fp8_dispatch": dispatched.hidden_states.dtype == torch.float8_e4m3fn}


def sglang_experts_layer(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``DeepEPMoE.forward_impl`` (dispatch, ``run_moe_core``, combine: the layer's own steps) over its
    unmodified ``DeepEPDispatcher``, with bf16 expert weights in the layer, its experts being moe-comm's
    (the plugin's ``_cpu_experts``). ``cfg["mode"]``: ``normal`` or ``low_latency``; ``cfg["dispatch_fp8"]``:
    SGLang's default FP8 low-latency dispatch (the reference then runs on the dequantized activations)."""
    os.environ["MOE_COMM_DEEP_EP"] = "1"
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(cfg["max_tokens"])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE
    from sglang.srt.layers.moe.token_dispatcher import deepep
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from moe_comm.moe import ep_moe_reference
    from moe_comm.ops import per_token_cast_back, per_token_cast_to_fp8

    fp8, low_latency = cfg.get("dispatch_fp8", False), cfg["mode"] == "low_latency"
    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", device="cpu", deepep_dispatcher_output_dtype="auto" if fp8 else "bf16"))
    p = problem(group, cfg)
    mode = DeepEPMode.LOW_LATENCY if low_latency else DeepEPMode.NORMAL
    layer = DeepEPMoE.__new__(DeepEPMoE)
    torch.nn.Module.__init__(layer)
    layer.w13_weight = torch.nn.Parameter(p.mine.w13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(p.mine.w2, requires_grad=False)
    layer.quant_config, layer.deprecate_flag, layer.use_w4afp8 = None, False, False
    layer.dispatcher = deepep.DeepEPDispatcher(
        group=group, router_topk=cfg["topk"], permute_fusion=True, num_experts=p.num_experts,
        num_local_experts=p.local, hidden_size=cfg["hidden"], params_dtype=torch.bfloat16, deepep_mode=mode,
        async_finish=True, return_recv_hook=low_latency)
    outs = [DeepEPMoE.forward_impl(layer, p.x, StandardTopKOutput(p.topk_weights, p.topk_idx, None))
            for _ in range(2)]
    reference_mode = "low_latency" if low_latency else "sequential"
    if fp8:  # what the experts see: the activations after the dispatch's FP8 cast
        xs = [per_token_cast_back(*per_token_cast_to_fp8(x)) for x in p.xs]
        expected = ep_moe_reference(xs, p.idxs, p.weights, p.experts, reference_mode)[p.rank]
        result = {"rank": p.rank, "shape": list(outs[0].shape), "bitwise": torch.equal(outs[0], expected),
                  "accuracy": True, "reason": ""}
    else:
        result = verdict(p, outs[0], reference_mode)
    return {**result, "repeatable": torch.equal(outs[0], outs[1]),
            "patched": getattr(DeepEPMoE.run_moe_core, "__wrapped__", None) is not None}
