"""The low-latency layout ops (``_C`` kernels) against their plain-torch references, exactly."""
from __future__ import annotations

import pytest
import torch

from moe_comm.ops.records import RecordLayout, pack_rows
from moe_comm.protocol.low_latency_layout import (combine_rows, combine_rows_reference, low_latency_unpack,
                                                  low_latency_unpack_reference, send_order, send_order_reference)


def _records(seed: int, num_ranks: int, local: int, tokens: int, hidden: int, scales: bool):
    """Records as num_ranks sources would send them to one rank, concatenated in source order."""
    g = torch.Generator().manual_seed(seed)
    specs = [("x", torch.uint8, hidden)] + ([("scales", torch.float32, hidden // 128)] if scales else [])
    layout = RecordLayout.build(specs + [("src", torch.int32, 1), ("expert", torch.int32, 1)])
    parts, counts = [], []
    for s in range(num_ranks):
        topk = torch.stack([torch.randperm(local, generator=g)[:2] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, 2, dtype=torch.int64)
        topk[torch.rand(topk.shape, generator=g) < 0.3] = -1
        msg, experts, _ = send_order(topk, local, 1)
        fields = [torch.randint(0, 256, (tokens, hidden), dtype=torch.uint8, generator=g)]
        fields += [torch.randn(tokens, hidden // 128, generator=g)] if scales else []
        fields += [torch.arange(tokens, dtype=torch.int32).unsqueeze(1) + 1000 * s, None]
        rec = pack_rows(layout, fields, msg // 2)
        layout.view(rec, "expert").copy_(experts.to(torch.int32).unsqueeze(1))
        parts.append(rec)
        counts.append(rec.shape[0])
    return layout, torch.cat(parts), counts


def _outputs(local: int, rows: int, hidden: int, scales: bool, num_ranks: int):
    x = torch.zeros(local, rows, hidden, dtype=torch.uint8)
    sc = torch.zeros(local, hidden // 128, rows).transpose(1, 2) if scales else None  # DeepEP's column-major view
    return [x, sc, torch.full((local, rows), -1, dtype=torch.int32), torch.zeros(local, num_ranks, dtype=torch.int64),
            torch.zeros(local, dtype=torch.int32)]


@pytest.mark.parametrize("num_ranks,local,tokens,hidden,scales", [(1, 3, 5, 128, False), (3, 4, 17, 256, True),
                                                                  (4, 2, 0, 128, True), (2, 6, 33, 384, False)])
def test_low_latency_unpack_matches_reference(num_ranks, local, tokens, hidden, scales):
    layout, records, counts = _records(num_ranks * 10 + local, num_ranks, local, tokens, hidden, scales)
    rows = num_ranks * max(tokens, 1)
    got, want = _outputs(local, rows, hidden, scales, num_ranks), _outputs(local, rows, hidden, scales, num_ranks)
    low_latency_unpack(layout, records, counts, *got)
    low_latency_unpack_reference(layout, records, counts, *want)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    x, _, src, ranges, count = got
    assert int(count.sum()) == records.shape[0]
    for e in range(local):  # blocks by source ascending, tokens ascending inside a block
        n = int(count[e])
        assert torch.equal((ranges[e] >> 32), torch.cumsum(ranges[e] & 0xFFFFFFFF, 0) - (ranges[e] & 0xFFFFFFFF))
        assert torch.equal(src[e, :n], src[e, :n].sort().values) and bool((src[e, n:] == -1).all())
        assert not x[e, n:].any()


def test_low_latency_unpack_rejects_bad_expert_ids():
    layout, records, counts = _records(1, 2, 3, 4, 128, False)
    layout.view(records, "expert")[0] = 7
    with pytest.raises(ValueError, match=r"low_latency_unpack: record 0 from rank 0 names local expert 7, "
                                         r"outside \[0, 3\)"):
        low_latency_unpack(layout, records, counts, *_outputs(3, 8, 128, False, 2))


@pytest.mark.parametrize("tokens,topk,experts,ranks", [(0, 3, 8, 2), (1, 1, 1, 1), (37, 5, 12, 3), (64, 8, 32, 4)])
def test_send_order_matches_reference(tokens, topk, experts, ranks):
    g = torch.Generator().manual_seed(tokens + topk)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, topk, dtype=torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
    got, want = send_order(idx, experts, ranks), send_order_reference(idx, experts, ranks)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
    assert torch.equal(got[1], idx.view(-1)[got[0]])  # each message's expert is its top-k entry
    assert sum(got[2]) == int((idx >= 0).sum())


def test_send_order_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = 9 is outside \[-1, 8\)"):
        send_order(torch.tensor([[0, 1], [9, 2]]), 8, 2)


@pytest.mark.parametrize("local,ranks,rows", [(1, 1, 4), (3, 2, 10), (4, 4, 16)])
def test_combine_rows_matches_reference(local, ranks, rows):
    g = torch.Generator().manual_seed(local * ranks)
    counts = torch.randint(0, rows // ranks + 1, (local, ranks), generator=g)
    begins = counts.cumsum(1) - counts
    layout_range = (begins << 32) | counts
    got, want = combine_rows(layout_range, rows), combine_rows_reference(layout_range, rows)
    assert torch.equal(got, want) and got.shape[0] == int(counts.sum())
