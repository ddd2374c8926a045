"""No file in /dev/shm outlives its processes: moe-comm's segments and host counters, and the MPICH
segments of the jobs moe-comm launches, after SIGKILLs, timeouts and aborts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_comm.launch import LocalWorld
from moe_comm.transport.shm_segment import COUNTERS_PREFIX, PREFIX, sweep_stale

from helpers.deadlines import MEET_S, well_before
from helpers.paths import TESTS
from helpers.processes import all_gone
from helpers.shm_hygiene_cases import KILL_POINTS, identity, kill_rank, killed_at_random, killed_while_setting_up
from helpers.tiers import exhaustive
from helpers.transports import NO_MPI, TRANSPORTS, local_world

needs_mpi = pytest.mark.skipif(NO_MPI is not None, reason=NO_MPI or "")
SHM = Path("/dev/shm")


def _left(stamps: Path) -> list[str]:
    """Names (in /dev/shm) of the files the killed ranks were setting up."""
    return sorted(Path(f.read_text()).name for f in stamps.glob("left.*") if f.read_text() != "random")


def _present(names: list[str]) -> dict[str, int]:
    """The names still in /dev/shm, with their sizes."""
    found = {}
    for name in names:
        try:
            found[name] = (SHM / name).stat().st_size
        except FileNotFoundError:
            pass
    return found


def _files_of(ranks: list[dict]) -> list[str]:
    """What ranks (``identity``) left in /dev/shm: segments named for their pids, their MPICH segments."""
    own = {f"{PREFIX}{r['pid']}_" for r in ranks}
    mpich = {n for r in ranks for n in r["mpich"]}
    return sorted(n for n in os.listdir(SHM) if n in mpich or n.startswith(tuple(own)))


#: (transport, kill point, victims): the fast tier kills at every point once, the victims alternating.
_CASES = [pytest.param(t, p, v, id=f"{t}-{p}-{v}", marks=() if (i + j) % 2 == 0 else pytest.mark.exhaustive)
          for i, (t, p) in enumerate((t, p) for t in TRANSPORTS for p in KILL_POINTS[t])
          for j, v in enumerate(["one", "all"])]


@pytest.mark.every_transport  # the rows above choose the fast tier's runs
@pytest.mark.parametrize("transport,point,victims", _CASES)
def test_rank_killed_while_setting_up_leaves_nothing(tmp_path, transport, point, victims):
    """SIGKILL in the middle of a growth (shm) or of the host counters' set-up: once every process
    is gone, nothing of theirs is in /dev/shm. A surviving peer removes what a victim held; when
    every rank died, the next start-up's sweep does (here: a sweep as every start-up runs)."""
    if transport == "mpi" and NO_MPI:
        pytest.skip(NO_MPI)
    chosen = [1] if victims == "one" else [0, 1]
    with local_world(2, transport, timeout_s=60, threads_per_rank=1) as world:
        ranks = world.run(identity)
        try:
            results = dict(enumerate(world.run(killed_while_setting_up, chosen, point, str(tmp_path))))
        except TimeoutError as exc:
            results = exc.results
    if not list(tmp_path.glob("left.*")):
        assert results == {0: "not reached", 1: "not reached"}, results
        pytest.skip(f"the {transport} transport keeps no file in /dev/shm while it sets up")
    # Survivors report their error; under mpiexec a rank killed by a signal makes Hydra end the
    # others too (SIGUSR1, which they do not handle), so there may be none.
    survivors = set(range(2)) - set(chosen)
    assert set(results) <= survivors and (transport == "mpi" or set(results) == survivors), results
    assert all(isinstance(r, tuple) for r in results.values()), results
    assert all_gone([r["pid"] for r in ranks])
    left = _left(tmp_path)
    assert left, "the victims stamped what they were setting up"
    if victims == "all":  # nobody survived to sweep: the next start-up does
        sweep_stale()
    assert _present(left) == {}, f"left by the killed ranks: {_present(left)}"
    assert _files_of(ranks) == []


@pytest.mark.parametrize("trial", [0] + [exhaustive(t) for t in range(1, 8)])
def test_shm_rank_killed_at_a_random_moment_leaves_nothing(tmp_path, trial):
    """Buffers built and grown in a loop, a rank SIGKILLed at a random moment: once the processes
    are gone, none of their segments are left."""
    with LocalWorld(2, timeout_s=60, threads_per_rank=1) as world:
        ranks = world.run(identity)
        with pytest.raises(TimeoutError, match=r"ranks \[1\] exited"):
            world.run(killed_at_random, 1, trial, str(tmp_path))
    assert all_gone([r["pid"] for r in ranks])
    assert _files_of(ranks) == []


