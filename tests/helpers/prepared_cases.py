"""Prepared low-latency calls (backends/portable/prepared.py, backends/cuda/prepared.py) against the checked
path, run inside a rank: the same calls on two Buffers of one group, one of which never prepares."""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.bench.python_calls import counted
from moe_comm.ops import per_token_cast_to_fp8

#: the most Python calls a prepared low-latency op half may make (issue 46: DeepEP's is six statements around one
#: native call)
MAX_PYTHON_CALLS = 10


def _buffers(group: dist.ProcessGroup, m: int, hidden: int, experts: int) -> tuple[moe_comm.Buffer, moe_comm.Buffer]:
    """(a Buffer that prepares its calls, one whose every call runs the checked path), on the world's kind; the
    caller destroys them (``_destroyed``)."""
    size = moe_comm.Buffer.get_low_latency_rdma_size_hint(m, hidden, dist.get_world_size(group), experts)
    prepared = moe_comm.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, timeout_s=60,
                               explicitly_destroy=True)
    checked = moe_comm.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, timeout_s=60,
                              explicitly_destroy=True)
    for name in ("prepare_low_latency_dispatch", "prepare_low_latency_combine", "prepare_dispatch",
                 "prepare_combine"):
        setattr(checked.runtime, name, lambda *args: None)
    return prepared, checked


def _destroyed(result: Any, *buffers: moe_comm.Buffer) -> Any:
    """``result``, once ``buffers`` are destroyed (their memory released now, not at garbage collection)."""
    for buf in buffers:
        buf.destroy()
    return result


def _routing(g: torch.Generator, tokens: int, topk: int, experts: int) -> torch.Tensor:
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.int64)
    idx[torch.rand(tokens, topk, generator=g) < 0.15] = -1
    return idx


_FORMATS = (dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True),
            dict(use_fp8=True, round_scale=True, use_ue8m0=True))


