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
