"""Prepared normal-mode calls on the shm transport: a dispatch's or a combine's fixed cost paid once per
signature, as ``prepared.py`` does for low-latency calls.

A normal-mode call cannot leave its handshake out (its outputs are sized by every rank's counts), but what
surrounds the rounds can go: after a checked call of a signature (the x and scales dtypes and widths, top-k
given and its width, the number of experts, the alignment, ``num_worst_tokens``, the config), a later call is a
key lookup, one native call for the handshake (and a dispatch's count exchange), the outputs made here at the
sizes it returns, and one native call for the payload and the outputs (``moe_comm._C.PreparedNormalDispatch``,
``PreparedNormalCombine``, ``csrc/cpu/prepared_normal.h``); its rounds go on the wire as the checked path's
(``normal.py``). Arguments the prepared call does not take leave everything as it was, for the checked path to
run the call and word the error; a round that fails is raised by the checked path's own code (the transport's
waits, ``CallAgreement.judge``)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...core.config import Config
from ...core.memory import empty
from ...core.native import native, native_dtype
from ...ops.records import RecordLayout
from ...protocol.codes import Field, Op, WireDType
from ...transport.shm_segment import DATA, META, NUM_SLOTS
from .normal import _X_FIELDS, NormalMode, _check_worst, _ring_fields, _x_fields
from .prepared import shm_plan

__all__ = ["PreparedNormalDispatch", "PreparedNormalCombine", "prepare_normal_dispatch", "prepare_normal_combine"]

#: how far a prepared call's half got (``moe_comm._C.PreparedStatus``, as ints)
_OK, _NOT_TAKEN, _POST_FAILED, _WAIT_FAILED, _DISAGREE, _GROW = range(6)
#: the round a failure was in (``PreparedRound``): the handshake, the count exchange, the payload
_HEADER, _META = 0, 1


class _PreparedNormal:
    """What a prepared normal dispatch and combine share: the mode, the rounds' bookkeeping and failures."""

    op: str

    def __init__(self, mode: NormalMode, pending_posts: list, compare: tuple[Field, ...],
                 verdict: Optional[Any] = None) -> None:
        self.mode, self.agreement, self.transport = mode, mode.agreement, mode.transport
        self._pending_posts = pending_posts  # the low-latency posts a handshake settles first (the checked path's)
        self.compare, self._verdict = compare, verdict
        #: the transport mapped its segments again: this call's addresses are stale (prepare a new one)
        self.stale = False
        self.mapping = 0
        self.native: Any = None

    def _start(self, metadata: bool) -> Optional[tuple[int, int]]:
        """(first data exchange, metadata exchange) of the next call when this prepared call may run it now."""
        agreement = self.agreement
        if agreement.broken is not None or agreement.destroyed or self._pending_posts:
            return None
        seqs = self.transport.next_exchanges(self.mapping, metadata)
        self.stale = seqs is None and self.mapping != self.transport.mapping
        return seqs

    def _took(self, status: int, number: int, seq: int, meta: int) -> None:
        """The bookkeeping of call ``number`` after its ``begin`` ended with ``status`` (the exchanges it took, as
        far as the checked path takes them: a handshake that fails ends the call there); then larger data slots
        when it needs them, or its failure."""
        self.agreement.calls = number
        ended = status == _DISAGREE or status not in (_OK, _GROW) and self.native.failure[2] == _HEADER
        self.transport.exchanged(seq, seq if ended else seq + 1, 0 if ended else meta)
        if status == _GROW:
            self._grow(seq)
        elif status != _OK:
            self._failed(status, number, seq, meta)

    def _failed(self, status: int, number: int, seq: int, meta: int) -> None:
        """Raises for call ``number``'s round that failed (exchanges ``seq`` (the handshake), ``seq + 1``, and
        ``meta``): the handshake's verdict, the same on every rank (the buffer stays usable), or a wait's error
        (the buffer breaks), each as the checked path words it."""
        if status == _DISAGREE:
            post = self.transport.posted_call(seq % NUM_SLOTS, seq, self.op, self.native_header_bytes, 0)
            try:
                self.agreement.judge(self.op, post.headers(), self.compare, self._verdict)
            finally:
                post.release()
            raise AssertionError(f"{self.op}: call {number}'s handshake agrees in Python but not natively")
        index, outcome, round_ = self.native.failure
        channel, slot, exchange = (DATA, seq % NUM_SLOTS, seq) if round_ == _HEADER else \
            (META, meta % NUM_SLOTS, meta) if round_ == _META else (DATA, (seq + 1) % NUM_SLOTS, seq + 1)
        try:
            if status == _WAIT_FAILED:
                self.transport.wait_failed(channel, slot, exchange, index, outcome, self.op)
            if channel == META:
                self.transport.metadata_post_failed(slot, exchange, index, outcome, self.op)
            self.transport.post_failed(slot, exchange, index, outcome, self.op)
        except BaseException as exc:
            self.agreement.failed_started(self.op, number, exc)
            raise

    def _grow(self, seq: int) -> None:
        """The payload needs larger data slots (every rank found so): mapped, as the checked exchange maps them."""
        self.transport.grow(self.native.need, seq + 1)
        self.native.refresh(shm_plan(self.transport, self._header, self._record_bytes, self.compare)[0])
        self.mapping = self.transport.mapping

    native_header_bytes: int
    _header: torch.Tensor
    _record_bytes: int


