"""DeepEP's internode forms, checked inside each rank against references built from every rank's
routing (all-gathered): num_tokens_per_rdma_rank, the 10-tuple handle's fields, rows, cached dispatch,
and the two-level combine sum."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import Config
from moe_comm.ops import per_token_cast_to_fp8


def _gather(group: dist.ProcessGroup, t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (rows may differ per rank; trailing shape and dtype must not)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([t.shape[0]]), group=group)
    width = max(int(s) for s in sizes)
    wire = torch.int32 if t.dtype in (torch.int16, torch.bfloat16) else t.dtype  # gloo has no 16-bit types
    padded = torch.zeros((width,) + tuple(t.shape[1:]), dtype=wire)
    padded[:t.shape[0]] = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    got = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(got, padded, group=group)
    back = (lambda g: g.to(torch.int16).view(torch.bfloat16)) if t.dtype == torch.bfloat16 else \
        (lambda g: g.to(t.dtype))
    return [back(g[:int(s)]) for g, s in zip(got, sizes)]


def _bits(row: torch.Tensor) -> int:
    return sum(1 << i for i, v in enumerate(row.tolist()) if v)


def _reference_fields(rank: int, num_ranks: int, L: int, C: int, in_ranks: list[torch.Tensor]) -> dict:
    """The 10-tuple's fields from DeepEP's definitions, computed plainly (loops) from every rank's
    is_token_in_rank; DeepEP's arrival-ordered slots taken in source node, then token order."""
    Rn = -(-num_ranks // L)
    node, local = rank // L, rank % L

    def channel_of(t: int, T: int) -> int:
        return t // max(-(-T // C), 1)

    def node_cols(n: int) -> range:
        return range(n * L, min((n + 1) * L, num_ranks))

    mine = in_ranks[rank]
    T = mine.shape[0]
    rdma = torch.zeros(Rn, C, dtype=torch.int32)
    head = torch.full((T, Rn), -1, dtype=torch.int32)
    seen = [[0] * C for _ in range(Rn)]
    for t in range(T):
        c = channel_of(t, T)
        for n in range(Rn):
            if mine[t, list(node_cols(n))].any():
                rdma[n, c] += 1
                head[t, n] = seen[n][c]
                seen[n][c] += 1
    rdma = rdma.cumsum(1).to(torch.int32)

    recv_rdma = torch.zeros(Rn, C, dtype=torch.int32)
    forwarded = []  # (channel, bits) of the tokens this rank forwards, by source node then token
    for n in range(Rn):
        s = n * L + local
        if s >= num_ranks:
            continue
        src = in_ranks[s]
        for t in range(src.shape[0]):
            row = src[t, list(node_cols(node))]
            if row.any():
                recv_rdma[n, channel_of(t, src.shape[0])] += 1
                forwarded.append((channel_of(t, src.shape[0]), _bits(row)))
    recv_rdma = recv_rdma.cumsum(1).to(torch.int32)
    nvl_head = torch.full((len(forwarded), 8), -1, dtype=torch.int32)
    counts = [[0] * 8 for _ in range(C)]
    for i, (c, b) in enumerate(forwarded):
        for j in range(8):
            if b >> j & 1:
                nvl_head[i, j] = counts[c][j]
                counts[c][j] += 1

    received = [int(in_ranks[s][:, rank].sum()) for s in range(num_ranks)]
    gbl = torch.tensor(received).cumsum(0).to(torch.int32)
    recv_gbl_chan = torch.zeros(num_ranks, C, dtype=torch.int32)
    meta = []
    for s in range(num_ranks):
        src = in_ranks[s]
        start = int(gbl[s]) - received[s]
        per_chan = [0] * C
        for t in range(src.shape[0]):
            if src[t, rank]:
                per_chan[channel_of(t, src.shape[0])] += 1
                meta.append((s // L, _bits(src[t, list(node_cols(node))])))
        recv_gbl_chan[s] = torch.tensor([start + sum(per_chan[:c]) for c in range(C)], dtype=torch.int32)
    meta_t = torch.tensor(meta, dtype=torch.int32).view(-1, 2).view(torch.uint8).view(-1, 8)
    return dict(rdma=rdma, recv_rdma=recv_rdma, recv_rdma_sum=recv_rdma[:, -1].cumsum(0).to(torch.int32),
                recv_gbl_chan=recv_gbl_chan, gbl=gbl, meta=meta_t, head=head, nvl_head=nvl_head)


def internode(group: dist.ProcessGroup, ranks_per_node: Optional[int], num_tokens: int, hidden: int, num_topk: int,
              num_experts: int, num_sms: int = 8) -> dict[str, Any]:
    """Runs with ``MOE_COMM_RANKS_PER_NODE=ranks_per_node`` (None: unset, e.g. 16 ranks as two 8-rank nodes)."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    if ranks_per_node is not None:
        os.environ["MOE_COMM_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        buffer = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)
    checks = 0
    try:
        topo = buffer.topology
        L = ranks_per_node or 8
        assert topo.internode and topo.ranks_per_node == L, topo
        torch.manual_seed(rank)
        x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
        scores = torch.randn(num_tokens, num_experts).abs() + 1
        topk_idx = torch.topk(scores, num_topk, dim=-1).indices
        topk_idx[torch.rand(num_tokens, num_topk) < 0.1] = -1
        topk_weights = torch.rand(num_tokens, num_topk)
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        Rn = topo.num_nodes
        expect_node = torch.tensor([int(in_rank[:, n * L:(n + 1) * L].any(1).sum()) for n in range(Rn)],
                                   dtype=torch.int32)
        assert per_node is not None and per_node.dtype == torch.int32 and torch.equal(per_node, expect_node)
        checks += 1

        config = Config(num_sms, 6, 256, 6, 128)
        C = config.num_channels
        recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, config=config)
        assert isinstance(handle, tuple) and len(handle) == 10
        shapes = [(num_tokens, num_ranks), (Rn, C), (num_ranks, C), (Rn, C), (Rn,), (num_ranks, C), (num_ranks,),
                  (recv_x.shape[0], 8), (num_tokens, Rn), (None, 8)]
        dtypes = [torch.bool] + [torch.int32] * 6 + [torch.uint8, torch.int32, torch.int32]
        for i, (t, shape, dtype) in enumerate(zip(handle, shapes, dtypes)):
            assert t.dtype == dtype and all(a == b for a, b in zip(t.shape, shape) if b is not None), (i, t.shape)
        checks += 1

        in_ranks = _gather(group, in_rank)
        ref = _reference_fields(rank, num_ranks, L, C, in_ranks)
        names = ["rdma", None, "recv_rdma", "recv_rdma_sum", "recv_gbl_chan", "gbl", "meta", "head", "nvl_head"]
        for name, got in zip(names, handle[1:]):
            if name is not None:
                assert torch.equal(got, ref[name]), (name, got.tolist(), ref[name].tolist())
        assert torch.equal(handle[0], in_rank)
        checks += 1

        # rows: by global source rank, then token (the same order as one node)
        xs, idxs = _gather(group, x), in_ranks
        expect = torch.cat([xs[s][idxs[s][:, rank]] for s in range(num_ranks)])
        assert torch.equal(recv_x, expect)
        assert handle[-4][-1] == recv_x.shape[0]
        checks += 1

        cached, *_ = buffer.dispatch(x, handle=handle, config=config)
        assert torch.equal(cached, recv_x)
        fp8 = per_token_cast_to_fp8(x)
        (cached_fp8, cached_scales), *_ = buffer.dispatch(fp8, handle=handle, config=config)
        assert torch.equal(cached_scales, torch.cat([s[i[:, rank]] for s, i in zip(_gather(group, fp8[1]), idxs)]))
        checks += 1

        # combine: two-level sums, each node's ranks then the nodes, with biases and weights
        y = (recv_x.float() * (rank + 1) / 3).to(torch.bfloat16)
        bias = (torch.randn(num_tokens, hidden).to(torch.bfloat16), torch.randn(num_tokens, hidden).to(torch.bfloat16))
        out, out_w, _ = buffer.combine(y, handle, topk_weights=recv_w, bias=bias, config=Config(num_sms, 4, 256, 6, 128))
        ys, ws = _gather(group, y), _gather(group, recv_w)
        prefix = _gather(group, handle[-4])
        expect = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
        expect_w = torch.empty(num_tokens, num_topk)
        rows_of = []  # for each source rank r, row of my token t in r's received rows
        for r in range(num_ranks):
            start = int(prefix[r][rank - 1]) if rank else 0
            mine = in_rank[:, r].nonzero().view(-1).tolist()
            rows_of.append({t: start + i for i, t in enumerate(mine)})
        for t in range(num_tokens):
            total, total_w = torch.zeros(hidden), torch.zeros(num_topk)
            for n in range(Rn):
                part, part_w, any_row = torch.zeros(hidden), torch.zeros(num_topk), False
                for r in range(n * L, min((n + 1) * L, num_ranks)):
                    if t in rows_of[r]:
                        part = part + ys[r][rows_of[r][t]].float()
                        part_w = part_w + ws[r][rows_of[r][t]]
                        any_row = True
                if any_row:
                    total = total + part.to(torch.bfloat16).float()
                    total_w = total_w + part_w
            expect[t] = ((total + bias[0][t].float()) + bias[1][t].float()).to(torch.bfloat16)
            expect_w[t] = total_w
        assert torch.equal(out, expect) and torch.equal(out_w, expect_w)
        checks += 1

        # a tuple rebuilt from the 10 fields cannot be used; a wrong num_tokens_per_rdma_rank is refused
        for call in (lambda: buffer.combine(y, tuple(handle), config=Config(num_sms, 4, 256, 6, 128)),
                     lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node + 1,
                                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                             topk_idx=topk_idx, topk_weights=topk_weights, config=config),
                     lambda: buffer.combine(y, handle, config=Config(num_sms, 200, 256, 6, 128))):
            try:
                call()
            except (TypeError, ValueError) as exc:
                assert "handle" in str(exc) or "num_tokens_per_rdma_rank" in str(exc) or "config" in str(exc), exc
                checks += 1
        # across nodes the RDMA ring sizes must agree (DeepEP's internode kernels size rings by them)
        try:
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                            config=Config(num_sms, 6, 256, 6 + rank % 2, 128))
        except moe_comm.CrossRankMismatchError as exc:
            assert "num_max_rdma_chunked_send_tokens" in str(exc), exc
            checks += 1
        digest = int(out.view(torch.int16).to(torch.int64).sum())
    finally:
        buffer.destroy()
    return dict(rank=rank, checks=checks, digest=digest, handle_len=len(handle))


def zero_token_rank(group: dist.ProcessGroup, ranks_per_node: int) -> dict:
    """Two nodes where the last rank has no tokens: its dispatch receives every row meant for it (the
    internode handle's exchanges carry no rows from it) and every rank's combine gives each token back
    once per rank it went to."""
    os.environ["MOE_COMM_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        buf = moe_comm.Buffer(group, explicitly_destroy=True, timeout_s=60)
        assert buf.topology.internode
        num_tokens = 0 if rank == num_ranks - 1 else 3 + rank
        g = torch.Generator().manual_seed(rank)
        experts = 2 * num_ranks
        idx = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(num_tokens)]) if num_tokens \
            else torch.empty(0, 2, dtype=torch.int64)
        x = torch.randn(num_tokens, 64, generator=g).bfloat16()
        recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(num_tokens, 2),
                                                  num_experts=experts)
        out, _, _ = buf.combine(recv_x, handle)
        copies = torch.zeros(num_tokens)
        for r in range(num_ranks):
            copies += ((idx // 2) == r).any(1).float() if num_tokens else 0
        expected = (x.float() * copies.unsqueeze(1)).bfloat16()
        buf.destroy()
        return {"rank": rank, "received": recv_x.shape[0], "combined": torch.equal(out, expected)}
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)
