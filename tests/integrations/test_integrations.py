"""The ``deep_ep`` module surface and its opt-in alias, the unsupported DeepEP knobs, and the plugin
entry points, each in a fresh interpreter where import state matters. The engines themselves are
exercised by ``tests/integrations/engines`` (``make test-engines``)."""
import importlib.metadata
import weakref

import pytest
import torch

import moe_comm
from moe_comm.compat import deep_ep

from helpers.fresh_python import run_python
from helpers.low_latency_cases import ll_buffer

OTHER_DEEP_EP = {
    "deep_ep/__init__.py": "from .utils import EventHandle, EventOverlap\nclass Buffer: pass\nclass Config: pass\n",
    "deep_ep/utils.py": "class EventHandle: pass\nclass EventOverlap: pass\n",
    "engine_module.py": "import deep_ep\nfrom deep_ep import Buffer, Config\nfrom deep_ep.utils import EventOverlap\n",
}


@pytest.fixture
def other_deep_ep(tmp_path):
    """A different, real ``deep_ep`` package (and a module that imports from it) on a path."""
    for name, text in OTHER_DEEP_EP.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def test_module_surface_is_moe_comms_objects():
    assert deep_ep.Buffer is moe_comm.Buffer and deep_ep.Config is moe_comm.Config
    assert deep_ep.EventOverlap is moe_comm.EventOverlap and deep_ep.utils.EventHandle is moe_comm.EventHandle
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.__spec__ is not None and deep_ep.utils.__spec__ is not None
    assert deep_ep.ElasticBuffer is moe_comm.ElasticBuffer and deep_ep.EPHandle is moe_comm.EPHandle  # V2's API
    assert not hasattr(deep_ep, "HybridEPBuffer")
    overlap = deep_ep.utils.EventOverlap(deep_ep.utils.EventHandle())  # Megatron builds these with no arguments
    overlap.current_stream_wait()


def test_buffer_lives_in_a_weak_value_cache(worlds):
    """vLLM caches Buffers in a WeakValueDictionary."""
    assert worlds(1).run(_weak_cache)[0] == (True, True)


def _weak_cache(group):
    cache = weakref.WeakValueDictionary()
    buffer = moe_comm.Buffer(group=group, explicitly_destroy=True)
    cache["key"] = buffer
    alive = cache.get("key") is buffer
    buffer.destroy()
    del buffer
    return alive, "key" not in cache


def test_alias_is_off_unless_asked():
    result = run_python("""
        import sys
        from moe_comm.integrations import install_from_env, vllm, sglang
        assert install_from_env() is None
        vllm.register(); sglang.register()
        assert "deep_ep" not in sys.modules and "vllm" not in sys.modules and "sglang" not in sys.modules
        try:
            import deep_ep
        except ModuleNotFoundError:
            print("absent")
        """)
    assert result.returncode == 0 and result.stdout.strip() == "absent", result.stderr


def test_alias_gives_deep_ep_and_its_utils():
    result = run_python("""
        import importlib.util, moe_comm
        from moe_comm.integrations import install_from_env, alias_installed
        module = install_from_env()
        import deep_ep, deep_ep.utils
        from deep_ep import Buffer, Config, EventOverlap
        from deep_ep.utils import EventHandle
        assert deep_ep is module and alias_installed() and Buffer is moe_comm.Buffer
        assert importlib.util.find_spec("deep_ep") is not None  # vLLM's has_deep_ep() looks it up so
        assert install_from_env() is module                     # idempotent
        print("ok")
        """, MOE_COMM_DEEP_EP="1")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_alias_shadows_an_installed_but_unimported_deep_ep(other_deep_ep):
    result = run_python("""
        import logging; logging.basicConfig(level=logging.INFO)
        from moe_comm.integrations import install_deep_ep_alias
        install_deep_ep_alias()
        import deep_ep
        print(getattr(deep_ep, "MOE_COMM", False))
        """, path=other_deep_ep)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
    assert "shadows the one installed at" in result.stderr and other_deep_ep in result.stderr


def test_alias_refuses_an_imported_deep_ep_unless_forced(other_deep_ep):
    refused = run_python("""
        import engine_module
        from moe_comm.integrations import install_from_env
        install_from_env()
        """, path=other_deep_ep, MOE_COMM_DEEP_EP="1")
    assert refused.returncode != 0
    assert "DeepEPConflictError" in refused.stderr and "another deep_ep is already imported" in refused.stderr
    assert other_deep_ep in refused.stderr and "MOE_COMM_DEEP_EP=force" in refused.stderr

    forced = run_python("""
        import sys, engine_module, moe_comm
        from moe_comm.integrations import install_from_env
        install_from_env()
        import deep_ep
        assert deep_ep.MOE_COMM and sys.modules["deep_ep.utils"] is deep_ep.utils
        assert engine_module.deep_ep is deep_ep and engine_module.Buffer is moe_comm.Buffer
        assert engine_module.Config is moe_comm.Config and engine_module.EventOverlap is moe_comm.EventOverlap
        print("ok")
        """, path=other_deep_ep, MOE_COMM_DEEP_EP="force")
    assert forced.returncode == 0 and forced.stdout.strip() == "ok", forced.stderr
    assert "rebound" in forced.stderr and "engine_module.Buffer" in forced.stderr


