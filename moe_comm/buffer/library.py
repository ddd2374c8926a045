"""``Buffer``'s calls as ``torch.ops.moe_comm`` ops, the form ``torch.compile`` traces.

While Dynamo traces, a ``Buffer`` method (wrapped by ``traced_as``) runs its twin here instead of its
body: the twin turns the arguments into tensors and constants and calls the op; the op's
implementation calls the eager method with them, so a compiled call checks, agrees across ranks,
moves and raises exactly as an eager one. Outside tracing nothing here runs.

What crosses the graph:
    the buffer   an int id (a graph constant) into a registry of live buffers, plus the buffer's
                 ``state`` tensor: every communication op takes it and returns the next one, which the
                 buffer keeps, so the calls form one chain the compiler can neither reorder nor drop
                 (every rank runs the same calls in the same order), and the ops stay functional (an
                 autograd formula needs that).
    handles      their tensors, and their ints as constants.
    hooks        a receive is its own op (``low_latency_receive``) that fills, in place, the tensors its
                 send returned: a ticket tensor names the pending receive.
    events       a compiled call with ``async_finish`` completes before it returns (its event is done):
                 the bits are the same, only the overlap of an eager async call is lost.
Normal-mode sizes known only at run time (the rows received) are unbacked sizes; the per-expert list
of a dispatch is returned as an int32 tensor `[E_loc]` (a list of ints would need a host read, a graph
break). Not traceable (a clear error when Dynamo meets them): internode handles, ``zero_copy``.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from ..core.config import Config
from ..core.library import NAMESPACE, define, no_tensor, op
from .event import EventOverlap

__all__ = ["register", "traced_as", "low_latency_dispatch", "low_latency_combine", "clean_low_latency_buffer",
           "get_next_low_latency_combine_buffer", "get_dispatch_layout", "dispatch", "combine"]

_F = TypeVar("_F", bound=Callable)
_BUFFERS: dict[int, "weakref.ref[Any]"] = {}
_IDS = itertools.count()
#: pending receives of compiled hook calls: ticket -> (receive, the tensors it fills)
_RECEIVES: dict[int, tuple[Callable[[], None], list[torch.Tensor]]] = {}
_TICKETS = itertools.count()


def register(buffer: Any) -> tuple[int, torch.Tensor]:
    """A new id for ``buffer`` in the registry the ops look it up in (dropped with the buffer), and its first
    ``state`` tensor (`[1]` int64: how many calls went through ops)."""
    buffer_id = next(_IDS)
    _BUFFERS[buffer_id] = weakref.ref(buffer, lambda _: _BUFFERS.pop(buffer_id, None))
    return buffer_id, torch.zeros(1, dtype=torch.int64)


def _buffer(buffer_id: int, name: str) -> Any:
    ref = _BUFFERS.get(buffer_id)
    buffer = None if ref is None else ref()
    if buffer is None:
        raise RuntimeError(f"{name}: the Buffer this compiled call was traced with (id {buffer_id}) no longer "
                           f"exists; build the Buffer before compiling and keep it alive while the graph runs")
    return buffer


def traced_as(twin: Callable) -> Callable[[_F], _F]:
    """Decorator of a ``Buffer`` method: while Dynamo traces, ``twin(self, *args, **kwargs)`` runs instead (the
    low-latency calls, which take their prepared calls first, ask ``torch.compiler.is_compiling`` themselves)."""
    def wrap(method: _F) -> _F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return twin(self, *args, **kwargs)
            return method(self, *args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


class _Completed:
    """The event of a compiled call made with ``async_finish``: the call completed before it returned."""

    is_pending = False

    def current_stream_wait(self) -> None:
        return None


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(_Completed()) if async_finish else EventOverlap()  # type: ignore[arg-type]


def _fresh(outputs: Sequence[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """``outputs``, each cloned if it shares memory with an input or an earlier output: an op's outputs
    must be its own (a handle may hold the caller's ``is_token_in_rank``)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    result = []
    for t in outputs:
        if t.numel():
            key = t.untyped_storage().data_ptr()
            if key in seen:
                t = t.clone()
                key = t.untyped_storage().data_ptr()
            seen.add(key)
        result.append(t)
    return tuple(result)


def _call(buffer: Any, name: str, *args: Any) -> list[Any]:
    """Calls op ``name`` on ``buffer`` (its id and state first) and keeps the state the op returns last."""
    result = op(name)(buffer._op_id, buffer._op_state, *args)
    if isinstance(result, torch.Tensor):  # an op that returns only the state
        buffer._op_state = result
        return []
    *outputs, buffer._op_state = result
    return outputs


def _next(state: torch.Tensor) -> torch.Tensor:
    """The state a communication op returns: the calls made through ops so far."""
    return state + 1


def _filled(outputs: Sequence[torch.Tensor], *stats: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """What a hook call's receive fills, in the order the op and its twin both name them: the send's
    outputs, then the stats tensors given."""
    return list(outputs) + [t for t in stats if t is not None]


def _ticket(receive: Callable[[], None], filled: list[torch.Tensor]) -> torch.Tensor:
    ticket = next(_TICKETS)
    _RECEIVES[ticket] = (receive, filled)
    return torch.tensor([ticket], dtype=torch.int64)


def _ticket_fake() -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64)


def _hook(buffer: Any, ticket: torch.Tensor, filled: list[torch.Tensor]) -> Callable[[], None]:
    """The receive hook a compiled hook call returns: it runs ``low_latency_receive`` once."""
    def hook() -> None:
        _call(buffer, "low_latency_receive", ticket, filled)
    return hook


def _receive_fake(buffer: int, state: torch.Tensor, ticket: torch.Tensor, filled: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(state)


@define("low_latency_receive(int buffer, Tensor state, Tensor ticket, Tensor(a!)[] filled) -> Tensor", _receive_fake)
def _receive_op(buffer: int, state: torch.Tensor, ticket: torch.Tensor, filled: list[torch.Tensor]) -> torch.Tensor:
    """Runs the receive of a compiled hook call; the tensors it filled are copied into ``filled`` where the
    compiler passed others (it may copy a tensor before an in-place op)."""
    entry = _RECEIVES.pop(int(ticket[0]), None)
    if entry is None:
        raise RuntimeError(f"low_latency_receive: rank {_buffer(buffer, 'low_latency_receive').rank}: this receive "
                           f"hook was already called (a hook receives once)")
    receive, targets = entry
    receive()
    for dst, src in zip(filled, targets):
        if dst.numel() and dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    return _next(state)


# ---------------------------------------------------------------------------------------------- low-latency mode
def _ll_dispatch_fake(buffer: int, state: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, m: int,
                      num_experts: int, recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                      use_fp8: bool, round_scale: bool, use_ue8m0: bool, send_only: bool) -> tuple:
    ranks = _buffer(buffer, "low_latency_dispatch").group_size
    local, rows, hidden = num_experts // ranks, ranks * m, x.shape[-1]
    recv_x = x.new_empty((local, rows, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    if use_fp8:
        width, dtype = (hidden // 512, torch.int32) if use_ue8m0 else (hidden // 128, torch.float32)
        scales = x.new_empty((local, width, rows), dtype=dtype).transpose(1, 2)
    else:
        scales = no_tensor(x, torch.float32)
    return (recv_x, scales, x.new_empty(local, dtype=torch.int32), x.new_empty((local, rows), dtype=torch.int32),
            x.new_empty((local, ranks), dtype=torch.int64), _ticket_fake(), torch.empty_like(state))


@define("low_latency_dispatch(int buffer, Tensor state, Tensor x, Tensor topk_idx, "
        "int num_max_dispatch_tokens_per_rank, int num_experts, Tensor(b!)? cumulative_local_expert_recv_stats, "
        "Tensor(c!)? dispatch_wait_recv_cost_stats, bool use_fp8, bool round_scale, bool use_ue8m0, bool send_only) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _ll_dispatch_fake)
def _ll_dispatch_op(buffer: int, state: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, m: int,
                    num_experts: int, recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                    use_fp8: bool, round_scale: bool, use_ue8m0: bool, send_only: bool) -> tuple:
    """``Buffer.low_latency_dispatch``: (recv_x, recv_scales or empty, recv_count, src_info, layout_range,
    ticket). ``send_only``: only sends; the ticket names the receive (``low_latency_receive``)."""
    # the checked path: its outputs are its own (a prepared call's live in the buffer, and a compiler that
    # takes an op's outputs for fresh may move a read of them past a later call)
    recv_x, count, handle, _, hook = _buffer(buffer, "low_latency_dispatch")._checked_low_latency_dispatch(
        x, topk_idx, m, num_experts, recv_stats, wait_stats, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0, return_recv_hook=send_only)
    data, scales = recv_x if use_fp8 else (recv_x, no_tensor(x, torch.float32))
    outputs = (data, scales, count, handle[0], handle[1])
    ticket = _ticket(hook, _filled(outputs, recv_stats, wait_stats)) if send_only else torch.zeros(1, dtype=torch.int64)
    return _fresh(outputs, (x, topk_idx)) + (ticket, _next(state))


def low_latency_dispatch(self: Any, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                         dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                         round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                         return_recv_hook: bool = False, **variant_knobs: Any) -> tuple:
    """``Buffer.low_latency_dispatch`` while tracing (same arguments and results)."""
    if variant_knobs:
        _not_traceable("low_latency_dispatch", f"the variant keywords {sorted(variant_knobs)}")
    recv_x, scales, count, src_info, layout_range, ticket = _call(
        self, "low_latency_dispatch", x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0,
        return_recv_hook)
    handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
    hook = None
    if return_recv_hook:
        hook = _hook(self, ticket, _filled((recv_x, scales, count, src_info, layout_range),
                                           cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
    return (recv_x, scales) if use_fp8 else recv_x, count, handle, _event(async_finish), hook


def _ll_combine_fake(buffer: int, state: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor, m: int,
                     hidden: int, num_experts: int, use_logfmt: bool, out: Optional[torch.Tensor],
                     wait_stats: Optional[torch.Tensor], send_only: bool) -> tuple[torch.Tensor, ...]:
    combined = no_tensor(x) if out is not None else x.new_empty((topk_idx.shape[0], hidden), dtype=torch.bfloat16)
    return combined, _ticket_fake(), torch.empty_like(state)


@define("low_latency_combine(int buffer, Tensor state, Tensor x, Tensor topk_idx, Tensor topk_weights, "
        "Tensor src_info, Tensor layout_range, int num_max_dispatch_tokens_per_rank, int hidden, int num_experts, "
        "bool use_logfmt, Tensor(a!)? out, Tensor(b!)? combine_wait_recv_cost_stats, bool send_only) "
        "-> (Tensor, Tensor, Tensor)", _ll_combine_fake)
def _ll_combine_op(buffer: int, state: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor, m: int, hidden: int,
                   num_experts: int, use_logfmt: bool, out: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                   send_only: bool) -> tuple[torch.Tensor, ...]:
    """``Buffer.low_latency_combine``: (combined, or empty when written to ``out``; ticket; state)."""
    combined, _, hook = _buffer(buffer, "low_latency_combine")._checked_low_latency_combine(  # as dispatch's
        x, topk_idx, topk_weights, (src_info, layout_range, m, hidden, num_experts), use_logfmt=use_logfmt,
        out=out, combine_wait_recv_cost_stats=wait_stats, return_recv_hook=send_only)
    ticket = _ticket(hook, _filled((combined,), wait_stats)) if send_only else torch.zeros(1, dtype=torch.int64)
    return (no_tensor(x) if out is not None else _fresh((combined,), (x, topk_idx, topk_weights))[0]), ticket, \
        _next(state)


def low_latency_combine(self: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: tuple, use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                        return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **variant_knobs: Any) -> tuple:
    """``Buffer.low_latency_combine`` while tracing (same arguments and results)."""
    if variant_knobs:
        _not_traceable("low_latency_combine", f"the variant keywords {sorted(variant_knobs)}")
    if zero_copy:
        _not_traceable("low_latency_combine", "zero_copy=True (a graph cannot see writes into the buffer "
                       "get_next_low_latency_combine_buffer returned); pass the rows with zero_copy=False")
    src_info, layout_range, m, hidden, num_experts = _ll_handle("low_latency_combine", handle)
    combined, ticket = _call(self, "low_latency_combine", x, topk_idx, topk_weights, src_info, layout_range, m, hidden,
                             num_experts, use_logfmt, out, combine_wait_recv_cost_stats, return_recv_hook)
    if out is not None:
        combined = out
    hook = None
    if return_recv_hook:
        hook = _hook(self, ticket, _filled((combined,), combine_wait_recv_cost_stats))
    return combined, _event(async_finish), hook


def _ll_handle(name: str, handle: Any) -> tuple:
    if not isinstance(handle, (tuple, list)) or len(handle) != 5:
        _not_traceable(name, "a handle that is not the 5-tuple low_latency_dispatch returned")
    return tuple(handle)


def _next_buffer_fake(buffer: int, state: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor, m: int,
                      hidden: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    ranks = _buffer(buffer, "get_next_low_latency_combine_buffer").group_size
    return src_info.new_empty((num_experts // ranks, ranks * m, hidden), dtype=torch.bfloat16), torch.empty_like(state)


@define("get_next_low_latency_combine_buffer(int buffer, Tensor state, Tensor src_info, Tensor layout_range, "
        "int num_max_dispatch_tokens_per_rank, int hidden, int num_experts) -> (Tensor, Tensor)", _next_buffer_fake)
def _next_buffer_op(buffer: int, state: torch.Tensor, src_info: torch.Tensor, layout_range: torch.Tensor, m: int,
                    hidden: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Buffer.get_next_low_latency_combine_buffer`` (a view of the buffer's memory)."""
    return _buffer(buffer, "get_next_low_latency_combine_buffer").get_next_low_latency_combine_buffer(
        (src_info, layout_range, m, hidden, num_experts)), _next(state)


def get_next_low_latency_combine_buffer(self: Any, handle: tuple) -> torch.Tensor:
    """``Buffer.get_next_low_latency_combine_buffer`` while tracing."""
    src_info, layout_range, m, hidden, num_experts = _ll_handle("get_next_low_latency_combine_buffer", handle)
    return _call(self, "get_next_low_latency_combine_buffer", src_info, layout_range, m, hidden, num_experts)[0]


def _clean_fake(buffer: int, state: torch.Tensor, m: int, hidden: int, num_experts: int) -> torch.Tensor:
    return torch.empty_like(state)


@define("clean_low_latency_buffer(int buffer, Tensor state, int num_max_dispatch_tokens_per_rank, int hidden, "
        "int num_experts) -> Tensor", _clean_fake)
def _clean_op(buffer: int, state: torch.Tensor, m: int, hidden: int, num_experts: int) -> torch.Tensor:
    """``Buffer.clean_low_latency_buffer``."""
    _buffer(buffer, "clean_low_latency_buffer").clean_low_latency_buffer(m, hidden, num_experts)
    return _next(state)


def clean_low_latency_buffer(self: Any, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
    """``Buffer.clean_low_latency_buffer`` while tracing."""
    _call(self, "clean_low_latency_buffer", num_max_dispatch_tokens_per_rank, hidden, num_experts)


# ---------------------------------------------------------------------------------------------- normal mode
def _layout_fake(buffer: int, topk_idx: torch.Tensor, num_experts: int) -> tuple:
    b = _buffer(buffer, "get_dispatch_layout")
    ranks, nodes = b.group_size, b.topology.num_nodes if b.topology.internode else 0
    return (topk_idx.new_empty(ranks, dtype=torch.int32), topk_idx.new_empty(nodes, dtype=torch.int32),
            topk_idx.new_empty(num_experts, dtype=torch.int32),
            topk_idx.new_empty((topk_idx.shape[0], ranks), dtype=torch.bool))


@define("get_dispatch_layout(int buffer, Tensor topk_idx, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)",
        _layout_fake)
def _layout_op(buffer: int, topk_idx: torch.Tensor, num_experts: int) -> tuple:
    """``Buffer.get_dispatch_layout``: (per rank, per node or empty on one node, per expert, is_token_in_rank)."""
    per_rank, per_node, per_expert, in_rank, _ = _buffer(buffer, "get_dispatch_layout").get_dispatch_layout(
        topk_idx, num_experts)
    return _fresh((per_rank, no_tensor(per_rank) if per_node is None else per_node, per_expert, in_rank), (topk_idx,))


def get_dispatch_layout(self: Any, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                        async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
    """``Buffer.get_dispatch_layout`` while tracing."""
    self._begin("get_dispatch_layout", previous_event, async_finish, allocate_on_comm_stream)
    per_rank, per_node, per_expert, in_rank = op("get_dispatch_layout")(self._op_id, topk_idx, num_experts)
    return per_rank, per_node if self.topology.internode else None, per_expert, in_rank, _event(async_finish)


def _config_values(self: Any, op_name: str, config: Any, default: Callable[[int], Config]) -> list[int]:
    config = self._config(op_name, config, default)
    return [config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens]


def _handle_fake(like: torch.Tensor, ranks: int, channels: int, tokens: int, rows: Any) -> list[torch.Tensor]:
    i32 = torch.int32
    return [like.new_empty((ranks, ranks), dtype=i32), like.new_empty((ranks, channels), dtype=i32),
            like.new_empty((ranks, channels), dtype=i32), like.new_empty(rows, dtype=i32),
            like.new_empty((tokens, ranks), dtype=torch.bool), like.new_empty((tokens, ranks), dtype=i32)]


def _dispatch_fake(buffer: int, state: torch.Tensor, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                   num_tokens_per_rank: Optional[torch.Tensor], is_token_in_rank: Optional[torch.Tensor],
                   num_tokens_per_expert: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                   topk_weights: Optional[torch.Tensor], expert_alignment: int, num_worst_tokens: int,
                   config: list[int], num_experts: Optional[int]) -> tuple:
    b = _buffer(buffer, "dispatch")
    rows = num_worst_tokens if num_worst_tokens > 0 else torch.library.get_ctx().new_dynamic_size()
    local = (num_experts if num_experts is not None else num_tokens_per_expert.shape[0]) // b.group_size
    recv_scales = no_tensor(x, torch.float32) if x_scales is None else \
        x.new_empty((rows, x_scales.shape[1]), dtype=x_scales.dtype)
    if topk_idx is None:
        recv_idx, recv_weights = no_tensor(x, torch.int64), no_tensor(x, torch.float32)
    else:
        recv_idx = x.new_empty((rows, topk_idx.shape[1]), dtype=topk_idx.dtype)
        recv_weights = x.new_empty((rows, topk_idx.shape[1]), dtype=torch.float32)
    per_expert = x.new_empty(0 if num_worst_tokens > 0 else local, dtype=torch.int32)
    handle = _handle_fake(x, b.group_size, max(config[0] // 2, 1), x.shape[0], rows)
    return (x.new_empty((rows, x.shape[1])), recv_scales, recv_idx, recv_weights, per_expert, *handle,
            torch.empty_like(state))


@define("dispatch(int buffer, Tensor state, Tensor x, Tensor? x_scales, Tensor? num_tokens_per_rank, "
        "Tensor? is_token_in_rank, Tensor? num_tokens_per_expert, Tensor? topk_idx, Tensor? topk_weights, "
        "int expert_alignment, int num_worst_tokens, int[] config, int? num_experts) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _dispatch_fake)
def _dispatch_op(buffer: int, state: torch.Tensor, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                 num_tokens_per_rank: Optional[torch.Tensor], is_token_in_rank: Optional[torch.Tensor],
                 num_tokens_per_expert: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], expert_alignment: int, num_worst_tokens: int,
                 config: list[int], num_experts: Optional[int]) -> tuple:
    """``Buffer.dispatch`` (not cached): (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, each empty
    where the method returns None; the per-expert counts as int32; the handle's six tensors: an op's
    results cannot hold a list)."""
    inputs = (x, x_scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)
    recv_x, recv_idx, recv_weights, per_expert, handle, _ = _buffer(buffer, "dispatch").dispatch(
        x if x_scales is None else (x, x_scales), None, num_tokens_per_rank, None, is_token_in_rank,
        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, Config(*config),
        num_experts=num_experts)
    data, scales = recv_x if x_scales is not None else (recv_x, no_tensor(x, torch.float32))
    return _fresh((data, scales, no_tensor(x, torch.int64) if recv_idx is None else recv_idx,
                   no_tensor(x, torch.float32) if recv_weights is None else recv_weights,
                   torch.tensor(per_expert, dtype=torch.int32, device=x.device)) + tuple(handle), inputs) + \
        (_next(state),)


def _rows_fake(x: torch.Tensor, rows: Any, extra: Optional[torch.Tensor], state: torch.Tensor) -> tuple:
    """The fake outputs of a call that returns ``rows`` rows of ``x``, the same rows of ``extra`` (or an empty
    float32 tensor), and the state."""
    second = no_tensor(x, torch.float32) if extra is None else x.new_empty((rows, extra.shape[1]), dtype=extra.dtype)
    return x.new_empty((rows, x.shape[1])), second, torch.empty_like(state)


def _cached_dispatch_fake(buffer: int, state: torch.Tensor, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                          handle: list[torch.Tensor], config: list[int]) -> tuple[torch.Tensor, ...]:
    return _rows_fake(x, handle[3].shape[0], x_scales, state)  # the rows of the handle's dispatch


@define("cached_dispatch(int buffer, Tensor state, Tensor x, Tensor? x_scales, Tensor[] handle, int[] config) "
        "-> (Tensor, Tensor, Tensor)", _cached_dispatch_fake)
def _cached_dispatch_op(buffer: int, state: torch.Tensor, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                        handle: list[torch.Tensor], config: list[int]) -> tuple[torch.Tensor, ...]:
    """``Buffer.dispatch`` with a handle: (recv_x, recv_scales or empty, state)."""
    recv_x, *_ = _buffer(buffer, "dispatch").dispatch(x if x_scales is None else (x, x_scales), tuple(handle),
                                                      config=Config(*config))
    data, scales = recv_x if x_scales is not None else (recv_x, no_tensor(x, torch.float32))
    return _fresh((data, scales), [x, x_scales, *handle]) + (_next(state),)


def dispatch(self: Any, x: Any, handle: Optional[tuple] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
             num_tokens_per_rdma_rank: Optional[torch.Tensor] = None, is_token_in_rank: Optional[torch.Tensor] = None,
             num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
             topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
             config: Optional[Config] = None, previous_event: Any = None, async_finish: bool = False,
             allocate_on_comm_stream: bool = False, *, num_experts: Optional[int] = None) -> tuple:
    """``Buffer.dispatch`` while tracing; the per-expert list is an int32 tensor (see the module)."""
    self._begin("dispatch", previous_event, async_finish, allocate_on_comm_stream)
    if self.topology.internode:
        _not_traceable("dispatch", "a group that spans several nodes (its handle carries Python routing)")
    data, scales = x if isinstance(x, (tuple, list)) else (x, None)
    values = _config_values(self, "dispatch", config, self.get_dispatch_config)
    if handle is not None:
        recv_x, recv_scales = _call(self, "cached_dispatch", data, scales, list(handle), values)
        return (recv_x, recv_scales) if scales is not None else recv_x, None, None, None, None, _event(async_finish)
    recv_x, recv_scales, recv_idx, recv_weights, per_expert, *handle_out = _call(
        self, "dispatch", data, scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
        topk_weights, expert_alignment, num_worst_tokens, values, num_experts)
    routed = topk_idx is not None
    return ((recv_x, recv_scales) if scales is not None else recv_x, recv_idx if routed else None,
            recv_weights if routed else None, per_expert, tuple(handle_out), _event(async_finish))


def _combine_fake(buffer: int, state: torch.Tensor, x: torch.Tensor, handle: list[torch.Tensor],
                  topk_weights: Optional[torch.Tensor], bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                  config: list[int]) -> tuple[torch.Tensor, ...]:
    return _rows_fake(x, handle[4].shape[0], topk_weights, state)  # the tokens of the handle's dispatch


@define("combine(int buffer, Tensor state, Tensor x, Tensor[] handle, Tensor? topk_weights, Tensor? bias0, "
        "Tensor? bias1, int[] config) -> (Tensor, Tensor, Tensor)", _combine_fake)
def _combine_op(buffer: int, state: torch.Tensor, x: torch.Tensor, handle: list[torch.Tensor],
                topk_weights: Optional[torch.Tensor], bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                config: list[int]) -> tuple[torch.Tensor, ...]:
    """``Buffer.combine``: (combined_x, combined_topk_weights or empty, state)."""
    bias = bias0 if bias1 is None else (bias0, bias1)
    combined, weights, _ = _buffer(buffer, "combine").combine(x, tuple(handle), topk_weights, bias, Config(*config))
    return _fresh((combined, no_tensor(x, torch.float32) if weights is None else weights),
                  [x, topk_weights, bias0, bias1, *handle]) + (_next(state),)


def combine(self: Any, x: torch.Tensor, handle: tuple, topk_weights: Optional[torch.Tensor] = None,
            bias: Any = None, config: Optional[Config] = None, previous_event: Any = None, async_finish: bool = False,
            allocate_on_comm_stream: bool = False) -> tuple:
    """``Buffer.combine`` while tracing."""
    self._begin("combine", previous_event, async_finish, allocate_on_comm_stream)
    if self.topology.internode:
        _not_traceable("combine", "a group that spans several nodes (its handle carries Python routing)")
    bias0, bias1 = bias if isinstance(bias, (tuple, list)) else (bias, None)
    combined, weights = _call(self, "combine", x, list(handle), topk_weights, bias0, bias1,
                              _config_values(self, "combine", config, self.get_combine_config))
    return combined, weights if topk_weights is not None else None, _event(async_finish)


def _not_traceable(name: str, what: str) -> None:
    raise NotImplementedError(f"{name}: {what} cannot be compiled with torch.compile; call it outside the compiled "
                              f"region")


# ---------------------------------------------------------------------------------------------- autograd
# Normal mode's two calls are each other's adjoints (DeepEP's and Megatron-Core's convention): the gradient
# of a dispatch is the combine of its received rows' gradients (with the received weights' gradients where
# the dispatch kept a weight: the slots of the receiving rank's experts), and the gradient of a combine is
# a cached dispatch of its outputs' gradients. A backward call chains from the state its forward call
# returned; backward calls are ordered among themselves by the gradients they pass on.
def _dispatch_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, topk_weights = inputs[2], inputs[8]
    ctx.buffer, ctx.config, ctx.weighted = inputs[0], inputs[11], topk_weights is not None
    ctx.hidden, ctx.dtype = x.shape[1], x.dtype
    ctx.save_for_backward(output[2], *output[5:12])  # recv_topk_idx, the handle, the state


def _dispatch_backward(ctx: Any, grad_x: Optional[torch.Tensor], _scales: Any, _idx: Any,
                       grad_weights: Optional[torch.Tensor], *_rest: Any) -> tuple:
    recv_idx, *handle, state = ctx.saved_tensors
    if grad_x is None:
        grad_x = torch.zeros((handle[3].shape[0], ctx.hidden), dtype=ctx.dtype, device=recv_idx.device)
    weights = None
    if ctx.weighted and ctx.needs_input_grad[8]:
        weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device) if grad_weights is None \
            else torch.where(recv_idx >= 0, grad_weights, 0.0)
    combined, combined_weights, _ = op("combine")(ctx.buffer, state, grad_x.contiguous(), handle, weights, None, None,
                                                  ctx.config)
    return (None, None, combined if ctx.needs_input_grad[2] else None, None, None, None, None, None,
            combined_weights if weights is not None else None, None, None, None, None)


def _combine_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x = inputs[2]
    ctx.buffer, ctx.config, ctx.hidden, ctx.dtype = inputs[0], inputs[7], x.shape[1], x.dtype
    ctx.given = tuple(t is not None for t in inputs[4:7])  # topk_weights, bias0, bias1
    ctx.num_topk = 0 if inputs[4] is None else inputs[4].shape[1]
    ctx.save_for_backward(*inputs[3], output[2])  # the handle, the state


def _combine_backward(ctx: Any, grad_out: Optional[torch.Tensor], grad_weights: Optional[torch.Tensor],
                      _state: Any) -> tuple:
    *handle, state = ctx.saved_tensors
    tokens, device = handle[4].shape[0], handle[4].device
    if grad_out is None:
        grad_out = torch.zeros((tokens, ctx.hidden), dtype=ctx.dtype, device=device)
    grad_out = grad_out.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[2]:
        grad_x, _, state = op("cached_dispatch")(ctx.buffer, state, grad_out, None, handle, ctx.config)
    if ctx.given[0] and ctx.needs_input_grad[4]:
        if grad_weights is None:
            grad_weights = torch.zeros((tokens, ctx.num_topk), dtype=torch.float32, device=device)
        grad_w, _, _ = op("cached_dispatch")(ctx.buffer, state, grad_weights.contiguous(), None, handle, ctx.config)
    bias = tuple(grad_out if given and needed else None for given, needed in zip(ctx.given[1:],
                                                                                  ctx.needs_input_grad[5:7]))
    return (None, None, grad_x, [None] * len(handle), grad_w) + bias + (None,)


torch.library.register_autograd(f"{NAMESPACE}::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd(f"{NAMESPACE}::combine", _combine_backward, setup_context=_combine_setup)
