"""The expert-parallel MoE layer, built only from ``Buffer`` and ``moe_comm.ops``:

    experts = Experts(w13, w2).select(rank * E_loc, E_loc)       # this rank's share of the experts
    layer = EPMoE(buffer, experts, num_experts, top_k=8, mode="chunked", num_chunks=4)
    y = layer(x, router_logits=logits)                            # or layer(x, topk_idx, topk_weights)

Modes (``ep_moe``): ``sequential``, ``chunked`` (pipelined normal mode), ``two_batch`` (low-latency
two-micro-batch overlap with hooks) and ``low_latency`` (decode). ``ep_moe_reference`` gives each rank's
exact expected output from every rank's inputs; ``dense_moe_reference`` is the fp64 specification.
"""
from .experts import Experts
from .layer import EPMoE, ep_moe
from .reference import dense_moe, dense_moe_reference, ep_moe_reference
from .routing import SCORINGS, select_experts
from .schedules import LOW_LATENCY_MODES, MODES, micro_batches
from .stages import LowLatencyStages, NormalStages

__all__ = ["EPMoE", "ep_moe", "Experts", "select_experts", "SCORINGS", "MODES", "LOW_LATENCY_MODES", "micro_batches",
           "dense_moe", "dense_moe_reference", "ep_moe_reference", "NormalStages", "LowLatencyStages"]
