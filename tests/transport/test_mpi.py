"""The mpi transport: a Buffer over an mpi4py communicator gives the collective transport's bits;
subgroups, argument errors, deadlines and the abort after a timeout."""
from __future__ import annotations

import os

import pytest

from moe_comm import transport as transports
from moe_comm.launch import LocalWorld

from helpers.deadlines import MEET_S, before
from helpers.mpi_cases import (a_peer_done_and_gone_while_another_is_late, bad_arguments, comm_and_group, destroy_kept,
                               many_buffers, mpi_transport_outside_mpiexec, rows_of_a_peer_that_exits,
                               skip_construction, subgroup, time_out_then_refuse)
from helpers.tiers import exhaustive
from helpers.transports import NO_MPI, local_world

needs_mpi = pytest.mark.skipif(NO_MPI is not None, reason=NO_MPI or "")


@needs_mpi
@pytest.mark.parametrize("world_size", [exhaustive(1), exhaustive(2), 3, exhaustive(4)])
def test_comm_buffer_gives_the_collective_transports_bits(world_size):
    with local_world(world_size, "mpi", timeout_s=120, threads_per_rank=1) as world:
        results = world.run(comm_and_group)
    for rank, r in enumerate(results):
        assert r["info"] == dict(group=None, rank=rank, size=world_size, transport="mpi"), r["info"]
        assert r["comm"] == r["collective"] and r["mpi"] == r["collective"]
    assert len({tuple(r["collective"]) for r in results}) == world_size  # the digests tell ranks apart


@needs_mpi
def test_subgroup_buffers_give_the_collective_transports_bits():
    with local_world(4, "mpi", timeout_s=120, threads_per_rank=1) as world:
        results = world.run(subgroup)
    assert results[1] is None and results[3] is None
    for r in (results[0], results[2]):
        assert r["mpi"] == r["collective"] and r["comm"] == r["collective"]


@needs_mpi
def test_comm_misuse_is_a_clear_error():
    with local_world(2, "mpi", timeout_s=60, threads_per_rank=1) as world:
        results = world.run(bad_arguments)
    for rank, r in enumerate(results):
        assert r["shm_with_comm"] == ("ValueError", "Buffer: transport must be 'auto' or 'mpi' when comm (an "
                                      "mpi4py communicator) is given, got 'shm'")
        assert r["comm_null"] == ("ValueError", "Buffer: comm must be a valid communicator, got MPI.COMM_NULL")
        for case, how in (("not_cpu", "on meta"), ("strided", "on cpu, not contiguous")):
            kind, message = r[case]
            assert kind == "ValueError" and message.startswith(
                "all_to_all: the mpi transport moves contiguous CPU tensors; input is "), message
            assert how in message, message
        assert r["ranks_differ"] == ("ValueError", f"Buffer: comm must be the same ranks as group (rank {rank} of "
                                     f"2), got rank 0 of 1")


@needs_mpi
def test_mpi_transport_needs_ranks_launched_as_one_mpi_job():
    with LocalWorld(2, timeout_s=60, threads_per_rank=1) as world:  # spawned: each rank is its own MPI world
        results = world.run(mpi_transport_outside_mpiexec)
    for rank, (kind, message, _) in enumerate(results):
        assert kind == "RuntimeError", message
        assert (f"transport 'mpi' on a torch.distributed group needs torch rank r to be MPI.COMM_WORLD rank r; "
                f"got torch rank {rank} of 2, MPI rank 0 of 1") in message
    # each singleton's segment goes with its rank (which finalises MPI as it leaves the closed world)
    segments = [name for _, _, names in results for name in names]
    assert segments and not [n for n in segments if os.path.exists(f"/dev/shm/{n}")], segments


