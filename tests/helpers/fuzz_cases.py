"""A seeded fuzz of malformed calls, run inside ranks: each bad call is followed by a correct one whose
results are compared bit for bit with plain-Python references.

Every rank draws the same plan from the seed: which operation, which corruption, and which ranks
apply it (one rank, or all). Ranks that do not corrupt make the correct call of the same kind, so
a corruption on one rank must fail the call on every rank (the others with a CrossRankMismatchError)
and must never shift, corrupt or crash a later call.
"""
from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import moe_comm

from helpers.reference_cases import expected_combine, expected_for, expert_fn

H, E, K, M = 128, 12, 3, 16  # hidden, experts, top-k, low-latency num_max_dispatch_tokens_per_rank
LL_E = 6  # low-latency experts (a multiple of the world sizes used: 2 and 3)


def _routing(tokens: int, experts: int, topk: int, num_ranks: int, g: torch.Generator) -> torch.Tensor:
    """Random top-k ids with some -1, except that token 0 picks local expert 0 of every rank and the
    last token only rank 0's expert 0: every rank gets rows from every rank, and token rows differ,
    so every tampering below changes something that matters."""
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    first = [r * (experts // num_ranks) for r in range(num_ranks)][:topk]
    idx[0] = torch.tensor(first + [-1] * (topk - len(first)))
    idx[-1] = torch.tensor([0] + [-1] * (topk - 1))
    return idx


def make_inputs(src: int, num_ranks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``src``'s normal-mode (x bf16 [T, H], topk_idx [T, K], topk_weights [T, K]), T in [2, 24)."""
    g = torch.Generator().manual_seed(seed * 1009 + src)
    tokens = int(torch.randint(2, 24, (1,), generator=g))
    idx = _routing(tokens, E, K, num_ranks, g)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), idx, torch.rand(tokens, K, generator=g)


@dataclass
class Ctx:
    """What one step has at hand: the buffers, this rank's good inputs, and a handle to tamper with."""
    normal: moe_comm.Buffer
    ll: moe_comm.Buffer
    rank: int
    num_ranks: int
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    rng: random.Random  # this step's private draws (the same on every rank)
    handle: Optional[tuple] = None
    recv_x: Optional[torch.Tensor] = None
    ll_x: Optional[torch.Tensor] = None
    ll_idx: Optional[torch.Tensor] = None
    ll_w: Optional[torch.Tensor] = None
    ll_handle: Optional[tuple] = None
    ll_recv: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- helpers
def _layout(c: Ctx) -> dict:
    ntr, _, nte, itr, _ = c.normal.get_dispatch_layout(c.idx, E)
    return dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)


def _dispatch(c: Ctx, **kw: Any) -> Any:
    args = dict(x=c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=E)
    args.update(kw)
    return c.normal.dispatch(**args)


def _combine(c: Ctx, **kw: Any) -> Any:
    args = dict(x=expert_fn(c.recv_x, c.rank), handle=c.handle)
    args.update(kw)
    return c.normal.combine(**args)


def _ll_dispatch(c: Ctx, **kw: Any) -> Any:
    args = dict(x=c.ll_x, topk_idx=c.ll_idx, num_max_dispatch_tokens_per_rank=M, num_experts=LL_E, use_fp8=False)
    args.update(kw)
    return c.ll.low_latency_dispatch(**args)


def _ll_combine(c: Ctx, **kw: Any) -> Any:
    args = dict(x=c.ll_recv, topk_idx=c.ll_idx, topk_weights=c.ll_w, handle=c.ll_handle)
    args.update(kw)
    return c.ll.low_latency_combine(**args)


def _swap(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    t = t.clone()
    t[[i, j]] = t[[j, i]]
    return t


def _handle(c: Ctx, index: int, value: Any) -> tuple:
    h = list(c.handle)
    h[index] = value
    return tuple(h)


def _ll_handle(c: Ctx, index: int, value: Any) -> tuple:
    h = list(c.ll_handle)
    h[index] = value
    return tuple(h)


def _tamper(t: torch.Tensor, rng: random.Random, values: list[int], among: int = 0) -> torch.Tensor:
    """``t`` with one of its first ``among`` entries (all by default) set to a value drawn from
    ``values`` or moved by +-1; always a change (2**30 when the draw would leave it as it was)."""
    t = t.clone()
    flat = t.view(-1)
    at = rng.randrange(among or flat.numel())
    old = int(flat[at])
    choice = rng.choice(values + ["+1", "-1"])
    new = old + (1 if choice == "+1" else -1) if isinstance(choice, str) else choice
    flat[at] = new if new != old else 2**30
    return t


def _src_info_tamper(c: Ctx) -> torch.Tensor:
    """src_info with one valid row's token changed (rows past recv_count are not used)."""
    src_info = c.ll_handle[0].clone()
    counts = (c.ll_handle[1] & 0xFFFFFFFF).sum(1)
    e = int(counts.argmax())  # local expert 0 has a row from every rank
    src_info[e] = _tamper(src_info[e], c.rng, [-1, 0, 2**30], among=int(counts[e]))
    return src_info


def _send_head_shift(c: Ctx) -> torch.Tensor:
    head = c.handle[5].clone()
    sent = head >= 0
    head[sent] += c.rng.choice([1, -1, 2**30])
    return head


def _count_shuffle(c: Ctx) -> torch.Tensor:
    """layout_range with a row moved between two experts of one source (the source's total kept)."""
    lr = c.ll_handle[1].clone()
    counts, begins = lr & 0xFFFFFFFF, lr >> 32
    for s in range(lr.shape[1]):
        col = counts[:, s]
        if lr.shape[0] > 1 and int(col[0]) > 0:
            col[0] -= 1
            col[1] += 1
            begins = counts.cumsum(1) - counts
            return begins << 32 | counts
    return lr + (1 << 32)  # no row to move: shift a begin instead


# Corruptions: name -> (kind, call). The call runs the corrupted operation on this rank; kind says
# which correct call the other ranks make ("dispatch", "cached", "combine", "ll_dispatch",
# "ll_combine", "clean"). Every one is malformed on its own, except the ONE_SIDED ones, which are
# only wrong against the other ranks' calls, and ALL_RANKS ones, which use another buffer.
CORRUPTIONS: dict[str, tuple[str, Callable[[Ctx], Any]]] = {
    # ---- normal dispatch: arguments
    "x_not_tensor": ("dispatch", lambda c: _dispatch(c, x="x")),
    "x_3d": ("dispatch", lambda c: _dispatch(c, x=c.x.unsqueeze(-1))),
    "x_transposed": ("dispatch", lambda c: _dispatch(c, x=torch.zeros(H, c.x.shape[0], dtype=torch.bfloat16).T)),
    "x_fewer_rows": ("dispatch", lambda c: _dispatch(c, x=torch.zeros(c.x.shape[0] + 1, H, dtype=torch.bfloat16))),
    "fp8_tuple_len": ("dispatch", lambda c: _dispatch(c, x=(c.x.float().to(torch.float8_e4m3fn),))),
    "fp8_scales_rows": ("dispatch", lambda c: _dispatch(c, x=(c.x.float().to(torch.float8_e4m3fn),
                                                              torch.ones(c.x.shape[0] + 2, 1)))),
    "idx_too_big": ("dispatch", lambda c: _dispatch(c, topk_idx=c.idx.clamp(min=0) + E)),
    "idx_below": ("dispatch", lambda c: _dispatch(c, topk_idx=c.idx - 2 * E)),
    "idx_int32": ("dispatch", lambda c: _dispatch(c, topk_idx=c.idx.int())),
    "idx_1d": ("dispatch", lambda c: _dispatch(c, topk_idx=c.idx.view(-1))),
    "weights_none": ("dispatch", lambda c: _dispatch(c, topk_weights=None)),
    "weights_double": ("dispatch", lambda c: _dispatch(c, topk_weights=c.w.double())),
    "weights_shape": ("dispatch", lambda c: _dispatch(c, topk_weights=torch.rand(c.x.shape[0], K + 1))),
    "experts_not_multiple": ("dispatch", lambda c: _dispatch(c, num_experts=E + 1)),
    "experts_zero": ("dispatch", lambda c: _dispatch(c, num_experts=0)),
    "experts_huge": ("dispatch", lambda c: _dispatch(c, num_experts=2**40)),
    "experts_float": ("dispatch", lambda c: _dispatch(c, num_experts=12.0)),
    "worst_negative": ("dispatch", lambda c: _dispatch(c, num_worst_tokens=-1)),
    "worst_huge": ("dispatch", lambda c: _dispatch(c, num_worst_tokens=2**40)),
    "alignment_zero": ("dispatch", lambda c: _dispatch(c, expert_alignment=0)),
    "alignment_huge": ("dispatch", lambda c: _dispatch(c, expert_alignment=2**40)),
    "layout_wrong_counts": ("dispatch", lambda c: _dispatch(c, **dict(_layout(c), num_tokens_per_rank=torch.zeros(
        c.num_ranks, dtype=torch.int32)), num_experts=None)),
    "layout_partial": ("dispatch", lambda c: _dispatch(c, is_token_in_rank=_layout(c)["is_token_in_rank"])),
    "config_dict": ("dispatch", lambda c: _dispatch(c, config={"num_sms": 20})),
    "event_str": ("dispatch", lambda c: _dispatch(c, previous_event="event")),
    "async_int": ("dispatch", lambda c: _dispatch(c, async_finish=1)),
    "unknown_keyword": ("dispatch", lambda c: _dispatch(c, num_sms=20)),
    "positional_overflow": ("dispatch", lambda c: c.normal.dispatch(c.x, *([None] * 20))),
    "hidden_differs": ("dispatch", lambda c: _dispatch(c, x=torch.zeros(c.x.shape[0], 2 * H, dtype=torch.bfloat16))),
    "dtype_differs": ("dispatch", lambda c: _dispatch(c, x=c.x.float())),
    "topk_differs": ("dispatch", lambda c: _dispatch(c, topk_idx=torch.cat([c.idx, c.idx[:, :1]], 1),
                                                     topk_weights=torch.rand(c.x.shape[0], K + 1))),
    # ---- cached dispatch: tampered handles
    "cached_with_topk": ("cached", lambda c: _dispatch(c, handle=c.handle)),
    "cached_handle_len": ("cached", lambda c: c.normal.dispatch(c.x, handle=c.handle[:5])),
    "cached_prefix_dtype": ("cached", lambda c: c.normal.dispatch(c.x, handle=_handle(c, 0, c.handle[0].long()))),
    "cached_prefix_tampered": ("cached", lambda c: c.normal.dispatch(c.x, handle=_handle(
        c, 0, _tamper(c.handle[0], c.rng, [-1, 2**30, 0])))),
    "cached_src_tampered": ("cached", lambda c: c.normal.dispatch(c.x, handle=_handle(
        c, 3, _tamper(c.handle[3], c.rng, [-1, 2**30, 0, 1])))),
    "cached_in_rank_swapped": ("cached", lambda c: c.normal.dispatch(c.x, handle=_handle(
        c, 4, _swap(c.handle[4], 0, c.x.shape[0] - 1)))),
    "cached_send_head": ("cached", lambda c: c.normal.dispatch(c.x, handle=_handle(c, 5, _send_head_shift(c)))),
    "cached_rows": ("cached", lambda c: c.normal.dispatch(torch.zeros(c.x.shape[0] + 1, H, dtype=torch.bfloat16),
                                                          handle=c.handle)),
    # ---- combine
    "combine_x_str": ("combine", lambda c: _combine(c, x="x")),
    "combine_x_rows": ("combine", lambda c: _combine(c, x=torch.zeros(c.recv_x.shape[0] + 3, H, dtype=torch.bfloat16))),
    "combine_x_int": ("combine", lambda c: _combine(c, x=torch.zeros(c.recv_x.shape, dtype=torch.int32))),
    "combine_hidden": ("combine", lambda c: _combine(c, x=torch.zeros(c.recv_x.shape[0], 2 * H, dtype=torch.bfloat16))),
    "combine_bias_shape": ("combine", lambda c: _combine(c, bias=torch.zeros(c.x.shape[0], H + 1, dtype=torch.bfloat16))),
    "combine_weights_rows": ("combine", lambda c: _combine(c, topk_weights=torch.zeros(c.recv_x.shape[0] + 1, K))),
    "combine_handle_none": ("combine", lambda c: _combine(c, handle=None)),
    "combine_prefix_tampered": ("combine", lambda c: _combine(c, handle=_handle(
        c, 0, _tamper(c.handle[0], c.rng, [-1, 2**30, 0])))),
    "combine_src_tampered": ("combine", lambda c: _combine(c, handle=_handle(
        c, 3, _tamper(c.handle[3], c.rng, [-1, 2**30, 0, 1])))),
    "combine_in_rank_swapped": ("combine", lambda c: _combine(c, handle=_handle(
        c, 4, _swap(c.handle[4], 0, c.x.shape[0] - 1)))),
    "combine_send_head": ("combine", lambda c: _combine(c, handle=_handle(c, 5, _send_head_shift(c)))),
    "combine_send_head_shape": ("combine", lambda c: _combine(c, handle=_handle(c, 5, c.handle[5][:1]))),
    # ---- low-latency dispatch
    "ll_x_float": ("ll_dispatch", lambda c: _ll_dispatch(c, x=c.ll_x.float())),
    "ll_hidden_200": ("ll_dispatch", lambda c: _ll_dispatch(c, x=torch.zeros(c.ll_x.shape[0], 200,
                                                                                dtype=torch.bfloat16))),
    "ll_too_many_tokens": ("ll_dispatch", lambda c: _ll_dispatch(c, x=torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                                                 topk_idx=torch.zeros(M + 1, 1, dtype=torch.int64))),
    "ll_duplicate_expert": ("ll_dispatch", lambda c: _ll_dispatch(c, topk_idx=torch.zeros(c.ll_x.shape[0], 2,
                                                                                          dtype=torch.int64))),
    "ll_idx_range": ("ll_dispatch", lambda c: _ll_dispatch(c, topk_idx=c.ll_idx.clamp(min=0) + LL_E)),
    "ll_m_zero": ("ll_dispatch", lambda c: _ll_dispatch(c, num_max_dispatch_tokens_per_rank=0)),
    "ll_m_huge": ("ll_dispatch", lambda c: _ll_dispatch(c, num_max_dispatch_tokens_per_rank=2**40)),
    "ll_m_differs": ("ll_dispatch", lambda c: _ll_dispatch(c, num_max_dispatch_tokens_per_rank=M // 2)),
    "ll_experts_huge": ("ll_dispatch", lambda c: _ll_dispatch(c, num_experts=2**40)),
    "ll_ue8m0_alone": ("ll_dispatch", lambda c: _ll_dispatch(c, use_fp8=True, use_ue8m0=True)),
    "ll_async_and_hook": ("ll_dispatch", lambda c: _ll_dispatch(c, async_finish=True, return_recv_hook=True)),
    "ll_stats_shape": ("ll_dispatch", lambda c: _ll_dispatch(c, cumulative_local_expert_recv_stats=torch.zeros(
        LL_E, dtype=torch.int32))),
    "ll_variant_knob": ("ll_dispatch", lambda c: _ll_dispatch(c, use_nvfp4=True)),
    "ll_fp8_differs": ("ll_dispatch", lambda c: _ll_dispatch(c, use_fp8=True)),
    "ll_on_normal_buffer": ("ll_dispatch", lambda c: c.normal.low_latency_dispatch(c.ll_x, c.ll_idx, M, LL_E)),
    # ---- low-latency combine: tampered handles and routing
    "llc_handle_len": ("ll_combine", lambda c: _ll_combine(c, handle=c.ll_handle[:4])),
    "llc_begin_shift": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(c, 1, c.ll_handle[1] + (1 << 32)))),
    "llc_begin_back": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(c, 1, c.ll_handle[1] - (1 << 32)))),
    "llc_count_shuffle": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(c, 1, _count_shuffle(c)))),
    "llc_src_tampered": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(
        c, 0, _src_info_tamper(c)))),
    "llc_m_changed": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(c, 2, M // 2))),
    "llc_hidden_changed": ("ll_combine", lambda c: _ll_combine(c, handle=_ll_handle(c, 3, 2 * H))),
    "llc_other_routing": ("ll_combine", lambda c: _ll_combine(c, topk_idx=c.ll_idx.flip(0))),
    "llc_weights_shape": ("ll_combine", lambda c: _ll_combine(c, topk_weights=torch.zeros(c.ll_idx.shape[0], 5))),
    "llc_x_shape": ("ll_combine", lambda c: _ll_combine(c, x=c.ll_recv[:, :-1])),
    "llc_zero_copy_unlent": ("ll_combine", lambda c: _ll_combine(c, zero_copy=True)),
    "llc_logfmt_zero_copy": ("ll_combine", lambda c: _ll_combine(c, use_logfmt=True, zero_copy=True)),
    "llc_out_strides": ("ll_combine", lambda c: _ll_combine(c, out=torch.zeros(H, c.ll_idx.shape[0],
                                                                               dtype=torch.bfloat16).T)),
    # ---- clean
    "clean_hidden": ("clean", lambda c: c.ll.clean_low_latency_buffer(M, 200, LL_E)),
    "clean_experts": ("clean", lambda c: c.ll.clean_low_latency_buffer(M, H, LL_E + 1)),
}


