"""moe-comm: expert-parallel MoE dispatch/combine with DeepEP's v1 ``Buffer`` API, on any device.

    import moe_comm
    buf = moe_comm.Buffer(group)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buf.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
    y, _, _ = buf.combine(expert_out, handle)
"""
from .buffer import Buffer, ElasticBuffer, EPHandle, EventHandle, EventOverlap, topk_idx_t
from .core.config import Config
from .core.errors import (BackendUnavailableError, BufferUnusableError, CommTimeoutError, CrossRankMismatchError,
                          PeerExitedError)
from .core.native import build_info
from .launch import init_from_env, spawn
from .moe import EPMoE, Experts, ep_moe

__version__ = "0.1.0"

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventHandle", "EventOverlap", "BackendUnavailableError", "BufferUnusableError",
           "CommTimeoutError", "CrossRankMismatchError", "PeerExitedError",
           "topk_idx_t", "build_info", "EPMoE", "Experts", "ep_moe", "init_from_env", "spawn", "__version__"]