class PreparedNormalDispatch(_PreparedNormal):
    """A normal-mode dispatch (non-cached, with DeepEP's layout tensors) prepared for one signature."""

    op = "dispatch"

    def __init__(self, mode: NormalMode, pending_posts: list, key: tuple, x: torch.Tensor,
                 scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor], num_experts: int,
                 expert_alignment: int, num_worst_tokens: int, config: Config) -> None:
        super().__init__(mode, pending_posts, _X_FIELDS + (Field.NUM_TOPK, Field.NUM_EXPERTS, Field.NUM_CHANNELS)
                         + mode._rings, _check_worst)
        R, hidden = mode.num_ranks, x.shape[1]
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        specs = [("x", x.dtype, hidden)] + ([] if scales is None else [("scales", scales.dtype, scales.shape[1])])
        specs += [("topk_idx", torch.int64, num_topk), ("topk_weights", torch.float32, num_topk)] if num_topk else []
        records = RecordLayout.build(specs + [("src_idx", torch.int32, 1)])
        fields = {**_x_fields(x, scales), Field.NUM_TOPK: -1 if topk_idx is None else num_topk,
                  Field.NUM_EXPERTS: num_experts,
                  Field.NUM_CHANNELS: config.num_channels, Field.NUM_WORST_TOKENS: num_worst_tokens,
                  **_ring_fields(config)}
        self._header = self.agreement.header(Op.DISPATCH, fields, [0] * R, number=0)
        self._record_bytes, self.native_header_bytes = records.record_bytes, self._header.numel()
        plan, self.mapping = shm_plan(self.transport, self._header, records.record_bytes, self.compare, metadata=True)
        geometry = native().NormalDispatchGeometry()
        geometry.num_experts, geometry.num_channels, geometry.num_worst = num_experts, config.num_channels, \
            num_worst_tokens
        geometry.alignment, geometry.num_topk, geometry.worst_word = expert_alignment, num_topk, \
            int(Field.NUM_WORST_TOKENS)
        geometry.src_offset = records.field("src_idx").offset
        if num_topk:
            geometry.topk_offset = records.field("topk_idx").offset
            geometry.weights_offset = records.field("topk_weights").offset
        scales_field = None if scales is None else records.field("scales")
        self.native = native().PreparedNormalDispatch(
            plan, geometry, hidden, x.dtype, records.field("x").offset, None if scales is None else scales.dtype,
            0 if scales is None else scales.shape[1], 0 if scales_field is None else scales_field.offset, key, torch)
        self._hidden, self._num_topk, self._num_worst = hidden, num_topk, num_worst_tokens
        self._scales = None if scales is None else (scales.dtype, scales.shape[1])
        self._channels = config.num_channels

    def send(self, key: tuple, x: Any, scales: Any, topk_idx: Any, topk_weights: Any, num_tokens_per_rank: Any,
             is_token_in_rank: Any, num_tokens_per_expert: Any) -> Optional[tuple]:
        """The call with these (unchecked) arguments: DeepEP's ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle)``, or None when the checked path must run it (nothing happened)."""
        seqs = self._start(True)
        if seqs is None:
            return None
        (seq, meta), number = seqs, self.agreement.calls + 1
        status = self.native.begin(key, x, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                   num_tokens_per_expert, number, seq, meta, seq + 1)
        if status == _NOT_TAKEN:
            return None
        self._took(status, number, seq, meta)
        R, T = self.mode.num_ranks, is_token_in_rank.shape[0]
        rows = self._num_worst or self.native.num_recv
        recv_x = empty((rows, self._hidden), x.dtype, x.device)
        recv_scales = None if self._scales is None else torch.empty((rows, self._scales[1]), dtype=self._scales[0])
        topk = self._num_topk
        recv_topk_idx = torch.empty((rows, topk), dtype=torch.int64) if topk else None
        recv_topk_weights = torch.empty((rows, topk), dtype=torch.float32) if topk else None
        recv_src_idx, rank_prefix = torch.empty(rows, dtype=torch.int32), torch.empty((R, R), dtype=torch.int32)
        channel_prefix = torch.empty((R, self._channels), dtype=torch.int32)
        recv_channel_prefix = torch.empty((R, self._channels), dtype=torch.int32)
        send_head = torch.empty((T, R), dtype=torch.int32)
        status = self.native.finish(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, rank_prefix,
                                    channel_prefix, recv_channel_prefix, send_head)
        if status != _OK:
            self._failed(status, number, seq, meta)
        return (recv_x if recv_scales is None else (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
                [] if self._num_worst else self.native.per_expert,
                (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank, send_head))


class PreparedNormalCombine(_PreparedNormal):
    """A normal-mode combine prepared for one signature."""

    op = "combine"

    def __init__(self, mode: NormalMode, pending_posts: list, key: tuple, x: torch.Tensor,
                 topk_weights: Optional[torch.Tensor], config: Config) -> None:
        super().__init__(mode, pending_posts, (Field.HIDDEN, Field.X_DTYPE, Field.NUM_TOPK, Field.HAS_WEIGHTS,
                                               Field.PREFIX_DIGEST) + mode._rings)
        hidden, num_topk = x.shape[1], 0 if topk_weights is None else topk_weights.shape[1]
        specs = [("x", x.dtype, hidden)] + ([("weights", torch.float32, num_topk)] if num_topk else [])
        records = RecordLayout.build(specs)
        fields = {Field.HIDDEN: hidden, Field.X_DTYPE: WireDType.code(x.dtype),
                  Field.NUM_TOPK: -1 if topk_weights is None else num_topk,
                  Field.HAS_WEIGHTS: int(num_topk > 0), **_ring_fields(config)}
        self._header = self.agreement.header(Op.COMBINE, fields, [0] * mode.num_ranks, number=0)
        self._record_bytes, self.native_header_bytes = records.record_bytes, self._header.numel()
        plan, self.mapping = shm_plan(self.transport, self._header, records.record_bytes, self.compare)
        geometry = native().NormalCombineGeometry()
        geometry.hidden, geometry.x_elem, geometry.num_topk = hidden, x.element_size(), num_topk
        geometry.weights_offset = records.field("weights").offset if num_topk else 0
        geometry.dtype = native_dtype(x.dtype)
        geometry.direct = not num_topk and records.record_bytes == hidden * x.element_size()
        geometry.digest_word = int(Field.PREFIX_DIGEST)
        self.native = native().PreparedNormalCombine(plan, geometry, x.dtype, key, torch)
        self._num_topk = num_topk

    def send(self, key: tuple, x: Any, handle: Any, topk_weights: Any, bias0: Any,
             bias1: Any) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The call with these (unchecked) arguments: ``(combined_x, combined_topk_weights)``, or None when the
        checked path must run it (nothing happened)."""
        seqs = self._start(False)
        if seqs is None:
            return None
        seq, number = seqs[0], self.agreement.calls + 1
        status = self.native.begin(key, x, handle, topk_weights, bias0, bias1, number, seq, seq + 1)
        if status == _NOT_TAKEN:
            return None
        self._took(status, number, seq, 0)
        num_tokens = handle[4].shape[0]
        out = empty((num_tokens, x.shape[1]), x.dtype, x.device)
        out_weights = torch.empty((num_tokens, self._num_topk), dtype=torch.float32) if self._num_topk else None
        status = self.native.finish(out, out_weights)
        if status != _OK:
            self._failed(status, number, seq, 0)
        return out, out_weights


def _preparable(mode: NormalMode, internode: bool) -> bool:
    """Whether ``mode``'s calls can be prepared: one node (DeepEP's internode handle is made collectively) on a
    transport that exchanges natively with every rank (shm, one host)."""
    return not internode and mode.transport.prepared_plan(0, 8) is not None


def prepare_normal_dispatch(mode: NormalMode, pending_posts: list, key: tuple, x: torch.Tensor,
                            scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor], num_experts: int,
                            expert_alignment: int, num_worst_tokens: int,
                            config: Config) -> Optional[PreparedNormalDispatch]:
    """A prepared dispatch for this signature (of checked arguments), or None where ``mode`` takes none."""
    if not _preparable(mode, mode.topology.internode):
        return None
    return PreparedNormalDispatch(mode, pending_posts, key, x, scales, topk_idx, num_experts, expert_alignment,
                                  num_worst_tokens, config)


def prepare_normal_combine(mode: NormalMode, pending_posts: list, key: tuple, x: torch.Tensor,
                           topk_weights: Optional[torch.Tensor], config: Config) -> Optional[PreparedNormalCombine]:
    """A prepared combine for this signature (of checked arguments), or None where ``mode`` takes none."""
    if not _preparable(mode, mode.topology.internode):
        return None
    return PreparedNormalCombine(mode, pending_posts, key, x, topk_weights, config)