def prepared_equals_checked(group: dist.ProcessGroup, iterations: int, vary_hidden: bool) -> dict[str, Any]:
    """``iterations`` dispatch + combine rounds with random token counts (0 to M), top-k (-1 entries
    included), top-k widths and (``vary_hidden``) hidden sizes that change within one signature (a prepared
    call must decline those), every cast format, blocking, hooked and async, stats tensors given, on both
    Buffers; returns how many outputs differ, the signatures used and how many of them each prepared."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    m, experts = 12, 4 * R
    prepared, checked = _buffers(group, m, 2048, experts)
    g = torch.Generator().manual_seed(rank)
    shapes = torch.Generator().manual_seed(7)  # the same hidden and top-k on every rank
    differ, dispatches, combines = 0, set(), set()
    for it in range(iterations):
        # 12 iterations visit every signature (format it % 4, mode it % 3, stats it % 2) once: the first round
        # prepares them; the second changes only the hidden size within each, the third the top-k width too
        rnd, k = divmod(it, 12)
        topk = (4, 3)[k % 2] if rnd % 3 < 2 else 2
        drawn = int(torch.randint(1, 5, (1,), generator=shapes)) * 512
        hidden = (512, 1024, drawn)[rnd % 3] if vary_hidden else 512
        tokens = int(torch.randint(0, m + 1, (1,), generator=g))
        x = (torch.randn(tokens, hidden, generator=g) * 0.3).bfloat16()
        idx, w = _routing(g, tokens, topk, experts), torch.rand(tokens, topk, generator=g)
        y = torch.randn(experts // R, R * m, hidden, generator=g).bfloat16()
        fmt, mode = _FORMATS[it % 4], it % 3  # 0: blocking, 1: hook, 2: async
        dispatches.add((it % 4, mode, it % 2))  # the signatures: what a prepared call is made for
        combines.add((hidden, mode))
        outputs = []
        for buf in (prepared, checked):
            recv_stats, wait_stats = torch.zeros(experts // R, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
            flags = dict(return_recv_hook=mode == 1, async_finish=mode == 2)
            recv, count, handle, event, hook = buf.low_latency_dispatch(
                x, idx, m, experts, cumulative_local_expert_recv_stats=recv_stats,
                dispatch_wait_recv_cost_stats=wait_stats if it % 2 else None, **fmt, **flags)
            _finish(event, hook, mode)
            data, scales = recv if isinstance(recv, tuple) else (recv, None)
            got = [data.view(torch.uint8).clone(), count.clone(), handle[0].clone(), handle[1].clone(),
                   recv_stats.clone(), (wait_stats > 0).all() if it % 2 else torch.tensor(True)]
            got += [] if scales is None else [scales.clone()]
            combined, event, hook = buf.low_latency_combine(y, idx, w, handle, **flags)
            _finish(event, hook, mode)
            outputs.append(got + [combined.clone()])
        differ += sum(not torch.equal(a, b) for a, b in zip(*outputs))
    return _destroyed({"differ": differ, "signatures": (len(dispatches), len(combines)),
                       "prepared": (sum(bool(p) for p in prepared._prepared_ll_dispatches.values()),
                                    sum(bool(p) for p in prepared._prepared_ll_combines.values()))},
                      prepared, checked)


def _finish(event: Any, hook: Any, mode: int) -> None:
    if mode == 1:
        hook()
    elif mode == 2:
        event.current_stream_wait()


def two_batches(group: dist.ProcessGroup, steps: int) -> dict[str, Any]:
    """EPMoE's two-batch order (dispatch A, dispatch B, receive A, receive B, combine A and B likewise), a normal
    dispatch between steps (its handshake settles what is pending), and a hook received only after the next
    call on the other half: the prepared Buffer against the checked one."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    m, hidden, topk, experts = 8, 256, 3, 2 * R
    prepared, checked = _buffers(group, m, hidden, experts)
    g = torch.Generator().manual_seed(10 + rank)
    differ = 0
    for _ in range(steps):
        batches = [((torch.randn(m, hidden, generator=g)).bfloat16(), _routing(g, m, topk, experts),
                    torch.rand(m, topk, generator=g)) for _ in range(2)]
        outputs = []
        for buf in (prepared, checked):
            sent = [buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False, return_recv_hook=True)
                    for x, idx, _ in batches]
            for s in sent:
                s[-1]()
            got = [s[0].clone() for s in sent]
            combines = [buf.low_latency_combine(s[0] * 2, idx, w, s[2], return_recv_hook=True)
                        for s, (_, idx, w) in zip(sent, batches)]
            buf.dispatch(batches[0][0], topk_idx=batches[0][1], topk_weights=batches[0][2], num_experts=experts)
            for c in combines:
                c[-1]()
            outputs.append(got + [c[0].clone() for c in combines])
        differ += sum(not torch.equal(a, b) for a, b in zip(*outputs))
    return _destroyed({"differ": differ}, prepared, checked)


