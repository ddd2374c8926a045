"""The routing digests of the handshake and the handle checks behind them: native kernels bitwise
equal to their references, and sensitive to every change a tampered handle can make."""
import pytest
import torch

from moe_comm.protocol.digest import (digests, digests_reference, low_latency_combine_digests,
                                      low_latency_combine_digests_reference, sent_tokens, sent_tokens_reference)
from moe_comm.protocol.handle import plan_sends
from moe_comm.protocol.low_latency_layout import layout_range_check, layout_range_check_reference, send_order


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("counts", [[], [0], [5], [3, 0, 7, 1], [0, 0, 0], [131, 496, 33]])
def test_block_digests_match_the_reference(dtype, counts):
    keys = torch.randint(-2**31, 2**31 - 1, (sum(counts),), dtype=torch.int64).to(dtype)
    assert digests(keys, counts) == digests_reference(keys, counts)
    assert all(0 <= d < 2**62 for d in digests(keys, counts))


def test_block_digest_changes_with_any_key_its_position_or_the_block_split():
    keys = torch.arange(40, dtype=torch.int32) * 7
    base = digests(keys, [10, 30])
    for at in (0, 9, 10, 39):
        changed = keys.clone()
        changed[at] += 1
        assert digests(changed, [10, 30]) != base, at
    swapped = keys.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert digests(swapped, [10, 30])[0] != base[0] and digests(swapped, [10, 30])[1] == base[1]
    assert digests(keys, [11, 29]) != base
    assert digests(keys.long(), [10, 30]) == base  # a key is its value, whatever its width


def test_block_digests_check_their_counts():
    with pytest.raises(ValueError, match=r"block_digests: blocks of 5 keys in all, but 4 keys"):
        digests(torch.zeros(4, dtype=torch.int32), [2, 3])
    with pytest.raises(ValueError, match=r"block_digests: counts\[1\] = -1 is negative"):
        digests(torch.zeros(4, dtype=torch.int32), [5, -1])


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_sent_tokens_match_the_reference_and_find_a_moved_send_head(num_ranks):
    g = torch.Generator().manual_seed(num_ranks)
    in_rank = torch.rand(131, num_ranks, generator=g) < 0.4
    head = plan_sends(in_rank).send_pos
    counts, sums, wrong = sent_tokens(in_rank, head)
    assert (counts, sums, wrong) == sent_tokens_reference(in_rank, head)
    assert wrong is None and counts == in_rank.sum(0).tolist()
    assert sums == digests(plan_sends(in_rank).send_rows, counts)
    t, r = (int(i) for i in in_rank.nonzero()[17])
    for delta in (1, -1, 2**30):
        moved = head.clone()
        moved[t, r] += delta
        assert sent_tokens(in_rank, moved)[2] == (t, r) == sent_tokens_reference(in_rank, moved)[2]
    unsent = (~in_rank).nonzero()
    if unsent.shape[0]:
        t, r = (int(i) for i in unsent[0])
        moved = head.clone()
        moved[t, r] = 0
        assert sent_tokens(in_rank, moved)[2] == (t, r) == sent_tokens_reference(in_rank, moved)[2]


def _ll_handle(num_ranks: int, local: int, rows: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, rows // num_ranks + 1, (local, num_ranks), generator=g)
    layout_range = (counts.cumsum(1) - counts) << 32 | counts
    src_info = torch.randint(0, 50, (local, rows), dtype=torch.int32, generator=g)
    return layout_range, src_info


@pytest.mark.parametrize("num_ranks,local", [(1, 3), (2, 2), (4, 3)])
def test_low_latency_combine_digests_match_the_reference(num_ranks, local):
    g = torch.Generator().manual_seed(num_ranks * 10 + local)
    rows = 8 * num_ranks
    layout_range, src_info = _ll_handle(num_ranks, local, rows, g)
    topk = torch.stack([torch.randperm(local * num_ranks, generator=g)[:2] for _ in range(11)])
    topk[3, 1] = -1
    msg, experts, send_counts = send_order(topk, local * num_ranks, num_ranks)
    got = low_latency_combine_digests(layout_range, src_info, msg, experts, send_counts, 2)
    assert got == low_latency_combine_digests_reference(layout_range, src_info, msg, experts, send_counts, 2)
    assert layout_range_check(layout_range, rows) is None is layout_range_check_reference(layout_range, rows)


def test_layout_range_check_finds_shifted_overlapping_and_overlong_blocks():
    g = torch.Generator().manual_seed(1)
    layout_range, _ = _ll_handle(3, 2, 24, g)
    layout_range[:, 0] = 4  # every expert gets 4 rows from source 0 (begins 0), so later begins are >= 4
    layout_range[:, 1:] = 0
    counts = layout_range & 0xFFFFFFFF
    layout_range = (counts.cumsum(1) - counts) << 32 | counts
    cases = {
        "begin shifted": (0, 1, layout_range[0, 1] + (1 << 32)),
        "begin back": (1, 2, layout_range[1, 2] - (1 << 32)),
        "negative": (1, 0, -1),
        "overlong": (0, 2, (4 << 32) | 21),
        "first not at 0": (1, 0, (1 << 32) | 3),
    }
    for name, (e, s, value) in cases.items():
        bad = layout_range.clone()
        bad[e, s] = value
        assert layout_range_check(bad, 24) == (e, s) == layout_range_check_reference(bad, 24), name