_HOLDER = """
import os, signal, time
from helpers.shm_hygiene_cases import hold_counters
kept = hold_counters({token!r}, 2)
print(flush=True)
{then}
"""


def _holder(token: str, then: str) -> subprocess.Popen:
    """A process that opens host counters ``token`` as a rank does, then runs ``then``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", _HOLDER.format(token=token, then=then)], stdout=subprocess.PIPE,
                            text=True, env=env)


def test_counters_file_of_dead_ranks_is_swept_and_a_held_one_is_not():
    """A counters file whose openers all died (killed before their barrier) goes at the next
    start-up on the host, at once; one that a live process holds stays, however old."""
    dead_name, live_name = (f"{COUNTERS_PREFIX}hygiene{os.getpid()}{kind}" for kind in ("dead", "live"))
    dead = _holder(dead_name[len(COUNTERS_PREFIX):], "os.kill(os.getpid(), signal.SIGKILL)")
    dead.communicate(timeout=120)
    assert (SHM / dead_name).exists(), "the killed process left its counters file"
    live = _holder(live_name[len(COUNTERS_PREFIX):], "time.sleep(120)")
    try:
        live.stdout.readline()  # it has opened its own counters (sweeping first) and holds them
        assert not (SHM / dead_name).exists(), "the next start-up did not sweep the dead ranks' file"
        an_hour_ago = time.time() - 3600
        os.utime(SHM / live_name, (an_hour_ago, an_hour_ago))
        assert live_name not in sweep_stale() and (SHM / live_name).exists(), "a held counters file was swept"
    finally:
        live.kill()
        live.wait()
    assert live_name in sweep_stale()  # its holder is gone now


@needs_mpi
def test_mpi_world_aborted_after_a_timeout_leaves_no_mpich_segment():
    from helpers.mpi_cases import destroy_kept, time_out_then_refuse
    with local_world(3, "mpi", timeout_s=60, threads_per_rank=1) as world:
        ranks = world.run(identity)
        assert all(r["mpich"] for r in ranks), ranks
        world.run(time_out_then_refuse, MEET_S)
        with pytest.raises(TimeoutError, match=r"exited"):
            world.run(destroy_kept, timeout_s=30)
    assert all_gone([r["pid"] for r in ranks])
    assert _present(sorted({n for r in ranks for n in r["mpich"]})) == {}


@needs_mpi
def test_bare_mpiexec_job_aborted_after_a_timeout_leaves_no_mpich_segment(tmp_path):
    """Under a plain mpiexec (no LocalWorld to clean up after it) the aborting rank unlinks the
    host's MPICH segment before MPI_Abort."""
    from moe_comm.launch.mpiexec import find_mpiexec
    # rank 1's sleep: the job ends before it only if the abort ends it. The job's time includes starting
    # two Pythons with torch (51 s beside two busy loops and the rest of the fast tier)
    sleep_s = 240
    script = tmp_path / "abort_job.py"
    script.write_text(textwrap.dedent("""
        import json, time
        from mpi4py import MPI
        import moe_comm
        from helpers.fault_cases import _dispatch
        from helpers.shm_hygiene_cases import mpich_job_shm
        comm = MPI.COMM_WORLD
        print(json.dumps(mpich_job_shm()), flush=True)
        comm.Barrier()  # the ranks start Python apart; building the buffer is collective, under its deadline
        buf = moe_comm.Buffer(None, comm=comm, timeout_s={meet_s}, explicitly_destroy=True)
        if comm.rank == 0:
            try:
                _dispatch(buf)
            except moe_comm.CommTimeoutError:
                buf.destroy()  # aborts the job
        time.sleep({sleep_s})
    """).format(sleep_s=sleep_s, meet_s=MEET_S))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "MOE_COMM_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=sleep_s + 60)
    elapsed = time.monotonic() - start
    # the abort ended the job (rank 1 would sleep sleep_s); Hydra may lose the ranks' stderr as it ends them
    assert done.returncode != 0 and elapsed < well_before(sleep_s), (done.returncode, elapsed, done.stderr[-2000:])
    names = sorted({n for line in done.stdout.splitlines() if line.startswith("[") for n in json.loads(line)})
    assert names, done.stdout
    assert _present(names) == {}


@needs_mpi
def test_mpiexec_world_with_a_sigkilled_rank_leaves_no_mpich_segment():
    with LocalWorld(2, launcher="mpiexec", timeout_s=60, threads_per_rank=1) as world:
        ranks = world.run(identity)
        assert all(r["mpich"] for r in ranks), ranks
        # Hydra ends rank 0 too (SIGUSR1) once rank 1 is killed, often before it returns
        with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] exited"):
            world.run(kill_rank, 1)
    assert all_gone([r["pid"] for r in ranks])
    assert _files_of(ranks) == []
