"""What ``Buffer`` asks of a backend: the one interface every implementation of DeepEP's operations has.

``Buffer`` (``buffer/buffer.py``, ``buffer/low_latency.py``) checks every argument and shapes results into
DeepEP's tuples; a backend receives checked arguments and does the work: the normal-mode layout,
dispatch, cached dispatch and combine, the low-latency dispatch, combine, zero-copy combine buffer,
clean and rank masks, and the device facts DeepEP exposes. Each collective ``Buffer`` method runs
inside ``Backend.call`` (see ``agreed_call``), so a backend decides how a call is kept in step across
ranks: the portable backend runs a host handshake; a device-initiated kernel may not.

The ``portable`` backend is the semantic reference: every other backend must give the same bytes,
the same errors and the same order for the same inputs (the tests run against each backend built).
"""
from __future__ import annotations

import abc
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, TypeVar

import torch

from ..core.config import Config
from ..core.topology import Topology
from ..ops import DispatchLayout
from ..protocol.codes import Fp8Format
from ..protocol.handle import LowLatencyHandle, NormalHandle

__all__ = ["Backend", "DispatchResult", "LowLatencyDispatch", "Receive", "agreed_call", "agreed_signature"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Receive:
    """The receive half of one low-latency call. Calling it (DeepEP's ``hook()``) runs it; it runs once."""

    def __init__(self, op: str, finish: Callable[[], None]) -> None:
        self._op, self._finish = op, finish
        self.done = False

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError(f"{self._op}: this recv hook was already called; each hook receives once")
        self.done = True
        finish, self._finish = self._finish, None
        finish()

    def complete(self) -> None:
        """Runs the receive unless it already ran."""
        if not self.done:
            self()


@dataclass
class DispatchResult:
    """A normal-mode dispatch: the outputs, filled by ``finish()`` (which the caller runs once)."""

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list[int]]
    handle: Optional[NormalHandle]
    finish: Callable[[], None]


@dataclass
class LowLatencyDispatch:
    """A low-latency dispatch: the outputs, filled by ``receive``."""

    recv_x: torch.Tensor                   # [E_loc, R * M, H] bf16 or float8_e4m3fn
    recv_scales: Optional[torch.Tensor]    # [E_loc, R * M, S] float32 / int32 view, token stride 1
    recv_count: torch.Tensor               # [E_loc] int32
    handle: LowLatencyHandle
    receive: Receive


