"""The ``cuda_host`` backend: the CUDA kernels of ``csrc/cuda`` built for the host platform
(``moe_comm._cuda_host``), on CPU tensors, ranks of one host sharing memory.

It is the portable backend with its payload path replaced: the same call agreement and handshakes
(so the same argument checks and cross-rank errors), then the kernels' own protocol (notify,
barriers, rings, low-latency slots and signals) moves every byte through the ranks' shared buffers,
with each kernel's groups as host threads. A failed wait inside a kernel raises CommTimeoutError or
PeerExitedError naming the peer, and breaks the buffer like any failure mid-call.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ... import _cuda_host  # built beside moe_comm._C (CMakeLists.txt)
from ...ops import DispatchLayout
from ...ops.rows import check_index
from ..portable.backend import PortableBackend
from .host_stream import HostStream
from .kernel_errors import raise_for
from .low_latency import KernelLowLatencyMode
from .prepared import KernelLowLatencyCalls
from .normal import KernelNormalMode
from .shared_buffers import SharedBuffers

__all__ = ["CudaHostBackend"]


class CudaHostBackend(KernelLowLatencyCalls, PortableBackend):
    """The kernels' host build as a backend. Construction is collective. Arguments: as ``PortableBackend``
    (the transport carries the handshakes; the kernels' buffers are shared memory of this host)."""

    name = "cuda_host"

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        super().__init__(group, comm, transport, timeout_s, buffer_bytes, shrink)
        if self.transport.device.type != "cpu":
            raise ValueError(f"Buffer: the cuda_host backend runs on CPU tensors, but the {self.transport_name} "
                             f"transport moves {self.transport.device.type} tensors")
        self._normal_buffers = SharedBuffers(self.transport, "normal-mode")
        # Across nodes each rank also has an RDMA buffer (its rail's puts and signals land there), as on
        # the GPU: here shared memory too, which the host build's link writes directly.
        self._rdma_buffers = SharedBuffers(self.transport, "RDMA") if self.topology.internode else None
        self._low_latency_buffers = SharedBuffers(self.transport, "low-latency")
        pids = self._normal_buffers.pids
        #: the buffer's communication stream (DeepEP's comm stream): launches in order, on a host thread
        self.stream = HostStream(lambda op, record: raise_for(_cuda_host, op, timeout_s, pids, record))
        self.normal = KernelNormalMode(self.normal, _cuda_host, self._normal_buffers, self.stream, timeout_s,
                                       rdma_buffers=self._rdma_buffers)
        # Across full nodes the low-latency kernels reach other nodes' ranks through staging, as NVSHMEM does.
        node_ranks = self.topology.ranks_per_node if self.normal.internode is not None else 0
        self.low_latency = KernelLowLatencyMode(self.transport, self.agreement, _cuda_host,
                                                self._low_latency_buffers, self.stream, timeout_s, node_ranks)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        """The layout kernel's histograms (the same as the portable backend's; an id out of range is the
        same ValueError)."""
        T, K = topk_idx.shape
        R = self.num_ranks
        idx = topk_idx.to(torch.int64).contiguous()
        per_rank, per_expert, bad = torch.zeros(R, dtype=torch.int64), torch.zeros(num_experts, dtype=torch.int64), \
            torch.zeros(1, dtype=torch.int64)
        in_rank = torch.empty(T, R, dtype=torch.bool)
        _cuda_host.layout(T, K, R, num_experts, idx.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(),
                          in_rank.data_ptr(), bad.data_ptr())
        if bad.item():
            check_index("dispatch_layout", "topk_idx", idx, -1, num_experts, f"expert ids of {num_experts} experts")
        return DispatchLayout(per_rank.to(torch.int32), per_expert.to(torch.int32), in_rank)

    def get_comm_stream(self) -> Any:
        raise NotImplementedError("Buffer.get_comm_stream: the cuda_host backend runs its launches in order on a "
                                  "host thread, not a CUDA stream; order work with the EventOverlap objects the "
                                  "calls return")

    def destroy(self) -> None:
        if not self.agreement.destroyed:
            try:
                self.stream.synchronize()  # the last launch may still use the buffers
            except Exception:  # a failed launch: its error was the buffer's to raise, the memory goes anyway
                pass
            self.stream.close()
            for buffers in (self._normal_buffers, self._rdma_buffers, self._low_latency_buffers):
                if buffers is not None:
                    buffers.close()
        super().destroy()
