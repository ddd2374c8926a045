"""The shm transport: the same bits as the collective transport, growth, spill, faults, masks, hosts."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from moe_comm.launch import LocalWorld

from helpers.deadlines import before
from helpers.shm_cases import (both_transports, engine_local_world_size, grow_with_many_in_flight, growth,
                               killed_mid_run, many_in_flight, masked_rank_survives, node_split, plant_stale_segment,
                               rejoin_after_mask, segments_after_setup)
from helpers.transports import local_world


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shm_gives_the_collective_transports_bits(worlds, world_size):
    for per_rank in worlds(world_size).run(both_transports):
        assert per_rank["shm"] == per_rank["collective"]


def test_buffer_grows_and_is_sized_from_num_nvl_bytes(worlds, transport):
    if transport == "cuda_host":
        pytest.skip("the shm transport's slots grow with the payload, which the cuda_host kernels move in their own "
                    "buffers (sized by the call: backends/cuda/shared_buffers.py)")
    for r in worlds(2).run(growth):
        assert r["before"] == 1 << 20 and r["after"] > r["before"], r
        assert r["same"], r
        assert r["sized"] == 4 << 20, r  # two slots share num_nvl_bytes
        assert r["huge"] == 256 << 20, r  # preallocated at most 512 MiB for both slots


def test_more_exchanges_in_flight_than_slots(worlds):
    assert all(worlds(3).run(many_in_flight, 5))


@pytest.mark.parametrize("delay_rank", [0, 1])
def test_growth_with_exchanges_in_flight(worlds, transport, delay_rank):
    if transport != "shm":
        pytest.skip("slot growth is the shm transport's")
    assert all(worlds(2).run(grow_with_many_in_flight, delay_rank))


def test_segments_are_unlinked_once_mapped(worlds):
    assert worlds(3).run(segments_after_setup) == [[], [], []]


def test_killed_rank_is_reported_within_seconds_and_leaves_no_segment():
    with tempfile.TemporaryDirectory() as stamps, LocalWorld(3, timeout_s=60, threads_per_rank=1) as world:
        with pytest.raises(TimeoutError, match=r"ranks \[2\] exited") as info:
            world.run(killed_mid_run, 2, stamps)
        survivors = info.value.results
    assert sorted(survivors) == [0, 1], survivors
    for rank, (kind, message, seconds) in survivors.items():
        assert kind == "PeerExitedError", message
        assert "rank 2 (pid" in message and "has exited" in message, message
        assert seconds < 5.0, seconds
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("moe_comm_")]


def test_unheld_segment_is_removed_and_a_held_one_is_not(worlds):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert worlds(2).run(plant_stale_segment, dead.pid) == [(False, True), (False, True)]


@pytest.mark.parametrize("how", ["exit", "mask"])
def test_masked_rank_is_skipped_by_low_latency_calls(transport, how):
    with local_world(3, transport, timeout_s=60, threads_per_rank=1) as world:
        if how == "exit":
            with pytest.raises(TimeoutError, match=r"ranks \[2\] exited") as info:
                world.run(masked_rank_survives, 2, how)
            results = info.value.results
        else:
            results = dict(enumerate(world.run(masked_rank_survives, 2, how)))
    for rank in (0, 1):
        r = results[rank]
        assert r["bf16"] < 1e-5 and r["fp8"] < 9e-4, r  # DeepEP's low-latency thresholds
        assert r["mask"] == [0, 0, 1] and r["after_clean"] == [0, 0, 0], r


def test_rank_masked_while_alive_cannot_rejoin():
    with LocalWorld(3, timeout_s=60, threads_per_rank=1) as world:
        results = world.run(rejoin_after_mask)
    kind, message, _ = results[2]  # the others went on without it: they masked it
    assert kind == "RuntimeError" and "rank 2 is out of step: ranks [0, 1] went past its exchange" in message, message
    for kind, message, mask in results[:2]:  # it never reaches their third call: masked again, by timeout
        assert (kind, mask) == ("no exception", [0, 0, 1]), (kind, message)


def test_engine_local_world_size_keeps_the_host_local(worlds):
    for result in worlds(2).run(engine_local_world_size, "LOCAL_WORLD_SIZE"):
        assert (result["local"], result["remote"], result["internode"]) == ([0, 1], [], False), result
        assert result["equal"], result


def test_nodes_of_one_rank_post_rows_of_a_real_model_size(worlds):
    """Rows to other nodes, and to itself, past the size of a metadata cell (the issue's vLLM case before the
    host decided the transport)."""
    for rank, result in enumerate(worlds(2).run(engine_local_world_size, "MOE_COMM_RANKS_PER_NODE")):
        assert (result["local"], result["remote"], result["internode"]) == ([rank], [1 - rank], True), result
        assert result["equal"], result


def test_ranks_per_node_splits_one_host_into_nodes(worlds):
    results = worlds(4).run(node_split)
    assert [r["local"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["remote"] for r in results] == [[2, 3], [2, 3], [0, 1], [0, 1]]
    assert all(r["same"] for r in results)


def test_flags_wait_outcomes():
    """The native wait: reached, past an exact target, deadline, and a dead setter (reaped or a zombie)."""
    import time

    import torch

    from moe_comm.core.native import native
    outcomes = native().WaitOutcome
    flags = torch.zeros(2, dtype=torch.int64)
    a, b = flags.data_ptr(), flags.data_ptr() + 8
    native().flag_store(a, 5)
    assert native().flag_load(a) == 5
    assert native().flags_wait([a], [5], [0], 1.0, True) == (-1, outcomes.REACHED)
    assert native().flags_wait([a], [3], [0], 1.0, False) == (-1, outcomes.REACHED)
    assert native().flags_wait([a, b], [5, 3], [0, 0], 1.0, True)[1] == outcomes.TIMEOUT  # b never set: deadline
    assert native().flags_wait([a], [3], [0], 1.0, True) == (0, outcomes.PAST_TARGET)  # already past: out of step
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    deadline_s = 30.0
    start = time.monotonic()
    assert native().flags_wait([a, b], [5, 1], [0, dead.pid], deadline_s, True) == (1, outcomes.PEER_EXITED)
    assert time.monotonic() - start < before(deadline_s)  # noticed at a 20 ms check, not at the deadline
    # exited but not reaped (a zombie: its parent has not waited yet, as a launcher that polls late)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    until = time.monotonic() + 30
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < until, "the child did not exit within 30 s"
        time.sleep(0.01)
    start = time.monotonic()
    assert native().flags_wait([a, b], [5, 1], [0, zombie.pid], deadline_s, True) == (1, outcomes.PEER_EXITED)
    assert time.monotonic() - start < before(deadline_s)
    zombie.wait()


def test_segment_that_does_not_fit_is_a_clear_error_and_leaves_nothing():
    from moe_comm.transport.shm_segment import Segment, SegmentLayout, segment_name
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    name = segment_name()
    with pytest.raises(RuntimeError, match=r"shm transport: cannot reserve \d+ bytes in /dev/shm .*"
                                           r"transport='collective'"):
        Segment.create(name, SegmentLayout(2, too_big))
    assert not os.path.exists(f"/dev/shm/{name}")
