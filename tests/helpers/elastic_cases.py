"""``ElasticBuffer`` (DeepEP V2's API) inside ranks: dispatch and combine against a reference written here from
DeepEP V2's documented semantics (every rank's inputs are gathered, so each rank knows what it must
receive and what its tokens must sum to), and bad arguments on one rank."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import moe_comm

FP8 = torch.float8_e4m3fn


def _inputs(rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int, masked: bool, fp8: bool,
            seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:num_topk] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
    if masked and num_tokens:
        topk_idx[torch.rand(topk_idx.shape, generator=g) < 0.25] = -1
    weights = torch.rand(num_tokens, num_topk, generator=g).masked_fill(topk_idx < 0, 0.0)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    sf = None
    if fp8:
        sf = torch.rand(num_tokens, -(-hidden // 128), generator=g) + 0.5
        x = x.to(FP8)
    return dict(x=x, sf=sf, topk_idx=topk_idx, topk_weights=weights)


def _gather(group: dist.ProcessGroup, t: Optional[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, None if t is None else (t.view(torch.uint8) if t.dtype == FP8 else t), group=group)
    return [o.view(FP8) if o is not None and t is not None and t.dtype == FP8 else o for o in out]


def _contribution(src_global: torch.Tensor, rank: int, hidden: int) -> torch.Tensor:
    """What rank ``rank`` returns for a token (a bf16 row that tells ranks and tokens apart)."""
    cols = torch.arange(hidden, dtype=torch.float32)
    return torch.sin(src_global.float().unsqueeze(1) * 0.37 + rank * 1.3 + cols * 0.01).to(torch.bfloat16)


def _last_slots(groups: torch.Tensor) -> list[int]:
    """Slots of one token that are the last of their group (rank), ascending."""
    seen: dict[int, int] = {}
    for k, g in enumerate(groups.tolist()):
        if g >= 0:
            seen[g] = k
    return sorted(seen.values())


def roundtrip(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_topk: int, num_experts: int,
              options: dict) -> dict:
    """One dispatch (then its cached repeat) and one combine, every output checked; returns the checks made.
    ``options``: fp8, expand, alignment, cpu_sync (default True), masked, num_bias, tma_sf, and
    ranks_per_node (the group split into nodes by MOE_COMM_RANKS_PER_NODE: hybrid mode)."""
    options = dict(options)
    per_node = options.pop("ranks_per_node", None)
    if per_node is None:
        return _roundtrip(group, num_tokens, hidden, num_topk, num_experts, **options)
    os.environ["MOE_COMM_RANKS_PER_NODE"] = str(per_node)
    try:
        return _roundtrip(group, num_tokens, hidden, num_topk, num_experts, ranks_per_node=per_node, **options)
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)


def _expected_sum(t: int, ranks: torch.Tensor, biases: tuple, rank: int, max_tokens: int, hidden: int,
                  per_node: Optional[int]) -> torch.Tensor:
    """DeepEP V2's sum for token t: biases first, then each rank's row in the order of its last slot (fp32,
    rounded once); in hybrid mode each node's ranks summed (rounded) first, the nodes in the same order."""
    def row(r: int) -> torch.Tensor:
        return _contribution(torch.tensor([rank * max_tokens + t]), r, hidden)[0].float()

    acc = torch.zeros(hidden, dtype=torch.float32)
    for b in biases:
        acc += b[t].float()
    if per_node is None:
        for k in _last_slots(ranks):
            acc += row(int(ranks[k]))
        return acc.to(torch.bfloat16)
    nodes = torch.where(ranks >= 0, torch.div(ranks, per_node, rounding_mode="floor"), -1)
    for k in _last_slots(nodes):
        part = torch.zeros(hidden, dtype=torch.float32)
        for j in _last_slots(torch.where(nodes == nodes[k], ranks, -1)):
            part += row(int(ranks[j]))
        acc += part.to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _roundtrip(group: dist.ProcessGroup, num_tokens: int, hidden: int, num_topk: int, num_experts: int, *,
               fp8: bool = False, expand: bool = False, alignment: int = 1, cpu_sync: bool = True,
               masked: bool = False, num_bias: int = 0, tma_sf: bool = False,
               ranks_per_node: Optional[int] = None, multi: bool = True) -> dict:
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    max_tokens = num_tokens + 2
    my_tokens = max(num_tokens - rank, 0)  # ranks send different counts, as DeepEP's test does
    buf = moe_comm.ElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=hidden, num_topk=num_topk,
                                 explicitly_destroy=True, num_cpu_timeout_secs=60, allow_multiple_reduction=multi)
    inputs = _inputs(rank, my_tokens, hidden, num_topk, num_experts, masked, fp8)
    every = {k: _gather(group, v) for k, v in inputs.items()}
    per_rank = num_experts // num_ranks
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    checks = 0

    # what this rank must receive: source rank, then token, ascending
    exp_x, exp_sf, exp_idx, exp_w, exp_meta = [], [], [], [], []
    for s in range(num_ranks):
        idx_s = every["topk_idx"][s]
        for t in range(idx_s.shape[0]):
            local = (idx_s[t] >= lo) & (idx_s[t] < hi)
            if bool(local.any()):
                exp_x.append(every["x"][s][t])
                if fp8:
                    exp_sf.append(every["sf"][s][t])
                exp_idx.append(torch.where(local, idx_s[t] - lo, -1))
                exp_w.append(torch.where(local, every["topk_weights"][s][t], 0.0))
                exp_meta.append(s * max_tokens + t)
    num_recv = len(exp_x)
    x_arg = (inputs["x"], inputs["sf"]) if fp8 else inputs["x"]
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
        x_arg, topk_idx=inputs["topk_idx"], topk_weights=inputs["topk_weights"], num_experts=num_experts,
        expert_alignment=alignment, do_cpu_sync=cpu_sync, do_expand=expand, do_zero_padding=expand,
        use_tma_aligned_col_major_sf=tma_sf, async_with_compute_stream=True)
    event.current_stream_wait()
    data, sf = recv_x if fp8 else (recv_x, None)
    rows = handle.recv_src_metadata.shape[0]
    assert rows == (num_recv if cpu_sync else num_ranks * max_tokens), (rows, num_recv)
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == num_recv
    meta = handle.recv_src_metadata[:num_recv, 0].tolist()
    assert meta == exp_meta, (meta, exp_meta)
    counts = [sum(int((i == e).sum()) for i in exp_idx) for e in range(per_rank)]
    aligned = [-(-c // alignment) * alignment for c in counts]
    assert handle.num_recv_tokens_per_expert_list == (aligned if cpu_sync else [])
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == counts
    checks += 5
    if sf is not None:
        assert sf.stride() == ((1, -(-sf.shape[0] // 4) * 4) if tma_sf else (sf.shape[1], 1)), sf.stride()
        checks += 1
    if not expand:
        if num_recv:
            assert torch.equal(data[:num_recv].view(torch.uint8), torch.stack(exp_x).view(torch.uint8))
        assert torch.equal(recv_idx[:num_recv], torch.stack(exp_idx)) if num_recv else True
        assert torch.equal(recv_w[:num_recv], torch.stack(exp_w)) if num_recv else True
        if sf is not None and num_recv:
            assert torch.equal(sf[:num_recv], torch.stack(exp_sf))
        assert handle.psum_num_recv_tokens_per_expert.tolist() == torch.tensor(aligned).cumsum(0).tolist()
        assert (recv_idx[num_recv:] == -1).all() and (data[num_recv:].view(torch.uint8) == 0).all()
        checks += 6
    else:
        assert recv_idx is None
        starts = [sum(aligned[:e]) for e in range(per_rank)]
        assert handle.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(starts, counts)]
        slots = handle.recv_src_metadata[:num_recv, 2:]
        filled = torch.zeros(data.shape[0], dtype=torch.bool)
        for i in range(num_recv):
            for k in range(num_topk):
                e = int(exp_idx[i][k])
                assert (int(slots[i, k]) >= 0) == (e >= 0)
                if e >= 0:
                    row = int(slots[i, k])
                    assert starts[e] <= row < starts[e] + counts[e]
                    assert torch.equal(data[row].view(torch.uint8), exp_x[i].view(torch.uint8))
                    assert float(recv_w[row]) == float(exp_w[i][k])
                    if sf is not None:
                        assert torch.equal(sf[row], exp_sf[i])
                    filled[row] = True
        assert (data[~filled].view(torch.uint8) == 0).all() and (recv_w[~filled] == 0).all()
        checks += 4

    # the cached repeat gives the same rows
    again = buf.dispatch(x_arg, handle=handle, topk_weights=inputs["topk_weights"], do_expand=expand,
                         use_tma_aligned_col_major_sf=tma_sf)
    again_x = again[0][0] if fp8 else again[0]
    assert torch.equal(again_x.view(torch.uint8), data.view(torch.uint8)) and again[3] is handle
    assert torch.equal(again[2], recv_w)
    checks += 2

    # combine: rank r returns _contribution(token, r); the token's rank sums bias first, then each rank's row
    # in the order of the rank's last top-k slot, in fp32, rounded once
    src_global = handle.recv_src_metadata[:, 0].clamp(min=0)
    mine = _contribution(src_global, rank, hidden)
    if expand:
        # each expanded row holds the rank's row split over its slots: the slots' sum is what the rank returns
        combine_x = torch.zeros(data.shape[0], hidden, dtype=torch.bfloat16)
        for i in range(num_recv):
            first = [int(s) for s in handle.recv_src_metadata[i, 2:] if int(s) >= 0]
            combine_x[first[0]] = mine[i]
        combine_w = recv_w
    else:
        combine_x, combine_w = mine, recv_w
    g = torch.Generator().manual_seed(77 + rank)
    biases = tuple(torch.randn(my_tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(num_bias))
    bias = None if num_bias == 0 else biases[0] if num_bias == 1 else biases
    out, out_w, _ = buf.combine(combine_x, handle, topk_weights=combine_w if multi or not expand else None,
                                bias=bias)
    ranks_of = torch.where(inputs["topk_idx"] >= 0, torch.div(inputs["topk_idx"], per_rank, rounding_mode="floor"), -1)
    assert buf.get_logical_domain_size() == ((num_ranks // ranks_per_node, ranks_per_node) if ranks_per_node
                                             else (1, num_ranks))
    expect = torch.empty(my_tokens, hidden, dtype=torch.bfloat16)
    for t in range(my_tokens):
        if expand and not multi:  # each slot's row returns alone: a rank's row counts at its first slot
            first = torch.tensor([r if r >= 0 and r not in ranks_of[t, :k].tolist() else -1
                                  for k, r in enumerate(ranks_of[t].tolist())])
            expect[t] = _expected_sum(t, first, biases, rank, max_tokens, hidden, None)
        else:
            expect[t] = _expected_sum(t, ranks_of[t], biases, rank, max_tokens, hidden,
                                      ranks_per_node if multi else None)
    assert torch.equal(out, expect)
    assert (out_w is None) if expand and not multi else torch.equal(out_w, inputs["topk_weights"])
    checks += 2
    buf.destroy()
    return {"rank": rank, "checks": checks, "num_recv": num_recv}


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # compared across ranks by the test
        return type(exc).__name__, str(exc)
    return "no exception", ""


def one_rank_rejects(group: dist.ProcessGroup, case: str) -> dict:
    """Rank 0 makes a bad call, the others a good one: every rank raises (rank 0 its own error, the others a
    CrossRankMismatchError naming it), and the next good call works on every rank."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    buf = moe_comm.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, explicitly_destroy=True,
                                 num_cpu_timeout_secs=30)
    inputs = _inputs(rank, 8, 128, 2, 2 * num_ranks, False, False)
    good = dict(x=inputs["x"], topk_idx=inputs["topk_idx"], topk_weights=inputs["topk_weights"],
                num_experts=2 * num_ranks)
    bad = dict(good)
    if case == "num_sms":
        bad["num_sms"] = -1
    elif case == "too_many_tokens":
        bad["num_max_tokens_per_rank"] = 4
    elif case == "duplicate_expert":
        idx = inputs["topk_idx"].clone()
        idx[3, 1] = idx[3, 0]
        bad["topk_idx"] = idx
    elif case == "zero_padding_without_expand":
        bad["do_zero_padding"] = True
    elif case == "weights_shape":
        bad["topk_weights"] = inputs["topk_weights"][:, :1]
    elif case == "num_max_tokens_differs":  # valid on rank 0 alone: the ranks disagree
        bad["num_max_tokens_per_rank"] = 16
    else:
        raise ValueError(case)
    outcome = _outcome(lambda: buf.dispatch(**(bad if rank == 0 else good)))
    recv_x, _, _, handle, _ = buf.dispatch(**good)
    out, _, _ = buf.combine(torch.zeros(recv_x.shape, dtype=torch.bfloat16), handle)
    assert out.shape == inputs["x"].shape
    buf.destroy()
    return {"rank": rank, "outcome": outcome}


def facts(group: dist.ProcessGroup) -> dict:
    """The non-exchange surface: sizes, domains, QP counts, barrier, capture, destroy's rule, refusals."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    hint = moe_comm.ElasticBuffer.get_buffer_size_hint(group, 64, 512, 8, use_fp8_dispatch=True)
    assert hint > 0 and hint % (2 << 20) == 0
    buf = moe_comm.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, allow_hybrid_mode=False)
    assert buf.num_bytes == moe_comm.ElasticBuffer.get_buffer_size_hint(group, 8, 128, allow_hybrid_mode=False)
    assert buf.get_logical_domain_size() == (1, num_ranks) == moe_comm.buffer.elastic.get_logical_domain_size(
        group, allow_hybrid_mode=False)
    assert (buf.rank_idx, buf.num_ranks, buf.scaleup_rank_idx, buf.scaleout_rank_idx) == (rank, num_ranks, rank, 0)
    assert buf.num_allocated_qps == 17 and buf.get_theoretical_num_qps(4) == 4 and buf.get_theoretical_num_qps(64) == 9
    buf.barrier()
    assert isinstance(buf.capture(), moe_comm.EventHandle)
    refused = []
    for name, args in (("pp_send", (torch.zeros(4), 0)), ("all_gather", (torch.zeros(4),)),
                       ("engram_fetch", (torch.zeros(1, 1, dtype=torch.int32),)), ("create_agrs_session", ())):
        try:
            getattr(buf, name)(*args)
        except NotImplementedError as exc:
            refused.append(f"ElasticBuffer.{name}: not implemented" in str(exc))
    try:
        buf.destroy()
        destroy = "no exception"
    except RuntimeError as exc:
        destroy = str(exc)
    return {"rank": rank, "refused": refused, "destroy": destroy}
