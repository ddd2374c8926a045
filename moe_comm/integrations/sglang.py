"""SGLang plugin (entry point ``sglang.srt.plugins: moe_comm``): with ``MOE_COMM_DEEP_EP=1``, SGLang's
``--moe-a2a-backend deepep`` runs on moe-comm.

SGLang binds ``Buffer`` and ``Config`` with ``from deep_ep import ...`` when its dispatcher module
(``sglang.srt.layers.moe.token_dispatcher.deepep``) is imported; ``load_plugins()`` runs first in
each SGLang process, so the ``deep_ep`` alias is what it binds. If that module was imported
earlier anyway, ``register`` points its names at moe-comm. Without CUDA, ``register`` also lets
``DeepEPBuffer.get_deepep_buffer`` run there (below). Written against SGLang 0.5.23.
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
