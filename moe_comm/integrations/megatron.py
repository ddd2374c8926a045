"""Megatron-Core: ``moe_comm.integrations.megatron.patch()`` makes the flex token dispatcher
(``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``) run on moe-comm.

Megatron's ``transformer/moe/fused_a2a.py`` imports ``Buffer`` from ``deep_ep`` and
``EventHandle``/``EventOverlap`` from ``deep_ep.utils`` in a try block, and defines
``fused_dispatch``/``fused_combine``/``set_deepep_num_sms`` only when that import worked. Its
autograd functions use cached dispatch in the backward of combine and a weight-summing combine in
the backward of dispatch, which moe-comm's ``Buffer`` provides. Written against Megatron-Core 0.16.
"""
from __future__ import annotations

import importlib
import logging
import sys

from . import install_deep_ep_alias

__all__ = ["patch", "FUSED_A2A"]

logger = logging.getLogger("moe_comm.integrations.megatron")

FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"
_DEFINED_WITH_DEEP_EP = ("fused_dispatch", "fused_combine", "set_deepep_num_sms")


def patch(force: bool = False) -> None:
    """Call once per process before building the model. Installs the ``deep_ep`` alias
    (``force`` as in ``install_deep_ep_alias``); if ``fused_a2a`` was imported without DeepEP, it is
    reloaded and the modules that imported its functions (the token dispatcher) get the new
    ones; its cached buffer is dropped. Idempotent."""
    compat = install_deep_ep_alias(force=force)
    module = sys.modules.get(FUSED_A2A)
    if module is None:
        return
    if module.HAVE_DEEP_EP and module.Buffer is compat.Buffer:
        if module._buffer is not None and not isinstance(module._buffer, compat.Buffer):
            module._buffer = None  # built by the DeepEP that force replaced
        return
    before = {name: getattr(module, name, None) for name in _DEFINED_WITH_DEEP_EP}
    module = importlib.reload(module)
    changed = []
    for module_name, other in list(sys.modules.items()):
        if not module_name.startswith("megatron.") or other is module:
            continue
        for name, old in before.items():
            if name in getattr(other, "__dict__", {}) and getattr(other, name) is old:
                setattr(other, name, getattr(module, name))
                changed.append(f"{module_name}.{name}")
    logger.info("moe-comm: reloaded %s on moe-comm's deep_ep; rebound %s", FUSED_A2A, ", ".join(changed) or "nothing")
