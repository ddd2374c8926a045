"""SGLang 0.5.23 with moe-comm as its ``deep_ep``, on 2 CPU ranks: the plugin, and SGLang's
unmodified ``DeepEPDispatcher`` in low-latency mode (BF16 and SGLang's default FP8 dispatch), bit
for bit against moe-comm's references, with the exact call forms."""
import pytest

from helpers.engines.engine_support import require, run_ranks
from helpers.fresh_python import run_python

require("sglang", "0.5.23")

from helpers import engine_calls  # noqa: E402

from helpers.engines.sglang_cases import sglang_experts_layer, sglang_low_latency  # noqa: E402


@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sglang_deepep_dispatcher_low_latency(fp8, transport):
    cfg = dict(tokens=[13, 6], hidden=256, inter=128, topk=4, experts=8, seed=3, max_tokens=16, fp8=fp8)
    forms = dict(engine_calls.SGLANG_LL)
    if fp8:
        forms["low_latency_dispatch"] = engine_calls.SGLANG_LL_FP8_DISPATCH
    for rank, r in enumerate(run_ranks(sglang_low_latency, cfg, transport)):
        assert r["use_deepep"] and r["buffer_is_moe_comm"] and r["formats"] == ["DEEPEP_LL"]
        assert r["fp8_dispatch"] == fp8
        assert r["forms"] == forms, (rank, r["forms"])
        assert r["shape"] == [cfg["tokens"][rank], cfg["hidden"]]
        assert r["bitwise"] and r["repeatable"], (rank, r)
        assert r["accuracy"], (rank, r["reason"])


@pytest.mark.parametrize("mode,dispatch_fp8", [("normal", False), ("low_latency", False), ("low_latency", True)],
                         ids=["normal-bf16", "low_latency-bf16", "low_latency-fp8"])
def test_sglang_deepep_moe_layer_runs_moe_comm_experts(mode, dispatch_fp8):
    """SGLang's DeepEPMoE layer on CPU (its own experts are DeepGEMM's only): dispatch, moe-comm's experts,
    combine, against the dense reference on 2 ranks. (SGLang's normal dispatch sends FP8 only with DeepGEMM.)"""
    cfg = dict(tokens=[13, 6], hidden=256, inter=128, topk=4, experts=8, seed=5, max_tokens=16, mode=mode,
               dispatch_fp8=dispatch_fp8)
    for rank, r in enumerate(run_ranks(sglang_experts_layer, cfg, "shm")):
        assert r["patched"] and r["shape"] == [cfg["tokens"][rank], cfg["hidden"]]
        assert r["bitwise"] and r["repeatable"], (rank, r)
        assert r["accuracy"], (rank, r["reason"])


PROBE = """
    import sys
    {before}
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.layers.moe.token_dispatcher import deepep
    import moe_comm, moe_comm.integrations
    print(deepep.use_deepep, getattr(deepep, "Buffer", None) is moe_comm.Buffer,
          getattr(deepep.DeepEPBuffer.get_deepep_buffer, moe_comm.integrations.PATCH_MARK, False))
    """


@pytest.mark.parametrize("before", ["", "from sglang.srt.layers.moe.token_dispatcher import deepep"],
                         ids=["plugins-first", "dispatcher-imported-first"])
def test_plugin_wires_sglang_only_when_asked(before):
    on = run_python(PROBE.format(before=before), MOE_COMM_DEEP_EP="1")
    assert on.returncode == 0 and on.stdout.split()[-3:] == ["True", "True", "True"], on.stderr
    off = run_python(PROBE.format(before=before))
    assert off.returncode == 0 and off.stdout.split()[-3:] == ["False", "False", "False"], off.stderr
