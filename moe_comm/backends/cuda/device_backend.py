"""The ``cuda`` backend: the CUDA kernels of ``csrc/cuda`` built for the GPU (``moe_comm._cuda``), on
CUDA tensors, the GPUs of one node sharing their buffers through CUDA IPC; across hosts, NVSHMEM
(``moe_comm._cuda_nvshmem``) carries what crosses between nodes.

It is the portable backend with its payload path replaced, like ``cuda_host`` (``backend.py``): the
same call agreement and handshakes (so the same argument checks and cross-rank errors), run over the
buffer's transport (``shm`` between the CPU ranks of a gloo group, ``collective`` on an NCCL group:
the handshake vectors live on ``transport.device``), then the kernels' own protocol (notify, barriers,
rings, low-latency slots and signals) moves every byte between the ranks' GPU buffers
(``ipc_buffers.IpcBuffers``). Payload tensors stay on the GPU; the kernels read and write them by address.

Across nodes (``topology.Topology``; nodes of equal size) normal mode takes the two-hop kernels
(``internode.KernelInternodeMode``): on one host (nodes split by ``MOE_COMM_RANKS_PER_NODE``) every buffer is
an IPC buffer; across hosts the node's NVL buffers are IPC buffers of its ranks, and the RDMA and
low-latency buffers NVSHMEM's symmetric memory (``symmetric_buffers``: one NVSHMEM world per process,
joined by a unique id the transport all-gathers), with ``moe_comm._cuda_nvshmem``'s kernels (puts with
signals to other nodes, NVLink stores where ``nvshmem_ptr`` maps a peer).

Streams: every launch runs on the buffer's comm stream (``get_comm_stream()``, DeepEP's), after the
work already queued on the caller's current stream. Normal-mode launches return once their kernel has
finished (the device build synchronises them, as DeepEP's notify waits on the host), so
``async_finish=True`` defers only the error check and the output padding to
``event.current_stream_wait()``. A low-latency send returns at once (the current stream is ordered after
it); its receive (the hook, ``current_stream_wait()`` or at once) waits on the host for its kernel and
reads the error record. ``get_dispatch_layout`` runs the layout kernel on the current stream.

A failed wait inside a kernel (its deadline, from the buffer's ``timeout_s``) raises CommTimeoutError
naming the peer and breaks the buffer like any failure mid-call.

Status: compiled, never run on a GPU. Without one, ``tests/backends/test_cuda_backend.py`` tests the
registry, the buffers', streams' and kernels adapter's logic with fakes, and this class end to end on
the host build's kernels behind a stand-in for ``moe_comm._cuda`` on CPU tensors (``kernels_module``
and the ``_device``/``_guard``/``_current_stream``/``_comm_stream`` hooks are what it replaces); its
GPU tests skip.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ... import _cuda  # the device build (CMakeLists.txt); importing it makes no CUDA call
from ...core.checks import describe
from ...core.config import Config
from ...core.errors import bad_argument
from ...ops import DispatchLayout
from ...ops.rows import check_index
from ...protocol.codes import Fp8Format
from ...protocol.handle import LowLatencyHandle, NormalHandle
from ...transport.base import host_id
from ..base import DispatchResult, LowLatencyDispatch, Receive
from ..portable.backend import PortableBackend
from .device_kernels import CommStream, DeviceKernels, MappedOutputs
from .device_stream import DeviceStream
from .internode import kernels_span
from .ipc_buffers import IpcBuffers
from .kernel_errors import raise_for
from .low_latency import KernelLowLatencyMode
from .prepared import KernelLowLatencyCalls
from .normal import KernelNormalMode
from .nvshmem_lib import NvshmemUnavailableError
from .nvshmem_lib import load as load_nvshmem
from .symmetric_buffers import SymmetricBuffers, heap_bytes, join_world

__all__ = ["CudaBackend"]


class CudaBackend(KernelLowLatencyCalls, PortableBackend):
    """The kernels' device build as a backend, on the current CUDA device (``torch.cuda.set_device``
    first, as with DeepEP). Construction is collective. Arguments: as ``PortableBackend`` (the transport
    carries the handshakes only, so it preallocates nothing; the kernels' buffers are GPU memory)."""

    name = "cuda"
    #: the device build (moe_comm._cuda), or a stand-in with its interface (tests)
    kernels_module: Any = _cuda

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        #: this buffer's GPU: the current device when it is built
        self.device = self._device()
        super().__init__(group, comm, transport, timeout_s, 0, shrink)
        try:
            kernels = self.kernels_module
            #: the buffer's communication stream (DeepEP's comm stream)
            self.comm_stream = self._comm_stream()
            self.kernels = DeviceKernels(kernels, self.comm_stream, self._guard)
            node_kernels, node_ranks = self.kernels, 0
            self._rdma_buffers = None
            if self._across_hosts():
                nvshmem = self._nvshmem()
                join_world(self.transport, nvshmem, self._guard, heap_bytes(buffer_bytes))
                node_kernels = DeviceKernels(nvshmem, self.comm_stream, self._guard)
                node_ranks = self.topology.ranks_per_node
                node = self.topology.node_of(self.rank)
                mine = [self.topology.rank_at(node, j) for j in range(node_ranks)]
                self._normal_buffers = IpcBuffers(self.transport, "NVL", kernels, self._guard, reach=mine)
                self._rdma_buffers = SymmetricBuffers(self.transport, "RDMA", nvshmem, kernels, self._guard)
                self._low_latency_buffers = SymmetricBuffers(self.transport, "low-latency", nvshmem, kernels,
                                                             self._guard)
            else:
                self._normal_buffers = IpcBuffers(self.transport, "normal-mode", kernels, self._guard)
                if self.topology.internode:  # nodes of one host (MOE_COMM_RANKS_PER_NODE): RDMA buffers over IPC too
                    self._rdma_buffers = IpcBuffers(self.transport, "RDMA", kernels, self._guard)
                self._low_latency_buffers = IpcBuffers(self.transport, "low-latency", kernels, self._guard)
            pids = self._normal_buffers.pids
            self.stream = DeviceStream(lambda op, record: raise_for(kernels, op, timeout_s, pids, record),
                                       self.comm_stream)
            self._notify_outputs = MappedOutputs(kernels)
            self.normal = KernelNormalMode(self.normal, node_kernels, self._normal_buffers, self.stream, timeout_s,
                                           notify_outputs=self._notify_outputs, name=self.name,
                                           rdma_buffers=self._rdma_buffers)
            self.low_latency = KernelLowLatencyMode(self.transport, self.agreement, node_kernels,
                                                    self._low_latency_buffers, self.stream, timeout_s, node_ranks,
                                                    self.device)
        except BaseException:
            self.transport.close()
            raise

    # ------------------------------------------------------------------ the device (hooks)
    @staticmethod
    def _device() -> torch.device:
        """The current CUDA device."""
        return torch.device("cuda", torch.cuda.current_device())

    def _guard(self) -> Any:
        """A context in which this buffer's GPU is the current device."""
        return torch.cuda.device(self.device)

    def _current_stream(self) -> int:
        """The caller's current stream on this buffer's GPU, as an int."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def _comm_stream(self) -> Any:
        """A new communication stream on this buffer's GPU."""
        return CommStream(self.device)

    def _across_hosts(self) -> bool:
        """Whether the ranks run on several hosts (collective; the same answer on every rank). Across
        hosts, CUDA IPC maps only a node's memory, so the nodes must be whole: refused, on every rank alike,
        unless the topology's nodes are the hosts' blocks of equal size."""
        me = torch.tensor([host_id()], dtype=torch.int64, device=self.transport.device)
        hosts = self.transport.all_gather_rows(me, op="cuda: the ranks' hosts").view(-1).tolist()
        if len(set(hosts)) == 1:
            return False
        topo = self.topology
        split = [r for r in range(self.num_ranks) if hosts[r] != hosts[topo.rank_at(topo.node_of(r), 0)]]
        if not kernels_span(topo, self.kernels_module.MAX_NODES) or split:
            raise ValueError(f"Buffer: the cuda backend across hosts needs nodes of equal size, each on one host "
                             f"(DeepEP's rule), at most {self.kernels_module.MAX_NODES} of them; these "
                             f"{self.num_ranks} ranks make {topo.num_nodes} nodes of up to {topo.ranks_per_node} ranks"
                             + (f", and ranks {split} share a node with a rank of another host" if split else "")
                             + "; use backend='portable', or MOE_COMM_RANKS_PER_NODE to set the node size")
        return True

    @staticmethod
    def _nvshmem() -> Any:
        """moe_comm._cuda_nvshmem, or the reason it cannot serve as a ValueError (on every rank alike)."""
        try:
            return load_nvshmem()
        except NvshmemUnavailableError as exc:
            raise ValueError(f"Buffer: the cuda backend across hosts moves data between nodes with NVSHMEM, "
                             f"which is not available: {exc}") from exc

    def _on_device(self, op: str, **tensors: Optional[torch.Tensor]) -> None:
        """Refuses tensors off this buffer's GPU: the kernels take them by address."""
        for name, t in tensors.items():
            if t is not None and t.device != self.device:
                bad_argument(op, name, f"on {self.device} (the cuda backend's kernels read and write this "
                             f"Buffer's GPU)", describe(t))

    # ------------------------------------------------------------------ lifetime and device facts
    def get_comm_stream(self) -> Any:
        return self.comm_stream.stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        raise NotImplementedError("Buffer.get_local_buffer_tensor: the cuda backend's buffers are laid out by "
                                  "csrc/cuda/kernels/buffer_layout.h, not as DeepEP's, so a raw view would not mean "
                                  "what DeepEP's does; clean_low_latency_buffer() resets the low-latency state instead")

    def destroy(self) -> None:
        """Collective when the buffer is healthy (the peers unmap this rank's memory before it is freed);
        a broken buffer frees its memory without waiting for peers that may never come."""
        if self.agreement.destroyed:
            return
        try:
            try:
                self.stream.synchronize()  # the last launch may still use the buffers
            except Exception:  # a failed launch: its error was the buffer's to raise, the memory goes anyway
                pass
            buffers = [b for b in (self._normal_buffers, self._rdma_buffers, self._low_latency_buffers)
                       if b is not None]
            healthy = self.agreement.broken is None
            for b in buffers:
                b.close_peers()
            try:
                if healthy:
                    self.transport.barrier(op="cuda: unmapping the buffers")
            finally:
                for b in buffers:
                    b.free(collective=healthy)
                self.kernels.forget()
                self._notify_outputs.close()
        finally:
            super().destroy()

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        """The layout kernel's histograms, on the current stream (the same as the portable backend's; an
        id out of range is the same ValueError)."""
        self._on_device("get_dispatch_layout", topk_idx=topk_idx)
        T, K = topk_idx.shape
        R, dev = self.num_ranks, self.device
        idx = topk_idx.to(torch.int64).contiguous()
        per_rank = torch.zeros(R, dtype=torch.int64, device=dev)
        per_expert = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        bad = torch.zeros(1, dtype=torch.int64, device=dev)
        in_rank = torch.empty(T, R, dtype=torch.bool, device=dev)
        with self._guard():
            self.kernels_module.layout(T, K, R, num_experts, idx.data_ptr(), per_rank.data_ptr(),
                                       per_expert.data_ptr(), in_rank.data_ptr(), bad.data_ptr(),
                                       self._current_stream())
        if bad.item():
            check_index("dispatch_layout", "topk_idx", idx, -1, num_experts, f"expert ids of {num_experts} experts")
        return DispatchLayout(per_rank.to(torch.int32), per_expert.to(torch.int32), in_rank)

    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        self._on_device("dispatch", x=x)
        return super().dispatch(x, scales, topk_idx, topk_weights, layout, expert_alignment, num_worst_tokens, config)

    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                        handle: NormalHandle, config: Config) -> DispatchResult:
        self._on_device("dispatch", x=x)
        return super().cached_dispatch(x, scales, handle, config)

    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        self._on_device("combine", x=x)
        return super().combine(x, handle, topk_weights, bias0, bias1, config)

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, fp8_format: Fp8Format, recv_stats: Optional[torch.Tensor],
                             wait_stats: Optional[torch.Tensor], hook: bool) -> LowLatencyDispatch:
        self._on_device("low_latency_dispatch", x=x)
        return super().low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, fp8_format,
                                            recv_stats, wait_stats, hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, zero_copy: bool, out: Optional[torch.Tensor],
                            wait_stats: Optional[torch.Tensor], hook: bool,
                            use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        self._on_device("low_latency_combine", x=x)
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats, hook,
                                           use_logfmt)

    def next_combine_buffer(self, handle: LowLatencyHandle, device: torch.device) -> torch.Tensor:
        self._on_device("get_next_low_latency_combine_buffer", **{"handle[0] (src_info)": handle.src_info})
        return super().next_combine_buffer(handle, device)
