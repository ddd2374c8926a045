"""Low-latency calls with a late rank, run inside ranks: the agreement travels with the data, so the
send half returns at once and the receive judges every rank's header."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from helpers.ll_hook_cases import E, H, T, _bits, _inputs, _raises
from helpers.low_latency_cases import ll_buffer


def _combine_input(rank: int, recv_x: Any) -> torch.Tensor:
    shape = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape
    torch.manual_seed(1000 + rank)
    return torch.randn(shape).to(torch.bfloat16)


@dataclass
class _Reference:
    """A low-latency buffer, this rank's inputs, and a blocking dispatch + combine's outputs on them."""

    buf: Any
    experts: int
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    recv_x: Any
    count: torch.Tensor
    out: torch.Tensor

    def equal(self, recv_x: Any, count: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether another dispatch + combine gave these outputs, bitwise."""
        return (all(torch.equal(p, q) for p, q in zip(_bits(recv_x), _bits(self.recv_x)))
                and torch.equal(count, self.count) and torch.equal(out.view(torch.int16), self.out.view(torch.int16)))


def _reference(group: dist.ProcessGroup, seed: int, use_fp8: bool) -> _Reference:
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    experts = E * R
    buf = ll_buffer(group, T, H, experts)
    x, idx, w = _inputs(rank, seed)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8)
    y = _combine_input(rank, recv_x)
    out = buf.low_latency_combine(y, idx, w, handle)[0].clone()
    return _Reference(buf, experts, x, idx, w, y, recv_x, count, out)


#: The calls of ``late_rank`` whose send halves it times.
SEND_HALVES = ("dispatch", "combine", "mismatch")


def _sent(out: dict[str, Any], call: str, start: float) -> None:
    """Records when this rank's send half of ``call`` began and ended, on the host's monotonic clock."""
    out[f"{call}_send"] = (start, time.monotonic())


def send_halves_that_waited(results: list[dict[str, Any]]) -> list[tuple[int, str, float]]:
    """The punctual ranks' send halves (of ``late_rank``'s results) that returned only after the late rank
    (the last) began the same call, as (rank, call, seconds they took).

    The ranks share one host and so one CLOCK_MONOTONIC, which makes this an order, not a duration: a send
    half that waits for the late rank cannot return before that rank has even called, however late the
    machine runs it. One that does not wait is found here only if its rank stalled, from the barrier to
    its return, for the whole delay; a bound on its duration alone (half the delay) failed once beside two
    busy loops, at 1.26 s against 1.0, where the send halves take milliseconds."""
    late = results[-1]
    return [(r["rank"], call, r[f"{call}_send"][1] - r[f"{call}_send"][0])
            for r in results[:-1] for call in SEND_HALVES
            if r[f"{call}_send"][1] >= late[f"{call}_send"][0]]


def late_rank(group: dist.ProcessGroup, late_s: float, use_fp8: bool) -> dict[str, Any]:
    """The last rank calls each send half ``late_s`` late: a correct dispatch + combine, then a
    dispatch with another hidden size, then a correct call again. Returns the others' send-half
    times, whether hooked outputs equal the blocking form's, and every rank's error."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    ref = _reference(group, 7, use_fp8)
    buf, experts, x, idx, w, y = ref.buf, ref.experts, ref.x, ref.idx, ref.w, ref.y
    late = rank == R - 1
    out: dict[str, Any] = {"rank": rank}

    dist.barrier(group)
    if late:
        time.sleep(late_s)
    start = time.monotonic()
    got_x, got_count, got_handle, _, hook = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8,
                                                                     return_recv_hook=True)
    _sent(out, "dispatch", start)
    hook()
    dist.barrier(group)
    if late:
        time.sleep(late_s)
    start = time.monotonic()
    got_out, _, hook = buf.low_latency_combine(y, idx, w, got_handle, return_recv_hook=True)
    _sent(out, "combine", start)
    hook()
    out["equal"] = ref.equal(got_x, got_count, got_out)

    dist.barrier(group)
    if late:
        time.sleep(late_s)
        x_odd = torch.randn(x.shape[0], H // 2).to(torch.bfloat16)
        start = time.monotonic()
        hook = buf.low_latency_dispatch(x_odd, idx, T, experts, use_fp8=use_fp8, return_recv_hook=True)[4]
    else:
        start = time.monotonic()
        hook = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8, return_recv_hook=True)[4]
    _sent(out, "mismatch", start)
    out["mismatch"] = _raises(hook)

    again = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8)[0]
    out["next_call_equal"] = all(torch.equal(p, q) for p, q in zip(_bits(again), _bits(ref.recv_x)))
    dist.barrier(group)
    buf.destroy()
    return out


def silent_rank(group: dist.ProcessGroup, timeout_s: float) -> dict[str, Any]:
    """The last rank never makes a low-latency dispatch that the others make (hooked): their hooks
    raise CommTimeoutError naming it and the call it last sent; a new Buffer then works on every rank."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    experts = E * R
    x, idx, _ = _inputs(rank, 9)
    buf = ll_buffer(group, T, H, experts, timeout_s=timeout_s)
    ref = _bits(buf.low_latency_dispatch(x, idx, T, experts)[0])
    out: dict[str, Any] = {"rank": rank}
    if rank != R - 1:
        start = time.monotonic()
        hook = buf.low_latency_dispatch(x, idx, T, experts, return_recv_hook=True)[4]
        out["send_s"] = time.monotonic() - start
        start = time.monotonic()
        out["error"] = _raises(hook)
        out["error_s"] = time.monotonic() - start
        out["after"] = _raises(lambda: buf.low_latency_dispatch(x, idx, T, experts))
    dist.barrier(group)
    buf.destroy()
    fresh = ll_buffer(group, T, H, experts)
    out["fresh_equal"] = all(torch.equal(p, q) for p, q in zip(_bits(fresh.low_latency_dispatch(x, idx, T, experts)[0]),
                                                                ref))
    dist.barrier(group)
    fresh.destroy()
    return out


