"""SGLang plugin (entry point ``sglang.srt.plugins: moe_comm``): with ``MOE_COMM_DEEP_EP=1``, SGLang's
``--moe-a2a-backend deepep`` runs on moe-comm.

SGLang binds ``Buffer`` and ``Config`` with ``from deep_ep import ...`` when its dispatcher module
(``sglang.srt.layers.moe.token_dispatcher.deepep``) is imported; ``load_plugins()`` runs first in
each SGLang process, so the ``deep_ep`` alias is what it binds. If that module was imported
earlier anyway, ``register`` points its names at moe-comm. Without CUDA, ``register`` also lets
``DeepEPBuffer.get_deepep_buffer`` run there, and gives ``DeepEPMoE`` experts for both DeepEP formats
(``_cpu_experts``: SGLang's own run only DeepGEMM's, which needs CUDA). Written against SGLang 0.5.23.
"""
from __future__ import annotations

import functools
import importlib
import logging
import sys
from typing import Any

import torch

from . import PATCH_MARK, install_from_env

__all__ = ["register", "TESTED_VERSIONS"]

logger = logging.getLogger("moe_comm.integrations.sglang")

TESTED_VERSIONS = ("0.5.23",)

DISPATCHER = "sglang.srt.layers.moe.token_dispatcher.deepep"


def register() -> None:
    """The plugin: does nothing unless ``MOE_COMM_DEEP_EP`` is ``1`` or ``force``. Idempotent."""
    compat = install_from_env()
    if compat is None:
        return
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if not version.startswith(TESTED_VERSIONS):
        logger.warning("moe-comm's deep_ep was tested with SGLang %s; this is SGLang %s", " / ".join(TESTED_VERSIONS),
                       version)
    already_imported = DISPATCHER in sys.modules
    dispatcher = importlib.import_module(DISPATCHER)
    if already_imported and dispatcher.__dict__.get("Buffer") is not compat.Buffer:
        _rebind_dispatcher(dispatcher, compat)
    if not torch.cuda.is_available():
        _skip_sm_probe(dispatcher)
        _cpu_experts(dispatcher)


def _rebind_dispatcher(dispatcher: Any, compat: Any) -> None:
    """The dispatcher module imported before the alias: its ``from deep_ep import`` block again."""
    dispatcher.Buffer, dispatcher.Config = compat.Buffer, compat.Config
    if not getattr(dispatcher, "_is_npu", False) and not hasattr(dispatcher, "sglang_per_token_group_quant_fp8"):
        from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8
        dispatcher.sglang_per_token_group_quant_fp8 = sglang_per_token_group_quant_fp8
    dispatcher.use_deepep, dispatcher._deepep_import_error = True, None
    logger.warning("moe-comm: %s was imported before the deep_ep alias; its Buffer and Config now are moe-comm's",
                   DISPATCHER)


def _skip_sm_probe(dispatcher: Any) -> None:
    """``get_deepep_buffer`` asks ``torch.cuda.get_device_properties`` for the SM count (for a
    warning about SMs) unless the module's ``_is_npu`` is set, and fails without CUDA. Its other
    ``_is_npu`` use in that method sets ``NVSHMEM_QP_DEPTH``, which moe-comm does not read. So on a
    machine without CUDA the method runs as on an NPU: SGLang's own buffer sizing and ``Buffer(...)``
    call, without the probe."""
    buffers = dispatcher.DeepEPBuffer
    original = buffers.get_deepep_buffer.__func__
    if getattr(original, PATCH_MARK, False):
        return

    @functools.wraps(original)
    def get_deepep_buffer(cls: Any, *args: Any, **kwargs: Any) -> Any:
        was_npu = dispatcher._is_npu
        dispatcher._is_npu = True
        try:
            return original(cls, *args, **kwargs)
        finally:
            dispatcher._is_npu = was_npu

    setattr(get_deepep_buffer, PATCH_MARK, True)
    buffers.get_deepep_buffer = classmethod(get_deepep_buffer)


def _cpu_experts(dispatcher: Any) -> None:
    """``DeepEPMoE.run_moe_core`` runs moe-comm's experts (SwiGLU, the layer's bf16 ``w13_weight``/``w2_weight``)
    on an unquantized layer's CPU dispatch output: the normal format (rows with local top-k ids; each output
    row its local slots' weighted sum) and the low-latency one (``[E_loc, R * M, H]`` blocks with
    ``masked_m`` counts; weighted by the combine), BF16 or FP8 (dequantized for the bf16 weights). SGLang's
    own ``run_moe_core`` has only DeepGEMM's experts there. The normal dispatcher's ``combine_a``, which
    passes the experts' output through under DeepGEMM and raises otherwise, passes it through here too.
    Other layers (quantized weights, CUDA tensors, SGLang's newer paths) keep SGLang's code."""
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE

    original = DeepEPMoE.run_moe_core
    if getattr(original, PATCH_MARK, False):
        return

    @functools.wraps(original)
    def run_moe_core(self: Any, dispatch_output: Any) -> Any:
        kind = getattr(getattr(dispatch_output, "format", None), "name", "")
        if (getattr(self, "deprecate_flag", True) or self.quant_config is not None
                or kind not in ("DEEPEP_NORMAL", "DEEPEP_LL") or dispatch_output.hidden_states.device.type != "cpu"):
            return original(self, dispatch_output)
        from ..moe import Experts
        from ..moe.stages import local_expert_rows
        from ..ops import dequantize

        experts = Experts(self.w13_weight.data, self.w2_weight.data)
        out = dispatch_output
        x = out.hidden_states
        if out.hidden_states_scale is not None:  # FP8 activations for bf16 weights: dequantized first
            hidden = x.shape[-1]
            scales = out.hidden_states_scale
            x = dequantize(x.reshape(-1, hidden), scales.reshape(-1, scales.shape[-1])).view(x.shape)
        if kind == "DEEPEP_NORMAL":
            y = local_expert_rows(experts, x, out.topk_ids.long(), out.topk_weights.float())
            return dispatcher.DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights)
        y = experts.ffn(x, masked_m=out.masked_m.to(torch.int32))
        return dispatcher.DeepEPLLCombineInput(y, out.topk_ids, out.topk_weights)

    setattr(run_moe_core, PATCH_MARK, True)
    DeepEPMoE.run_moe_core = run_moe_core

    normal = dispatcher._DeepEPDispatcherImplNormal
    combine_a = normal.combine_a

    @functools.wraps(combine_a)
    def pass_through(self: Any, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> Any:
        if hidden_states.device.type != "cpu":
            return combine_a(self, hidden_states, topk_ids, topk_weights)
        return hidden_states, (dispatcher.Buffer.capture() if self.async_finish else None)

    normal.combine_a = pass_through
