"""Shrink by timeout (``enable_shrink=True``): ranks that stay alive but stop calling are masked on
every survivor, the same mask everywhere, and the calls complete for the live experts
(moe_comm/protocol/shrink.py; DeepEP's ``--shrink-test`` semantics)."""
from __future__ import annotations

import re

import pytest

from helpers.deadlines import MEET_S, SCHEDULING_S, before
from helpers.shrink_cases import STOPS, slow_rank, stopped_ranks
from helpers.tiers import exhaustive
from helpers.transports import WORLD_KINDS, local_world

# every live rank must reach each call within the deadline of the others (a late one is masked)
TIMEOUT_S = MEET_S


# mpi (its 5-rank world takes 40 s on the 2-core test machine): the exhaustive tier
@pytest.mark.parametrize("transport", [k if k != "mpi" else exhaustive(k, id=k) for k in WORLD_KINDS], indirect=True)
def test_ranks_that_stop_calling_are_masked_everywhere(transport):
    with local_world(5, transport, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(stopped_ranks, TIMEOUT_S)
    survivors = [r for r in range(5) if r not in STOPS]
    for rank in survivors + [3, 4]:  # every rank that made the call reports the same mask
        assert results[rank]["masks"]["dispatch"] == [0, 1, 0, 0, 0], (rank, results[rank])
        assert results[rank]["dispatch_counts_ok"], (rank, results[rank])
    for rank in survivors + [4]:
        assert results[rank]["masks"]["combine"] == [0, 1, 0, 1, 0], (rank, results[rank])
        assert results[rank]["combine_diff"] < 1e-5, (rank, results[rank])
    for rank in survivors:
        r = results[rank]
        assert r["masks"]["clean"] == r["masks"]["dispatch_again"] == r["masks"]["combine_again"] == [0, 1, 0, 1, 1], r
        assert r["dispatch_again_counts_ok"] and r["combine_again_diff"] < 1e-5, r
        # each stop costs one deadline; once masked, a rank is never waited for again
        assert r["seconds"]["dispatch"] >= TIMEOUT_S and r["seconds"]["combine"] >= TIMEOUT_S, r
        assert r["seconds"]["dispatch_again"] < before(TIMEOUT_S) and r["seconds"]["combine_again"] < before(TIMEOUT_S), r
    for rank in STOPS:  # a masked rank cannot rejoin: an error, never rows
        kind, message = results[rank]["late_call"]
        assert kind in ("RuntimeError", "BufferUnusableError"), (rank, kind, message)
        assert re.search(r"out of step|masked by ranks|different calls", message), message


@pytest.mark.parametrize("transport", ["shm", "collective"], indirect=True)
def test_a_rank_late_for_some_peers_only_is_masked_by_all(transport):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        # Rank 0 must not hear rank 1 (its wait ends SCHEDULING_S after its deadline at most) and must hear
        # rank 2 in its next exchange, which rank 2 reaches only once it heard rank 1: that exchange's
        # deadline is twice rank 0's deadline, so with MEET_S it held too little slack beside two busy loops.
        short_s = 2 * MEET_S
        delay_s = short_s + SCHEDULING_S
        results = world.run(slow_rank, short_s, delay_s, delay_s + MEET_S)
    for rank in (0, 2):
        assert results[rank]["outcome"] == ("no exception", ""), results[rank]
        assert results[rank]["mask"] == [0, 1, 0] and results[rank]["counts_ok"], results[rank]
    kind, message = results[1]["outcome"]
    assert kind == "BufferUnusableError" and "rank 1 was masked by ranks [0] in call 1" in message, message
