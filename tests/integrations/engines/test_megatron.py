"""Megatron-Core 0.16.1 with moe-comm as its ``deep_ep``, on 2 CPU ranks: ``patch()`` and the flex
dispatcher's unmodified ``fused_dispatch``/``fused_combine``, forward and backward, against dense
autograd, with the exact call forms."""
import pytest

from helpers.engines.engine_support import require, run_ranks

require("megatron-core", "0.16.1")

from helpers import engine_calls  # noqa: E402

from helpers.engines.megatron_cases import megatron_train_step  # noqa: E402


@pytest.mark.parametrize("import_first", [False, True], ids=["patch-first", "megatron-imported-first"])
def test_megatron_flex_dispatch_forward_and_backward(import_first):
    cfg = dict(tokens=[13, 6], hidden=64, inter=64, topk=4, experts=8, seed=3, import_first=import_first)
    for rank, r in enumerate(run_ranks(megatron_train_step, cfg, "shm")):
        assert r["deep_ep"] and r["have_deep_ep"] and r["rebound"]
        assert r["forms"] == engine_calls.MEGATRON, (rank, r["forms"])
        assert r["out"] and r["grad_x"] and r["grad_probs"] and r["tokens_per_expert"], (rank, r)