def test_bad_alias_setting_is_named():
    result = run_python("from moe_comm.integrations import install_from_env; install_from_env()",
                        MOE_COMM_DEEP_EP="yes")
    assert result.returncode != 0 and "MOE_COMM_DEEP_EP must be 1, force, 0 or unset, got 'yes'" in result.stderr


def test_megatron_patch_installs_the_alias_before_megatron_is_imported():
    result = run_python("""
        import sys
        from moe_comm.integrations import megatron
        megatron.patch()
        import deep_ep
        print(deep_ep.MOE_COMM, megatron.FUSED_A2A in sys.modules)
        """)
    assert result.returncode == 0 and result.stdout.strip() == "True False", result.stderr


@pytest.mark.parametrize("group,target", [("vllm.general_plugins", "moe_comm.integrations.vllm:register"),
                                          ("sglang.srt.plugins", "moe_comm.integrations.sglang:register")])
def test_entry_points_are_declared(group, target):
    points = {p.name: p for p in importlib.metadata.entry_points(group=group)}
    assert "moe_comm" in points and points["moe_comm"].value == target
    assert callable(points["moe_comm"].load())


# ------------------------------------------------------------------ knobs moe-comm does not implement

KNOBS = [
    ("low_latency_dispatch", dict(use_nvfp4=True), "NVFP4 dispatch"),
    ("low_latency_dispatch", dict(x_global_scale=torch.ones(1)), "NVFP4 dispatch (its global scale)"),
    ("low_latency_dispatch", dict(topk_weights=torch.ones(2, 2)), "weights sent with the dispatch"),
    ("low_latency_dispatch", dict(use_mxfp8=True), "MXFP8 dispatch"),
    ("low_latency_combine", dict(overlap=True, num_sms=3), "a combine overlapped with the expert GEMM"),
    ("low_latency_combine", dict(comp_signal=torch.zeros(1)), "a signal-overlapped combine"),
    ("low_latency_combine", dict(src_signals=torch.zeros(1), src_signal_expect_value=1), "(Blackwell)"),
]


@pytest.mark.parametrize("method,knobs,feature", KNOBS, ids=[f"{m}-{next(iter(k))}" for m, k, _ in KNOBS])
def test_unsupported_knobs_raise_not_implemented(worlds, method, knobs, feature):
    kind, message = worlds(1).run(_call_with_knobs, method, knobs)[0]
    name = next(iter(knobs))
    assert kind == "NotImplementedError", message
    assert message.startswith(f"{method}: {name}=") and feature in message and "moe-comm does not implement" in message


def test_knobs_at_their_off_value_are_accepted_and_unknown_ones_are_type_errors(worlds):
    off = dict(use_nvfp4=False, x_global_scale=None, use_mxfp4=False, use_mxfp8=False)
    assert worlds(1).run(_call_with_knobs, "low_latency_dispatch", off)[0] == ("ok", "")
    combine_off = dict(overlap=False, block_m=64, threshold=0, num_sms=3, packed_recv_count=None)
    assert worlds(1).run(_call_with_knobs, "low_latency_combine", combine_off)[0] == ("ok", "")
    kind, message = worlds(1).run(_call_with_knobs, "low_latency_dispatch", dict(use_fp4=True))[0]
    assert kind == "TypeError" and "unexpected keyword argument 'use_fp4'" in message


def test_raw_buffer_views_and_comm_stream_are_not_implemented(worlds):
    kinds = worlds(1).run(_raw_views)[0]
    assert kinds == ["NotImplementedError: Buffer.get_comm_stream", "NotImplementedError: Buffer.get_local_buffer_tensor"]


def _call_with_knobs(group, method, knobs):
    hidden, m, experts = 128, 4, 4
    buffer = ll_buffer(group, m, hidden, experts)
    x = torch.randn(3, hidden).bfloat16()
    topk_idx = torch.tensor([[0, 1], [2, -1], [3, 0]])
    try:
        recv, count, handle, _, _ = buffer.low_latency_dispatch(
            x, topk_idx, m, experts, use_fp8=False, **(knobs if method == "low_latency_dispatch" else {}))
        if method == "low_latency_combine":
            buffer.low_latency_combine(recv, topk_idx, torch.ones(3, 2), handle, **knobs)
        return "ok", ""
    except (NotImplementedError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    finally:
        buffer.destroy()


def _raw_views(group):
    buffer = moe_comm.Buffer(group, explicitly_destroy=True)
    kinds = []
    for call in (buffer.get_comm_stream, lambda: buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)):
        try:
            call()
        except NotImplementedError as exc:
            kinds.append(f"NotImplementedError: {str(exc).split(':')[0]}")
    buffer.destroy()
    return kinds
