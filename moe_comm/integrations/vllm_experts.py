"""moe-comm's experts for vLLM's DeepEP prepare/finalize on the CPU platform, where vLLM has none that fit.

vLLM's CPU experts (``cpu_fused_moe``) take int32 local expert ids in the Standard format; DeepEP
high-throughput prepare hands over int64 global ids and an ``expert_map``, and low-latency prepare the
batched ``[E_loc, R * M, H]`` format with per-expert counts, for which vLLM has no CPU experts at all.
These two classes fill both gaps with ``moe_comm.moe.Experts`` (SwiGLU, bf16, vLLM's w13/w2 layout) and
are offered to vLLM's unquantized MoE oracle ahead of its own CPU kernels, only for the DeepEP
configurations (``register_cpu_experts``). Imported only by the vLLM plugin, with vLLM installed.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig
from vllm.model_executor.layers.fused_moe.oracle import unquantized
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (TopKWeightAndReduceDelegate,
                                                                         TopKWeightAndReduceNoOP)
from vllm.platforms import current_platform

from ..moe import Experts
from ..moe.stages import local_expert_rows
from . import PATCH_MARK

__all__ = ["MoeCommDeepEPHTExperts", "MoeCommDeepEPLLExperts", "register_cpu_experts"]

logger = logging.getLogger("moe_comm.integrations.vllm")


class _MoeCommExperts(mk.FusedMoEExpertsModular):
    """What both formats share: CPU, SwiGLU (SILU and mul), unquantized bf16 weights without biases,
    and only under the DeepEP kernels named by ``_kernels`` (a FusedMoEParallelConfig flag). Under those
    kernels a layer they do not take is warned about once (vLLM's CPU experts cannot take it either),
    and a number of experts that the EP size does not divide is refused with what to change."""

    _kernels = ""  # the FusedMoEParallelConfig flags (space-separated) under which the class serves

    @staticmethod
    def is_supported_config(cls: type[mk.FusedMoEExperts], moe_config: FusedMoEConfig, weight_key: Any,
                            activation_key: Any, activation_format: mk.FusedMoEActivationFormat
                            ) -> tuple[bool, Optional[str]]:
        if not (cls._supports_current_device() and cls._supports_parallel_config(moe_config.moe_parallel_config)):
            return False, f"kernel serves {cls._kernels} on the CPU platform only"
        supported, reason = mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                                   activation_format)
        if supported:
            supported, reason = cls._check(moe_config)
        if not supported:
            _warn_left_to_vllm(cls, reason)
        return supported, reason

    @classmethod
    def _check(cls, moe_config: FusedMoEConfig) -> tuple[bool, Optional[str]]:
        ep_size = moe_config.moe_parallel_config.ep_size
        if moe_config.num_experts % ep_size:  # DeepEP's layouts give every rank the same number of experts
            raise ValueError(
                f"moe-comm's deep_ep needs the number of experts to be a multiple of the expert-parallel size: this "
                f"model has {moe_config.num_experts} experts over {ep_size} ranks. Choose --data-parallel-size (times "
                f"--tensor-parallel-size) dividing {moe_config.num_experts}")
        if moe_config.has_bias:
            return False, "moe-comm's experts have no expert biases"
        if moe_config.in_dtype != torch.bfloat16:
            return False, f"moe-comm's experts take bfloat16 activations, not {moe_config.in_dtype}"
        return True, None

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @classmethod
    def _supports_parallel_config(cls, moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return any(getattr(moe_parallel_config, k, False) for k in cls._kernels.split())

    def _experts(self, w1: torch.Tensor, w2: torch.Tensor) -> Experts:
        return Experts(w1, w2)


_WARNED: set[tuple[str, str]] = set()


def _warn_left_to_vllm(cls: type, reason: Optional[str]) -> None:
    """Once per (class, reason): a layer under DeepEP on CPU that moe-comm's experts do not take."""
    if (cls.__name__, str(reason)) in _WARNED:
        return
    _WARNED.add((cls.__name__, str(reason)))
    logger.warning("moe-comm: %s does not take this MoE layer (%s); it is left to vLLM's own CPU experts, which do "
                   "not take DeepEP's %s format", cls.__name__, reason, cls.activation_format().value)


class MoeCommDeepEPHTExperts(_MoeCommExperts):
    """The Standard format of DeepEP high-throughput prepare (and of DeepEP V2's, whose expanded rows carry
    one slot each): rows `[N, H]` with the global ids of their top-k slots (``expert_map`` takes them to
    local ids, -1 for another rank's expert). Each output row is its local slots' weighted sum
    (``local_expert_rows``), so the finalize only combines."""

    _kernels = "use_deepep_ht_kernels use_deepep_v2_kernels"

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int, local_num_experts: int,
                         expert_tokens_meta: Any, activation: MoEActivation
                         ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # the weights are applied here

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor], a2_scale: Optional[torch.Tensor],
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        local = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        output.copy_(local_expert_rows(self._experts(w1, w2), hidden_states, local, weights.float()))


class MoeCommDeepEPLLExperts(_MoeCommExperts):
    """The batched format of DeepEP low-latency prepare: `[E_loc, R * M, H]` blocks, the first
    ``expert_num_tokens[e]`` rows of block e valid; the outputs in the same layout (rows past the
    count are zero), weighted and summed by the low-latency combine."""

    _kernels = "use_deepep_ll_kernels"

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int, local_num_experts: int,
                         expert_tokens_meta: Any, activation: MoEActivation
                         ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()  # the low-latency combine weighs and sums

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation, global_num_experts: int,
              expert_map: Optional[torch.Tensor], a1q_scale: Optional[torch.Tensor], a2_scale: Optional[torch.Tensor],
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        counts = expert_tokens_meta.expert_num_tokens
        output.copy_(self._experts(w1, w2).ffn(hidden_states, masked_m=counts.to(torch.int32)))


def register_cpu_experts() -> None:
    """Puts the two classes first in the CPU backend's list of vLLM's unquantized MoE oracle; each
    claims only its own DeepEP format, so every other configuration still gets vLLM's kernels."""
    original = unquantized.backend_to_kernel_cls
    if getattr(original, PATCH_MARK, False):
        return

    @functools.wraps(original)
    def backend_to_kernel_cls(backend: unquantized.UnquantizedMoeBackend) -> list[type[mk.FusedMoEExperts]]:
        classes = original(backend)
        if backend == unquantized.UnquantizedMoeBackend.CPU:
            classes = [MoeCommDeepEPHTExperts, MoeCommDeepEPLLExperts, *classes]
        return classes

    setattr(backend_to_kernel_cls, PATCH_MARK, True)
    unquantized.backend_to_kernel_cls = backend_to_kernel_cls
