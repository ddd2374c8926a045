"""async_finish inside ranks: calls that return while a delayed peer's payload is still on its way,
several exchanges in flight, completed by their events."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """40 tokens of hidden 64, each to 3 of 12 experts (so every rank sends to every rank)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(40)])
    return x, idx, torch.rand(40, 3, generator=g)


def _delay_payload(transport: Any, delay_s: float) -> None:
    """Makes this rank's payloads late: every ``exchange`` of its transport (the live object, wrapped)
    sleeps ``delay_s`` before it packs its first row. A call's count handshake comes before its
    payload exchange, so the peers pass the handshake on time and only this rank's rows are late."""
    exchange = transport.exchange

    def late_exchange(sent: Any, record_bytes: int, rows: Any, **kw: Any) -> Any:
        slept = []

        def late_rows(dest: int, first: int, out: torch.Tensor) -> None:
            if not slept:
                slept.append(True)
                time.sleep(delay_s)
            rows(dest, first, out)

        return exchange(sent, record_bytes, late_rows, **kw)

    transport.exchange = late_exchange


def _timed(call: Any, outputs: Any, group: dist.ProcessGroup) -> tuple[Any, float, bool, float]:
    """Runs the async ``call()`` from a barrier; returns (its result, seconds until it returned,
    whether its event was pending then, seconds until ``current_stream_wait()`` returned). Right
    after the call returns, the tensors ``outputs(result)`` are overwritten with -7 (NaN for floats),
    so whatever they hold after the wait was written after the call returned (by the wait, or by any
    other completion, which cannot have the late rank's rows before then)."""
    dist.barrier(group)  # every rank enters the call together: the handshake holds nobody up
    start = time.monotonic()
    result = call()
    returned_s = time.monotonic() - start
    event = result[-1]
    pending = event.event.is_pending
    for t in outputs(result):
        t.fill_(float("nan") if t.is_floating_point() else -7)
    event.current_stream_wait()
    return result, returned_s, pending, time.monotonic() - start


def returns_before_delayed_payload(group: dist.ProcessGroup, delay_s: float) -> dict[str, Any]:
    """The last rank packs its payloads ``delay_s`` late. An ``async_finish`` dispatch, then combine,
    must return on every rank before that payload can have arrived (it cannot before ``delay_s``
    after the call began: the late rank starts packing only once every rank's handshake is in), with
    the event pending and the outputs unwritten until ``current_stream_wait()``, which then fills
    them with the synchronous calls' results. Returns, per call: seconds to return, pending, seconds
    to the end of the wait, outputs equal; and the rows this rank gets from the late rank."""
    rank, late = dist.get_rank(group), dist.get_world_size(group) - 1
    buf = moe_comm.Buffer(group, timeout_s=30)
    x, idx, w = _inputs(rank)
    sync = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12)
    sync_y, sync_y_w, _ = buf.combine(sync[0], sync[4], topk_weights=sync[2])
    prefix, in_rank = sync[4][0], sync[4][4]
    rows_from_late = {"dispatch": int(prefix[late, rank] - (prefix[late - 1, rank] if late else 0)),
                      "combine": int(in_rank[:, late].sum())}
    if rank == late:
        _delay_payload(buf.runtime.transport, delay_s)

    got, returned_s, pending, done_s = _timed(
        lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12, async_finish=True),
        lambda r: (r[0], r[1], r[2], r[4][3]), group)
    dispatch = dict(returned_s=returned_s, pending=pending, done_s=done_s,
                    equal=torch.equal(got[0], sync[0]) and torch.equal(got[1], sync[1])
                    and torch.equal(got[2], sync[2]) and got[3] == sync[3] and torch.equal(got[4][3], sync[4][3]))

    (y, y_w, _), returned_s, pending, done_s = _timed(
        lambda: buf.combine(sync[0], sync[4], topk_weights=sync[2], async_finish=True), lambda r: r[:2], group)
    combine = dict(returned_s=returned_s, pending=pending, done_s=done_s,
                   equal=torch.equal(y, sync_y) and torch.equal(y_w, sync_y_w))
    return {"dispatch": dispatch, "combine": combine, "rows_from_late": rows_from_late}


def overlapped(group: dist.ProcessGroup) -> dict:
    """Two async dispatches in flight at once, finished in reverse order; ``previous_event``
    completes the operation it names before the next call starts."""
    rank = dist.get_rank(group)
    buf = moe_comm.Buffer(group, timeout_s=30)
    x, idx, w = _inputs(rank)
    sync = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12)

    # Two dispatches in flight at once, finished in reverse order.
    first = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12, async_finish=True)
    second = buf.dispatch(x * 2, topk_idx=idx, topk_weights=w, num_experts=12, async_finish=True,
                          previous_event=buf.capture())
    pending_before = (first[5].event.is_pending, second[5].event.is_pending)
    second[5].current_stream_wait()
    first[5].current_stream_wait()
    first[5].current_stream_wait()  # waiting twice is harmless
    assert torch.equal(first[0], sync[0]) and torch.equal(second[0], sync[0] * 2)
    assert torch.equal(first[1], sync[1]) and torch.equal(first[2], sync[2]) and first[3] == sync[3]

    # previous_event: a pending operation is completed before the next one starts.
    third = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12, async_finish=True)
    combined, _, event = buf.combine(sync[0], sync[4], async_finish=True, previous_event=third[5])
    pending_after_chain = third[5].event.is_pending
    with event:  # the context manager waits on exit
        pass
    y_sync, _, _ = buf.combine(sync[0], sync[4])
    assert torch.equal(combined, y_sync) and torch.equal(third[0], sync[0])
    return {"pending_before": pending_before, "pending_after_chain": pending_after_chain,
            "sync_event_empty": sync[5].event is None}
