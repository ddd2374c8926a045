"""The exact call forms each engine uses on ``deep_ep.Buffer``: per method, the set of
``(positional arguments after self, keyword names)``, read from the engines' released code
(vLLM 0.32.0's DeepEP all2all managers and prepare/finalize classes, SGLang 0.5.23's DeepEP
dispatcher, Megatron-Core 0.16.1's flex token dispatcher). ``moe_comm.testing.contract`` records
calls in the same form. The replays in ``engine_replays.py`` make exactly these calls; the
real-engine tests (``tests/integrations/engines``) check that the engines still do."""
from __future__ import annotations

Forms = dict[str, set[tuple[int, frozenset[str]]]]


def _form(positional: int, *keywords: str) -> tuple[int, frozenset[str]]:
    return positional, frozenset(keywords)


# vLLM 0.32.0, DeepEPHTAll2AllManager + DeepEPHTPrepareAndFinalize, without DBO (so no capture());
# the manager's destroy() destroys its buffers.
VLLM_HT: Forms = {
    "Buffer": {_form(0, "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "explicitly_destroy")},
    "get_dispatch_config": {_form(1)},
    "get_combine_config": {_form(1)},
    "get_dispatch_layout": {_form(0, "topk_idx", "num_experts", "previous_event", "async_finish",
                                  "allocate_on_comm_stream")},
    "dispatch": {_form(0, "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                       "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "config",
                       "previous_event", "async_finish", "allocate_on_comm_stream")},
    "combine": {_form(0, "x", "handle", "topk_weights", "config", "previous_event", "async_finish",
                      "allocate_on_comm_stream")},
    "destroy": {_form(0)},
}

# vLLM 0.32.0, DeepEPLLAll2AllManager + DeepEPLLPrepareAndFinalize (BF16 dispatch, no NVFP4).
VLLM_LL: Forms = {
    "get_low_latency_rdma_size_hint": {_form(0, "num_max_dispatch_tokens_per_rank", "hidden", "num_ranks",
                                             "num_experts")},
    "Buffer": {_form(0, "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink")},
    "low_latency_dispatch": {_form(4, "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook")},
    "low_latency_combine": {_form(4, "async_finish", "zero_copy", "return_recv_hook", "out")},
    "destroy": {_form(0)},
}

# SGLang 0.5.23, DeepEPDispatcher in low-latency mode (DeepEPBuffer.get_deepep_buffer), on a
# non-NPU machine. FP8 dispatch adds round_scale and use_ue8m0 (False without DeepGEMM Blackwell).
SGLANG_LL: Forms = {
    "get_low_latency_rdma_size_hint": {_form(4)},
    "Buffer": {_form(3, "low_latency_mode", "num_qps_per_rank", "allow_mnnvl")},
    "low_latency_dispatch": {_form(4, "use_fp8", "async_finish", "return_recv_hook")},
    "low_latency_combine": {_form(0, "x", "topk_idx", "topk_weights", "handle", "async_finish", "return_recv_hook")},
}
SGLANG_LL_FP8_DISPATCH = {_form(4, "use_fp8", "async_finish", "return_recv_hook", "round_scale", "use_ue8m0")}

# Megatron-Core 0.16.1, transformer/moe/fused_a2a.py: FusedDispatch and FusedCombine, forward and
# backward (the combine of dispatch's backward sums the probabilities' gradients; the dispatch of
# combine's backward is cached, by handle).
MEGATRON: Forms = {
    "get_dispatch_config": {_form(1)},
    "get_combine_config": {_form(1)},
    "Buffer": {_form(3)},
    "get_dispatch_layout": {_form(2, "previous_event", "async_finish", "allocate_on_comm_stream")},
    "dispatch": {_form(1, "topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                       "is_token_in_rank", "num_tokens_per_expert", "previous_event", "async_finish",
                       "allocate_on_comm_stream"),
                 _form(1, "handle", "previous_event", "async_finish", "allocate_on_comm_stream")},
    "combine": {_form(1, "handle", "async_finish", "previous_event", "allocate_on_comm_stream"),
                _form(2, "topk_weights", "previous_event", "async_finish", "allocate_on_comm_stream")},
}
