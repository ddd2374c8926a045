"""The ``ascend`` backend: DeepEP's operations on Ascend NPUs (``torch_npu``, an ``hccl`` group).

Normal mode is the portable backend's over the group's transport (``collective``: HCCL's uneven
``all_to_all_single``), so its outputs are the reference's bit for bit. ``npu_moe_init_routing_v2`` and
``npu_grouped_matmul`` sort rows by expert, which is not DeepEP's normal-mode layout (one row per token
and destination rank, by source rank); they serve the expert computation after a dispatch, as
``moe_comm.ops.permute`` / ``grouped_gemm`` on NPU tensors (``ops/npu.py``). Low-latency mode runs
MC2's fused operators (``low_latency.py``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ...core.vendor_imports import load
from ..vendor_common.backend import VendorBackend
from .low_latency import Mc2LowLatencyMode
from .mc2 import Mc2

__all__ = ["AscendBackend", "TORCH_NPU", "ascend_reason"]

#: the vendor module and where it comes from
TORCH_NPU = ("torch_npu", "Huawei's Ascend Extension for PyTorch (pip install torch-npu) with CANN's libraries")


def ascend_reason() -> Optional[str]:
    """Why the ascend backend cannot run in this process (torch_npu missing or not importing, no NPU,
    no MC2 operators), or None when it can."""
    torch_npu, why = load(*TORCH_NPU)
    if torch_npu is None:
        return why
    if not torch_npu.npu.is_available():
        return "torch_npu imports but sees no NPU (torch_npu.npu.is_available() is False)"
    if not hasattr(torch_npu, "npu_moe_distribute_dispatch"):
        return (f"torch_npu {getattr(torch_npu, '__version__', '?')} has no npu_moe_distribute_dispatch (MC2's EP "
                f"operators)")
    return None


class AscendBackend(VendorBackend):
    """DeepEP's operations on Ascend. Construction is collective (the transport, MC2's own group).
    Arguments: as ``PortableBackend``; ``enable_shrink`` is refused (MC2 runs on every rank of its
    communicator, so a rank that has exited cannot be left out)."""

    name = "ascend"

    module = TORCH_NPU
    collectives = "hccl"
    every_rank = "MC2's operators run on every rank of their HCCL communicator"

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        super().__init__(group, comm, transport, timeout_s, buffer_bytes, shrink)
        self.low_latency = Mc2LowLatencyMode(self.transport, self.agreement,
                                             Mc2(self.vendor, group or dist.group.WORLD, self.transport.device.type))
