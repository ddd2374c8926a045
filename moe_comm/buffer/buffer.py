"""``Buffer``: DeepEP v1's ``deep_ep.Buffer`` API on any ``torch.distributed`` group and device.

The facade checks arguments and shapes results into DeepEP's tuples (its low-latency methods are in
``low_latency.py``); a backend (``moe_comm.backends``) does the work: ``portable`` over a
transport (``moe_comm.transport``) on every device, native ones with device kernels.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from .. import backends
from ..backends.base import Backend, agreed_call, agreed_signature
from ..core import env
from ..core.checks import check_bools, check_int, describe
from ..core.config import Config, check_internode_combine_config, combine_config, dispatch_config
from ..core.errors import bad_argument
from ..protocol.handle import NormalHandle
from ..protocol.internode_layout import check_tokens_per_node, tokens_per_node
from ..transport import resolve as resolve_transport
from ..transport.collective import default_store
from ..transport.mpi import as_comm
from ..transport.store_group import StoreGroup
from . import library
from .event import NO_EVENT, EventHandle, EventOverlap
from .low_latency import MAX_PREPARED, LowLatencyAPI, XType
from .low_latency_args import low_latency_buffer_bytes
from .normal_args import (TOPK_IDX_T, check_combine_args, check_dispatch_routing, check_num_experts, check_topk_idx,
                          split_x)
from .rejoin import REJOINABLE, Membership

__all__ = ["Buffer"]



class Buffer(LowLatencyAPI):
    """The expert-parallel communication buffer of one group (DeepEP v1 ``Buffer``).

    Construction is collective: every rank of ``group`` must build its ``Buffer`` (buffers on one
    group pair up in creation order). The ``shm`` transport (the default for CPU ranks) preallocates
    its two data slots from ``max(num_nvl_bytes, num_rdma_bytes)`` (capped at 2 x 256 MiB) and grows
    them when an exchange needs more; the ``collective`` transport allocates per call. Keywords that
    tune DeepEP's NVLink/RDMA hardware (``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
    ``allow_mnnvl``, ``use_fabric``) are accepted and checked but have no effect. ``num_rdma_bytes``
    is checked as DeepEP does: low-latency calls need ``low_latency_mode=True`` and at least
    ``get_low_latency_rdma_size_hint(...)`` bytes.

    ``comm`` (an mpi4py intra-communicator, e.g. ``MPI.COMM_WORLD``) may replace ``group``, as in
    DeepEP: the buffer then runs on the ``mpi`` transport and needs no torch.distributed group
    (``group`` stays None; a group given as well must have the same ranks).

    Faults (``agreement.py``): every collective call is numbered and its handshake carries the
    number, so ranks agree on which call they are in. A rank that rejects its own arguments still
    meets the others, which then raise the same ``CrossRankMismatchError`` naming it (the buffer
    stays usable). After a failure that may leave ranks out of step (a timeout, an exited peer, a
    failure in the middle of a call, ranks on different calls) the buffer refuses every further
    call, hook and event wait with ``BufferUnusableError``: build a new one on every rank.

    Args (besides DeepEP's):
        backend: ``"auto"`` (default; env ``MOE_COMM_BACKEND`` may name one) or a name from
            ``moe_comm.backends.KNOWN``: ``"portable"`` (every device, over a transport) or a native
            backend (``"cuda"``, ``"ascend"``, ``"cambricon"``) where built. ``"auto"`` takes the native
            backend of the group's device when it can run, else ``portable``; ``backend_choice``
            says which it took and why. A named backend that cannot run raises
            ``moe_comm.BackendUnavailableError`` with the reason and the backends available.
        transport: for the portable backend: ``"auto"`` (default; env ``MOE_COMM_TRANSPORT`` may
            name one) or a name from ``moe_comm.transport.available()``; with ``comm``, only
            ``"auto"`` or ``"mpi"``.
        timeout_s: deadline for every wait (default: env ``MOE_COMM_TIMEOUT_S``, else 300 s); a missed
            deadline raises ``moe_comm.CommTimeoutError`` naming the ranks not heard from.
        enable_shrink: DeepEP's: a rank that exits, or misses a low-latency call's deadline
            (``timeout_s``), is masked on every rank that carries on, the same mask everywhere, and the
            call completes without its experts (``low_latency_query_mask_buffer`` reports it). Each
            low-latency handshake then takes two rounds that survive a missing rank: the ``shm``
            transport's metadata cells when every rank is on one host (measured +0.2 ms a call),
            else torch.distributed's rendezvous store (+0.6 ms). Normal-mode calls never shrink. While a
            rank is masked, each low-latency dispatch also looks in the rendezvous store for a process
            started to replace it (``rejoin``), and admits it (docs/elastic-ep.md).
        rejoin: this process replaces a rank of a running job whose ``enable_shrink=True`` buffers masked
            it (default: env ``MOE_COMM_REJOIN``): instead of meeting the group, the Buffer announces
            itself in the rendezvous store and returns once the survivors have admitted it, at one of
            their low-latency dispatches (``CommTimeoutError`` if none comes within twice ``timeout_s``).
            Needs ``low_latency_mode`` and ``enable_shrink``; not on ``mpi`` (MPI cannot admit a process).
        min_ranks: reserved rank slots (Mooncake's ``max_world_size``; default: env ``MOE_COMM_MIN_RANKS``, 0:
            off): the Buffer does not meet the group but starts from the rendezvous store with the ranks that
            came within ``timeout_s`` (every rank, or at least ``min_ranks``), the others masked; a rank that
            starts later is admitted as a replacement is. The group must not connect eagerly to ranks that
            never start: ``TORCH_GLOO_LAZY_INIT=1``. Needs what ``rejoin`` needs.
    """

    #: SMs DeepEP's normal kernels use; only feeds the default configs here.
    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm: Any = None, *,
                 backend: str = "auto", transport: str = "auto", timeout_s: Optional[float] = None,
                 rejoin: Optional[bool] = None, min_ranks: Optional[int] = None) -> None:
        op = "Buffer"
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("num_qps_per_rank", num_qps_per_rank)):
            check_int(op, name, value, minimum=0)
        check_bools(op, low_latency_mode=low_latency_mode,
                    allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode, allow_mnnvl=allow_mnnvl,
                    use_fabric=use_fabric, explicitly_destroy=explicitly_destroy, enable_shrink=enable_shrink)
        if comm is not None:
            comm = as_comm(op, comm)
        if group is None and comm is None:
            if not dist.is_initialized():
                bad_argument(op, "group", "a torch.distributed ProcessGroup, or None with comm= or after "
                             "init_process_group", "None, and torch.distributed is not initialized")
            group = dist.group.WORLD
        elif group is not None and not isinstance(group, dist.ProcessGroup):
            bad_argument(op, "group", "a torch.distributed ProcessGroup", describe(group), kind=TypeError)
        if group is not None and comm is not None and \
                (dist.get_rank(group), dist.get_world_size(group)) != (comm.Get_rank(), comm.Get_size()):
            bad_argument(op, "comm", f"the same ranks as group (rank {dist.get_rank(group)} of "
                         f"{dist.get_world_size(group)})", f"rank {comm.Get_rank()} of {comm.Get_size()}")
        if timeout_s is None:
            timeout_s = env.timeout_s()
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            bad_argument(op, "timeout_s", "a positive number of seconds", describe(timeout_s))
        for name, value in (("backend", backend), ("transport", transport)):
            if not isinstance(value, str):
                bad_argument(op, name, "a str", describe(value), kind=TypeError)
        choice = backends.choose(backend, group, comm)
        rejoin = env.rejoin() if rejoin is None else rejoin
        check_bools(op, rejoin=rejoin)
        min_ranks = env.min_ranks() if min_ranks is None else min_ranks
        check_int(op, "min_ranks", min_ranks, minimum=0)
        size = comm.Get_size() if group is None else dist.get_world_size(group)
        if min_ranks > size:
            bad_argument(op, "min_ranks", f"at most the group's {size} ranks", min_ranks)

        self.group, self.comm = group, comm
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.timeout_s = float(timeout_s)
        #: the backend this buffer runs on, and why it was picked
        self.backend_choice = choice
        #: the epochs of an elastic buffer (``enable_shrink``: ranks masked, replacements admitted), else None
        self.membership: Optional[Membership] = None
        if rejoin or min_ranks:
            name = self._rejoinable(transport, "rejoin" if rejoin else "min_ranks", rejoin or min_ranks)
            backends.load()
            self.membership = Membership(group, default_store(), self.timeout_s)
            build = lambda epoch_group: self._build_runtime(epoch_group, name)  # noqa: E731
            #: the backend object (DeepEP's ``runtime``, its C++ buffer); a new one per epoch
            self.runtime: Backend = self.membership.join(build) if rejoin else self.membership.start(build, min_ranks)
        else:
            self.runtime = self._build_runtime(group, transport)
            if enable_shrink:
                self.membership = Membership.of(group, choice.name, self.runtime.transport_name, self.timeout_s)
                if self.membership is not None:
                    self.membership.watch(self.runtime)
        self.transport_name = self.runtime.transport_name
        self.rank, self.group_size = self.runtime.rank, self.runtime.num_ranks
        #: DeepEP's node split of the group: its internode forms apply when ``topology.internode``
        self.topology = self.runtime.topology
        #: how a compiled graph names this buffer: an id, and the state tensor its calls write (``library``)
        self._op_id, self._op_state = library.register(self)
        self._prepared_dispatches, self._prepared_combines = {}, {}  # normal mode's prepared calls
        self._prepared_ll_dispatches, self._prepared_ll_combines = {}, {}

    def _build_runtime(self, group: Union[dist.ProcessGroup, StoreGroup, None], transport: str) -> Backend:
        """A backend for ``group`` (the caller's, or an epoch's); collective over it."""
        runtime = backends.create(
            self.backend_choice, group=group, comm=self.comm, transport=transport, timeout_s=self.timeout_s,
            buffer_bytes=max(self.num_nvl_bytes, self.num_rdma_bytes), shrink=self.enable_shrink)
        if self.low_latency_mode:
            runtime.reserve_low_latency(self.num_rdma_bytes)
        return runtime

    def _rejoinable(self, transport: str, arg: str, value: object) -> str:
        """The transport a replacement (``rejoin=True``), or a rank of a job that starts short of ranks
        (``min_ranks``), joins over; raises ValueError naming ``arg`` and what is missing."""
        op, off = "Buffer", "False" if arg == "rejoin" else "0"
        if self.comm is not None:
            bad_argument(op, arg, f"{off} with comm= (MPI cannot admit a process; use a torch.distributed gloo "
                         f"group, whose shm or collective transport can)", value)
        if not (self.low_latency_mode and self.enable_shrink):
            bad_argument(op, arg, f"{off} unless low_latency_mode=True and enable_shrink=True (the ranks mask a "
                         f"missing rank and admit its replacement at a low-latency dispatch)",
                         f"{value} with low_latency_mode={self.low_latency_mode}, enable_shrink={self.enable_shrink}")
        if self.backend_choice.name not in REJOINABLE:
            bad_argument(op, arg, f"{off} unless the Buffer is on the portable or cuda_host backend (the cuda "
                         f"backend's rejoin path has never run on a GPU)", f"{value} on {self.backend_choice}")
        name = resolve_transport(transport, self.group)
        if name == "mpi":
            bad_argument(op, arg, f"{off} on transport 'mpi' (MPI cannot admit a process without ULFM; shm or "
                         f"collective can)", value)
        if default_store() is None:
            bad_argument(op, arg, f"{off} without the job's rendezvous store (initialise torch.distributed with a "
                         f"store that every rank shares)", value)
        return name

    def _admit(self) -> None:
        """At a low-latency dispatch: builds the next epoch with the replacements every rank decided to admit
        (``rejoin.py``), and runs on it from here if every member built it."""
        joiners = self.runtime.take_admission()
        if not joiners:
            return
        runtime = self.membership.admit(joiners, lambda group: self._build_runtime(group, self.transport_name),
                                        self.runtime.exited_ranks, self.runtime.masked_ranks())
        if runtime is not None:
            old, self.runtime = self.runtime, runtime
            old.destroy()
            self._drop_prepared()

    def __repr__(self) -> str:
        return (f"Buffer(rank {self.rank} of {self.group_size}, {self.backend_choice}"
                f"{'' if self.transport_name is None else f', transport {self.transport_name!r}'})")

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the class-wide SM count used by ``get_dispatch_config``/``get_combine_config`` (even)."""
        check_int("Buffer.set_num_sms", "new_num_sms", new_num_sms, minimum=0)
        if new_num_sms % 2:
            bad_argument("Buffer.set_num_sms", "new_num_sms", "even", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` for the current point of the current stream (pass as ``previous_event``)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: FP8 normal dispatch (``(x_fp8, scales)`` tuples) is available. DeepEP answers whether
        it was built with SM90 features, and its callers (its own tests, vLLM, SGLang) ask it to decide
        whether to use FP8 dispatch; every moe-comm backend transports FP8 tuples on every device, so
        the answer is what they mean by it. ``moe_comm.build_info()["cuda_archs"]`` lists the GPU
        architectures actually compiled."""
        return backends.fp8_dispatch()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch ``Config``; any ``num_ranks`` >= 1 (no whitelist)."""
        return dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine ``Config``; any ``num_ranks`` >= 1 (no whitelist)."""
        return combine_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes DeepEP's low-latency buffer needs (its formula, BF16 sized; independent of num_ranks)."""
        op = "Buffer.get_low_latency_rdma_size_hint"
        m = check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        h = check_int(op, "hidden", hidden, minimum=128)
        check_int(op, "num_ranks", num_ranks, minimum=1)
        e = check_int(op, "num_experts", num_experts, minimum=1)
        total = low_latency_buffer_bytes(m, h, e)
        # NOTES: DeepEP rounds as (n + 128) // 128 * 128, adding 128 when n is already aligned; kept
        # so sizes match byte for byte.
        return (total + 128) // 128 * 128

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Releases the buffer; only allowed with ``explicitly_destroy=True`` (as DeepEP). Idempotent."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: needs Buffer(..., explicitly_destroy=True); otherwise the buffer "
                               "is released when it is garbage collected")
        self.runtime.destroy()
        self._drop_prepared()

    def get_comm_stream(self) -> Any:
        """DeepEP's communication stream, where the backend has one (the portable backend has none:
        NotImplementedError saying so)."""
        self._alive("get_comm_stream")
        return self.runtime.get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP's raw view of its NVLink/RDMA buffer, where the backend exposes one (the portable
        backend does not: NotImplementedError saying why)."""
        self._alive("get_local_buffer_tensor")
        return self.runtime.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def _alive(self, op: str) -> None:
        """Raises unless the buffer is usable (not destroyed, not broken)."""
        self.runtime.refuse(op)

    # ------------------------------------------------------------------ async plumbing
    @staticmethod
    def _begin(op: str, previous_event: Any, async_finish: Any, allocate_on_comm_stream: Any) -> None:
        check_bools(op, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            bad_argument(op, "previous_event", "an EventOverlap or None", describe(previous_event), kind=TypeError)
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            bad_argument(op, "allocate_on_comm_stream", "False unless previous_event is given and async_finish=True "
                         "(as DeepEP asserts)", f"True with previous_event={previous_event!r}, "
                         f"async_finish={async_finish}")
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()

    @staticmethod
    def _end(finish: Callable[[], None], async_finish: bool, extra: tuple) -> EventOverlap:
        if async_finish:
            return EventOverlap(EventHandle(finish), extra)
        finish()
        return EventOverlap()

    # ------------------------------------------------------------------ normal mode
    @library.traced_as(library.get_dispatch_layout)
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Routing histograms of ``topk_idx``. Local (no communication); blocks the host on CPU.

        Args:
            topk_idx: `[num_tokens, num_topk]` ``topk_idx_t`` (int64), expert ids or -1 (no selection).
            num_experts: total experts, a multiple of the group size; expert e lives on rank
                ``e // (num_experts // num_ranks)``.
        Returns:
            ``(num_tokens_per_rank [R] int32`` (a token counts once per rank), ``num_tokens_per_rdma_rank``
            (``[num_nodes]`` int32, a token counting once per node, when the group spans several nodes
            (``Buffer.topology``); else None, as DeepEP), ``num_tokens_per_expert [E] int32``,
            ``is_token_in_rank [T, R] bool``, ``event)``.
        """
        op = "get_dispatch_layout"
        self._alive(op)
        self._begin(op, previous_event, async_finish, allocate_on_comm_stream)
        check_num_experts(op, num_experts, self.group_size,
                          topk_idx.device if isinstance(topk_idx, torch.Tensor) else torch.device("cpu"))
        topk_idx = check_topk_idx(op, topk_idx, num_experts, None, None)
        layout = self.runtime.get_dispatch_layout(topk_idx, num_experts)
        per_node = tokens_per_node(layout.is_token_in_rank, self.topology).to(topk_idx.device) \
            if self.topology.internode else None
        event = EventOverlap(EventHandle()) if async_finish else EventOverlap()
        return layout.num_tokens_per_rank, per_node, layout.num_tokens_per_expert, layout.is_token_in_rank, event

    @agreed_signature("_checked_dispatch")
    def dispatch(self, x: XType, handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, num_experts: Optional[int] = None
                 ) -> tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], Optional[list[int]], Optional[tuple],
                            EventOverlap]:
        """Sends each token to every rank holding one of its experts. Collective; blocks the host for
        the count exchange; the payload exchange overlaps with the caller when ``async_finish=True``
        (the returned tensors are filled by ``event.current_stream_wait()``).

        Args:
            x: `[T, H]` tensor of any dtype, or ``(x_fp8 [T, H] float8, scales [T, S] float32|int32)``
                with scales of any strides.
            handle: from a non-cached dispatch: re-send with the same routing (topk must be None);
                returns ``(recv_x, None, None, None, None, event)``.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``;
                when all None, computed from ``topk_idx`` and the keyword ``num_experts`` (moe-comm only).
            num_tokens_per_rdma_rank: from ``get_dispatch_layout`` across nodes (checked against the
                routing when given); ignored on one node, as DeepEP.
            topk_idx, topk_weights: `[T, K]` int64 / float32, given together.
            expert_alignment: each entry of the per-expert list is rounded up to a multiple of it.
            num_worst_tokens: if > 0, outputs have this many rows (padding: x and scales 0,
                ``recv_topk_idx`` -1, weights 0, ``handle[3]`` -1) and the per-expert list is ``[]``.
            config: accepted for compatibility; ``num_sms // 2`` sets the handle's channel count.
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``.
            Rows arrive grouped by source rank ascending, then source token ascending, one row per
            (token, rank). ``recv_topk_idx`` holds local expert ids or -1 (weight 0.0 there). The
            handle is DeepEP's 6-tuple; ``handle[0]`` is the inclusive rank prefix matrix, ``handle[3]``
            the source token of each row, ``handle[4]`` ``is_token_in_rank``. Across nodes it is DeepEP's
            internode 10-tuple (``handle.InternodeHandle``; ``handle[-4]`` is the inclusive prefix of the
            rows received from each rank); rows come in the same order.
        """
        if torch.compiler.is_compiling():
            return library.dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                    num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                    config, previous_event, async_finish, allocate_on_comm_stream,
                                    num_experts=num_experts)
        # A call of a signature seen before runs its prepared call (docs/DESIGN.md), unless that declines the
        # arguments; then the checked path runs it (and words any error).
        key = prepared = None
        if handle is None and is_token_in_rank is not None and previous_event is None:
            key = (type(x) is tuple, topk_idx is None, expert_alignment, num_worst_tokens, config, async_finish,
                   allocate_on_comm_stream, num_experts)
            try:
                prepared = self._prepared_dispatches.get(key)
            except TypeError:  # an unhashable argument
                prepared = key = None
        if prepared:
            data, scales = x if type(x) is tuple and len(x) == 2 else (x, None)
            result = prepared.send(key, data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                   num_tokens_per_expert)
            if result is not None:
                return (*result, EventOverlap(EventHandle(), (data, scales) + result[:3]) if async_finish else
                        NO_EVENT)
        result = self._checked_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                        num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream,
                                        num_experts=num_experts)
        if key is not None and (prepared is None or prepared and prepared.stale) and \
                len(self._prepared_dispatches) < MAX_PREPARED:
            data, scales = split_x("dispatch", x)
            self._prepared_dispatches[key] = self.runtime.prepare_dispatch(
                key, data, scales, topk_idx, num_tokens_per_expert.numel(), expert_alignment, num_worst_tokens,
                self._config("dispatch", config, Buffer.get_dispatch_config)) or False
        return result

    @agreed_call("dispatch")
    def _checked_dispatch(self, x: XType, handle: Optional[tuple] = None,
                          num_tokens_per_rank: Optional[torch.Tensor] = None,
                          num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                          is_token_in_rank: Optional[torch.Tensor] = None,
                          num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                          topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                          num_worst_tokens: int = 0, config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False, *, num_experts: Optional[int] = None
                          ) -> tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], Optional[list[int]],
                                     Optional[tuple], EventOverlap]:
        """``dispatch`` with every argument checked (a call of a new signature, or one its prepared call
        declined)."""
        op = "dispatch"
        config = self._config(op, config, Buffer.get_dispatch_config)
        data, scales = split_x(op, x)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                bad_argument(op, "topk_idx and topk_weights", "None in cached mode (handle given)",
                             f"topk_idx={describe(topk_idx)}, topk_weights={describe(topk_weights)}")
            cached = NormalHandle.from_tuple(op, handle, self.rank, self.group_size, data.device,
                                             self.topology.internode)
            if cached.is_token_in_rank.shape[0] != data.shape[0]:
                bad_argument(op, "x", f"{cached.is_token_in_rank.shape[0]} rows (the tokens of the handle's dispatch)",
                             describe(data))
            self._begin(op, previous_event, async_finish, allocate_on_comm_stream)
            result = self.runtime.cached_dispatch(data, scales, cached, config)
        else:
            routing = check_dispatch_routing(op, data, self.group_size, num_tokens_per_rank, is_token_in_rank,
                                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                             num_worst_tokens, num_experts)
            if self.topology.internode:
                check_tokens_per_node(op, num_tokens_per_rdma_rank, routing.layout.is_token_in_rank, self.topology)
            self._begin(op, previous_event, async_finish, allocate_on_comm_stream)
            result = self.runtime.dispatch(data, scales, routing.topk_idx, routing.topk_weights, routing.layout,
                                           expert_alignment, num_worst_tokens, config)
        recv_x = result.recv_x if scales is None else (result.recv_x, result.recv_scales)
        outputs = (result.recv_x, result.recv_scales, result.recv_topk_idx, result.recv_topk_weights)
        event = self._end(result.finish, async_finish, (data, scales) + outputs)
        handle_out = None if result.handle is None else result.handle.as_tuple()
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                handle_out, event)

    @agreed_signature("_checked_combine")
    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Returns each received row to its source rank and sums per token, **without** weights.
        Collective; blocks the host for the count exchange; overlaps like ``dispatch``.

        Args:
            x: `[N, H]` bf16 | fp16 | fp32, rows in the order ``dispatch`` returned them (N = rows
                received, or the padded ``num_worst_tokens``; padding rows are ignored).
            handle: from the non-cached dispatch.
            topk_weights: optional `[N, K]` float32, summed the same way.
            bias: None, a tensor or a 2-tuple of `[T, H]` tensors of x's dtype, added to the sum.
        Returns:
            ``(combined_x [T, H]`` x's dtype, ``combined_topk_weights [T, K]`` float32 or None, ``event)``,
            ``combined_x[t] = ((sum over ranks r ascending of rank r's row for t) + bias0[t]) + bias1[t]``,
            every add in fp32, rounded once: bitwise reproducible. Across nodes the sum runs in DeepEP's two
            levels (``ops.node_reduce``): each node's ranks first, rounded to x's dtype, then the nodes.
        """
        if torch.compiler.is_compiling():
            return library.combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                                   allocate_on_comm_stream)
        key = prepared = None
        if previous_event is None and type(handle) is tuple:  # as in dispatch
            bias0, bias1 = bias if type(bias) is tuple and len(bias) == 2 else (bias, None)
            if bias0 is None:
                bias0, bias1 = bias1, None
            key = (topk_weights is None, bias0 is None, bias1 is None, config, async_finish, allocate_on_comm_stream)
            try:
                prepared = self._prepared_combines.get(key)
            except TypeError:
                prepared = key = None
        if prepared:
            result = prepared.send(key, x, handle, topk_weights, bias0, bias1)
            if result is not None:
                return (*result, EventOverlap(EventHandle(), (x, topk_weights) + result) if async_finish else NO_EVENT)
        result = self._checked_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                       allocate_on_comm_stream)
        if key is not None and (prepared is None or prepared and prepared.stale) and \
                len(self._prepared_combines) < MAX_PREPARED:
            self._prepared_combines[key] = self.runtime.prepare_combine(
                key, x, topk_weights, self._config("combine", config, Buffer.get_combine_config)) or False
        return result

    @agreed_call("combine")
    def _checked_combine(self, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
                         bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None,
                         config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                         async_finish: bool = False, allocate_on_comm_stream: bool = False
                         ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """``combine`` with every argument checked."""
        op = "combine"
        config = self._config(op, config, Buffer.get_combine_config)
        if not isinstance(x, torch.Tensor):
            bad_argument(op, "x", "a tensor", describe(x), kind=TypeError)
        parsed = NormalHandle.from_tuple(op, handle, self.rank, self.group_size, x.device, self.topology.internode)
        if self.topology.internode:
            check_internode_combine_config(op, config, self.topology.num_nodes)
        x, topk_weights, bias0, bias1 = check_combine_args(op, x, parsed, self.rank, topk_weights, bias)
        self._begin(op, previous_event, async_finish, allocate_on_comm_stream)
        out, out_weights, finish = self.runtime.combine(x, parsed, topk_weights, bias0, bias1, config)
        event = self._end(finish, async_finish, (x, topk_weights, bias0, bias1, out, out_weights))
        return out, out_weights, event

    def _config(self, op: str, config: Any, default: Callable[[int], Config]) -> Config:
        if config is None:
            return default(self.group_size)
        if not isinstance(config, Config):
            bad_argument(op, "config", "a moe_comm.Config or None", describe(config), kind=TypeError)
        return config


topk_idx_t = TOPK_IDX_T
