"""The low-latency half of ``Buffer``'s API (DeepEP v1): dispatch, combine, hooks, the zero-copy
combine buffer, clean, and the shrink (rank masking) helpers. A mixin: ``Buffer`` provides the
state (group size, the backend) and ``_alive``."""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..backends.base import Backend, agreed_call, agreed_signature
from ..core.checks import check_bools, check_int, check_tensor
from ..core.errors import bad_argument
from ..protocol.codes import Fp8Format
from ..protocol.handle import LowLatencyHandle
from . import library
from .event import NO_EVENT, EventHandle, EventOverlap
from .low_latency_args import check_ll_combine, check_ll_counts, check_ll_dispatch, check_ll_sizes, check_rdma_bytes
from .variant_knobs import LOW_LATENCY_COMBINE, LOW_LATENCY_DISPATCH, reject_unsupported

__all__ = ["LowLatencyAPI", "MAX_PREPARED", "XType"]

#: ``x`` of a dispatch: a tensor, or an ``(fp8 data, scales)`` pair
XType = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

#: prepared calls a Buffer keeps per operation (signatures past that run checked: a caller whose arguments
#: change every call pays no preparation every call)
MAX_PREPARED = 64


class LowLatencyAPI:
    """Low-latency methods of ``Buffer``."""

    group_size: int
    rank: int
    num_rdma_bytes: int
    low_latency_mode: bool
    enable_shrink: bool
    membership: Any  # ``rejoin.Membership`` of an elastic buffer, else None
    runtime: Backend
    _admit: Callable[[], None]  # admits the replacements every rank decided on (``buffer.py``)
    _alive: Callable[[str], None]  # raises once the buffer is destroyed or broken
    #: prepared calls by signature (``backends.portable.prepared``); False: the backend takes none for it
    _prepared_ll_dispatches: dict[tuple, Any]
    _prepared_ll_combines: dict[tuple, Any]
    _prepared_dispatches: dict[tuple, Any]  # normal mode's (``buffer.py``)
    _prepared_combines: dict[tuple, Any]

    # ------------------------------------------------------------------ low-latency mode
    def _low_latency_ready(self, op: str) -> None:
        self._alive(op)
        if not self.low_latency_mode:
            raise RuntimeError(f"{op}: needs a Buffer created with low_latency_mode=True (as DeepEP requires)")

    @library.traced_as(library.clean_low_latency_buffer)
    @agreed_call("clean_low_latency_buffer")
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP's reset of both low-latency buffers. Collective: a barrier with the deadline.
        Finishes async results still pending; raises if a recv hook has not been called yet."""
        op = "clean_low_latency_buffer"
        self._low_latency_ready(op)
        check_ll_sizes(op, num_max_dispatch_tokens_per_rank, hidden, num_experts, self.group_size, self.num_rdma_bytes)
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._drop_prepared()

    @agreed_signature("_checked_low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, **variant_knobs: Any
                             ) -> tuple[XType, torch.Tensor, tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Sends one message per (token, selected expert) into fixed-shape per-expert blocks. Collective.

        Args:
            x: `[T, H]` bf16, T <= M = ``num_max_dispatch_tokens_per_rank`` (the same M on every rank),
                H any multiple of 128 (of 512 with ``use_ue8m0``).
            topk_idx: `[T, K]` int64 expert ids or -1, K <= ``num_experts``, no expert twice in a row.
            cumulative_local_expert_recv_stats: optional `[E_loc]` int32, increased by ``recv_count``.
            dispatch_wait_recv_cost_stats: optional `[R]` int64, increased per source rank by the
                nanoseconds this rank waited to receive (DeepEP counts GPU cycles; moe-comm's transports
                wait for all sources at once, so every entry grows by the same wait).
            use_fp8: cast to FP8 E4M3 with one scale per 128 channels (``moe_comm.ops.quantize``, bitwise
                ``moe_comm.ops.per_token_cast_to_fp8``);
                ``round_scale``: power-of-two scales; ``use_ue8m0``: packed UE8M0 scales (needs round_scale).
            async_finish: the receive runs in ``event.current_stream_wait()``.
            return_recv_hook: the call only sends; ``hook()`` receives and fills the outputs (once).
            variant_knobs: keywords of DeepEP forks (``use_nvfp4``, ``x_global_scale``, ...), accepted
                at their off value only (``moe_comm.buffer.variant_knobs``).
        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` `[E_loc, R * M, H]` bf16, or
            ``(float8_e4m3fn [E_loc, R * M, H], scales)`` with scales float32 `[E_loc, R * M, H / 128]` or
            int32 `[E_loc, R * M, H / 512]`, viewed column-major (token stride 1) as DeepEP returns them;
            ``recv_count`` `[E_loc]` int32 valid rows per local expert; ``handle`` DeepEP's
            ``(src_info [E_loc, R * M] int32, layout_range [E_loc, R] int64 (begin << 32 | count), M, H,
            num_experts)``. Rows of expert e come in blocks by source rank ascending, then source
            token ascending; rows past ``recv_count[e]`` are 0 (``src_info`` -1). The outputs live in one of
            the buffer's two halves, as DeepEP's: the results of at most two low-latency calls can be held at
            a time (a third call reuses the memory of the first).
        """
        if torch.compiler.is_compiling():
            return library.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
                                                **variant_knobs)
        if self.membership is not None:  # replacements every rank decided to admit join at this dispatch
            self._admit()
        # A call of a signature seen before: its prepared call (docs/DESIGN "prepared calls"), unless it
        # declines the arguments; then the checked path runs the call (and words any error).
        key = None if variant_knobs else (num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                          use_ue8m0, async_finish, return_recv_hook,
                                          cumulative_local_expert_recv_stats is None,
                                          dispatch_wait_recv_cost_stats is None)
        try:
            prepared = self._prepared_ll_dispatches.get(key)
        except TypeError:  # an unhashable argument
            prepared = key = None
        if prepared:
            half = prepared.send(key, x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
            if half >= 0:
                if return_recv_hook:
                    return (*prepared.results[half], NO_EVENT, prepared.receive)
                if async_finish:
                    return (*prepared.results[half], EventOverlap(EventHandle(prepared.receive.complete),
                                                                  (x, topk_idx)), None)
                return (*prepared.results[half], NO_EVENT, None)
        result = self._checked_low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            **variant_knobs)
        if self.membership is not None:
            self.membership.keep_handle(result[2])
        if key is not None and (prepared is None or prepared and prepared.stale) and \
                len(self._prepared_ll_dispatches) < MAX_PREPARED:
            self._prepared_ll_dispatches[key] = self.runtime.prepare_low_latency_dispatch(
                key, x.shape[1], topk_idx.shape[1], num_max_dispatch_tokens_per_rank, num_experts,
                Fp8Format.of(use_fp8, round_scale, use_ue8m0), return_recv_hook, async_finish) or False
        return result

    @agreed_call("low_latency_dispatch")
    def _checked_low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                                      num_max_dispatch_tokens_per_rank: int, num_experts: int,
                                      cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                                      dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                                      use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                                      async_finish: bool = False, return_recv_hook: bool = False,
                                      **variant_knobs: Any
                                      ) -> tuple[XType, torch.Tensor, tuple, EventOverlap,
                                                 Optional[Callable[[], None]]]:
        """``low_latency_dispatch`` with every argument checked (a call of a new signature, or one its
        prepared call declined); its outputs are its own."""
        op = "low_latency_dispatch"
        reject_unsupported(op, LOW_LATENCY_DISPATCH, variant_knobs)
        self._low_latency_ready(op)
        check_bools(op, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                    return_recv_hook=return_recv_hook)
        self._no_async_with_hook(op, async_finish, return_recv_hook)
        check_ll_counts(op, num_max_dispatch_tokens_per_rank, num_experts, self.group_size)
        args = check_ll_dispatch(op, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, self.group_size,
                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                 round_scale, use_ue8m0, not self.runtime.low_latency_checks_topk)
        check_rdma_bytes(op, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, self.group_size,
                         self.num_rdma_bytes)
        result = self.runtime.low_latency_dispatch(args.x, args.topk_idx, num_max_dispatch_tokens_per_rank,
                                                   num_experts, args.fp8_format, cumulative_local_expert_recv_stats,
                                                   dispatch_wait_recv_cost_stats, return_recv_hook)
        recv_x = result.recv_x if result.recv_scales is None else (result.recv_x, result.recv_scales)
        outputs = (result.recv_x, result.recv_scales, result.recv_count) + result.handle.as_tuple()[:2]
        event, hook = self._ll_end(result.receive, async_finish, return_recv_hook, (args.x, args.topk_idx) + outputs)
        return recv_x, result.recv_count, result.handle.as_tuple(), event, hook

    @agreed_signature("_checked_low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **variant_knobs: Any
                            ) -> tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Returns expert outputs to their source ranks and reduces them, weighted. Collective.

        Args:
            x: `[E_loc, R * M, H]` bf16 expert outputs in the dispatch layout (rows past
                ``recv_count`` are ignored). With ``zero_copy=True`` the rows are read from the buffer
                ``get_next_low_latency_combine_buffer(handle)`` returned just before instead.
            topk_idx, topk_weights: this rank's `[T, K]` routing from the dispatch, int64 / float32.
            handle: from ``low_latency_dispatch``.
            use_logfmt: rows travel in DeepEP's 10-bit LogFMT (``moe_comm.ops.logfmt``: per 128 channels
                a bf16 (amax, amin) pair, chunks of all-small values as 9-bit log codes and a sign,
                the others as bf16) and are decoded straight into the fp32 sum; not with ``zero_copy``
                (as DeepEP).
            out: optional `[T, H]` bf16 contiguous output.
            combine_wait_recv_cost_stats: like ``dispatch_wait_recv_cost_stats``.
            variant_knobs: keywords of DeepEP forks (``overlap``, ``comp_signal``, ...), accepted at
                their off value only (``moe_comm.buffer.variant_knobs``).
        Returns:
            ``(combined_x, event, hook)``: ``combined_x[t] = bf16(sum over k ascending with topk_idx[t, k]
            >= 0 of topk_weights[t, k] * y(t, k))``, fp32 multiply and add: bitwise reproducible.
        """
        if torch.compiler.is_compiling():
            return library.low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                               async_finish, return_recv_hook, out, combine_wait_recv_cost_stats,
                                               **variant_knobs)
        key = prepared = None
        if not variant_knobs and type(handle) is tuple:  # as in low_latency_dispatch
            key = handle[2:] + (use_logfmt, zero_copy, async_finish, return_recv_hook, out is None,
                                combine_wait_recv_cost_stats is None)
            try:
                prepared = self._prepared_ll_combines.get(key)
            except TypeError:
                prepared = key = None
        if prepared:
            combined = prepared.send(key, x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats)
            if combined is not None:
                if return_recv_hook:
                    return combined, NO_EVENT, prepared.receive
                if async_finish:
                    return combined, EventOverlap(EventHandle(prepared.receive.complete),
                                                  (x, topk_idx, topk_weights, combined)), None
                return combined, NO_EVENT, None
        result = self._checked_low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                                   async_finish, return_recv_hook, out, combine_wait_recv_cost_stats,
                                                   **variant_knobs)
        if key is not None and (prepared is None or prepared and prepared.stale) and \
                len(self._prepared_ll_combines) < MAX_PREPARED:
            self._prepared_ll_combines[key] = not use_logfmt and not zero_copy and \
                self.runtime.prepare_low_latency_combine(key, handle[3], topk_idx.shape[1], handle[2], handle[4],
                                                         return_recv_hook, async_finish) or False
        return result

    @agreed_call("low_latency_combine")
    def _checked_low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                     handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                                     async_finish: bool = False, return_recv_hook: bool = False,
                                     out: Optional[torch.Tensor] = None,
                                     combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                                     **variant_knobs: Any) -> tuple[torch.Tensor, EventOverlap,
                                                                    Optional[Callable[[], None]]]:
        """``low_latency_combine`` with every argument checked."""
        op = "low_latency_combine"
        reject_unsupported(op, LOW_LATENCY_COMBINE, variant_knobs)
        self._low_latency_ready(op)
        check_bools(op, use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                    return_recv_hook=return_recv_hook)
        if use_logfmt and zero_copy:
            bad_argument(op, "use_logfmt", "False with zero_copy=True (as DeepEP asserts: the zero-copy buffer "
                         "holds bf16 rows)", "True")
        self._no_async_with_hook(op, async_finish, return_recv_hook)
        if self.membership is not None:  # (in the agreed call: a rejection reaches every rank)
            self.membership.check_handle(op, handle)
        x, topk_idx, topk_weights, parsed = check_ll_combine(op, x, topk_idx, topk_weights, handle, self.group_size,
                                                             out, combine_wait_recv_cost_stats,
                                                             not self.runtime.low_latency_checks_topk)
        check_rdma_bytes(op, parsed.num_max_dispatch_tokens_per_rank, parsed.hidden, parsed.num_experts,
                         self.group_size, self.num_rdma_bytes)
        combined, receive = self.runtime.low_latency_combine(x, topk_idx, topk_weights, parsed, zero_copy, out,
                                                             combine_wait_recv_cost_stats, return_recv_hook,
                                                             use_logfmt)
        event, hook = self._ll_end(receive, async_finish, return_recv_hook, (x, topk_idx, topk_weights, combined))
        return combined, event, hook

    @library.traced_as(library.get_next_low_latency_combine_buffer)
    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The bf16 `[E_loc, R * M, H]` buffer that a following ``low_latency_combine(...,
        zero_copy=True)`` reads: write the expert outputs into it, then combine, with no other
        low-latency call in between."""
        op = "get_next_low_latency_combine_buffer"
        self._low_latency_ready(op)
        src_info = handle[0] if isinstance(handle, (tuple, list)) and handle else None
        device = src_info.device if isinstance(src_info, torch.Tensor) else torch.device("cpu")
        if self.membership is not None:
            self.membership.check_handle(op, handle)
        parsed = LowLatencyHandle.from_tuple(op, handle, self.group_size, device)
        return self.runtime.next_combine_buffer(parsed, device)

    # ------------------------------------------------------------------ fault tolerance (enable_shrink)
    def _shrink_ready(self, op: str) -> None:
        self._low_latency_ready(op)
        if not self.enable_shrink:
            raise RuntimeError(f"{op}: needs a Buffer created with enable_shrink=True (as DeepEP requires)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks a rank for this rank's low-latency calls: a masked rank is
        neither sent to nor waited for, and its experts' top-k entries count as -1 (so they add
        nothing to a combine). Takes effect at this rank's next low-latency call, whose handshake
        shares it: a rank masked by any rank is masked by all, and the masked rank itself, if it
        still calls, is refused. Ranks that exit, or miss a low-latency call's deadline, are masked
        the same way (shrink by timeout, ``protocol/shrink.py``)."""
        op = "low_latency_update_mask_buffer"
        self._shrink_ready(op)
        check_int(op, "rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            bad_argument(op, "rank_to_mask", f"a rank in [0, {self.group_size})", rank_to_mask)
        check_bools(op, mask=mask)
        if rank_to_mask == self.rank and mask:
            bad_argument(op, "rank_to_mask", f"another rank than this one ({self.rank})", rank_to_mask)
        self.runtime.mask_rank(rank_to_mask, mask)
        self._drop_prepared()

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes 1 for masked ranks and 0 for the others into ``mask_status`` (`[num_ranks]` int32)."""
        op = "low_latency_query_mask_buffer"
        self._shrink_ready(op)
        check_tensor(op, "mask_status", mask_status, shape=(self.group_size,), dtype=torch.int32)
        status = torch.zeros(self.group_size, dtype=torch.int32)
        status[sorted(self.runtime.masked_ranks())] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank."""
        self._shrink_ready("low_latency_clean_mask_buffer")
        self.runtime.clear_masks()
        self._drop_prepared()

    def _drop_prepared(self) -> None:
        """Forgets the prepared calls (a mask change, ``clean_low_latency_buffer``, ``destroy``): later calls
        prepare again, for what holds then."""
        for prepared in (self._prepared_ll_dispatches, self._prepared_ll_combines, self._prepared_dispatches,
                         self._prepared_combines):
            prepared.clear()

    @staticmethod
    def _no_async_with_hook(op: str, async_finish: bool, return_recv_hook: bool) -> None:
        if async_finish and return_recv_hook:
            bad_argument(op, "async_finish and return_recv_hook", "not both True (as DeepEP asserts)",
                         "both True")

    @staticmethod
    def _ll_end(receive: Any, async_finish: bool, return_recv_hook: bool,
                extra: tuple) -> tuple[EventOverlap, Optional[Callable[[], None]]]:
        if return_recv_hook:
            return EventOverlap(), receive
        if async_finish:
            return EventOverlap(EventHandle(receive.complete), extra), None
        receive()
        return EventOverlap(), None