ONE_SIDED = {"hidden_differs", "dtype_differs", "topk_differs", "combine_hidden", "ll_m_differs", "ll_fp8_differs"}
ALL_RANKS = {"ll_on_normal_buffer"}
#: the operation each kind's error messages name
OP_OF = {"dispatch": "dispatch", "cached": "dispatch", "combine": "combine", "ll_dispatch": "low_latency_dispatch",
         "ll_combine": "low_latency_combine", "clean": "clean_low_latency_buffer"}


def _correct(kind: str, c: Ctx) -> Any:
    """The well-formed call of ``kind`` (what the ranks that do not corrupt make)."""
    if kind == "dispatch":
        return _dispatch(c)
    if kind == "cached":
        return c.normal.dispatch(c.x, handle=c.handle)
    if kind == "combine":
        return _combine(c)
    if kind == "ll_dispatch":
        return _ll_dispatch(c)
    if kind == "ll_combine":
        return _ll_combine(c)
    return c.ll.clean_low_latency_buffer(M, H, LL_E)


# ---------------------------------------------------------------------------------------------- references
def _ll_inputs(src: int, num_ranks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``src``'s low-latency (x bf16 [T, H], topk_idx [T, 3], topk_weights [T, 3]), T in [2, M]."""
    g = torch.Generator().manual_seed(seed * 7919 + src)
    tokens = int(torch.randint(2, M + 1, (1,), generator=g))
    idx = _routing(tokens, LL_E, 3, num_ranks, g)
    return torch.randn(tokens, H, generator=g).to(torch.bfloat16), idx, torch.rand(tokens, 3, generator=g)


def _ll_expected_recv(me: int, inputs: list, local: int) -> list[torch.Tensor]:
    """Rows of each local expert: blocks by source rank ascending, tokens ascending."""
    out = []
    for e in range(local):
        expert = me * local + e
        rows = [x[t] for x, idx, _ in inputs for t in range(x.shape[0]) if expert in idx[t].tolist()]
        out.append(torch.stack(rows) if rows else torch.empty(0, H, dtype=torch.bfloat16))
    return out


def _ll_expected_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """combine of the identity expert: bf16(sum over k ascending of w * x), fp32 multiply then add."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        hit = (idx[:, k] >= 0).unsqueeze(1)
        acc = torch.where(hit, acc + w[:, k:k + 1] * x.float(), acc)
    return acc.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check_normal(c: Ctx, seed: int, async_finish: bool = False) -> None:
    """A correct dispatch + combine on fresh inputs, bitwise against the reference (stores the handle)."""
    inputs = [make_inputs(src, c.num_ranks, seed) for src in range(c.num_ranks)]
    c.x, c.idx, c.w = inputs[c.rank]
    want_x, want_idx, want_w, want_list, want_prefix, want_src = expected_for(c.rank, inputs, E)
    recv_x, recv_idx, recv_w, recv_list, handle, event = _dispatch(c, async_finish=async_finish)
    if async_finish:
        event.current_stream_wait()
    assert torch.equal(_bits(recv_x), _bits(want_x)) and torch.equal(recv_idx, want_idx), "dispatch rows"
    assert torch.equal(_bits(recv_w), _bits(want_w)) and recv_list == want_list, "dispatch weights/counts"
    assert torch.equal(handle[0], want_prefix) and torch.equal(handle[3], want_src), "dispatch handle"
    c.handle, c.recv_x = handle, recv_x
    combined, _, _ = _combine(c)
    assert torch.equal(_bits(combined), _bits(expected_combine(c.rank, inputs, E))), "combine"
    again, _, _, _, _, _ = c.normal.dispatch(c.x, handle=handle)  # cached
    assert torch.equal(_bits(again), _bits(want_x)), "cached dispatch"


def _check_low_latency(c: Ctx, seed: int, hook: bool) -> None:
    """A correct low-latency dispatch + combine (optionally with hooks), bitwise against the reference."""
    inputs = [_ll_inputs(src, c.num_ranks, seed) for src in range(c.num_ranks)]
    c.ll_x, c.ll_idx, c.ll_w = inputs[c.rank]
    local = LL_E // c.num_ranks
    recv, count, handle, _, recv_hook = _ll_dispatch(c, return_recv_hook=hook)
    if hook:
        recv_hook()
    want = _ll_expected_recv(c.rank, inputs, local)
    assert count.tolist() == [w.shape[0] for w in want], "low-latency counts"
    for e in range(local):
        n = want[e].shape[0]
        assert torch.equal(_bits(recv[e, :n]), _bits(want[e])), "low-latency rows"
        assert not bool(recv[e, n:].view(torch.int16).any()), "low-latency padding"
    c.ll_handle, c.ll_recv = handle, recv
    out, _, combine_hook = _ll_combine(c, return_recv_hook=hook)
    if hook:
        combine_hook()
    assert torch.equal(_bits(out), _bits(_ll_expected_combine(c.ll_x, c.ll_idx, c.ll_w))), "low-latency combine"


# ---------------------------------------------------------------------------------------------- the fuzz
def _buffers(group: dist.ProcessGroup, timeout_s: float) -> tuple[moe_comm.Buffer, moe_comm.Buffer]:
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, 2 * H, dist.get_world_size(group), 2 * LL_E)
    return (moe_comm.Buffer(group, timeout_s=timeout_s),
            moe_comm.Buffer(group, low_latency_mode=True, num_rdma_bytes=hint, timeout_s=timeout_s))


def fuzz(group: dist.ProcessGroup, seed: int, steps: int, timeout_s: float = 20.0) -> dict[str, Any]:
    """``steps`` malformed calls, each followed by correct calls checked bitwise. Returns per-rank
    statistics; raises AssertionError (with the step) on any silently wrong result or missing error."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    plan = random.Random(seed)
    normal, ll = _buffers(group, timeout_s)
    c = Ctx(normal, ll, rank, num_ranks, *make_inputs(rank, num_ranks, seed), random.Random())
    _check_normal(c, seed)
    _check_low_latency(c, seed, hook=False)
    stats: dict[str, Any] = {"errors": collections.Counter(), "cases": collections.Counter(), "rebuilt": 0,
                             "unclear": []}
    names = sorted(CORRUPTIONS)
    for step in range(steps):
        name = plan.choice(names)
        kind, bad_call = CORRUPTIONS[name]
        everyone = name in ALL_RANKS or (name not in ONE_SIDED and plan.random() < 0.3)
        corrupters = set(range(num_ranks)) if everyone else {plan.randrange(num_ranks)}
        c.rng = random.Random(plan.getrandbits(32) + 1000 * rank)  # tampering may differ per rank
        raised: Optional[BaseException] = None
        try:
            bad_call(c) if rank in corrupters else _correct(kind, c)
        except Exception as exc:  # every rank must raise; checked below
            raised = exc
        where = f"step {step} ({name}, corrupting ranks {sorted(corrupters)})"
        assert raised is not None, f"{where}: rank {rank} raised nothing"
        message = str(raised)
        stats["errors"][type(raised).__name__] += 1
        stats["cases"][name] += 1
        if OP_OF[kind] not in message and not (name == "ll_on_normal_buffer" and "low_latency_dispatch" in message):
            stats["unclear"].append((where, type(raised).__name__, message))
        if rank not in corrupters and not isinstance(raised, moe_comm.BufferUnusableError):
            assert isinstance(raised, moe_comm.CrossRankMismatchError), f"{where}: rank {rank}: {raised!r}"
        if isinstance(raised, moe_comm.BufferUnusableError) or (c.normal.runtime.agreement.broken or c.ll.runtime.agreement.broken):
            stats["rebuilt"] += 1
            stats.setdefault("broken_by", []).append((where, message[:300]))
            c.normal, c.ll = _buffers(group, timeout_s)
        follow = seed * 100003 + step
        _check_normal(c, follow, async_finish=bool(step % 3 == 1))
        _check_low_latency(c, follow, hook=bool(step % 2))
    stats["errors"], stats["cases"] = dict(stats["errors"]), dict(stats["cases"])
    return stats
