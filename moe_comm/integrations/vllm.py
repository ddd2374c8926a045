"""vLLM plugin (entry point ``vllm.general_plugins: moe_comm``): with ``MOE_COMM_DEEP_EP=1``, vLLM's
``--all2all-backend deepep_high_throughput|deepep_low_latency|deepep_v2`` runs on moe-comm.

vLLM loads general plugins in every process before its MoE modules are imported, so the
``deep_ep`` alias is in place when ``prepare_finalize/deepep_ht.py`` and ``deepep_ll.py`` run
``import deep_ep``. On vLLM's CPU platform two more things are needed (vLLM wires DeepEP on
CUDA/ROCm only), and ``register`` adds them:

1. ``CpuCommunicator`` builds vLLM's own ``DeepEPHTAll2AllManager`` / ``DeepEPLLAll2AllManager`` /
   ``DeepEPV2All2AllManager`` for those backends, instead of falling back to all-gather/reduce-scatter;
2. ``fused_moe.all2all_utils`` gets the names ``DeepEPHTPrepareAndFinalize``,
   ``DeepEPLLPrepareAndFinalize``, ``DeepEPV2PrepareAndFinalize`` and ``DEEPEP_QUANT_BLOCK_SHAPE``, which
   it imports on CUDA only (and V2's prepare a torch form of its one Triton kernel);
3. vLLM's unquantized MoE oracle is offered experts for both DeepEP formats (``vllm_experts.py``).

On every platform, vLLM's ``deepep_v2`` check no longer asks moe-comm's ``deep_ep`` for NCCL 2.30.4
(``_accept_elastic_buffer``). These reuse vLLM's unmodified classes. On every platform the hidden size is
no longer padded to DeepEP's compiled sizes (``_keep_hidden_size``). Written against vLLM 0.32
(``TESTED_VERSIONS``);
another version gets a warning, since the calls vLLM makes into ``deep_ep`` are version-specific.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from ..ops.fp8 import GROUP
from . import PATCH_MARK, install_from_env

__all__ = ["register", "TESTED_VERSIONS"]

logger = logging.getLogger("moe_comm.integrations.vllm")

TESTED_VERSIONS = ("0.32.",)

_MANAGERS = {"deepep_high_throughput": "DeepEPHTAll2AllManager", "deepep_low_latency": "DeepEPLLAll2AllManager",
             "deepep_v2": "DeepEPV2All2AllManager"}


def register() -> None:
    """The plugin: wires nothing unless ``MOE_COMM_DEEP_EP`` is ``1`` or ``force``; without it, on the CPU
    platform a ``deepep_*`` backend is met with what to set (vLLM has no DeepEP there). Idempotent (vLLM
    may call it several times per process)."""
    if install_from_env() is None:
        if "vllm" in sys.modules:  # called by vLLM's plugin loader (not by hand, without vLLM)
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                _hook_cpu_communicator(enabled=False)
        return
    import vllm
    from vllm.platforms import current_platform
    from vllm.utils import import_utils

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TESTED_VERSIONS):
        logger.warning("moe-comm's deep_ep was tested with vLLM %s; this is vLLM %s", " / ".join(TESTED_VERSIONS),
                       version)
    has_module = getattr(import_utils, "_has_module", None)  # has_deep_ep()'s cached probe; it may have cached False
    if hasattr(has_module, "cache_clear"):
        has_module.cache_clear()
    _accept_elastic_buffer(import_utils)
    if current_platform.is_cpu():
        _hook_cpu_communicator(enabled=True)
        _bind_prepare_finalize_names()
        from .vllm_experts import register_cpu_experts
        register_cpu_experts()
    _keep_hidden_size()


def _off_message(backend: str) -> str:
    return (f"--all2all-backend {backend} on vLLM's CPU platform runs on moe-comm's deep_ep, which is off in this "
            f"process: set MOE_COMM_DEEP_EP=1 in the environment of every vLLM process")


def _hook_cpu_communicator(enabled: bool) -> None:
    """Makes ``CpuCommunicator`` build vLLM's DeepEP all2all managers for the ``deepep_*`` backends; when not
    ``enabled`` (MOE_COMM_DEEP_EP unset), refuses low-latency, which vLLM could not build on CPU anyway, and
    warns on high-throughput, which vLLM serves by all-gather instead."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.device_communicators import all2all
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if getattr(CpuCommunicator.__init__, PATCH_MARK, False):
        return
    original = CpuCommunicator.__init__

    @functools.wraps(original)
    def __init__(self: Any, cpu_group: Any, device: Any = None, device_group: Any = None, unique_name: str = "",
                 use_all2all: bool = False, **kwargs: Any) -> None:
        config = get_current_vllm_config_or_none()
        backend = config.parallel_config.all2all_backend if config is not None else None
        if not (use_all2all and backend in _MANAGERS):
            original(self, cpu_group, device, device_group, unique_name, use_all2all=use_all2all, **kwargs)
            return
        if not enabled:
            if backend == "deepep_low_latency":
                raise RuntimeError(_off_message(backend))
            logger.warning("%s; vLLM falls back to all-gather and reduce-scatter", _off_message(backend))
            original(self, cpu_group, device, device_group, unique_name, use_all2all=use_all2all, **kwargs)
            return
        # Built without all2all so the CPU fallback (a warning and an all-gather manager) is skipped;
        # the flag is then what the base class sets for use_all2all=True.
        original(self, cpu_group, device, device_group, unique_name, use_all2all=False, **kwargs)
        self.use_all2all = self.is_ep_communicator
        if self.use_all2all:
            self.all2all_manager = getattr(all2all, _MANAGERS[backend])(self.cpu_group)
            if backend == "deepep_v2":  # its NCCL GIN probe allocates on CUDA; moe-comm needs no GIN
                self.all2all_manager._gin_checked = True
            logger.info("moe-comm: %s on the CPU platform uses vLLM's %s over moe-comm's deep_ep", backend,
                        _MANAGERS[backend])

    setattr(__init__, PATCH_MARK, True)
    CpuCommunicator.__init__ = __init__


