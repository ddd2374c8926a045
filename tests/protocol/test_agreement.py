"""Ranks agree on every call or all fail it: one-sided rejections, tampered handles, refusal after a
failure, ranks found on different calls (moe_comm/protocol/agreement.py)."""
import re

import pytest

from helpers.agreement_cases import (REJECTIONS, TAMPERS, calls_after_timeout, one_sided_rejection, skipped_call,
                                     tampered_handle)
from helpers.deadlines import MEET_S, before, found_within
from helpers.transports import local_world

# The rejecting rank's own error: its type and message (as on a rank alone).
OWN = {
    "dispatch_dtype": ("TypeError", r"^dispatch: topk_idx must be of dtype int64, got \[\d+, 3\] int32"),
    "dispatch_signature": ("TypeError", r"dispatch\(\) got an unexpected keyword argument 'bogus'"),
    "dispatch_worst_huge": ("ValueError", r"^dispatch: num_worst_tokens must be at most 2147483647 .*got "
                                          r"1099511627776$"),
    "combine_send_head": ("ValueError", r"^combine: handle\[5\] \(send_head\) must be the send positions of "
                                        r"handle\[4\]"),
    "ll_hidden": ("ValueError", r"^low_latency_dispatch: x must be \[T, hidden\] with hidden a positive multiple"),
    "ll_hooks_left": ("RuntimeError", r"^low_latency_dispatch: low-latency buffer 0 still holds a result whose "
                                      r"recv hook has not been called"),
    "llc_begins": ("ValueError", r"^low_latency_combine: handle\[1\] \(layout_range\) must be"),
    "clean_experts": ("ValueError", r"^clean_low_latency_buffer: num_experts must be a multiple of the group size"),
}


def test_every_rejection_has_an_expectation():
    assert set(OWN) == set(REJECTIONS)


@pytest.mark.parametrize("name", sorted(REJECTIONS))
def test_one_sided_rejection_fails_the_call_everywhere_and_nothing_after(worlds, name):
    results = worlds(3).run(one_sided_rejection, name, 1)
    kind, pattern = OWN[name]
    assert results[1]["kind"] == kind and re.search(pattern, results[1]["message"]), results[1]
    others = [results[r] for r in (0, 2)]
    assert {r["kind"] for r in others} == {"CrossRankMismatchError"}, others
    assert others[0]["message"] == others[1]["message"]  # the same words on every other rank
    said = others[0]["message"]
    assert "rank 1 rejected its arguments" in said and results[1]["message"][:60] in said, said
    assert "the Buffer stays usable" in said
    assert len({r["calls"] for r in results}) == 1  # every rank numbered the same calls


# The tampering rank's error (None: only the peers can tell, and every rank raises the same mismatch).
TAMPERED = {
    "send_head_huge": r"combine: handle\[5\] \(send_head\) must be the send positions",
    "send_head_plus_one": r"combine: handle\[5\] \(send_head\) must be the send positions",
    "send_head_minus_one": r"combine: handle\[5\] \(send_head\) must be the send positions",
    "prefix_changed": None,
    "src_idx_changed": None,
    "src_idx_cached": None,
    "ll_begin_shifted": r"low_latency_combine: handle\[1\] \(layout_range\) must be begin << 32 \| count blocks "
                        r"by source rank ascending .* got begin 1, count \d+ at \[0, 0\]",
    "ll_count_moved": None,
    "ll_src_info_changed": None,
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_tampered_handle_is_an_error_on_every_rank(worlds, name):
    assert set(TAMPERED) == set(TAMPERS)
    results = worlds(3).run(tampered_handle, name)
    own = TAMPERED[name]
    if own is not None:
        assert results[0]["kind"] == "ValueError" and re.search(own, results[0]["message"]), results[0]
        assert {r["kind"] for r in results[1:]} == {"CrossRankMismatchError"}, results
        assert all("rank 0 rejected its arguments" in r["message"] for r in results[1:]), results
    else:  # caught by the handshake's digests: the same error on every rank, the tamperer's too
        assert {r["kind"] for r in results} == {"CrossRankMismatchError"}, results
        assert len({r["message"] for r in results}) == 1, results
        assert re.search(r"the handles disagree on which tokens travel|rank prefix matrices \(handle\[0\]\) differ|"
                         r"row counts disagree", results[0]["message"]), results[0]


# The deadline of the buffers whose peer skips two calls. Their construction in a fresh world is collective, and
# every rank must reach it within the deadline: at 2 s, beside two busy loops and a second xdist worker, all three
# ranks timed out building the buffer on collective.
TIMEOUT_S = MEET_S


def test_after_a_timeout_every_call_hook_and_event_is_refused(transport):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(calls_after_timeout, TIMEOUT_S)
    for rank in (0, 1):
        r = results[rank]
        for kind, message in (r["first"], r["first_ll"]):
            # collective: the first rank to time out makes gloo close its pairs, so the other sees that
            assert kind in ("CommTimeoutError", "RuntimeError") and ("rank 2" in message or "[2]" in message), r
        assert r["first_s"] < found_within(2 * TIMEOUT_S), r  # two calls, each to its deadline
        for name, (kind, message) in r["later"].items():
            assert kind == "BufferUnusableError", (name, kind, message)
            assert "this Buffer is unusable since" in message and "build a new Buffer on every rank" in message
        # refused at once, no call waiting for its deadline (the low-latency buffer's checked call included)
        assert r["later_s"] < before(TIMEOUT_S), r
    kind, message = results[2]["first"]  # the late rank: its peers refuse, so it fails too
    assert kind in ("CommTimeoutError", "RuntimeError", "BufferUnusableError", "PeerExitedError"), results[2]


@pytest.mark.parametrize("shrink", [False, True], ids=["plain", "shrink"])
@pytest.mark.parametrize("transport", ["collective", "mpi"], indirect=True)
def test_ranks_on_different_calls_are_refused_everywhere(transport, shrink):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(skipped_call, shrink)
    for first, second in results:
        assert first[0] == "BufferUnusableError", first
        assert re.search(r"ranks were found on different calls \(rank 0: call 2 \(low_latency_dispatch\), "
                         r"rank 1: call 2 \(low_latency_dispatch\), rank 2: call 4 \(low_latency_dispatch\)\)",
                         first[1]), first
        assert second[0] == "BufferUnusableError" and "different calls" in second[1], second
