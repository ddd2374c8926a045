"""The EP-MoE layer in every mode on 1 to 4 real gloo ranks, against the single-process references:
bit for bit ``ep_moe_reference`` (the same ops with all experts in one process), within the accuracy
standard of its fp64 specification, and the same on every run. Inputs include ranks with no
tokens, experts no token picks, -1 slots and micro-batches with no tokens."""
import pytest
import torch

from moe_comm.launch import LocalWorld
from moe_comm.moe import MODES
from moe_comm.ops import triton_usable
from moe_comm.ops.impl import tilelang_usable

from helpers.deadlines import found_within
from helpers.moe_cases import layer_from_logits, mismatched_chunks, moe_forward, skip_forward
from helpers.tiers import exhaustive

CASES = [
    # world, tokens per rank, hidden, intermediate, topk, experts, unused experts
    (1, [40], 256, 128, 4, 8, 2),
    (2, [24, 17], 256, 256, 4, 16, 2),
    (2, [9, 30], 384, 128, 3, 8, 4),       # rank 1's experts are never picked
    (3, [24, 0, 9], 128, 128, 5, 12, 1),   # rank 1 sends nothing
    (4, [16, 33, 3, 8], 512, 256, 6, 32, 3),
]


#: Every case in every mode, bf16 and fp8; the fast tier runs each (mode, dtype) once, the cases in turn.
_LAYER_RUNS = [pytest.param(*case, mode, fp8, id=f"{i}-{mode}-{'fp8' if fp8 else 'bf16'}",
                            marks=() if (2 * m + f) % len(CASES) == i else pytest.mark.exhaustive)
               for i, case in enumerate(CASES) for m, mode in enumerate(MODES) for f, fp8 in enumerate([False, True])]


@pytest.mark.parametrize("world_size,tokens,hidden,inter,topk,experts,unused,mode,fp8", _LAYER_RUNS)
def test_ep_moe_matches_dense_reference(worlds, world_size, tokens, hidden, inter, topk, experts, unused, mode, fp8):
    cfg = dict(tokens=tokens, hidden=hidden, inter=inter, topk=topk, experts=experts, unused=unused, mode=mode,
               num_chunks=3, fp8=fp8, seed=world_size)
    results = worlds(world_size).run(moe_forward, cfg)
    for rank, r in enumerate(results):
        assert r["shape"] == [tokens[rank], hidden] and r["dtype"] == "torch.bfloat16"
        assert r["bitwise_reference"], (rank, r["metrics"])
        assert r["accuracy"], (rank, r["reason"])
        assert r["repeatable"]
        if tokens[rank] > 4:  # a token with every slot -1 gets zeros; most tokens have a route
            assert r["nonzero_rows"] > tokens[rank] // 2


@pytest.mark.parametrize("num_chunks", [1, 4, 7])
def test_chunk_counts_including_empty_chunks(worlds, num_chunks):
    cfg = dict(tokens=[5, 2], hidden=128, inter=128, topk=2, experts=8, mode="chunked", num_chunks=num_chunks,
               seed=11)
    for r in worlds(2).run(moe_forward, cfg):
        assert r["bitwise_reference"] and r["accuracy"] and r["repeatable"], r


def test_results_are_identical_across_runs(worlds):
    cfg = dict(tokens=[20, 13, 7], hidden=256, inter=128, topk=4, experts=12, mode="chunked", num_chunks=2, seed=5)
    first, second = worlds(3).run(moe_forward, cfg), worlds(3).run(moe_forward, cfg)
    assert [r["digest"] for r in first] == [r["digest"] for r in second]
    assert len({r["digest"] for r in first}) == 3


@pytest.mark.parametrize("mode", MODES)
def test_layer_routes_from_logits(worlds, mode):
    for r in worlds(2).run(layer_from_logits, mode):
        assert r["layer_equals_functional"] and r["equals_reference"]
        assert r["buffers"] == ["correction_bias", "w13", "w2"]


def test_ranks_disagreeing_on_chunks_raise(worlds):
    for message in worlds(2).run(mismatched_chunks, timeout_s=60):
        assert message != "no error"
        assert "CrossRankMismatchError" in message or "CommTimeoutError" in message, message


@pytest.mark.parametrize("mode", MODES)
def test_ep_moe_on_triton_kernels(worlds, mode):
    """The layer on the Triton kernels (the interpreter on CPU: small shapes) matches its reference there too."""
    usable, why = triton_usable(torch.device("cpu"))
    if not usable:
        pytest.skip(why)
    cfg = dict(tokens=[6, 3], hidden=128, inter=128, topk=2, experts=4, mode=mode, num_chunks=2, fp8=mode == "two_batch",
               seed=2, impl="triton")
    for r in worlds(2).run(moe_forward, cfg):
        assert r["bitwise_reference"] and r["accuracy"] and r["repeatable"], r


@pytest.mark.parametrize("mode", MODES)
def test_ep_moe_on_tilelang_kernels(worlds, mode):
    """The layer on the TileLang programs (their CPU build) matches its reference on 2 ranks, FP8 included."""
    usable, why = tilelang_usable(torch.device("cpu"))
    if not usable:
        pytest.skip(why)
    cfg = dict(tokens=[6, 3], hidden=128, inter=128, topk=2, experts=4, mode=mode, num_chunks=2,
               fp8=mode == "two_batch", seed=3, impl="tilelang")
    for r in worlds(2).run(moe_forward, cfg):
        assert r["bitwise_reference"] and r["accuracy"] and r["repeatable"], r


SKIP_TIMEOUT_S = 2.0  # the deadline of the buffers whose peer skips the layer


@pytest.mark.parametrize("mode", [m if m in ("sequential", "two_batch") else exhaustive(m) for m in MODES])
def test_rank_that_skips_the_layer_times_out_the_others(mode):
    with LocalWorld(2, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(skip_forward, mode, SKIP_TIMEOUT_S)
    assert results[1] == "skipped"
    elapsed, message, missing = results[0]
    assert missing == [1] and SKIP_TIMEOUT_S <= elapsed < found_within(SKIP_TIMEOUT_S), (elapsed, message)
    assert f"rank 0 timed out after {SKIP_TIMEOUT_S:g} s; ranks not heard from: [1]" in message, message