def _stop_before_rows(buf: Any) -> None:
    """Makes this process stop (SIGSTOP) inside its next low-latency call, after its headers went and before
    its rows do. Why there and not after the call returns: on ``collective`` a thread of the transport moves
    the headers and rows, and it could finish both before the caller stopped, so nobody would wait."""
    transport = buf.runtime.transport
    posted_all_to_all = transport.posted_all_to_all

    def stop_first(*args: Any, **kw: Any) -> Any:
        transport.posted_all_to_all = posted_all_to_all
        os.kill(os.getpid(), signal.SIGSTOP)
        return posted_all_to_all(*args, **kw)

    transport.posted_all_to_all = stop_first


def stopped_mid_call(group: dist.ProcessGroup, timeout_s: float) -> dict[str, Any]:
    """The last rank posts a hooked low-latency dispatch, then stops (SIGSTOP) inside the call; the
    others' hooks fail at their deadline naming it; then rank 0 continues it."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    experts = E * R
    pids = [None] * R
    dist.all_gather_object(pids, os.getpid(), group=group)
    x, idx, _ = _inputs(rank, 11)
    buf = ll_buffer(group, T, H, experts, timeout_s=timeout_s)
    buf.low_latency_dispatch(x, idx, T, experts)
    out: dict[str, Any] = {"rank": rank}
    if rank == R - 1:
        _stop_before_rows(buf)
    hook = buf.low_latency_dispatch(x, idx, T, experts, return_recv_hook=True)[4]
    out["error"] = _raises(hook)
    if rank != R - 1:
        # the stopped rank is continued once every punctual rank has raised: a rank still inside its
        # deadline's handling would otherwise find it running and could not name it as stopped
        store = dist.distributed_c10d._get_default_store()
        store.add("stopped_mid_call_raised", 1)
        if rank == 0:
            while store.add("stopped_mid_call_raised", 0) < R - 1:
                time.sleep(0.01)
            os.kill(pids[R - 1], signal.SIGCONT)
    buf.destroy()
    return out


#: what reads a tensor's values on the host (a GPU sync, which a CUDA graph cannot capture)
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero")


def reads_no_tensor_data(group: dist.ProcessGroup, use_fp8: bool) -> dict[str, Any]:
    """After a first call (which maps nothing new), a hooked low-latency dispatch + hook + hooked
    combine + hook with every host read of tensor data (``HOST_READS``) raising, in every thread of
    this process; their outputs against the same calls made normally. Returns what the guarded calls
    raised ("" when nothing) and whether the outputs were equal."""
    ref = _reference(group, 13, use_fp8)
    buf, experts, x, idx, w, y = ref.buf, ref.experts, ref.x, ref.idx, ref.w, ref.y
    dist.barrier(group)

    def refuse(name: str) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"Tensor.{name}: a host read of tensor data inside a low-latency call")
        return read

    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    out: dict[str, Any] = {"rank": dist.get_rank(group), "raised": ""}
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, refuse(name))
        got_x, got_count, got_handle, _, hook = buf.low_latency_dispatch(x, idx, T, experts, use_fp8=use_fp8,
                                                                         return_recv_hook=True)
        hook()
        got_out, _, hook = buf.low_latency_combine(y, idx, w, got_handle, return_recv_hook=True)
        hook()
    except Exception as exc:  # reported (the test checks it), then the buffer is not used again
        out["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    if not out["raised"]:
        out["equal"] = ref.equal(got_x, got_count, got_out)
    dist.barrier(group)
    buf.destroy()
    return out
