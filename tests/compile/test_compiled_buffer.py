"""``Buffer``'s calls under ``torch.compile`` on real ranks: each is a ``torch.ops.moe_comm`` op that passes
``torch.library.opcheck``; low-latency and normal-mode steps compiled with ``fullgraph=True`` give eager's
bits (hooks, FP8, stats, cached dispatch, an unbacked receive size or ``num_worst_tokens``); normal mode's
gradients are the adjoints of its calls; a rank's bad input inside a compiled call raises what it raises
eagerly, on every rank, and the next call works."""
from __future__ import annotations

import pytest

from helpers.compile_cases import (BUFFER_OPS, buffer_opchecks, low_latency_bad_input, low_latency_steps,
                                   normal_adjoints, normal_steps)
from helpers.tiers import exhaustive


def test_every_buffer_op_passes_opcheck(worlds):
    for result in worlds(2).run(buffer_opchecks):
        assert result["failures"] == {}
        assert set(result["checked"]) == BUFFER_OPS


@pytest.mark.parametrize("hook,fp8", [(False, False), (True, True), exhaustive(True, False), exhaustive(False, True)])
def test_low_latency_steps_compile_with_eager_bits(worlds, hook, fp8):
    cfg = dict(tokens=8, hidden=256, topk=3, experts=8, hook=hook, fp8=fp8)
    for result in worlds(2).run(low_latency_steps, cfg):
        assert result["compiled"] == result["eager"]
        assert len(set(result["eager"])) == 1  # the same bits on every call
        # two compiled steps of clean, dispatch, combine (and two receives with hooks), each call in the
        # buffer's chain (eager calls do not go through the ops)
        assert result["op_calls"] == 2 * (5 if hook else 3)


@pytest.mark.parametrize("worst,fp8", [(0, False), (40, True), exhaustive(0, True), exhaustive(40, False)])
def test_normal_steps_compile_with_eager_bits(worlds, worst, fp8):
    cfg = dict(tokens=[9, 13], hidden=256, topk=3, experts=8, worst=worst, fp8=fp8)
    for result in worlds(2).run(normal_steps, cfg):
        assert result["compiled"] == result["eager"]
        assert len(set(result["eager"])) == 1


def test_bad_input_in_a_compiled_call_fails_every_rank_as_eager(worlds):
    results = worlds(2).run(low_latency_bad_input)
    for rank, result in enumerate(results):
        assert result["compiled"] == result["eager"], rank
        assert result["eager"].startswith("ValueError: " if rank == 1 else "CrossRankMismatchError: "), result
        assert "topk_idx must be expert ids in [-1, 8)" in result["eager"]
        assert result["next_equal"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager_ops"])
def test_normal_mode_gradients_are_the_adjoint_calls(worlds, compiled):
    for result in worlds(2).run(normal_adjoints, compiled):
        assert result["dispatch"][0] == result["dispatch"][1]   # sum <dispatch(x), g> == sum <x, grad>
        assert result["combine"][0] == result["combine"][1]
        assert result["dispatch_grad_is_a_combine"] and result["combine_grad_is_a_cached_dispatch"]
        assert result["nonzero"]