def _accept_elastic_buffer(import_utils: Any) -> None:
    """vLLM's ``deepep_v2`` backend asks for DeepEP's ``ElasticBuffer`` and an NCCL of 2.30.4 or newer (DeepEP V2's
    GIN transport). moe-comm's ``ElasticBuffer`` needs no NCCL, so with moe-comm's ``deep_ep`` the NCCL
    condition is dropped; any other ``deep_ep`` is judged as vLLM judges it."""
    original = import_utils.deep_ep_v2_unavailable_reason
    if getattr(original, PATCH_MARK, False):
        return

    @functools.wraps(original)
    def deep_ep_v2_unavailable_reason() -> Any:
        deep_ep = sys.modules.get("deep_ep")
        if deep_ep is not None and getattr(deep_ep, "MOE_COMM", False):
            return None
        return original()

    setattr(deep_ep_v2_unavailable_reason, PATCH_MARK, True)
    import_utils.deep_ep_v2_unavailable_reason = deep_ep_v2_unavailable_reason


def _bind_prepare_finalize_names() -> None:
    """Gives ``all2all_utils`` the DeepEP prepare/finalize names it binds on CUDA/ROCm only, and V2's prepare a
    CPU form of the one Triton kernel it launches."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ht, deepep_ll, deepep_v2

    all2all_utils.DeepEPHTPrepareAndFinalize = deepep_ht.DeepEPHTPrepareAndFinalize
    all2all_utils.DeepEPLLPrepareAndFinalize = deepep_ll.DeepEPLLPrepareAndFinalize
    all2all_utils.DEEPEP_QUANT_BLOCK_SHAPE = deepep_ll.DEEPEP_QUANT_BLOCK_SHAPE
    all2all_utils.DeepEPV2PrepareAndFinalize = deepep_v2.DeepEPV2PrepareAndFinalize
    deepep_v2._globalize_recv_topk_idx = _globalize_recv_topk_idx


def _globalize_recv_topk_idx(recv_topk_idx: Any, psum_recv_per_rank: Any, rank_expert_offset: int,
                             num_experts: int) -> Any:
    """What vLLM's Triton kernel of the same name does, in torch (the CPU has no Triton launch): in place, local
    expert ids become global ones, and slots without a local expert, past ``num_experts`` or in rows past the
    received count (``psum_recv_per_rank[-1]``, read on the device) become -1."""
    import torch

    rows = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device).unsqueeze(1)
    glob = recv_topk_idx + rank_expert_offset
    valid = (recv_topk_idx >= 0) & (glob < num_experts) & (rows < psum_recv_per_rank[-1])
    recv_topk_idx.copy_(torch.where(valid, glob, -1))
    return recv_topk_idx


def _check_low_latency_hidden(hidden_size: int) -> int:
    """vLLM's DeepEP low-latency hidden-size rounding, for moe-comm: the size itself (moe-comm has no list of
    compiled sizes), which must be a multiple of 128."""
    if hidden_size % GROUP:
        raise ValueError(f"moe-comm's deepep_low_latency needs the model's hidden size to be a multiple of {GROUP}; "
                         f"this model has hidden_size={hidden_size}. Use --all2all-backend deepep_high_throughput "
                         f"(no such condition) or a model whose hidden size is a multiple of {GROUP}")
    return hidden_size


def _keep_hidden_size() -> None:
    """vLLM pads the hidden size up to what DeepEP's kernels were compiled for (low-latency: a list whose smallest
    entry is 2048; high-throughput: 512-byte rows) before the router gate. moe-comm takes any hidden size in
    high-throughput mode and any multiple of 128 in low-latency mode, so the model keeps its own."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_ht, deepep_ll

    ll, ht = deepep_ll.DeepEPLLPrepareAndFinalize, deepep_ht.DeepEPHTPrepareAndFinalize
    if getattr(ll.maybe_roundup_layer_hidden_size, PATCH_MARK, False):
        return
    setattr(_check_low_latency_hidden, PATCH_MARK, True)
    ll.maybe_roundup_layer_hidden_size = staticmethod(_check_low_latency_hidden)
    ll.SUPPORTED_HIDDEN_SIZES = range(GROUP, 1 << 31, GROUP)  # what its prepare asserts a hidden size is in
    ht.maybe_roundup_layer_hidden_size = staticmethod(lambda hidden_size, dtype: hidden_size)