class Backend(abc.ABC):
    """One rank's implementation of a ``Buffer``'s operations. Arguments arrive checked (shapes,
    dtypes, ranges, handles), with the meanings ``Buffer``'s docstrings give them."""

    #: the name ``Buffer(backend=...)`` and ``MOE_COMM_BACKEND`` take
    name: ClassVar[str]
    rank: int
    num_ranks: int
    #: the transport it moves bytes over, for backends built on one (``moe_comm.transport``), else None
    transport_name: Optional[str] = None
    #: DeepEP's node split of the group (internode forms when it has several nodes)
    topology: Topology
    #: low-latency calls arrive with their top-k values unchecked (range, an expert twice in a row): the
    #: send launch checks them and every rank fails the call at its receive (no host read of tensor data)
    low_latency_checks_topk: bool = False

    # ------------------------------------------------------------------ calls and lifetime
    @abc.abstractmethod
    def call(self, op: str, body: Callable[[], T]) -> T:
        """Runs ``body`` (the argument checks and the work of one collective call of ``op``) in step
        with the other ranks, or raises the same way on every rank."""

    @abc.abstractmethod
    def refuse(self, op: str) -> None:
        """Raises unless the buffer is usable (destroyed: RuntimeError; broken: BufferUnusableError)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Releases what the backend holds; later calls are refused. Idempotent."""

    def reserve_low_latency(self, num_rdma_bytes: int) -> None:
        """Called once, at construction (collective), for a ``low_latency_mode`` buffer: what its
        low-latency calls may use, DeepEP's ``num_rdma_bytes``. Backends that map memory for those calls
        map it here, so no call grows it collectively (a send half meets no peer)."""

    # ------------------------------------------------------------------ device facts (DeepEP's)
    @classmethod
    def fp8_dispatch(cls) -> bool:
        """Whether ``dispatch`` takes ``(x_fp8, scales)`` tuples: what DeepEP's callers ask
        ``Buffer.is_sm90_compiled()`` before FP8 normal mode (DeepEP builds FP8 only with SM90)."""
        return True

    @abc.abstractmethod
    def get_comm_stream(self) -> Any:
        """The stream communication runs on, or NotImplementedError saying why there is none."""

    @abc.abstractmethod
    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size], offset: int,
                                use_rdma_buffer: bool) -> torch.Tensor:
        """A view of the raw communication buffer, or NotImplementedError saying why there is none."""

    # ------------------------------------------------------------------ normal mode
    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        """Routing histograms of checked ``topk_idx`` (local)."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        """Non-cached dispatch; ``config``: its channel count (``num_channels``) and ring geometry."""

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                        handle: NormalHandle, config: Config) -> DispatchResult:
        """Dispatch with the routing of ``handle``."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        """Combine: ``(out, out_weights, finish)``; ``finish()`` fills the two outputs. Channels
        follow the handle's dispatch; ``config`` gives the ring geometry."""

    # ------------------------------------------------------------------ low-latency mode
    @abc.abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, fp8_format: Fp8Format, recv_stats: Optional[torch.Tensor],
                             wait_stats: Optional[torch.Tensor], hook: bool) -> LowLatencyDispatch:
        """Low-latency dispatch; ``fp8_format``: the cast of ``x``; ``hook``: the caller will run
        the receive itself (and a third call on its buffer must refuse until it has)."""

    @abc.abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, zero_copy: bool, out: Optional[torch.Tensor],
                            wait_stats: Optional[torch.Tensor], hook: bool,
                            use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        """Low-latency combine: ``(out, receive)``; the receive fills ``out``. ``use_logfmt``: rows
        travel in DeepEP's LogFMT-10 (``moe_comm.ops.logfmt``), never with ``zero_copy``."""

    def prepare_dispatch(self, key: tuple, x: torch.Tensor, scales: Optional[torch.Tensor],
                         topk_idx: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                         num_worst_tokens: int, config: Config) -> Optional[Any]:
        """A prepared call for the later normal-mode dispatches (non-cached, with DeepEP's layout tensors) of one
        signature, after a checked call of it (``key``: as ``Buffer`` builds it; the other arguments checked), or
        None where this backend takes none: its ``send(key, x, scales, topk_idx, topk_weights, num_tokens_per_rank,
        is_token_in_rank, num_tokens_per_expert)`` returns DeepEP's outputs but the event, or None for the
        checked path (``portable.prepared_normal.PreparedNormalDispatch``)."""
        return None

    def prepare_combine(self, key: tuple, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                        config: Config) -> Optional[Any]:
        """As ``prepare_dispatch``, for combines: ``send(key, x, handle, topk_weights, bias0, bias1)`` returns
        ``(combined_x, combined_topk_weights)`` or None (``portable.prepared_normal.PreparedNormalCombine``)."""
        return None

    def prepare_low_latency_dispatch(self, key: tuple, hidden: int, num_topk: int,
                                     num_max_dispatch_tokens_per_rank: int, num_experts: int, fp8_format: Fp8Format,
                                     hook: bool, async_finish: bool) -> Optional[Any]:
        """A prepared call for the later low-latency dispatches of one signature, after a checked call of it
        (``key``: the signature as ``Buffer`` builds it; the other arguments checked), or None where this
        backend takes none: its ``send(key, x, topk_idx, recv_stats, wait_stats)`` returns the buffer half of
        a call it ran, or -1 for the checked path to run it (``portable.prepared.PreparedDispatch``)."""
        return None

    def prepare_low_latency_combine(self, key: tuple, hidden: int, num_topk: int,
                                    num_max_dispatch_tokens_per_rank: int, num_experts: int, hook: bool,
                                    async_finish: bool) -> Optional[Any]:
        """As ``prepare_low_latency_dispatch``, for BF16 combines that are not zero-copy
        (``portable.prepared.PreparedCombine``)."""
        return None

    @abc.abstractmethod
    def next_combine_buffer(self, handle: LowLatencyHandle, device: torch.device) -> torch.Tensor:
        """The bf16 `[E_loc, R * M, H]` buffer a following zero-copy combine reads."""

    @abc.abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's reset of both low-latency buffers (collective)."""

    @abc.abstractmethod
    def mask_rank(self, rank: int, masked: bool) -> None:
        """Masks or unmasks ``rank`` for this rank's low-latency calls (DeepEP's mask buffer)."""

    @abc.abstractmethod
    def masked_ranks(self) -> frozenset[int]:
        """The ranks masked now."""

    @abc.abstractmethod
    def clear_masks(self) -> None:
        """Unmasks every rank."""

    def watch_rejoins(self, joinable: Callable[[frozenset[int]], frozenset[int]]) -> None:
        """Asks ``joinable(masked ranks)`` in each shrinking dispatch's handshake which masked ranks have a
        replacement ready (an elastic Buffer). Backends that cannot admit one ignore it."""

    def exited_ranks(self) -> list[int]:
        """Ranks on this host whose process has exited, as far as this backend can tell."""
        return []

    def take_admission(self) -> frozenset[int]:
        """The masked ranks that every rank decided, in one handshake, to admit (then forgotten here):
        the Buffer admits them at its next low-latency dispatch. Empty where nothing was decided."""
        return frozenset()


def agreed_call(op: str) -> Callable[[F], F]:
    """Makes a ``Buffer`` method one collective call ``op`` of the buffer's backend (``self.runtime``):
    the whole method, its argument checks included, runs in ``Backend.call``, so that even a wrong
    signature on one rank is a call every rank fails alike."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.runtime.call(op, lambda: method(self, *args, **kwargs))
        return run  # type: ignore[return-value]
    return wrap


def agreed_signature(checked: str) -> Callable[[F], F]:
    """Makes a ``Buffer`` method with a prepared-call fast path fail like its ``agreed_call`` method
    ``checked`` when its arguments do not bind to its signature: the call runs ``checked``, where the
    TypeError is a call every rank fails alike (the fast path runs before any agreement)."""
    def wrap(method: F) -> F:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except TypeError:
                try:  # only on the error path: binding costs more than the whole fast call
                    signature.bind(self, *args, **kwargs)
                except TypeError:
                    return getattr(self, checked)(*args, **kwargs)
                raise
        return run  # type: ignore[return-value]
    return wrap
