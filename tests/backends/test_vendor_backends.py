"""The ascend and cambricon backends held to the portable backend's contract on CPU ranks, through CPU
models of the vendor operators written from their documentation (``vendor_models/``). This proves the
adapters' argument mapping and layout conversions against the documentation, not against an NPU or
MLU: the device suites (``test_vendor_devices.py``, ``pytest -m ascend`` / ``-m mlu``) do that."""
from __future__ import annotations

from functools import partial

import pytest

from moe_comm.launch import LocalWorld

from helpers import vendor_cases
from helpers.tiers import exhaustive

A3 = {"TORCH_NPU_MODEL_DEVICE": "Ascend910_9391"}


@pytest.fixture(scope="module")
def vendor_worlds(_world_pool):
    """``get(n)``: a world of n ranks for these tests only (its processes import the models)."""
    made: dict[tuple, LocalWorld] = {}

    def get(n: int, **env: str) -> LocalWorld:
        """``env``: set in the ranks from their start (before a model is imported)."""
        key = (n, tuple(sorted(env.items())))
        if key not in made or made[key].closed:
            made[key] = LocalWorld(n, timeout_s=120, threads_per_rank=1, env=env)
        return made[key]
    yield get
    for world in made.values():
        world.close()


def _clean(results: list[list[str]]) -> None:
    problems = [line for rank in results for line in rank]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("hook,zero_copy,ranks", [
    pytest.param(h, z, r, id=f"{h}-{z}-{r}", marks=() if (h, r) in ((False, 3), (True, 2)) else pytest.mark.exhaustive)
    for h, z in [(False, False), (True, True)] for r in [2, 3, 4]])
def test_ascend_low_latency_is_the_portable_backends(vendor_worlds, ranks, hook, zero_copy):
    _clean(vendor_worlds(ranks).run(partial(vendor_cases.low_latency, backend="ascend", num_tokens=6, hidden=256,
                                            num_topk=3, num_experts=4 * ranks, hook=hook, zero_copy=zero_copy)))



@pytest.mark.parametrize("ranks", [exhaustive(2), 4])
def test_ascend_fp8_is_mc2s_int8_of_the_portable_rows(vendor_worlds, ranks):
    _clean(vendor_worlds(ranks).run(partial(vendor_cases.low_latency, backend="ascend", num_tokens=5, hidden=128,
                                            num_topk=2, num_experts=2 * ranks, use_fp8=True)))


def test_ascend_on_atlas_a3(vendor_worlds):
    _clean(vendor_worlds(2).run(partial(vendor_cases.low_latency, backend="ascend", num_tokens=4, hidden=1024,
                                        num_topk=2, num_experts=4, env=A3)))


@pytest.mark.parametrize("ranks,backend", [
    pytest.param(r, b, id=f"{r}-{b}",
                 marks=() if (r, b) in ((2, "ascend"), (4, "cambricon")) else pytest.mark.exhaustive)
    for b in ["ascend", "cambricon"] for r in [1, 2, 4]])
def test_normal_mode_is_the_portable_backends(vendor_worlds, backend, ranks):
    _clean(vendor_worlds(ranks).run(partial(vendor_cases.normal, backend=backend, num_tokens=10, hidden=64,
                                            num_topk=2, num_experts=2 * ranks)))


CALL = dict(num_tokens=4, hidden=128, num_topk=2, num_experts=4)
MC2 = "low_latency_dispatch: the ascend backend's MC2 operators refuse this call: "


