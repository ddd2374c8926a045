"""Opt-in wiring of moe-comm into code written for DeepEP: vLLM, SGLang and Megatron-Core.

Nothing here runs unless asked. ``install_deep_ep_alias()`` makes ``import deep_ep`` (and
``deep_ep.utils``) give ``moe_comm.compat.deep_ep``; the engines' plugin entry points
(``moe_comm.integrations.vllm:register``, ``moe_comm.integrations.sglang:register``) call it when
``MOE_COMM_DEEP_EP=1`` (or ``force``), and ``moe_comm.integrations.megatron.patch()`` calls it for
Megatron-Core.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType
from typing import Optional

from ..core import env

__all__ = ["DeepEPConflictError", "install_deep_ep_alias", "install_from_env", "alias_installed", "PATCH_MARK"]

logger = logging.getLogger("moe_comm.integrations")

_ALIASED = ("Buffer", "Config", "EventHandle", "EventOverlap")

#: Attribute set on every engine function the plugins wrap, so a second registration leaves it be.
PATCH_MARK = "_moe_comm_deep_ep"


class DeepEPConflictError(RuntimeError):
    """Another ``deep_ep`` is already imported and moe-comm was not asked to replace it."""


def _compat() -> ModuleType:
    from ..compat import deep_ep
    return deep_ep


def alias_installed() -> bool:
    """True when ``import deep_ep`` gives moe-comm's module in this process."""
    return sys.modules.get("deep_ep") is _compat()


def _rebind(old: ModuleType, new: ModuleType) -> list[str]:
    """Points every module attribute that holds ``old``, ``old.utils`` or one of old's public objects
    at moe-comm's counterpart; returns the ``module.name`` entries changed."""
    targets: dict[int, object] = {id(old): new}
    old_utils = getattr(old, "utils", None) or sys.modules.get("deep_ep.utils")
    if isinstance(old_utils, ModuleType):
        targets[id(old_utils)] = new.utils
    for source in (old, old_utils):
        for name in _ALIASED:
            value = getattr(source, name, None)
            if value is not None:
                targets[id(value)] = getattr(new, name)
    changed = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module in (old, old_utils, new, new.utils) or not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in targets:
                namespace[attr] = targets[id(value)]
                changed.append(f"{module_name}.{attr}")
    return changed


def install_deep_ep_alias(force: bool = False) -> ModuleType:
    """Registers ``moe_comm.compat.deep_ep`` as ``deep_ep`` and ``deep_ep.utils``; returns it. Idempotent.

    An installed but not yet imported DeepEP (e.g. SGLang's ``sgl-deep-ep``) is shadowed, and the
    log says so. Another ``deep_ep`` that is already imported is kept (DeepEPConflictError) unless
    ``force``: then the module entries are replaced and every module attribute that already took
    ``deep_ep``, ``deep_ep.utils`` or their ``Buffer``/``Config``/``EventHandle``/``EventOverlap``
    is pointed at moe-comm's (logged as a warning, with the list).
    """
    compat = _compat()
    current = sys.modules.get("deep_ep")
    if current is compat:
        return compat
    if current is not None:
        where = getattr(current, "__file__", None) or repr(current)
        if not force:
            raise DeepEPConflictError(
                f"install_deep_ep_alias: another deep_ep is already imported ({where}), so moe-comm does not "
                f"replace it. Make moe-comm's alias the first import of deep_ep (MOE_COMM_DEEP_EP=1 does this from "
                f"the vLLM and SGLang plugin entry points, which run before their MoE layers are imported), or "
                f"replace it anyway with force=True or MOE_COMM_DEEP_EP=force")
        changed = _rebind(current, compat)
        logger.warning("moe-comm replaced the deep_ep already imported from %s; rebound %d names: %s", where,
                       len(changed), ", ".join(changed) or "none")
    else:
        spec = importlib.util.find_spec("deep_ep")
        if spec is not None:
            logger.info("moe-comm's deep_ep shadows the one installed at %s (MOE_COMM_DEEP_EP)", spec.origin)
    sys.modules["deep_ep"] = compat
    sys.modules["deep_ep.utils"] = compat.utils
    return compat


def install_from_env() -> Optional[ModuleType]:
    """``install_deep_ep_alias`` as ``MOE_COMM_DEEP_EP`` asks: None when it is off, else the module."""
    mode = env.deep_ep_alias()
    if mode is None:
        return None
    return install_deep_ep_alias(force=mode == "force")
