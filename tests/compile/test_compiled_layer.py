"""``EPMoE`` under ``torch.compile(fullgraph=True, dynamic=True)`` in every mode on real ranks: bit for bit
eager on two token counts, one frame compiled (no recompile for another token count or the same shapes
again, nor for another layer on the same buffer in the same mode), and ``torch._dynamo.explain`` finds
one graph and no break."""
from __future__ import annotations

import pytest

from moe_comm.moe import MODES

from helpers.compile_cases import compiled_layer
from helpers.tiers import exhaustive

_RUNS = [pytest.param(2, mode, fp8, id=f"2-{mode}-{'fp8' if fp8 else 'bf16'}",
                      marks=() if fp8 == (i % 2 == 1) else pytest.mark.exhaustive)
         for i, mode in enumerate(MODES) for fp8 in (False, True)] + \
        [exhaustive(n, mode, False, id=f"{n}-{mode}-bf16") for n in (3, 4) for mode in MODES]


@pytest.mark.parametrize("world_size,mode,fp8", _RUNS)
def test_layer_compiles_into_one_graph_with_eager_bits(worlds, world_size, mode, fp8):
    tokens = [9 + 4 * r for r in range(world_size)]
    cfg = dict(mode=mode, fp8=fp8, experts=4 * world_size, hidden=256, inter=128, topk=3, seed=world_size,
               tokens=tokens, tokens_again=[t + 2 for t in tokens])  # (+2 keeps each chunk split's remainder)
    for result in worlds(world_size).run(compiled_layer, cfg):
        assert result["equal"] == [True] * 4
        assert (result["graphs"], result["graph_breaks"]) == (1, 0)
        assert result["frames_after_first"] == result["frames"] == 1
        assert result["other_layer_equal"] and result["frames_with_another_layer"] == 1