@pytest.mark.parametrize("ranks,call,env,kind,message", [
    (1, CALL, {}, "ValueError", MC2 + "ep_world_size must be one of {2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256} on "
                                      "Atlas A2 (v2, comm_alg ''), got 1"),
    (2, CALL, A3, "ValueError", MC2 + "hidden must be in [1024, 8192] on Atlas A3 (v2, comm_alg ''), got 128"),
    (2, CALL, {"MOE_COMM_ASCEND_COMM_ALG": "ring"}, "ValueError",
     MC2 + "comm_alg must be one of '', 'fullmesh', 'hierarchy' on Atlas A2 (v2, comm_alg 'ring'), got 'ring'"),
    (2, {**CALL, "num_tokens": 300}, {}, "ValueError",
     MC2 + "num_max_dispatch_tokens_per_rank (the operators' BS) must be in [1, 256] on Atlas A2 (v2, comm_alg ''), "
           "got 300"),
    (2, CALL, {"TORCH_NPU_MODEL_DEVICE": "Ascend310P3"}, "ValueError",
     "low_latency_dispatch: the ascend backend's low-latency mode runs MC2's EP operators, which serve Atlas A2 "
     "(Ascend910B*) and Atlas A3 (Ascend910_93*); this NPU is 'Ascend310P3'"),
    (2, CALL, {"HCCL_BUFFSIZE": "4"}, "ValueError",
     "low_latency_dispatch: HCCL_BUFFSIZE must be at least 5 (MB) for MC2 at 2 ranks, 4 experts, hidden 128, 4 tokens "
     "per rank and top-2, got 4"),
    (2, {**CALL, "use_fp8": True, "round_scale": True}, {}, "ValueError",
     "low_latency_dispatch: the ascend backend quantises with MC2's dynamic INT8 (one fp32 scale per token; Atlas "
     "A2/A3 have no FP8), which has no power-of-two scales: round_scale and use_ue8m0 must be False, got fp8 "
     "round_scale"),
])
def test_ascend_refuses_what_mc2_refuses_before_any_byte_moves(vendor_worlds, ranks, call, env, kind, message):
    results = vendor_worlds(ranks).run(partial(vendor_cases.refused, backend="ascend", env=env, **call))
    assert results == [(kind, message)] * ranks, results


@pytest.mark.parametrize("use_fp8,hook,zero_copy,ranks", [
    pytest.param(f, f, f, r, id=f"{f}-{f}-{f}-{r}",
                 marks=() if (f, r) in ((False, 2), (True, 3)) else pytest.mark.exhaustive)
    for f in [False, True] for r in [1, 2, 3, 4]])
def test_cambricon_low_latency_on_tmos_all2all_is_the_portable_backends(vendor_worlds, ranks, use_fp8, hook,
                                                                         zero_copy):
    _clean(vendor_worlds(ranks).run(partial(vendor_cases.low_latency, backend="cambricon", num_tokens=6, hidden=128,
                                            num_topk=2, num_experts=2 * ranks, use_fp8=use_fp8, hook=hook,
                                            zero_copy=zero_copy)))


def test_cambricon_handle_grows_with_the_rows_and_keeps_two_results_in_flight(vendor_worlds):
    """A larger call after a smaller one (the all-to-all's handle is made again, on every rank alike), and
    two hooked dispatches in flight before either is received."""
    _clean(vendor_worlds(2).run(partial(vendor_cases.grow_and_overlap, backend="cambricon")))


@pytest.mark.parametrize("backend,why", [
    ("ascend", "MC2's operators run on every rank of their HCCL communicator"),
    ("cambricon", "torch_mlu_ops' all-to-all runs on every rank of its handle")])
def test_shrink_is_refused_at_construction(vendor_worlds, backend, why):
    results = vendor_worlds(2).run(partial(vendor_cases.construct, backend=backend, low_latency_mode=True,
                                           enable_shrink=True))
    assert results == [("ValueError", f"Buffer: enable_shrink=True leaves exited ranks out of low-latency calls, but "
                                      f"{why}; leave enable_shrink off on the {backend} backend")] * 2, results


def test_ascend_without_the_v2_operators_takes_v1_and_its_limits(vendor_worlds):
    results = vendor_worlds(2, TORCH_NPU_MODEL_V1_ONLY="1").run(partial(vendor_cases.refused, backend="ascend", **CALL))
    assert results == [("ValueError", MC2 + "ep_world_size must be one of {16, 32, 64} on Atlas A2 (v1), got 2")] * 2, \
        results


@pytest.mark.parametrize("backend,why", [
    ("ascend", "the ascend backend's combine needs that dispatch's MC2 bookkeeping"),
    ("cambricon", "the cambricon backend's combine sends rows back to the places that dispatch's "
                  "moe_all2all_dispatch reported")])
def test_a_handle_not_from_this_buffer_is_refused_on_every_rank(vendor_worlds, backend, why):
    results = vendor_worlds(2).run(partial(vendor_cases.foreign_handle, backend=backend))
    assert results == [("ValueError", f"low_latency_combine: handle must be one that this Buffer's "
                                      f"low_latency_dispatch returned: {why}, which the handle's tensors do not "
                                      f"hold")] * 2, results
