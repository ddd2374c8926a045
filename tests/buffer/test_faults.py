"""Cross-rank mismatches raise the same error on every rank; missing or dead ranks never hang the others."""
import re

import pytest

from helpers.deadlines import MEET_S, before, found_within
from helpers.fault_cases import (die_before_buffer, die_before_dispatch, ll_mismatch, mismatch, skip_dispatch,
                                 skip_ll_dispatch)
from helpers.transports import WORLD_KINDS, local_world

# the deadline of the buffers whose peer skips a call: the punctual ranks must meet each other within it (to be
# named as heard from), which under load takes MEET_S (at 2 s, beside two busy loops, an mpi run named a punctual
# rank as not heard from)
TIMEOUT_S = MEET_S
DEAD_TIMEOUT_S = 30.0  # the deadline of the buffers whose peer dies: never reached

MISMATCH = {
    "hidden": r"dispatch: ranks disagree on hidden: rank 0: 32, rank 1: 64, rank 2: 64",
    "dtype": r"dispatch: ranks disagree on x_dtype: rank 0: float32, rank 1: bfloat16, rank 2: bfloat16",
    "num_experts": r"dispatch: ranks disagree on num_experts: rank 0: 24, rank 1: 12, rank 2: 12",
    "topk": r"dispatch: ranks disagree on num_topk: rank 0: 3, rank 1: 2, rank 2: 2",
    "worst": r"dispatch: rank 0 receives \d+ rows but num_worst_tokens=1",
    "op": r"ranks called different operations: rank 0: dispatch, rank 1: combine, rank 2: combine",
    "handle": r"combine: row counts disagree: rank \d expects \d+ rows from rank \d, which sends \d+",
}


@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "prepared"])
@pytest.mark.parametrize("kind", sorted(MISMATCH))
def test_cross_rank_mismatch_same_error_everywhere(worlds, kind, warm):
    results = worlds(3).run(mismatch, kind, warm)
    kinds = {r[0] for r in results}
    messages = {r[1] for r in results}
    assert kinds == {"CrossRankMismatchError"}, results
    assert len(messages) == 1, messages  # every rank says the same thing
    assert re.search(MISMATCH[kind], messages.pop())
    assert all(r[2] for r in results)  # and the buffer keeps working afterwards


# NOTES: on the collective transport the first rank to time out makes gloo close its connections, so
# the other waiting ranks see "connection closed" (a RuntimeError naming the same late rank) instead.
DEADLINE_TRANSPORTS = [t for t in WORLD_KINDS if t != "collective"]


@pytest.mark.parametrize("transport", DEADLINE_TRANSPORTS, indirect=True)
def test_rank_that_skips_dispatch_times_out_others(transport):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(skip_dispatch, TIMEOUT_S)
    assert results[2] == "skipped"
    for rank in (0, 1):
        elapsed, message, missing, op, who = results[rank]
        assert missing == [2] and op == "dispatch" and who == rank
        assert TIMEOUT_S <= elapsed < found_within(TIMEOUT_S), elapsed
        assert f"dispatch: rank {rank} timed out after {TIMEOUT_S:g} s; ranks not heard from: [2]" in message


def test_dead_rank_is_reported_not_waited_on(transport):
    with local_world(2, transport, timeout_s=60, threads_per_rank=1) as world:
        with pytest.raises(TimeoutError, match=r"ranks \[1\] exited") as info:
            world.run(die_before_dispatch, DEAD_TIMEOUT_S)
    elapsed, kind, message = info.value.results[0]
    assert elapsed < before(DEAD_TIMEOUT_S), elapsed  # found out at once, well before the deadline
    assert "rank 1" in message and "has exited" in message, message


@pytest.mark.parametrize("transport", ["collective"], indirect=True)
def test_dead_rank_is_named_by_a_new_buffer(transport):
    """Building a Buffer after a rank has exited fails soon, naming that rank (not the caller)."""
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        with pytest.raises(TimeoutError, match=r"ranks \[2\] exited") as info:
            world.run(die_before_buffer, DEAD_TIMEOUT_S)
    for rank in (0, 1):
        elapsed, kind, message = info.value.results[rank]
        assert elapsed < before(DEAD_TIMEOUT_S), elapsed
        assert "ranks not heard from: [2]" in message, message


LL_MISMATCH = {
    "ll_m": r"low_latency_dispatch: ranks disagree on num_max_dispatch_tokens_per_rank: rank 0: 16, rank 1: 8, "
            r"rank 2: 8",
    "ll_hidden": r"low_latency_dispatch: ranks disagree on hidden: rank 0: 512, rank 1: 256, rank 2: 256",
    "ll_experts": r"low_latency_dispatch: ranks disagree on num_experts: rank 0: 24, rank 1: 12, rank 2: 12",
    "ll_fp8": r"low_latency_dispatch: ranks disagree on fp8_format: rank 0: fp8, rank 1: bf16, rank 2: bf16",
    "ll_op": r"ranks called different operations: rank 0: dispatch, rank 1: low_latency_dispatch, "
             r"rank 2: low_latency_dispatch",
    "ll_combine_routing": r"low_latency_combine: row counts disagree: rank 0 expects \d+ rows from rank \d, which "
                          r"sends \d+",
}


@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "prepared"])
@pytest.mark.parametrize("kind", sorted(LL_MISMATCH))
def test_low_latency_mismatch_same_error_everywhere(worlds, kind, warm):
    results = worlds(3).run(ll_mismatch, kind, warm)
    assert {r[0] for r in results} == {"CrossRankMismatchError"}, results
    messages = {r[1] for r in results}
    assert len(messages) == 1, messages
    assert re.search(LL_MISMATCH[kind], messages.pop())
    assert all(r[2] for r in results)


@pytest.mark.parametrize("transport", DEADLINE_TRANSPORTS, indirect=True)
@pytest.mark.parametrize("warm", [False, True], ids=["first_call", "prepared"])
@pytest.mark.parametrize("hook", [False, True])
def test_rank_that_skips_low_latency_dispatch_times_out_others(transport, hook, warm):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(skip_ll_dispatch, TIMEOUT_S, hook, warm)
    assert results[2] == "skipped"
    for rank in (0, 1):
        elapsed, message, missing, op, who = results[rank]
        assert missing == [2] and op == "low_latency_dispatch" and who == rank
        assert TIMEOUT_S <= elapsed < found_within(TIMEOUT_S), elapsed
        assert (f"low_latency_dispatch: rank {rank} timed out after {TIMEOUT_S:g} s; ranks not heard from: [2]"
                in message)
