"""A CPU port of DeepEP's test_intranode: layout, dispatch (BF16 and FP8, with and without top-k,
cached, worst-token padding) and combine (weights, biases), on 1 to 4 ranks (and 8)."""
import pytest

from helpers.intranode_cases import intranode

CASES = [
    # world, tokens, hidden, topk, experts, variant, expert_alignment
    (1, 64, 256, 4, 8, "plain", 1),
    (2, 96, 256, 8, 16, "plain", 1),
    (3, 77, 384, 6, 12, "minus_one", 4),
    (4, 64, 256, 8, 32, "plain", 1),
    (4, 48, 256, 4, 16, "minus_one", 1),
    (3, 40, 128, 3, 9, "silent_last", 1),
    (2, 32, 128, 2, 8, "empty_first", 8),
]


@pytest.mark.parametrize("world_size,tokens,hidden,topk,experts,variant,alignment", CASES)
def test_intranode(worlds, world_size, tokens, hidden, topk, experts, variant, alignment):
    results = worlds(world_size).run(intranode, tokens, hidden, topk, experts, variant, alignment)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["checks"] == 24 for r in results)


def test_intranode_eight_ranks(worlds):
    results = worlds(8).run(intranode, 16, 128, 4, 16, "minus_one", 2)
    assert all(r["checks"] == 24 for r in results)
