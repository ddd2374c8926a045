"""The ``cambricon`` backend: DeepEP's operations on Cambricon MLUs (``torch_mlu``, a ``cncl`` group).

Both modes are the portable backend's over the group's transport (``collective``: CNCL's uneven
``all_to_all_single``), so the outputs are the reference's bit for bit. Not built yet: low-latency
mode over ``torch_mlu_ops``' byte all-to-all (``moe_all2all_dispatch`` / ``_combine``), whose calling
conventions are read from its public callers (``../shared/research/tmo.md``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..vendor import load
from ..portable.backend import PortableBackend

__all__ = ["CambriconBackend", "TORCH_MLU", "cambricon_reason"]

#: the vendor module and where it comes from
TORCH_MLU = ("torch_mlu", "Cambricon's PyTorch extension (Cambricon's SDK images, with Neuware)")


def cambricon_reason() -> Optional[str]:
    """Why the cambricon backend cannot run in this process (torch_mlu missing or not importing, no MLU),
    or None when it can."""
    torch_mlu, why = load(*TORCH_MLU)
    if torch_mlu is None:
        return why
    if not torch_mlu.mlu.is_available():
        return "torch_mlu imports but sees no MLU (torch_mlu.mlu.is_available() is False)"
    return None


class CambriconBackend(PortableBackend):
    """DeepEP's operations on Cambricon MLUs. Construction is collective. Arguments: as ``PortableBackend``."""

    name = "cambricon"

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        torch_mlu, why = load(*TORCH_MLU)
        if torch_mlu is None:  # checked by backends.unavailable_reason before; the module may have gone since
            raise RuntimeError(f"Buffer: the cambricon backend needs {why}")
        if comm is not None or group is None and not dist.is_initialized():
            raise ValueError("Buffer: the cambricon backend runs on a torch.distributed group (cncl), not an mpi4py "
                             "communicator")
        super().__init__(group, comm, transport, timeout_s, buffer_bytes, shrink)
