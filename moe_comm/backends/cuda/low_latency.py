"""Low-latency mode on the CUDA kernels (``csrc/cuda/kernels/low_latency.h``): the portable backend's
double buffering (``portable.low_latency.LowLatencyMode``), the kernels' send and receive launches.

    dispatch:  send launch: top-k checks -> this call's header to every rank -> FP8 cast -> slots into
               peers' halves -> count signals (each carrying the call number)
               ...  receive (the hook, or at once): every rank's header judged -> counts -> rows by source
    combine:   send launch: checks -> header -> rows back to their sources -> flags
               ...  receive: headers judged -> flags -> weighted fixed-order sum

Every build agrees in the data path (``moe_comm._cuda_host`` for the ``cuda_host`` backend; the device
builds ``moe_comm._cuda`` and ``moe_comm._cuda_nvshmem`` through ``device_kernels.DeviceKernels``): the
send half waits for no peer (only, as flow control, for each peer to have received call n - 2), and
the Python path reads no tensor data: the top-k checks run in the send launch, the verdict in the
receive launch, and the kernels count the call number in the buffer (so a CUDA graph's replays advance
it). When the kernels find the headers unlike, this module reads them from its own buffer and raises
``CallAgreement.judge``'s verdict, the same on every rank. A shrinking Buffer (``enable_shrink``) agrees
on the host first (the portable mode's handshake), then launches. Call n uses buffer half (n - 1) % 2
on every rank; outputs are bitwise the portable backend's. What ran on a GPU: see docs/status.md.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from ...core.errors import CrossRankMismatchError
from ...core.memory import empty
from ...ops.fp8 import GROUP
from ...protocol.agreement import CallAgreement, mark_agreed
from ...protocol.call_header import compare_mask, decode, header_bytes, messages
from ...protocol.codes import UNKNOWN, Field, Fp8Format, Op
from ...protocol.handle import LowLatencyHandle
from ...protocol.low_latency_layout import add_stats, dispatch_outputs
from ...transport import Transport
from ..base import LowLatencyDispatch, Receive
from ..portable.low_latency import LowLatencyMode
from .host_stream import HostStream
from .kernel_errors import HeadersDisagree
from .pins import Pins
from .shared_buffers import SharedBuffers

__all__ = ["KernelLowLatencyMode"]

#: the header words every rank's must hold alike, per operation (the call and the operation first)
_DISPATCH_COMPARED = (Field.HIDDEN, Field.NUM_EXPERTS, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK, Field.FP8_FORMAT)
_COMBINE_COMPARED = (Field.HIDDEN, Field.NUM_EXPERTS, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK, Field.USE_LOGFMT)
#: header words that size the kernels' layout: ranks that disagree on them write at other offsets
_SIZES = (Field.HIDDEN, Field.NUM_EXPERTS, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK)
#: the operations whose headers the kernels carry (a header with another came from a handshake)
_LOW_LATENCY_OPS = (Op.LOW_LATENCY_DISPATCH, Op.LOW_LATENCY_COMBINE)
#: a launch's ``post`` with no header: the host agreed first
_NO_POST = (0, 0, 0, 0, 0)


def reserved_bytes(num_rdma_bytes: int) -> int:
    """The halves' bytes mapped for a Buffer of ``num_rdma_bytes``: the kernels' layout takes at most
    1/32 more than DeepEP's for the same call, plus alignment (checked against DeepEP's size hint over
    ranks 1-64, hidden 128-16384, M 1-1024 in tests/backends/test_cuda_host.py), so a call that passes
    ``check_rdma_bytes`` fits."""
    return num_rdma_bytes + num_rdma_bytes // 32 + (64 << 10)


def _holds_hooked(slot: Any) -> bool:
    """Whether a buffer half holds a result whose receive hook has not run yet."""
    return slot.receive is not None and not slot.receive.done and slot.hook


class KernelLowLatencyMode(LowLatencyMode):
    """Low-latency operations of one Buffer on the kernels of ``kernels`` (moe_comm._cuda_host, or the
    device build's adapter ``device_kernels.DeviceKernels``)."""

    def __init__(self, transport: Transport, agreement: CallAgreement, kernels: Any,
                 buffers: SharedBuffers, stream: HostStream, timeout_s: float, node_ranks: int = 0,
                 device: torch.device = torch.device("cpu")) -> None:
        #: the launches post and judge call headers once ``reserve`` mapped their buffers (a
        #: low_latency_mode Buffer that does not shrink); else the handshake comes first
        self.agrees_in_data_path = False
        super().__init__(transport, agreement)
        self.kernels, self.buffers, self.stream, self.timeout_s = kernels, buffers, stream, timeout_s
        self.device = device  # where the calls' tensors live (the outputs of a prepared call, ``prepared.py``)
        #: > 0: the ranks form nodes of this many, and the kernels reach other nodes' ranks as NVSHMEM
        #: does, putting from this rank's staging (the host build; its buffers are laid out for it)
        self.node_ranks = node_ranks
        self._calls = 0  # low-latency calls so far, rejected ones included: the next is number _calls + 1
        #: per half, header posts waiting for the hooked result the half holds (``_post_header_only``)
        self._after: list[list[Callable[[], None]]] = [[], []]
        self._width = agreement.vector_len
        room = kernels.low_latency_header_bytes(self.num_ranks)
        if header_bytes(self._width) > room:
            raise AssertionError(f"a call header of {header_bytes(self._width)} bytes outgrows the kernels' "
                                 f"{room}-byte cells (csrc/cuda/kernels/buffer_layout.h)")
        self._control = kernels.low_latency_control_bytes(self.num_ranks)

    def reserve(self, num_rdma_bytes: int) -> None:
        """Maps the buffers every call of a Buffer of ``num_rdma_bytes`` may use (collective; at
        construction), at most the buffers' ``limit()`` (the host's shared memory for the host build).
        With headers no call may grow them: a growth meets every rank, and ranks that disagree on sizes
        would grow apart. From here on, every handshake of the Buffer is announced in the header cells
        (``_announce``). Shrinking buffers (``enable_shrink``) keep the handshake first and grow on
        demand."""
        if self.agreement.shrink:
            return  # a shrinking buffer masks late ranks in its handshake: that comes first
        want, limit = self._control + reserved_bytes(num_rdma_bytes), self.buffers.limit()
        # a huge num_rdma_bytes is then a call's error (``_launcher``), the same on every rank
        self.buffers.ensure(max(self._control, want if limit is None else min(want, limit)))
        self.agrees_in_data_path = True
        for op in ("low_latency_dispatch", "low_latency_combine"):
            self.agreement.rejecters[op] = self._reject
        self.agreement.announcers.append(self._announce)

    def _launcher(self, local: int, m: int, hidden: int, skip: frozenset[int]) -> Any:
        need = self.kernels.low_latency_bytes(self.num_ranks, local, m, hidden)
        if need > self.buffers.nbytes and self.agrees_in_data_path:  # a rejection: every rank fails the call
            raise ValueError(f"this call's low-latency buffers take {need} bytes here, more than the "
                             f"{self.buffers.nbytes} mapped for num_rdma_bytes at construction; create the Buffer "
                             f"with a larger num_rdma_bytes (Buffer.get_low_latency_rdma_size_hint)")
        if need > self.buffers.nbytes:  # the first call of a larger shape meets its peers here
            self.stream.synchronize()  # no launch may run on buffers being replaced
            self.buffers.ensure(need, skip)
        unmapped = self.buffers.unmapped(skip)
        if unmapped:  # mapped while those ranks were masked; a kernel would write through address 0
            raise RuntimeError(f"low-latency call: ranks {unmapped} were masked when this rank's buffers were mapped "
                               f"and are not masked now; a rank masked while alive cannot rejoin this Buffer")
        return self.kernels.LowLatency(self.buffers.peers(range(self.num_ranks)), self.buffers.pids, self.rank,
                                       self.timeout_s, local, m, hidden, self.node_ranks)

    def _skip_mask(self, skip: frozenset[int], device: torch.device) -> torch.Tensor:
        """``[R]`` uint8 on ``device``: 1 for the ranks this call leaves out."""
        mask = torch.zeros(self.num_ranks, dtype=torch.uint8, device=device)
        if skip:  # (an index list would be a host-to-device copy, which a CUDA graph capture refuses)
            mask[list(skip)] = 1
        return mask

    def _next_call(self) -> int:
        self._calls += 1
        assert (self._calls - 1) & 1 == self._idx, "low-latency calls and buffer halves moved apart"
        return self._calls

    # ------------------------------------------------------------------ call headers
    def _post(self, pin: Pins, header: torch.Tensor, compare: tuple[Field, ...]) -> tuple[int, int, int, int, int]:
        """A launch's ``post`` argument for ``header`` (``call_header``): the words to compare, the
        rejected bit's and the message's places."""
        return pin(header), header.numel(), int(Field.REJECTED), 8 * self._width, compare_mask(compare)

    def _receive(self, op: str, kernel: Any, call: int, skip: frozenset[int], compare: tuple[Field, ...],
                 launch: Callable[[], Any]) -> None:
        """Runs a receive launch; when its kernel found the call's headers unlike, raises the verdict.
        Then the posts that waited for this half (``_received``)."""
        try:
            self.stream.run(op, launch)
        except HeadersDisagree as disagree:
            self._verdict(op, kernel, call, skip, compare, disagree)
        finally:
            if self.agreement.broken is None:
                self._received((call - 1) & 1)

    def _verdict(self, op: str, kernel: Any, call: int, skip: frozenset[int], compare: tuple[Field, ...],
                 disagree: HeadersDisagree) -> None:
        """Reads every rank's header of ``call`` from this rank's buffer and raises the verdict: this
        rank's own rejection (its top-k, found by its send) as the ValueError it would have raised on the
        host, else ``CallAgreement.judge``'s error. When ranks disagreed on sizes, first clears the
        halves with every rank (``_resync``)."""
        R, half, nbytes = self.num_ranks, (call - 1) & 1, header_bytes(self._width)
        offsets = kernel.header_offsets
        headers = torch.stack([self.buffers.own(offsets[half * R + s], nbytes) for s in range(R)]).clone()
        for s in skip:  # a masked rank posts nothing: this rank's header stands in, sending and expecting no row
            headers[s] = headers[self.rank]
            words = headers[s, :8 * self._width].view(torch.int64)
            words[len(Field):len(Field) + 2 * R] = 0
            words[len(Field) + 2 * R:] = UNKNOWN
        vectors = decode(headers, self._width)
        if any(v[Field.OP] not in _LOW_LATENCY_OPS for v in vectors):  # a peer runs a handshake instead
            self.agreement.meet(op, headers[self.rank], (Field.OP,) + compare)
        if vectors[self.rank][Field.REJECTED]:
            raise mark_agreed(ValueError(messages(headers, self._width, [self.rank])[0]))
        try:
            self.agreement.judge(op, headers, (Field.OP,) + compare)
        except CrossRankMismatchError:
            rejected = any(v[Field.REJECTED] for v in vectors)
            if not rejected and any(len({v[f] for v in vectors}) > 1 for f in _SIZES):
                self._resync(op, skip, vectors)
            raise
        # This call's headers agree: the record is older, from a call that a CUDA graph replayed (no
        # host read its record then). Every rank's kernels judged that call's headers alike, so every
        # rank raises here, at its next eager receive; the record is cleared, the buffer goes on.
        raise mark_agreed(CrossRankMismatchError(
            f"{op}: a low-latency call replayed from a CUDA graph before this one disagreed across ranks "
            f"({disagree}); this call (number {call} here) was not run"))

    def _resync(self, op: str, skip: frozenset[int], vectors: list[list[int]]) -> None:
        """After a call whose ranks disagreed on sizes (so they wrote rows and signals at each other's
        other offsets; ``vectors``: every rank's header): every rank meets, clears its halves as far as
        the largest layout reached, meets again. Every rank reaches this in its receive of the call, after
        its own send of it (stream order)."""
        R = self.num_ranks
        end = max(self.kernels.low_latency_bytes(R, max(v[Field.NUM_EXPERTS] // R, 1),
                                                 max(v[Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK], 1),
                                                 max(v[Field.HIDDEN], 1)) for v in vectors)
        self.transport.barrier(op=op, skip=skip)
        self.buffers.zero_own(self._control, min(end, self.buffers.nbytes))
        self.transport.barrier(op=op, skip=skip)

    def _reject(self, op: str, number: int, message: str) -> None:
        """Call ``number`` of ``op`` rejected here on the host, before its launch: its header, with the
        rejected bit and ``message``, goes to every rank (no rows), which fail it alike."""
        self._post_header_only(op, self.agreement.rejection_header(Op.of_method(op), number, message))

    def _announce(self, op: str, code: Op) -> None:
        """A handshake of another operation is about to run here: its header takes this low-latency
        call's place, so peers that called a low-latency operation instead find the difference and join
        the handshake (``CallAgreement.meet``). Not while the half it would take holds a result whose
        hook has not run: that half is not free (every rank that runs the same calls skips alike)."""
        if _holds_hooked(self._slots[self._idx]):
            return
        self._post_header_only(op, self.agreement.header(code, {}, [0] * self.num_ranks))

    def _post_header_only(self, op: str, header: torch.Tensor) -> None:
        """Posts ``header`` as this rank's next low-latency call, with no rows, and frees its half here
        (this rank receives nothing of that call). When that half still holds a result whose hook has not
        run, the post waits for that receive (``_after``): until then the half is not free, here or, as
        flow control, at peers that run the same calls."""
        pin, skip = Pins(), self.skip()
        # any sizes: the header cells sit where the rank count alone puts them
        kernel = self._launcher(1, 1, GROUP, skip)
        slot = self._slots[self._idx]
        waits = _holds_hooked(slot)
        if not waits:
            self._settle(op, slot)  # an async result there completes first, as a call's would
        call = self._next_call()

        def post() -> None:
            self.stream.run(op, lambda: pin.launch(kernel.reject, call, pin(self._skip_mask(skip, header.device)),
                                                   self._post(pin, header, ())))

        if waits:
            self._after[self._idx].append(post)
        else:
            post()
        self._idx ^= 1  # the peers' calls took a buffer half too
        self._lent = None

    def _received(self, half: int) -> None:
        """After a receive of ``half``: the posts that waited for it (``_post_header_only``)."""
        waiting, self._after[half] = self._after[half], []
        for post in waiting:
            post()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int, fp8_format: Fp8Format,
                 recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 hook: bool) -> LowLatencyDispatch:
        """Checked ``low_latency_dispatch`` (see ``Buffer``; with headers, the top-k values are checked by
        the send launch); returns outputs filled by ``receive``."""
        op = "low_latency_dispatch"
        R, hidden, pin = self.num_ranks, x.shape[1], Pins()
        local = num_experts // R
        slot = self._acquire(op)
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m,
                  Field.FP8_FORMAT: fp8_format}
        if self.agrees_in_data_path:
            skip, waited = self.skip(), 0
            kernel = self._launcher(local, m, hidden, skip)
            post = self._post(pin, self.agreement.header(Op.LOW_LATENCY_DISPATCH, fields, [0] * R), _DISPATCH_COMPARED)
        else:
            shake, _, _, waited = self.agree_dispatch(x, topk_idx, m, num_experts, fp8_format, self.skip())
            skip, post = shake.skip, _NO_POST
            kernel = self._launcher(local, m, hidden, skip)
        call = self._next_call()
        fp8 = fp8_format is not Fp8Format.BF16
        num_scales = (hidden // GROUP // (4 if fp8_format.ue8m0 else 1)) if fp8 else 0
        scales = (torch.int32 if fp8_format.ue8m0 else torch.float32, num_scales) if fp8 else None
        recv_x, recv_scales, src_info, layout_range, recv_count = dispatch_outputs(local, R, m, hidden, scales,
                                                                                   x.device)
        mask, routable = self._skip_mask(skip, x.device), self._routable(topk_idx, num_experts, skip).to(torch.int64)
        args = (call, pin(mask), x.shape[0], 4 * num_scales, topk_idx.shape[1], fp8, fp8_format.round_scale,
                fp8_format.ue8m0, pin(x.contiguous()), pin(routable.contiguous()), pin(recv_x),
                # recv_scales is the transposed view of an [E_loc, S, R * M] allocation: its storage
                pin(None if recv_scales is None else recv_scales.transpose(1, 2)), pin(src_info), pin(layout_range),
                pin(recv_count), post)
        self.stream.submit(op, lambda: pin.launch(kernel.dispatch, False, *args))

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            self._receive(op, kernel, call, skip, _DISPATCH_COMPARED,
                          lambda: pin.launch(kernel.dispatch, True, *args))
            add_stats(recv_stats, recv_count, wait_stats, waited + time.perf_counter_ns() - begin)

        receive = self._launch(slot, op, finish, hook)
        handle = LowLatencyHandle(src_info, layout_range, m, hidden, num_experts)
        return LowLatencyDispatch(recv_x, recv_scales, recv_count, handle, receive)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                zero_copy: bool, out: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                hook: bool, use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        """Checked ``low_latency_combine`` (see ``Buffer``); returns (out, receive that fills it). With
        ``use_logfmt`` the kernels encode each row to LogFMT-10 and decode it in the sum (the bits of the
        portable mode's)."""
        op = "low_latency_combine"
        local, _, hidden = x.shape
        pin = Pins()
        slot = self._acquire(op, zero_copy)
        if self.agrees_in_data_path:
            skip, waited = self.skip(), 0
            if skip:  # nothing goes back to masked sources
                layout_range = handle.layout_range.clone()
                layout_range[:, list(skip)] = 0
                handle = dataclasses.replace(handle, layout_range=layout_range)
            kernel = self._launcher(local, handle.num_max_dispatch_tokens_per_rank, hidden, skip)
            fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: handle.num_experts,
                      Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: handle.num_max_dispatch_tokens_per_rank,
                      Field.USE_LOGFMT: int(use_logfmt)}
            post = self._post(pin, self.agreement.header(Op.LOW_LATENCY_COMBINE, fields, [0] * self.num_ranks),
                              _COMBINE_COMPARED)
        else:
            shake, _, handle, waited = self.agree_combine(x, topk_idx, handle, self.skip(), use_logfmt)
            skip, post = shake.skip, _NO_POST
            kernel = self._launcher(local, handle.num_max_dispatch_tokens_per_rank, hidden, skip)
        call = self._next_call()
        source = slot.combine_buffer[:x.numel() * 2].view(torch.bfloat16).view(x.shape) if zero_copy else x
        num_tokens, num_topk = topk_idx.shape
        if out is None:
            out = empty((num_tokens, hidden), torch.bfloat16, x.device)
        routable = self._routable(topk_idx, handle.num_experts, skip).to(torch.int64)
        args = (call, pin(self._skip_mask(skip, x.device)), num_tokens, num_topk, pin(source.contiguous()),
                pin(handle.src_info.contiguous()), pin(handle.layout_range.contiguous()), pin(routable.contiguous()),
                pin(topk_weights.to(torch.float32).contiguous()), pin(out), use_logfmt, post)
        self.stream.submit(op, lambda: pin.launch(kernel.combine, False, *args))

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            self._receive(op, kernel, call, skip, _COMBINE_COMPARED, lambda: pin.launch(kernel.combine, True, *args))
            add_stats(None, None, wait_stats, waited + time.perf_counter_ns() - begin)

        return out, self._launch(slot, op, finish, hook)

    # ------------------------------------------------------------------ clean
    def clean(self, m: int, hidden: int, num_experts: int, device: torch.device) -> None:
        """DeepEP's ``clean_low_latency_buffer``: pending results settled, then (without headers) this
        rank's signals and flags zeroed (before the portable mode's barrier, so no peer writes one first),
        then the barrier."""
        for slot in self._slots:
            self._settle("clean_low_latency_buffer", slot)
        self.stream.synchronize()
        if not self.agrees_in_data_path:  # with headers every signal carries its call: none is stale
            self.buffers.zero_own()
        super().clean(m, hidden, num_experts, device)
