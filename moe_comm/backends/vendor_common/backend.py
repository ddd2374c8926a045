"""What the ascend and cambricon backends share: the portable backend (its handshakes, transport and
normal mode) on a torch.distributed group, with the vendor module their low-latency mode calls
imported first and ``enable_shrink`` refused (the vendors' all-to-alls run on every rank)."""
from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar, Optional

import torch.distributed as dist

from ...core.vendor_imports import load
from ..portable.backend import PortableBackend

__all__ = ["VendorBackend"]


class VendorBackend(PortableBackend):
    """A ``PortableBackend`` whose low-latency mode a vendor module drives (``self.vendor``). Construction
    is collective. Arguments: as ``PortableBackend``."""

    #: the module the low-latency mode calls, and where it comes from (``moe_comm.core.vendor_imports.load``)
    module: ClassVar[tuple[str, str]]
    #: the group's collective library, for messages
    collectives: ClassVar[str]
    #: why the vendor's all-to-all cannot leave exited ranks out
    every_rank: ClassVar[str]

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        vendor, why = load(*self.module)
        if vendor is None:  # checked by backends.unavailable_reason before; the module may have gone since
            raise RuntimeError(f"Buffer: the {self.name} backend needs {why}")
        if comm is not None or group is None and not dist.is_initialized():
            raise ValueError(f"Buffer: the {self.name} backend runs on a torch.distributed group ({self.collectives}), "
                             f"not an mpi4py communicator")
        if shrink:
            raise ValueError(f"Buffer: enable_shrink=True leaves exited ranks out of low-latency calls, but "
                             f"{self.every_rank}; leave enable_shrink off on the {self.name} backend")
        super().__init__(group, comm, transport, timeout_s, buffer_bytes, shrink)
        self.vendor: ModuleType = vendor
