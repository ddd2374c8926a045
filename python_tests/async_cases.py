"""async_finish inside ranks: several exchanges in flight, completed by their events."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm


def overlapped(group: dist.ProcessGroup) -> dict:
    rank = dist.get_rank(group)
    buf = moe_comm.Buffer(group, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(40)])
    w = torch.rand(40, 3, generator=g)
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
