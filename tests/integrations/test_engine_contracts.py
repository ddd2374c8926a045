"""The engines' contract with ``deep_ep.Buffer``, without the engines: each engine's calls (vLLM 0.32
high-throughput and low-latency, SGLang 0.5.23 low-latency in BF16 and FP8, Megatron-Core 0.16.1
forward and backward) replayed on 2 and 3 real gloo ranks through a recording moe-comm Buffer.
Each replay must be accepted with exactly the call forms of ``engine_calls.py`` and give the
reference result bit for bit. ``tests/integrations/engines`` drives the engines' own code the same way."""
import pytest

from helpers import engine_calls
from helpers.engine_cases import megatron_replay, sglang_ll_replay, vllm_ht_replay, vllm_ll_replay

CFG = dict(hidden=256, inter=128, topk=4, experts=8, seed=3)

REPLAYS = [
    (vllm_ht_replay, engine_calls.VLLM_HT, {}),
    (vllm_ll_replay, engine_calls.VLLM_LL, {}),
    (sglang_ll_replay, engine_calls.SGLANG_LL, {}),
    (sglang_ll_replay, {**engine_calls.SGLANG_LL, "low_latency_dispatch": engine_calls.SGLANG_LL_FP8_DISPATCH},
     {"fp8": True}),
    (megatron_replay, engine_calls.MEGATRON, {}),
]


@pytest.mark.parametrize("tokens", [[13, 6], [9, 0, 17]], ids=["2ranks", "3ranks-one-empty"])
@pytest.mark.parametrize("replay,forms,extra", REPLAYS,
                         ids=["vllm-ht", "vllm-ll", "sglang-ll", "sglang-ll-fp8", "megatron"])
def test_engine_calls_are_accepted_and_exact(worlds, replay, forms, extra, tokens):
    cfg = dict(CFG, tokens=tokens, experts=4 * len(tokens), **extra)
    for rank, r in enumerate(worlds(len(tokens)).run(replay, cfg)):
        assert r["forms"] == forms, (rank, r["forms"])
        assert r["shape"] == [tokens[rank], CFG["hidden"]] and r["dtype"] == "torch.bfloat16"
        assert r["bitwise"], (rank, r)
        assert r["accuracy"], (rank, r["reason"])
        if replay is sglang_ll_replay:
            assert r["group_size"] == len(tokens)
        if replay is megatron_replay:
            assert r["cached_dispatch_equal"] and r["weights_summed"]
