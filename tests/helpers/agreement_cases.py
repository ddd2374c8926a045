"""The call agreement inside ranks: one-sided rejections, tampered handles, calls after a failure,
ranks found on different calls."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_comm

from helpers.deadlines import found_within
from helpers.fuzz_cases import LL_E, Ctx, H, M, _buffers, _check_low_latency, _check_normal, make_inputs


def _ctx(group: dist.ProcessGroup, timeout_s: float = 20.0) -> Ctx:
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    normal, ll = _buffers(group, timeout_s)
    c = Ctx(normal, ll, rank, num_ranks, *make_inputs(rank, num_ranks, 5), __import__("random").Random(3))
    _check_normal(c, 5)
    _check_low_latency(c, 5, hook=False)
    return c


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # the test compares across ranks
        return type(exc).__name__, str(exc)
    return "no exception", ""


def _left_hook(c: Ctx) -> Any:
    """Two hooked low-latency dispatches whose hooks are not called yet: the next call must refuse."""
    c.extra["hooks"] = [c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False, return_recv_hook=True)[4]
                        for _ in range(2)]
    return c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False)


# name -> (the call the rejecting rank makes, the correct call of the others)
REJECTIONS: dict[str, tuple[Callable[[Ctx], Any], Callable[[Ctx], Any]]] = {
    "dispatch_dtype": (lambda c: c.normal.dispatch(c.x, topk_idx=c.idx.int(), topk_weights=c.w, num_experts=12),
                       lambda c: c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12)),
    "dispatch_signature": (lambda c: c.normal.dispatch(c.x, bogus=1),
                           lambda c: c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12)),
    "dispatch_worst_huge": (lambda c: c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12,
                                                        num_worst_tokens=2**40),
                            lambda c: c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12)),
    "combine_send_head": (lambda c: c.normal.combine(c.recv_x, c.handle[:5] + (c.handle[5] + 2**30,)),
                          lambda c: c.normal.combine(c.recv_x, c.handle)),
    "ll_hidden": (lambda c: c.ll.low_latency_dispatch(torch.zeros(2, 200, dtype=torch.bfloat16), c.ll_idx[:2], M,
                                                      LL_E),
                  lambda c: c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False)),
    "ll_hooks_left": (_left_hook, lambda c: c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False)),
    "llc_begins": (lambda c: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, (c.ll_handle[0],
                                                      c.ll_handle[1] + (1 << 32)) + c.ll_handle[2:]),
                   lambda c: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, c.ll_handle)),
    "clean_experts": (lambda c: c.ll.clean_low_latency_buffer(M, H, LL_E + 1),
                      lambda c: c.ll.clean_low_latency_buffer(M, H, LL_E)),
}


def one_sided_rejection(group: dist.ProcessGroup, name: str, rejecter: int) -> dict[str, Any]:
    """Rank ``rejecter`` rejects its arguments, the others call correctly; then everyone calls
    correctly again (checked bitwise inside). Returns what this rank raised and how many calls its
    buffer has numbered."""
    c = _ctx(group)
    bad, good = REJECTIONS[name]
    if name == "ll_hooks_left" and c.rank != rejecter:
        for _ in range(2):  # the same two calls, whose hooks these ranks do call
            c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False, return_recv_hook=True)[4]()
    kind, message = _outcome(lambda: bad(c) if c.rank == rejecter else good(c))
    for hook in c.extra.get("hooks", []):  # the rejecter's two results are still valid: receive them
        hook()
    _check_normal(c, 6)
    _check_low_latency(c, 6, hook=True)
    return dict(kind=kind, message=message, calls=c.normal.runtime.agreement.calls)


TAMPERS: dict[str, Callable[[Ctx], Any]] = {
    "send_head_huge": lambda c: c.normal.combine(c.recv_x, c.handle[:5] + (torch.where(
        c.handle[5] >= 0, c.handle[5] + 2**30, c.handle[5]),)),
    "send_head_plus_one": lambda c: c.normal.combine(c.recv_x, c.handle[:5] + (torch.where(
        c.handle[5] >= 0, c.handle[5] + 1, c.handle[5]),)),
    "send_head_minus_one": lambda c: c.normal.combine(c.recv_x, c.handle[:5] + (torch.where(
        c.handle[5] > 0, c.handle[5] - 1, c.handle[5]),)),
    "prefix_changed": lambda c: c.normal.combine(c.recv_x, (c.handle[0] + torch.eye(
        c.num_ranks, dtype=torch.int32),) + c.handle[1:]),
    "src_idx_changed": lambda c: c.normal.combine(c.recv_x, c.handle[:3] + (c.handle[3].flip(0),) + c.handle[4:]),
    "src_idx_cached": lambda c: c.normal.dispatch(c.x, handle=c.handle[:3] + (c.handle[3].flip(0),) + c.handle[4:]),
    "ll_begin_shifted": lambda c: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, (
        c.ll_handle[0], c.ll_handle[1] + (1 << 32)) + c.ll_handle[2:]),
    "ll_count_moved": lambda c: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, (
        c.ll_handle[0], _moved_count(c.ll_handle[1])) + c.ll_handle[2:]),
    "ll_src_info_changed": lambda c: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, (
        _moved_token(c.ll_handle[0]), c.ll_handle[1]) + c.ll_handle[2:]),
}


def _moved_count(layout_range: torch.Tensor) -> torch.Tensor:
    """One row of source 0 moved from local expert 0 to local expert 1 (the source's total kept,
    blocks still contiguous: only the peer can tell)."""
    counts = layout_range & 0xFFFFFFFF
    counts[0, 0] -= 1
    counts[1, 0] += 1
    return (counts.cumsum(1) - counts) << 32 | counts


def _moved_token(src_info: torch.Tensor) -> torch.Tensor:
    src_info = src_info.clone()
    src_info[0, 0] += 1  # local expert 0 has a row from every rank
    return src_info


def tampered_handle(group: dist.ProcessGroup, name: str) -> dict[str, Any]:
    """Rank 0 passes a tampered handle, the others the right one; then a correct call (checked bitwise)."""
    c = _ctx(group)
    good = {"src_idx_cached": lambda: c.normal.dispatch(c.x, handle=c.handle)}.get(name)
    if good is None:
        good = (lambda: c.normal.combine(c.recv_x, c.handle)) if not name.startswith("ll_") else \
            (lambda: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, c.ll_handle))
    kind, message = _outcome(lambda: TAMPERS[name](c) if c.rank == 0 else good())
    _check_normal(c, 7)
    _check_low_latency(c, 7, hook=False)
    return dict(kind=kind, message=message)


def calls_after_timeout(group: dist.ProcessGroup, timeout_s: float) -> dict[str, Any]:
    """The last rank skips a dispatch and a low-latency dispatch. The others time out in both; then
    every call of theirs, and the hook and event they had pending from before, is refused at once."""
    c = _ctx(group, timeout_s)
    hook = c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False, return_recv_hook=True)[4]
    event = c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12, async_finish=True)[5]
    normal = lambda: c.normal.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=12)  # noqa: E731
    low_latency = lambda: c.ll.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False)  # noqa: E731
    result: dict[str, Any] = {}
    if c.rank == c.num_ranks - 1:
        event.current_stream_wait()
        hook()
        time.sleep(found_within(2 * timeout_s))  # the others time out in both calls meanwhile
        result["first"] = _outcome(normal)
        return result
    start = time.monotonic()
    result["first"] = _outcome(normal)
    result["first_ll"] = _outcome(low_latency)
    result["first_s"] = time.monotonic() - start
    later = {
        "dispatch": normal,
        "combine": lambda: c.normal.combine(c.recv_x, c.handle),
        "layout": lambda: c.normal.get_dispatch_layout(c.idx, 12),
        "event": event.current_stream_wait,  # pending since before the timeout
        "low_latency_dispatch": low_latency,
        "low_latency_combine": lambda: c.ll.low_latency_combine(c.ll_recv, c.ll_idx, c.ll_w, c.ll_handle),
        "hook": hook,  # pending since before the timeout
        "combine_buffer": lambda: c.ll.get_next_low_latency_combine_buffer(c.ll_handle),
        "clean": lambda: c.ll.clean_low_latency_buffer(M, H, LL_E),
    }
    start = time.monotonic()
    result["later"] = {name: _outcome(call) for name, call in later.items()}
    result["later_s"] = time.monotonic() - start
    return result


def skipped_call(group: dist.ProcessGroup, shrink: bool) -> tuple[tuple[str, str], tuple[str, str]]:
    """A planted fault: rank 2's buffer counts two calls that the others never made (as if it had
    failed them alone, unseen), then every rank makes the same low-latency calls: (first outcome,
    second outcome). The handshake finds rank 2 on another call, which every rank reports."""
    c = _ctx(group)
    buf = moe_comm.Buffer(group, low_latency_mode=True, enable_shrink=shrink, timeout_s=10,
                          num_rdma_bytes=c.ll.num_rdma_bytes)
    buf.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False)
    if c.rank == 2:
        buf.runtime.agreement.calls += 2
    first = _outcome(lambda: buf.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False))
    second = _outcome(lambda: buf.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E, use_fp8=False))
    return first, second