@needs_mpi
def test_timed_out_buffer_refuses_work_and_aborts_the_job_when_destroyed():
    with local_world(3, "mpi", timeout_s=60, threads_per_rank=1) as world:
        results = world.run(time_out_then_refuse, MEET_S)
        assert results[2] == "skipped"
        for rank in (0, 1):
            (timeout, missing), refusal, seconds = results[rank]
            assert f"dispatch: rank {rank} timed out after {MEET_S:g} s; ranks not heard from: [2]" in timeout
            assert missing == [2]
            # the Buffer refuses before its transport would (which says MPI cannot cancel a collective)
            assert f"dispatch: rank {rank}: this Buffer is unusable since CommTimeoutError in dispatch" in refusal
            assert seconds < before(MEET_S), seconds  # at once, not after another deadline
        # MPI_Abort ends the whole job: rank 2 may be gone before it reports its own destroy
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1(, 2)?\] exited"):
            world.run(destroy_kept, timeout_s=30)


@needs_mpi
def test_rank_that_never_builds_its_buffer_times_out_the_others():
    with local_world(3, "mpi", timeout_s=60, threads_per_rank=1) as world:
        results = world.run(skip_construction, 2.0)
    assert results[2] == "skipped"
    for rank in (0, 1):
        seconds, message = results[rank]
        assert 2.0 <= seconds < 10.0, seconds
        assert message.startswith(f"Buffer(): rank {rank} timed out after 2 s; ranks not heard from: unknown"), message


@needs_mpi
def test_rows_a_peer_sent_before_it_exited_are_taken_in():
    """A wait that finds its peer exited takes in what the peer sent first: the call succeeds with its rows."""
    with local_world(3, "mpi", timeout_s=60, threads_per_rank=1) as world:
        with pytest.raises(TimeoutError, match=r"ranks \[1\] exited") as info:
            world.run(rows_of_a_peer_that_exits, 20.0)
    results = info.value.results
    assert results[2] == "sat out", results
    assert results[0] == [1.0, 2.0], results  # its own row, then rank 1's


@needs_mpi
def test_a_peer_that_finished_and_exited_is_not_blamed_for_a_late_one():
    """A wait that finds a peer exited goes on when that peer had finished the exchange: what is missing
    is a live rank's, which comes later. Rank 2 exits done while rank 0 is 1.5 s late."""
    with local_world(3, "mpi", timeout_s=60, threads_per_rank=1) as world:
        with pytest.raises(TimeoutError, match=r"ranks \[2\] exited") as info:
            world.run(a_peer_done_and_gone_while_another_is_late, 1.5)
    results = info.value.results
    assert results == {0: [1.0, 2.0], 1: [1.0, 2.0, 3.0]}, results


@needs_mpi
def test_dropped_buffers_free_their_communicators():
    # MPICH has about 2000 communicator ids; each buffer takes two while it lives
    with local_world(2, "mpi", timeout_s=120, threads_per_rank=1) as world:
        assert world.run(many_buffers, 1500) == [1500, 1500]


def test_auto_picks_mpi_on_the_mpi_backend():
    assert transports.auto("mpi") == "mpi"
    assert transports.auto("gloo") == "shm"
    assert transports.auto("nccl") == "collective"
    assert "mpi" in transports.available()


@needs_mpi
def test_shrink_without_torch_distributed_is_refused(tmp_path):
    """A pure MPI job has no rendezvous store for the shrink protocol: the Buffer says so on every rank."""
    import subprocess
    import sys

    from moe_comm.launch.mpiexec import find_mpiexec

    # Each rank reports to its own file: mpiexec forwards the ranks' stdout in pieces that can interleave.
    code = ("import sys; from mpi4py import MPI; import moe_comm\n"
            "out = open(sys.argv[1] + f'/rank{MPI.COMM_WORLD.Get_rank()}.txt', 'w')\n"
            "try:\n"
            "    moe_comm.Buffer(None, comm=MPI.COMM_WORLD, low_latency_mode=True, enable_shrink=True, timeout_s=30)\n"
            "except ValueError as exc:\n"
            "    out.write(f'REFUSED {exc}\\n')\n"
            "moe_comm.Buffer(None, comm=MPI.COMM_WORLD, low_latency_mode=True, timeout_s=30)\n"
            "out.write('PLAIN OK\\n')\n")
    done = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in range(2):
        report = (tmp_path / f"rank{rank}.txt").read_text()
        assert report.startswith("REFUSED Buffer: enable_shrink=True masks the ranks that miss a low-latency deadline, "
                                 "which needs torch.distributed's rendezvous store"), (rank, report)
        assert report.endswith("PLAIN OK\n"), (rank, report)
