"""Process groups from launchers' environments: torchrun, MPICH and Open MPI variables, and real launches."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from moe_comm.launch import LocalWorld, init_from_env, launcher_rank, spawn
from moe_comm.launch.mpiexec import shm_holders

from helpers.deadlines import EXIT_S
from helpers.paths import HELPERS
from helpers.ports import ATTEMPTS, free_port, port_taken
from helpers.processes import all_gone
from helpers.transports import NO_MPI

SCRIPT = HELPERS / "launch_script.py"
BIN = Path(sys.executable).parent
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("rank_var,size_var,launcher", [
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("PMI_RANK", "PMI_SIZE", "mpirun (MPICH/Hydra)"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
])
def test_launcher_environment_is_recognised(clean_env, rank_var, size_var, launcher):
    clean_env.setenv(rank_var, "3")
    clean_env.setenv(size_var, "5")
    assert launcher_rank() == (3, 5, launcher)


def test_no_launcher_environment_is_a_clear_error(clean_env):
    assert launcher_rank() is None
    with pytest.raises(RuntimeError, match=r"no launcher environment found \(looked for RANK/WORLD_SIZE, "
                                           r"PMI_RANK/PMI_SIZE, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE\)"):
        init_from_env()


def _rank_of(group, offset):
    import torch.distributed as dist
    return dist.get_rank(group) + offset, dist.get_world_size(group)


def test_spawn_runs_on_every_rank():
    assert spawn(_rank_of, 3, 10, timeout_s=120) == [(10, 3), (11, 3), (12, 3)]


def _run(cmd: Callable[[int], list[str]], extra_env: dict[str, str]) -> str:
    """The output of ``cmd(port)`` launched with MASTER_PORT=port (started again, on another port,
    when the port was taken meanwhile: helpers/ports.py)."""
    for _ in range(ATTEMPTS):
        port = free_port()
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra_env}
        for name in LAUNCH_VARS:
            env.pop(name, None)
        done = subprocess.run(cmd(port), env=env, capture_output=True, text=True, timeout=180)
        if done.returncode == 0 or not port_taken(done.stdout + done.stderr):
            break
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrun_launch():
    out = _run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(port), str(SCRIPT)], {"OMP_NUM_THREADS": "1"})
    assert sorted(re.findall(r"rank \d/\d ok", out)) == ["rank 0/2 ok", "rank 1/2 ok"]


def test_mpirun_launch():
    mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install 'moe-comm[mpi]' provides MPICH's)")
    out = _run(lambda port: [mpirun, "-n", "2", sys.executable, str(SCRIPT)], {"OMP_NUM_THREADS": "1"})
    assert sorted(re.findall(r"rank \d/\d ok", out)) == ["rank 0/2 ok", "rank 1/2 ok"]


def _mpi_rank(group):
    import torch.distributed as dist
    from mpi4py import MPI
    return dist.get_rank(group), MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.mark.skipif(NO_MPI is not None, reason=NO_MPI or "")
def test_mpiexec_world_ranks_are_its_mpi_ranks():
    with LocalWorld(3, launcher="mpiexec", timeout_s=120, threads_per_rank=1) as world:
        assert world.run(_mpi_rank) == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]


def test_unknown_launcher_is_a_clear_error():
    with pytest.raises(ValueError, match=r"LocalWorld: launcher must be 'spawn' or 'mpiexec', got 'slurm'"):
        LocalWorld(2, launcher="slurm")


MAIN_SCRIPT = '''
from moe_comm.launch import LocalWorld


def rank_and_size(group):
    import torch.distributed as dist
    return dist.get_rank(group), dist.get_world_size(group)


if __name__ == "__main__":
    with LocalWorld(2, launcher="{launcher}", timeout_s=120, threads_per_rank=1) as world:
        print("results", world.run(rank_and_size))
'''


@pytest.mark.parametrize("launcher", ["spawn", "mpiexec"])
def test_functions_of_the_main_script_run_on_local_ranks(tmp_path, launcher):
    if launcher == "mpiexec" and NO_MPI:
        pytest.skip(NO_MPI)
    script = tmp_path / "main_script.py"
    script.write_text(MAIN_SCRIPT.replace("{launcher}", launcher))
    out = _run(lambda port: [sys.executable, str(script)], {})
    assert "results [(0, 2), (1, 2)]" in out, out


def test_a_script_that_starts_mpiexec_ranks_unguarded_is_a_clear_error(tmp_path):
    if NO_MPI:
        pytest.skip(NO_MPI)
    script = tmp_path / "unguarded.py"
    script.write_text(MAIN_SCRIPT.replace("{launcher}", "mpiexec").replace('if __name__ == "__main__":', "if True:"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "was started while an mpiexec rank loaded the main script" in done.stderr, done.stderr[-2000:]


ORPHANING_SCRIPT = '''
import os
from moe_comm.launch import LocalWorld

def pid(group):
    return os.getpid()

if __name__ == "__main__":
    world = LocalWorld(2, timeout_s=60, threads_per_rank=1)
    print(*world.run(pid), flush=True)
    os.kill(os.getpid(), 9)  # as a CI timeout ends a test run: no cleanup of any kind
'''


def test_ranks_of_a_killed_owner_exit(tmp_path):
    """Ranks whose starting process was killed leave (they would otherwise wait for a task for ever)."""
    script = tmp_path / "orphaning.py"
    script.write_text(ORPHANING_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2, done.stdout
    assert all_gone(pids, within_s=1.0 + EXIT_S), "ranks outlived their world's owner"  # a poll, then the exit


def test_shm_holders_reads_through_processes_that_exit_meanwhile():
    """``shm_holders`` (how a closed mpiexec world and the session's /dev/shm check find who holds an entry)
    reads every process's /proc maps; a process reaped after its maps were opened makes the read fail with
    ESRCH, which once errored a loaded fast-tier run. Python processes start and exit beside it for 3 s (that
    met the race about twice in 5 s here); it must go on reading, and still find this process's own entry."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            subprocess.run([sys.executable, "-c", "import numpy"], check=False)

    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="moe-comm-test-holders-") as held:
        threads = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            # 3 s and at least 10 reads (beside two busy loops and a test run, 3 s once held 10 reads no more)
            calls, deadline, cap = 0, time.monotonic() + 3.0, time.monotonic() + 60.0
            while (time.monotonic() < deadline or calls < 10) and time.monotonic() < cap:
                holders, _ = shm_holders()
                assert os.getpid() in holders.get(os.path.basename(held.name), set()), holders
                calls += 1
        finally:
            stop.set()
            for thread in threads:
                thread.join()
    assert calls >= 10, calls
