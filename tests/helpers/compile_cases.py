"""moe-comm under ``torch.compile``, run inside ranks: the Buffer's calls and the EP-MoE layer compiled with
``fullgraph=True`` against the same calls run eagerly, ``torch.library.opcheck`` of the Buffer's ops, and
bad input inside a compiled call. Every function resets Dynamo first: the ranks of a pooled world live
across tests."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.buffer import library
from moe_comm.core.library import op

from helpers.ll_hook_cases import _raises
from helpers.low_latency_cases import ll_buffer, routing
from helpers.moe_cases import global_experts, make_buffer, max_tokens, rank_inputs

#: opcheck's checks: the schema (declared mutation and aliasing), the autograd registration, the fake
#: against the real outputs, and the op traced by AOTAutograd with dynamic shapes
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

#: the ops ``buffer_opchecks`` checks (on ranks: they communicate)
BUFFER_OPS = {"low_latency_dispatch", "low_latency_combine", "low_latency_receive", "clean_low_latency_buffer",
              "get_next_low_latency_combine_buffer", "get_dispatch_layout", "dispatch", "cached_dispatch", "combine"}


def bits(t: Any) -> str:
    """A digest of the bytes of a tensor, a tuple of them, or None."""
    if t is None:
        return "None"
    if isinstance(t, (tuple, list)):
        return ",".join(bits(p) for p in t)
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16] + str(list(t.shape))


def _compiled(fn: Callable, **kw: Any) -> Callable:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, **kw)


# ---------------------------------------------------------------------------------------------- low-latency
def low_latency_steps(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """``clean_low_latency_buffer -> low_latency_dispatch -> low_latency_combine`` compiled and eager (twice
    each, alternating):
    outputs, handles and stats bit for bit, with hooks or without, BF16 or FP8."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    t, h, k, e = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    hook, fp8 = cfg["hook"], cfg["fp8"]
    buf = ll_buffer(group, t, h, e)
    torch.manual_seed(100 + rank)
    x = torch.randn(t, h).bfloat16()
    topk_idx, topk_weights = routing(t, e, k, 100 + rank)

    def step(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, stats: torch.Tensor):
        buf.clean_low_latency_buffer(t, h, e)
        recv, count, handle, _, recv_hook = buf.low_latency_dispatch(
            x, topk_idx, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, return_recv_hook=hook)
        if hook:
            recv_hook()
        rows = (recv[0].float() * recv[1].repeat_interleave(128, dim=2)).bfloat16() if fp8 else recv * 2
        out, _, combine_hook = buf.low_latency_combine(rows, topk_idx, topk_weights, handle, return_recv_hook=hook)
        if hook:
            combine_hook()
        return recv, count, handle[0], handle[1], out

    compiled = _compiled(step)
    results: dict[str, Any] = {"eager": [], "compiled": []}
    try:
        for _ in range(2):
            for name, fn in (("eager", step), ("compiled", compiled)):
                stats = torch.zeros(e // ranks, dtype=torch.int32)
                results[name].append(bits(fn(x, topk_idx, topk_weights, stats)) + bits(stats))
        results["op_calls"] = int(buf._op_state[0])  # the state counts the calls made through ops
    finally:
        buf.destroy()
    return results


def low_latency_bad_input(group: dist.ProcessGroup) -> dict[str, str]:
    """Rank 1 routes to an expert that does not exist, eagerly then inside a compiled call: what each rank
    raises, then whether the next (good) compiled call still matches eager."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    t, h, e = 8, 256, 4 * ranks
    buf = ll_buffer(group, t, h, e)
    x = torch.randn(t, h).bfloat16()
    good, weights = routing(t, e, 2, rank)
    bad = good.clone()
    if rank == 1:
        bad[3, 0] = e + 5

    def step(x: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, t, e, use_fp8=False)
        return buf.low_latency_combine(recv, topk_idx.clamp(min=-1), weights, handle)[0]

    compiled = _compiled(step)
    try:
        out = {"eager": _raises(lambda: step(x, bad)), "compiled": _raises(lambda: compiled(x, bad))}
        out["next_equal"] = bits(compiled(x, good)) == bits(step(x, good))
    finally:
        buf.destroy()
    return out


# ---------------------------------------------------------------------------------------------- normal mode
def normal_steps(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """``get_dispatch_layout -> dispatch -> cached dispatch -> combine`` compiled (an unbacked receive size,
    or ``num_worst_tokens``) and eager, twice each: every output bit for bit."""
    rank = dist.get_rank(group)
    t, h, k, e, worst, fp8 = cfg["tokens"][rank], cfg["hidden"], cfg["topk"], cfg["experts"], cfg["worst"], cfg["fp8"]
    buf = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
    torch.manual_seed(200 + rank)
    x = torch.randn(t, h).bfloat16()
    topk_idx, topk_weights = routing(t, e, k, 200 + rank)

    def step(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, e)
        data = moe_comm.ops.quantize(x, "e4m3") if fp8 else x
        recv, recv_idx, recv_weights, counts, handle, event = buf.dispatch(
            data, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst, async_finish=True)
        event.current_stream_wait()
        again = buf.dispatch(data, handle=handle)[0]
        rows = moe_comm.ops.dequantize(*recv) if fp8 else recv
        combined, combined_weights, _ = buf.combine(rows, handle, topk_weights=recv_weights)
        return recv, again, recv_idx, recv_weights, counts, handle, combined, combined_weights

    compiled = _compiled(step)
    results: dict[str, list[str]] = {"eager": [], "compiled": []}
    try:
        for _ in range(2):
            for name, fn in (("eager", step), ("compiled", compiled)):
                outs = list(fn(x, topk_idx, topk_weights))
                outs[4] = torch.as_tensor(outs[4], dtype=torch.int32)  # the per-expert list is a tensor when compiled
                results[name].append(bits(tuple(outs)))
    finally:
        buf.destroy()
    return results


# ---------------------------------------------------------------------------------------------- opcheck
def buffer_opchecks(group: dist.ProcessGroup) -> dict[str, str]:
    """``torch.library.opcheck`` of every Buffer op with real arguments on every rank (each check runs
    the op, so every rank runs the same checks in the same order); the receive gets a new send per check.
    Returns the failures (empty when every check passed) and which ops were checked."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    t, h, k, e = 6, 256, 2, 2 * ranks
    failures: dict[str, str] = {}
    checked: list[str] = []

    def check(name: str, args: tuple, utils: tuple = OPCHECKS) -> None:
        checked.append(name)
        try:
            torch.library.opcheck(op(name), args, test_utils=utils)
        except Exception as exc:  # reported by name
            failures[f"{name} {utils}"] = f"{type(exc).__name__}: {exc}; caused by {exc.__cause__!r}"[:1500]

    torch.manual_seed(rank)
    x = torch.randn(t, h).bfloat16()
    topk_idx, topk_weights = routing(t, e, k, rank)
    ll = ll_buffer(group, t, h, e)
    normal = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
    try:
        i, s = ll._op_id, ll._op_state
        stats = torch.zeros(e // ranks, dtype=torch.int32)
        for fp8 in (False, True):
            check("low_latency_dispatch", (i, s, x, topk_idx, t, e, stats, None, fp8, False, False, False))
        recv, _, _, src_info, layout_range, *_ = op("low_latency_dispatch")(i, s, x, topk_idx, t, e, None, None,
                                                                            False, False, False, False)
        check("low_latency_combine", (i, s, recv, topk_idx, topk_weights, src_info, layout_range, t, h, e, False,
                                      None, None, False))
        check("low_latency_combine", (i, s, recv, topk_idx, topk_weights, src_info, layout_range, t, h, e, False,
                                      torch.empty(t, h, dtype=torch.bfloat16), None, False))
        check("get_next_low_latency_combine_buffer", (i, s, src_info, layout_range, t, h, e))
        check("clean_low_latency_buffer", (i, s, t, h, e))
        # A receive runs once: a new send for each check (received at once if the check did not). Not
        # test_aot_dispatch_dynamic, which runs the op twice on the same arguments; the compiled hook calls of
        # low_latency_steps run the receive inside AOTAutograd's graphs instead.
        for util in (c for c in OPCHECKS if c != "test_aot_dispatch_dynamic"):
            sent = op("low_latency_dispatch")(i, s, x, topk_idx, t, e, None, None, False, False, False, True)
            check("low_latency_receive", (i, s, sent[5], list(sent[:5])), (util,))
            if int(sent[5]) in library._RECEIVES:  # the check did not run the op: receive, as every rank must
                op("low_latency_receive")(i, s, sent[5], list(sent[:5]))
        i, s = normal._op_id, normal._op_state
        check("get_dispatch_layout", (i, topk_idx, e))
        per_rank, _, per_expert, in_rank = op("get_dispatch_layout")(i, topk_idx, e)
        config = [20, 6, 256, 6, 256]
        for worst in (0, 3 * t):
            check("dispatch", (i, s, x, None, per_rank, in_rank, per_expert, topk_idx, topk_weights, 1, worst,
                               config, None))
        out = op("dispatch")(i, s, x, None, per_rank, in_rank, per_expert, topk_idx, topk_weights, 1, 0, config, None)
        handle = list(out[5:11])
        check("cached_dispatch", (i, s, x, None, handle, config))
        check("combine", (i, s, out[0], handle, out[3], None, None, config))
        # the autograd formulas: float32 inputs that require grad
        xf, wf = x.float().requires_grad_(), topk_weights.clone().requires_grad_()
        check("dispatch", (i, s, xf, None, per_rank, in_rank, per_expert, topk_idx, wf, 1, 0, config, None))
        rows = out[0].float().requires_grad_()
        bias = torch.randn(t, h).requires_grad_()
        check("combine", (i, s, rows, handle, out[3].clone().requires_grad_(), bias, bias.detach().clone(), config))
    finally:
        ll.destroy()
        normal.destroy()
    return {"failures": failures, "checked": sorted(set(checked))}


# ---------------------------------------------------------------------------------------------- EP-MoE
def compiled_layer(group: dist.ProcessGroup, cfg: dict[str, Any]) -> dict[str, Any]:
    """``EPMoE`` in ``cfg["mode"]`` compiled with ``fullgraph=True`` against eager, bit for bit, on two token
    counts and then the first again; how many frames compiled; ``torch._dynamo.explain``'s graph breaks
    (normal modes with ``capture_dynamic_output_shape_ops``, which ``fullgraph=True`` implies: their receive
    size is data)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    mode, fp8, experts, hidden = cfg["mode"], cfg["fp8"], cfg["experts"], cfg["hidden"]
    first, second = cfg["tokens"], cfg["tokens_again"]
    m = max(max_tokens(mode, first), max_tokens(mode, second))
    everything = global_experts(experts, hidden, cfg["inter"], fp8, cfg["seed"])
    local = experts // ranks
    inputs = [rank_inputs(tokens, hidden, cfg["topk"], experts, cfg["seed"] + i) for i, tokens in
              enumerate((first, second))]
    mine = [tuple(part[rank] for part in drawn) for drawn in inputs]
    buffer = make_buffer(group, mode, m, hidden, experts)
    layer = moe_comm.EPMoE(buffer, everything.select(rank * local, local), experts, mode=mode, num_chunks=2,
                           num_max_dispatch_tokens_per_rank=m)
    normal = mode not in moe_comm.moe.LOW_LATENCY_MODES
    try:
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=normal):
            explained = torch._dynamo.explain(layer)(*mine[0])
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        compiled = _compiled(layer, backend=counter, dynamic=True)
        outs = [compiled(*mine[0])]
        frames_after_first = counter.frame_count
        outs += [compiled(*mine[0]), compiled(*mine[1]), compiled(*mine[0])]
        eager = [layer(*mine[0]), layer(*mine[1])]
        frames = counter.frame_count
        # another layer of the model (other weights) on the same buffer, in the same mode, compiled apart:
        # it runs the first layer's compiled code (its weights are inputs of the graph)
        other = moe_comm.EPMoE(buffer, global_experts(experts, hidden, cfg["inter"], fp8, cfg["seed"] + 9).select(
            rank * local, local), experts, mode=mode, num_chunks=2, num_max_dispatch_tokens_per_rank=m)
        other_equal = bits(torch.compile(other, fullgraph=True, backend=counter, dynamic=True)(*mine[1])) == \
            bits(other(*mine[1]))
    finally:
        buffer.destroy()
    return {"equal": [bits(o) == bits(eager[j]) for o, j in zip(outs, (0, 0, 1, 0))],
            "graph_breaks": explained.graph_break_count, "graphs": explained.graph_count,
            "frames_after_first": frames_after_first, "frames": frames, "other_layer_equal": other_equal,
            "frames_with_another_layer": counter.frame_count}


# ---------------------------------------------------------------------------------------------- autograd
def _dot(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: dist.ProcessGroup) -> float:
    """Sum over ranks of sum(a * b) over ``pairs``, in float64 (the inputs hold small integers: exact)."""
    total = torch.tensor([sum(float((a.double() * b.double()).sum()) for a, b in pairs)], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return float(total)


def normal_adjoints(group: dist.ProcessGroup, compiled: bool) -> dict[str, Any]:
    """Gradients of a dispatch and of a combine (compiled with ``fullgraph=True``, or the ops called eagerly):
    each is the adjoint of its forward map, ``sum <f(x), g> == sum <x, grad>`` over ranks, exactly on
    integer-valued float32 data, and equals Megatron-Core's convention computed with eager Buffer calls
    (a combine of the gradients; a cached dispatch)."""
    rank = dist.get_rank(group)
    t, h, k, e = 7 + 3 * rank, 128, 3, 8
    buf = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
    gen = torch.Generator().manual_seed(300 + rank)
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=gen).float()  # noqa: E731
    topk_idx, _ = routing(t, e, k, 300 + rank)
    x, w = ints(t, h).requires_grad_(), ints(t, k).requires_grad_()

    def dispatch(x: torch.Tensor, w: torch.Tensor):
        recv, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=w, num_experts=e)
        return recv, recv_w, handle

    def combine(rows: torch.Tensor, rows_w: torch.Tensor, handle: tuple):
        out, out_w, _ = buf.combine(rows, handle, topk_weights=rows_w)
        return out, out_w

    if compiled:
        torch._dynamo.reset()
        dispatch, combine = (torch.compile(f, fullgraph=True) for f in (dispatch, combine))
    else:  # the ops themselves, eagerly: the Buffer methods are not differentiable outside a graph
        def dispatch(x: torch.Tensor, w: torch.Tensor):  # noqa: F811
            per_rank, _, per_expert, in_rank = op("get_dispatch_layout")(buf._op_id, topk_idx, e)
            out = op("dispatch")(buf._op_id, buf._op_state, x, None, per_rank, in_rank, per_expert, topk_idx, w, 1, 0,
                                 [20, 6, 256, 6, 256], e)
            return out[0], out[3], tuple(out[5:11])

        def combine(rows: torch.Tensor, rows_w: torch.Tensor, handle: tuple):  # noqa: F811
            out = op("combine")(buf._op_id, buf._op_state, rows, list(handle), rows_w, None, None, [20, 6, 256, 6, 256])
            return out[0], out[1]
    try:
        recv, recv_w, handle = dispatch(x, w)
        g_recv, g_recv_w = ints(*recv.shape), ints(*recv_w.shape)
        ((recv * g_recv).sum() + (recv_w * g_recv_w).sum()).backward()
        rows, rows_w = ints(*recv.shape).requires_grad_(), ints(*recv_w.shape).requires_grad_()
        out, out_w = combine(rows, rows_w, handle)
        g_out, g_out_w = ints(*out.shape), ints(*out_w.shape)
        ((out * g_out).sum() + (out_w * g_out_w).sum()).backward()
        eager_handle = tuple(t.detach() for t in handle)
        megatron_dispatch_grad = buf.combine(g_recv, eager_handle)[0]
        megatron_combine_grad = buf.dispatch(g_out, handle=eager_handle)[0]
        return {
            "dispatch": (_dot([(recv.detach(), g_recv), (recv_w.detach(), g_recv_w)], group),
                         _dot([(x.detach(), x.grad), (w.detach(), w.grad)], group)),
            "combine": (_dot([(out.detach(), g_out), (out_w.detach(), g_out_w)], group),
                        _dot([(rows.detach(), rows.grad), (rows_w.detach(), rows_w.grad)], group)),
            "dispatch_grad_is_a_combine": torch.equal(x.grad, megatron_dispatch_grad),
            "combine_grad_is_a_cached_dispatch": torch.equal(rows.grad, megatron_combine_grad),
            "nonzero": bool(x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0 and rows_w.grad.abs().sum() > 0)}
    finally:
        buf.destroy()
