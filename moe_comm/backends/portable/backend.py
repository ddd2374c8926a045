"""The ``portable`` backend: DeepEP's operations over any ``Transport``, on any device torch runs.

Every call opens with a host handshake (``agreement.py``, ``handshake.py``) that fixes the receive
sizes and checks that every rank makes the same call; then the payload moves as row records through
the transport (``normal.py``, ``low_latency.py``). It is the semantic reference for every backend.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from ... import transport as transports
from ...core.config import Config
from ...core.topology import Topology
from ...ops import DispatchLayout, dispatch_layout
from ...protocol.agreement import CallAgreement
from ...protocol.codes import Fp8Format
from ...protocol.handle import LowLatencyHandle, NormalHandle
from ..base import Backend, DispatchResult, LowLatencyDispatch, Receive
from .low_latency import LowLatencyMode
from .normal import NormalMode
from .prepared import PreparedCombine, PreparedDispatch, prepare_combine, prepare_dispatch
from .prepared_normal import (PreparedNormalCombine, PreparedNormalDispatch, prepare_normal_combine,
                              prepare_normal_dispatch)

__all__ = ["PortableBackend"]

T = TypeVar("T")

_LOW_LATENCY_OPS = ("low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer")
# NOTES: DeepEP's size hints cover every expert's worst case (GBs at DeepSeek shapes); the shm
# transport's compact layout needs far less, so it preallocates at most this and grows on demand.
_PREALLOCATE_MAX = 512 << 20


class PortableBackend(Backend):
    """The modes of one ``Buffer`` over one transport. Construction is collective (it builds the transport).

    Args:
        group, comm: the ranks (a torch.distributed group, or an mpi4py communicator for ``mpi``).
        transport: ``"auto"`` or a name from ``moe_comm.transport.available()``.
        timeout_s: deadline for every wait.
        buffer_bytes: the bytes DeepEP's buffer would take (``max(num_nvl_bytes, num_rdma_bytes)``); a
            transport that preallocates takes at most ``_PREALLOCATE_MAX`` of it up front.
        shrink: DeepEP's ``enable_shrink``: low-latency calls mask the ranks that exit or miss their deadline
            (``shrink.py``).
    """

    name = "portable"

    def __init__(self, group: Optional[dist.ProcessGroup], comm: Any, transport: str, timeout_s: float,
                 buffer_bytes: int, shrink: bool) -> None:
        self.transport_name = transports.resolve(transport, group, comm)
        self.transport = transports.create(self.transport_name, group, timeout_s,
                                           min(buffer_bytes, _PREALLOCATE_MAX), comm=comm)
        self.rank, self.num_ranks = self.transport.rank, self.transport.num_ranks
        if shrink and not self.transport.tolerant:
            self.transport.close()
            raise ValueError(f"Buffer: enable_shrink=True masks the ranks that miss a low-latency deadline, which "
                             f"needs torch.distributed's rendezvous store, and the {self.transport_name} transport "
                             f"has none here (an mpi4py communicator without torch.distributed initialised); "
                             f"initialise torch.distributed, or leave enable_shrink off")
        self.agreement = CallAgreement(self.transport, shrink)
        self.topology = Topology.of(self.transport.nodes)
        self.normal = NormalMode(self.transport, self.agreement, self.topology)
        self.low_latency = LowLatencyMode(self.transport, self.agreement)

    # ------------------------------------------------------------------ calls and lifetime
    def call(self, op: str, body: Callable[[], T]) -> T:
        skipped = self.low_latency.skip if op in _LOW_LATENCY_OPS else frozenset
        return self.agreement.call(op, body, skipped)

    def refuse(self, op: str) -> None:
        self.agreement.refuse(op)

    def destroy(self) -> None:
        if not self.agreement.destroyed:
            self.agreement.destroyed = True
            self.transport.close()

    # ------------------------------------------------------------------ device facts
    def get_comm_stream(self) -> Any:
        raise NotImplementedError(f"Buffer.get_comm_stream: the portable backend (over the {self.transport_name} "
                                  f"transport) has no separate communication stream: it moves bytes on the "
                                  f"caller's thread and its own host threads; order work with the EventOverlap "
                                  f"objects the calls return")

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        raise NotImplementedError(f"Buffer.get_local_buffer_tensor: the portable backend (over the "
                                  f"{self.transport_name} transport) does not expose its raw buffers, whose "
                                  f"layouts are its own, so a raw view would not mean what DeepEP's does; "
                                  f"clean_low_latency_buffer() resets the low-latency state instead")

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        return dispatch_layout(topk_idx, self.num_ranks, num_experts)

    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        return self.normal.dispatch(x, scales, topk_idx, topk_weights, layout, expert_alignment, num_worst_tokens,
                                    config)

    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                        handle: NormalHandle, config: Config) -> DispatchResult:
        return self.normal.cached_dispatch(x, scales, handle, config)

    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        return self.normal.combine(x, handle, topk_weights, bias0, bias1, config)

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, fp8_format: Fp8Format, recv_stats: Optional[torch.Tensor],
                             wait_stats: Optional[torch.Tensor], hook: bool) -> LowLatencyDispatch:
        return self.low_latency.dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, fp8_format,
                                         recv_stats, wait_stats, hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, zero_copy: bool, out: Optional[torch.Tensor],
                            wait_stats: Optional[torch.Tensor], hook: bool,
                            use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        return self.low_latency.combine(x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats, hook,
                                        use_logfmt)

    def prepare_dispatch(self, key: tuple, x: torch.Tensor, scales: Optional[torch.Tensor],
                         topk_idx: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                         num_worst_tokens: int, config: Config) -> Optional[PreparedNormalDispatch]:
        if not isinstance(self.normal, NormalMode):  # a backend's own normal mode (the kernels'): none
            return None
        return prepare_normal_dispatch(self.normal, self.low_latency._unsettled, key, x, scales, topk_idx, num_experts,
                                       expert_alignment, num_worst_tokens, config)

    def prepare_combine(self, key: tuple, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                        config: Config) -> Optional[PreparedNormalCombine]:
        if not isinstance(self.normal, NormalMode):
            return None
        return prepare_normal_combine(self.normal, self.low_latency._unsettled, key, x, topk_weights, config)

    def prepare_low_latency_dispatch(self, key: tuple, hidden: int, num_topk: int,
                                     num_max_dispatch_tokens_per_rank: int, num_experts: int, fp8_format: Fp8Format,
                                     hook: bool, async_finish: bool) -> Optional[PreparedDispatch]:
        return prepare_dispatch(self.low_latency, key, hidden, num_topk, num_max_dispatch_tokens_per_rank, num_experts,
                                fp8_format, hook, async_finish)

    def prepare_low_latency_combine(self, key: tuple, hidden: int, num_topk: int,
                                    num_max_dispatch_tokens_per_rank: int, num_experts: int, hook: bool,
                                    async_finish: bool) -> Optional[PreparedCombine]:
        return prepare_combine(self.low_latency, key, hidden, num_topk, num_max_dispatch_tokens_per_rank, num_experts,
                               hook, async_finish)

    def next_combine_buffer(self, handle: LowLatencyHandle, device: torch.device) -> torch.Tensor:
        return self.low_latency.next_combine_buffer(handle, device)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts, self.transport.device)

    def mask_rank(self, rank: int, masked: bool) -> None:
        (self.agreement.masked.add if masked else self.agreement.masked.discard)(rank)

    def masked_ranks(self) -> frozenset[int]:
        return frozenset(self.agreement.masked)

    def clear_masks(self) -> None:
        self.agreement.masked.clear()

    def watch_rejoins(self, joinable: Callable[[frozenset[int]], frozenset[int]]) -> None:
        self.agreement.joinable = joinable

    def exited_ranks(self) -> list[int]:
        return self.transport.exited_ranks()

    def take_admission(self) -> frozenset[int]:
        admit, self.agreement.admit = self.agreement.admit, frozenset()
        return admit
