"""The host-side C++ of the vendor backends (csrc/ascend/mc2_limits.cpp, csrc/cpu/expert_rows.cpp)
through moe_comm._C: MC2's documented limits and sizes, and the bounds-checked row copy between the
vendors' expert-grouped rows and DeepEP's packed layout."""
from __future__ import annotations

import pytest
import torch

from moe_comm.core.native import native

C = native()


def _args(product="A2", version=2, alg="", ep=16, experts=64, hidden=7168, batch=128, topk=8, quant=False):
    return (product, version, alg, ep, experts, hidden, batch, topk, quant)


@pytest.mark.parametrize("args,message", [
    (_args(), ""),
    (_args(product="A3", ep=288, experts=288), ""),
    (_args(version=1, ep=8), "ep_world_size must be one of {16, 32, 64} on Atlas A2 (v1), got 8"),
    (_args(product="A3", version=1, hidden=4096), "hidden must be 7168 on Atlas A3 (v1), got 4096"),
    (_args(version=1, alg="fullmesh"), "comm_alg is a v2 argument on Atlas A2 (v1): leave it empty"),
    (_args(alg="hierarchy", ep=8), "ep_world_size must be one of {16, 32, 64} on Atlas A2 (v2, comm_alg "
                                   "'hierarchy'), got 8"),
    (_args(product="A3", alg="hierarchy", ep=24, experts=48),
     "ep_world_size must be a multiple of 16 in [16, 256] on Atlas A3 (v2, comm_alg 'hierarchy'), got 24"),
    (_args(experts=60), "moe_expert_num must be a multiple of ep_world_size 16 on Atlas A2 (v2, comm_alg ''), got 60"),
    (_args(ep=2, experts=64), "moe_expert_num / ep_world_size (local experts) must be at most 24 on Atlas A2 (v2, "
                              "comm_alg ''), got 32"),
    (_args(alg="hierarchy", ep=16, experts=512, hidden=10240), ""),
    (_args(experts=2048), "moe_expert_num must be in [1, 1024] on Atlas A2 (v2, comm_alg ''), got 2048"),
    (_args(batch=257), "num_max_dispatch_tokens_per_rank (the operators' BS) must be in [1, 256] on Atlas A2 (v2, "
                       "comm_alg ''), got 257"),
    (_args(product="A3", alg="fullmesh_v2", ep=16, topk=13),
     "num_topk (the operators' K) must be in [1, 12] on Atlas A3 (v2, comm_alg 'fullmesh_v2'), got 13"),
])
def test_mc2_limits_are_the_documented_ones(args, message):
    assert C.mc2_check(*args) == message


def test_mc2_sizes_follow_the_documented_formulas():
    # A = BS * ep * min(local experts, K)
    assert C.mc2_recv_rows(*_args(ep=16, experts=64, batch=128, topk=8)) == 128 * 16 * 4
    # A2: 2 * (A * H * 2 B + 2 MB), in MB rounded up
    a = 128 * 16 * 4
    assert C.mc2_min_buffsize_mb(*_args()) == -(-2 * (a * 7168 * 2 + (2 << 20)) // (1 << 20))
    # A3: 2 + BS * 2 * (H + 128) * (ep * local + K + 1) * 2 B, in MB rounded up
    need = 2 * 128 * 2 * (7168 + 128) * (16 * 4 + 8 + 1)
    assert C.mc2_min_buffsize_mb(*_args(product="A3")) == 2 + -(-need // (1 << 20))
    with pytest.raises(ValueError, match="product must be 'A2' or 'A3', got 'A1'"):
        C.mc2_check(*_args(product="A1"))


def test_grouped_rows_round_trip_through_the_packed_layout():
    counts, capacity, width = [2, 0, 3], 4, 5
    grouped = torch.arange(7 * width, dtype=torch.int16).view(7, width)
    packed = torch.full((3, capacity, width), -1, dtype=torch.int16)
    C.grouped_to_packed(packed.data_ptr(), grouped.data_ptr(), counts, capacity, 7, width * 2)
    assert torch.equal(packed[0, :2], grouped[:2]) and torch.equal(packed[2, :3], grouped[2:5])
    assert bool((packed[0, 2:] == -1).all()) and bool((packed[1] == -1).all()) and bool((packed[2, 3:] == -1).all())
    back = torch.full((7, width), -1, dtype=torch.int16)
    C.packed_to_grouped(packed.data_ptr(), back.data_ptr(), counts, capacity, 7, width * 2)
    assert torch.equal(back[:5], grouped[:5]) and bool((back[5:] == -1).all())


@pytest.mark.parametrize("counts,message", [
    ([2, 5, 0], "counts[1] = 5 is outside [0, 4] (rows one expert can hold)"),
    ([-1, 0, 0], "counts[0] = -1 is outside [0, 4] (rows one expert can hold)"),
    ([4, 4, 0], "the counts sum to 8, more than the 7 grouped rows"),
])
def test_counts_that_would_copy_out_of_bounds_are_refused_before_any_copy(counts, message):
    grouped = torch.zeros(7, 5, dtype=torch.int16)
    packed = torch.full((3, 4, 5), -1, dtype=torch.int16)
    assert C.check_expert_counts(counts, 4, 7) == message
    for fn in ("grouped_to_packed", "packed_to_grouped"):
        with pytest.raises(ValueError, match=f"{fn}: " + message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("]", r"\]")):
            getattr(C, fn)(packed.data_ptr(), grouped.data_ptr(), counts, 4, 7, 10)
    assert bool((packed == -1).all())
