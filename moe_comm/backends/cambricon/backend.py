"""The ``cambricon`` backend: DeepEP's operations on Cambricon MLUs (``torch_mlu``, a ``cncl`` group).

Normal mode is the portable backend's over the group's transport (``collective``: CNCL's uneven
``all_to_all_single``), so its outputs are the reference's bit for bit. Low-latency mode moves the
portable mode's row records through ``torch_mlu_ops``' byte all-to-all (``moe_all2all_dispatch`` /
``_combine``; ``tmo.py``, ``low_latency.py``), whose calling conventions are read from its public
callers (``docs/vendors.md``, torch_mlu_ops' all-to-all).
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ...core.vendor_imports import load
from ..vendor_common.backend import VendorBackend
from .low_latency import TmoLowLatencyMode
from .tmo import TmoAll2All

__all__ = ["CambriconBackend", "TORCH_MLU", "TORCH_MLU_OPS", "cambricon_reason"]

#: the vendor modules and where they come from
TORCH_MLU = ("torch_mlu", "Cambricon's PyTorch extension (Cambricon's SDK images, with Neuware)")
TORCH_MLU_OPS = ("torch_mlu_ops", "Cambricon's torch_mlu_ops (Cambricon's SDK images)")
# the operators the low-latency mode calls
_TMO_OPS = ("moe_all2all_create", "moe_all2all_init", "moe_all2all_dispatch", "moe_all2all_combine",
            "moe_all2all_destroy")


def cambricon_reason() -> Optional[str]:
    """Why the cambricon backend cannot run in this process (torch_mlu or torch_mlu_ops missing or not
    importing, no MLU, no EP all-to-all), or None when it can."""
    torch_mlu, why = load(*TORCH_MLU)
    if torch_mlu is None:
        return why
    if not torch_mlu.mlu.is_available():
        return "torch_mlu imports but sees no MLU (torch_mlu.mlu.is_available() is False)"
    tmo, why = load(*TORCH_MLU_OPS)
    if tmo is None:
        return why
    missing = [name for name in _TMO_OPS if not hasattr(tmo, name)]
    if missing:
        return f"torch_mlu_ops has no {', '.join(missing)} (its expert-parallel all-to-all)"
    return None


class CambriconBackend(VendorBackend):
    """DeepEP's operations on Cambricon MLUs. Construction is collective. Arguments: as ``PortableBackend``."""

    name = "cambricon"

    module = TORCH_MLU_OPS
    collectives = "cncl"
    every_rank = "torch_mlu_ops' all-to-all runs on every rank of its handle"

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        super().__init__(group, comm, transport, timeout_s, buffer_bytes, shrink)
        self.all2all = TmoAll2All(self.vendor, self.transport)
        self.low_latency = TmoLowLatencyMode(self.transport, self.agreement, self.all2all)

    def destroy(self) -> None:
        if not self.agreement.destroyed:
            self.all2all.destroy()
        super().destroy()
