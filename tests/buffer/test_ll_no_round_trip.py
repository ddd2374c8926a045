"""The agreement in the data path (issue 35): a low-latency send half never waits for a peer; the
receive judges every rank's header, so a late rank, a mismatched one and a silent one are each
found at the hook, the same way on every rank, and the buffer stays in step."""
import re

import pytest

from helpers.deadlines import MEET_S, found_within, well_before
from helpers.ll_late_cases import (late_rank, reads_no_tensor_data, send_halves_that_waited, silent_rank,
                                   stopped_mid_call)
from helpers.transports import local_world

LATE_S = 2.0  # how late the last rank calls each send half (the measure)


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_send_half_does_not_wait_for_a_late_rank(worlds, transport, use_fp8):
    results = worlds(3).run(late_rank, LATE_S, use_fp8)
    messages = {r["mismatch"] for r in results}
    for r in results:
        assert r["equal"] and r["next_call_equal"], r
    assert not send_halves_that_waited(results), results  # the punctual ranks' send halves did not wait
    assert len(messages) == 1, messages  # the same error on every rank, the late one included
    assert re.search(r"^CrossRankMismatchError: low_latency_dispatch: ranks disagree on hidden: rank 0: 256, "
                     r"rank 1: 256, rank 2: 128", messages.pop())


def test_a_send_half_that_returned_after_the_late_rank_called_is_named():
    """The order check itself, on spans of the host's clock: a punctual send half that ends after the late
    rank began the same call is named (with its duration); one that ends before is not, however long."""
    spans = {"dispatch_send": (0.0, 0.5), "combine_send": (10.0, 10.001), "mismatch_send": (20.0, 21.9)}
    late = {"rank": 2, "dispatch_send": (2.0, 2.1), "combine_send": (11.0, 11.1), "mismatch_send": (21.5, 21.6)}
    waited = send_halves_that_waited([{"rank": 0, **spans}, {"rank": 1, **spans, "combine_send": (10.0, 11.0)}, late])
    assert waited == [(0, "mismatch", pytest.approx(1.9)), (1, "combine", 1.0), (1, "mismatch", pytest.approx(1.9))]


# NOTES: mpi aborts the job when a timed-out buffer is destroyed (MPI cannot cancel a collective),
# and on collective the first rank to time out makes gloo close its pairs (see test_faults.py).
@pytest.mark.parametrize("transport", ["shm"], indirect=True)
def test_silent_rank_is_named_with_its_last_call(transport):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(silent_rank, MEET_S)
    for r in results[:-1]:
        assert r["send_s"] < well_before(MEET_S), r
        assert r["error"].startswith(f"CommTimeoutError: low_latency_dispatch: rank {r['rank']} timed out after "
                                     f"{MEET_S:g} s; ranks not heard from: [2]; this rank waits for call 2 "
                                     f"(low_latency_dispatch); rank 2 last sent call 1 (low_latency_dispatch)"), r
        assert r["after"].startswith("BufferUnusableError"), r
        assert r["error_s"] < found_within(MEET_S), r  # at its deadline, not later
    assert all(r["fresh_equal"] for r in results)


@pytest.mark.parametrize("transport", ["collective"], indirect=True)
def test_rank_stopped_inside_a_call_is_named(transport):
    """It entered the exchange (it is not behind in the arrival count), so it is named as stopped."""
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(stopped_mid_call, MEET_S)
    for r in results[:-1]:
        # the first rank to time out makes gloo close its pairs: the other may see that instead, or time out
        # on both the stopped rank and the one that left (test_faults.py)
        assert r["error"].startswith(("CommTimeoutError: low_latency_dispatch: ", "RuntimeError: low_latency_dispatch: ")), r
        assert re.search(r"ranks not heard from: \[(\d, )*2\]", r["error"]) or "gloo exchange failed" in r["error"], r
    # the first to time out says the stopped rank is stopped
    assert any("rank 2 (pid " in r["error"] and "is stopped" in r["error"] for r in results[:-1]), results


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("transport", ["cuda_host"], indirect=True)
def test_kernel_calls_read_no_tensor_data_on_the_host(worlds, transport, use_fp8):
    """The CUDA kernels' Python path (the host build here; the device build runs the same code) reads no
    tensor value between call entry and return, hooks included: what a CUDA graph needs to capture it."""
    for r in worlds(3).run(reads_no_tensor_data, use_fp8):
        assert r["raised"] == "" and r["equal"], r