def normal_prepared_equals_checked(group: dist.ProcessGroup, iterations: int) -> dict[str, Any]:
    """``iterations`` normal-mode dispatch + combine rounds with random token counts (0 to 39), -1 top-k entries,
    with and without top-k, BF16, FP32 and FP8 tuples, hidden sizes and dtypes that change within one signature
    (a prepared call must decline those), ``num_worst_tokens``, alignments, async, combine weights and biases,
    on both Buffers (DeepEP's form, the layout tensors given); returns how many outputs differ, the signatures
    used and how many each prepared."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    topk, experts = 3, 4 * R
    prepared, checked = _buffers(group, 8, 512, experts)
    g = torch.Generator().manual_seed(rank)
    differ, dispatches, combines = 0, set(), set()
    for it in range(iterations):
        tokens = int(torch.randint(0, 40, (1,), generator=g))
        hidden = 512 if it % 7 == 3 else 256  # the same on every rank
        dtype = torch.float32 if it % 6 == 2 else torch.bfloat16
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        idx = _routing(g, tokens, topk, experts)
        w = torch.rand(tokens, topk, generator=g)
        bias = torch.randn(tokens, hidden, generator=g).to(dtype) if it % 3 == 0 else None
        form = it % 4  # 0, 1: top-k given (1: combine weights too), 2: no top-k, 3: FP8
        kw = dict(expert_alignment=1 + it % 3, num_worst_tokens=R * 40 if it % 5 == 0 and form != 2 else 0,
                  async_finish=it % 2 == 1)
        dispatches.add((form == 3, form == 2, kw["expert_alignment"], kw["num_worst_tokens"], kw["async_finish"]))
        if form != 3:
            combines.add((form != 1, bias is None))
        outputs = []
        for buf in (prepared, checked):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
            routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
            if form != 2:
                routing.update(topk_idx=idx, topk_weights=w)
            recv, recv_idx, recv_w, counts, handle, event = buf.dispatch(
                per_token_cast_to_fp8(x) if form == 3 else x, **routing, **kw)
            if kw["async_finish"]:
                event.current_stream_wait()
            data = recv[0].view(torch.uint8) if form == 3 else recv
            got = [data.clone(), torch.tensor(counts)] + [t.clone() for t in handle]
            got += [] if recv_idx is None else [recv_idx.clone(), recv_w.clone()]
            got += [recv[1].clone()] if form == 3 else []
            if form != 3:
                combined, combined_w, _ = buf.combine(recv * 2, handle, topk_weights=recv_w if form == 1 else None,
                                                      bias=bias)
                got += [combined.clone()] + ([] if combined_w is None else [combined_w.clone()])
            outputs.append(got)
        differ += sum(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(*outputs))
    return _destroyed({"differ": differ, "signatures": (len(dispatches), len(combines)),
                       "prepared": (sum(bool(p) for p in prepared._prepared_dispatches.values()),
                                    sum(bool(p) for p in prepared._prepared_combines.values()))},
                      prepared, checked)


def normal_python_calls(group: dist.ProcessGroup) -> dict[str, int]:
    """The Python calls of a normal-mode dispatch and combine (DeepEP's form, top-k given), after a first call."""
    R = dist.get_world_size(group)
    tokens, hidden, topk, experts = 8, 128, 2, 4 * R
    buf, unused = _buffers(group, 8, hidden, experts)
    x, idx = torch.randn(tokens, hidden).bfloat16(), _routing(torch.Generator().manual_seed(1), tokens, topk, experts)
    w = torch.rand(tokens, topk)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
    dispatch = functools.partial(buf.dispatch, x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    counts: dict[str, int] = {}
    for _ in range(2):
        (recv, _, _, _, handle, _), counts["dispatch"] = counted(dispatch)
        _, counts["combine"] = counted(functools.partial(buf.combine, recv, handle))
    return _destroyed(counts, buf, unused)


def python_calls(group: dist.ProcessGroup) -> dict[str, int]:
    """The Python calls (``sys.setprofile`` call events on this thread) of each half of a hooked FP8 dispatch
    and BF16 combine, and of a blocking one, after a first call of each signature."""
    R = dist.get_world_size(group)
    m, hidden, topk, experts = 8, 128, 2, 4 * R
    buf, unused = _buffers(group, m, hidden, experts)
    x, idx = torch.randn(m, hidden).bfloat16(), _routing(torch.Generator().manual_seed(0), m, topk, experts)
    w = torch.rand(m, topk)
    y = torch.zeros(experts // R, R * m, hidden, dtype=torch.bfloat16)
    counts: dict[str, int] = {}
    for _ in range(2):  # the first call of a signature prepares it
        dispatch = functools.partial(buf.low_latency_dispatch, x, idx, m, experts)
        sent, counts["dispatch_send"] = counted(functools.partial(dispatch, return_recv_hook=True))
        _, counts["dispatch_recv"] = counted(sent[-1])
        _, counts["dispatch_blocking"] = counted(dispatch)
        combine = functools.partial(buf.low_latency_combine, y, idx, w, sent[2])
        sent, counts["combine_send"] = counted(functools.partial(combine, return_recv_hook=True))
        _, counts["combine_recv"] = counted(sent[-1])
        _, counts["combine_blocking"] = counted(combine)
    return _destroyed(counts, buf, unused)
