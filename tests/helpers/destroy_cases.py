"""Calls left pending across ``Buffer.destroy()``, then a new Buffer on the same group: nothing a
destroyed buffer still held may reach the group after it (gloo aborts a process whose peer's message
has another size than the one it posted), and the new buffer's calls give what a synchronous call gave."""
from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm

#: what is left pending when the first buffer is destroyed (every: the normal-mode three and a hooked combine);
#: also ll_hook_late_rows: a hooked dispatch whose rows the post thread moves 0.3 s late on every rank but 0
PENDING = ("dispatch", "cached_dispatch", "combine", "ll_dispatch_hook", "ll_combine_hook", "every")


def _late_posts(transport: Any, delay_s: float) -> None:
    """Makes the rows of this rank's posts late where a thread of the transport moves them (``collective``):
    its ``posted_all_to_all``, called on that thread, sleeps ``delay_s`` first. Elsewhere nothing changes."""
    posted_all_to_all = transport.posted_all_to_all

    def late(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay_s)
        return posted_all_to_all(*args, **kw)

    transport.posted_all_to_all = late


def pending_then_new_buffer(group: dist.ProcessGroup, pending: str) -> dict[str, Any]:
    """Leaves ``pending`` (one of PENDING) unfinished on a first buffer, destroys it, and returns whether a
    second buffer's dispatch and combine equal the first buffer's synchronous ones."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    tokens, hidden, topk, experts = 16, 128, 2, 4 * num_ranks
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=g)
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks, experts)
    first = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True)
    per_rank, _, per_expert, in_rank, _ = first.get_dispatch_layout(idx, experts)
    routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                   topk_idx=idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = first.dispatch(x, **routing)
    expected_x, expected_combined = recv_x.clone(), first.combine(recv_x, handle)[0].clone()
    held: list[Any] = []
    every = pending == "every"
    if every or pending == "dispatch":
        held.append(first.dispatch(x, **routing, async_finish=True))
    if every or pending == "cached_dispatch":
        held.append(first.dispatch(x, handle=handle, async_finish=True))
    if every or pending == "combine":
        held.append(first.combine(recv_x, handle, async_finish=True))
    if pending == "ll_hook_late_rows" and hasattr(getattr(first.runtime, "transport", None), "posted_all_to_all"):
        _late_posts(first.runtime.transport, 0.3 if rank else 0.0)  # rank 0's rows first, the others' late
    if pending in ("ll_dispatch_hook", "ll_hook_late_rows"):  # (not with every: three results would exceed two halves)
        held.append(first.low_latency_dispatch(x, idx, tokens, experts, return_recv_hook=True))
    if every or pending == "ll_combine_hook":
        ll_x, _, ll_handle, _, _ = first.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
        held.append(first.low_latency_combine(ll_x, idx, weights, ll_handle, return_recv_hook=True))
    first.destroy()
    second = moe_comm.Buffer(group, explicitly_destroy=True)
    got_x, _, _, _, got_handle, _ = second.dispatch(x, **routing)
    got_combined = second.combine(got_x, got_handle)[0]
    second.destroy()
    return {"held": len(held), "dispatch_equal": torch.equal(got_x, expected_x),
            "combine_equal": torch.equal(got_combined, expected_combined)}
