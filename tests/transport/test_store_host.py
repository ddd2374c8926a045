"""Deadlines hold when the rank that hosts the rendezvous store stops or dies, on every transport:
the others fail within the deadline plus 2 s, naming the rank."""
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import pytest

from moe_comm.launch.mpiexec import find_mpiexec

from helpers.deadlines import MEET_S, STACKS_S, STARTUP_S, found_within
from helpers.paths import HELPERS
from helpers.ports import ATTEMPTS, launcher_env, port_taken
from helpers.processes import command_line, describe_sessions, running_processes
from helpers.transports import NO_MPI, TRANSPORTS

SCRIPT = HELPERS / "store_host_script.py"
# the Buffer's deadline: its construction and first dispatch must meet every rank (MEET_S; at 4 s, a rank late
# beside two busy loops failed the construction)
RANKS, TIMEOUT_S = 3, MEET_S
INIT_TIMEOUT_S = 60.0  # store_host_script.py's init_from_env(timeout_s=60): the rendezvous deadline


def _run(transport: str, scenario: str) -> dict[int, dict]:
    """Starts the ranks as torchrun/mpirun would (rank 0 hosts the store); returns the survivors' reports.
    A launch whose store port was taken meanwhile is started again on another (helpers/ports.py)."""
    for _ in range(ATTEMPTS):
        reports = _launch(transport, scenario)
        if reports is not None:
            return reports
    raise AssertionError(f"the store's port was taken {ATTEMPTS} times in a row")


def _launch(transport: str, scenario: str) -> Optional[dict[int, dict]]:
    """One launch: the survivors' reports, or None when rank 0 could not bind the store's port."""
    env = launcher_env(transport)
    command = [sys.executable, str(SCRIPT), scenario, str(TIMEOUT_S)]
    env["MOE_COMM_TEST_REPORT_DIR"] = report_dir = tempfile.mkdtemp(prefix="moe_comm_store_host_")
    if transport == "mpi":
        procs = [subprocess.Popen([find_mpiexec(), "-disable-auto-cleanup", "-n", str(RANKS)] + command, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)]
    else:
        procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "WORLD_SIZE": str(RANKS)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(RANKS)]
    lines: queue.Queue = queue.Queue()
    for proc in procs:  # a stopped rank never closes its output: read every rank's at once
        threading.Thread(target=lambda out=proc.stdout: [lines.put(line) for line in out], daemon=True).start()
    reports, store_host, taken, output = {}, None, False, []
    # every survivor has reported by then: started, met within the rendezvous deadline, failed the
    # dispatch within its own
    deadline = time.monotonic() + STARTUP_S + found_within(INIT_TIMEOUT_S) + found_within(TIMEOUT_S)
    try:
        while len(reports) < RANKS - 1 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            output.append(line)
            if port_taken(line):
                taken = True
                break
            if line.startswith("SETUP_FAILED "):
                raise AssertionError(f"a rank failed before the store's host stopped or died: {line.strip()}\n"
                                     + "".join(output))
            if line.startswith("STORE_HOST "):
                store_host = int(line.split()[1])
            elif line.startswith("RESULT "):
                report = json.loads(line[len("RESULT "):])
                reports[report["rank"]] = report
        if not taken and len(reports) < RANKS - 1:  # shown with the test's failure
            print(f"reports from ranks {sorted(reports)} only; the ranks' processes:\n"
                  + describe_sessions([proc.pid for proc in procs]))
            print("the ranks' output, then every thread's stack:\n" + "".join(output + _stacks(procs, lines)))
    finally:
        # An mpi job ends by itself once its survivors know their reports were read (they abort it,
        # which takes the stopped rank too, and unlink MPICH's segments first): kill the store's
        # host only if it outlives the job. Spawned ranks: the stopped one never ends by itself.
        open(os.path.join(report_dir, "read"), "w").close()
        if transport == "mpi":
            _wait(procs)
        if store_host is not None:
            try:
                os.kill(store_host, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if taken:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGKILL)
        _wait(procs)
        shutil.rmtree(report_dir, ignore_errors=True)
    return None if taken else reports


def _stacks(procs: list[subprocess.Popen], lines: queue.Queue) -> list[str]:
    """What the ranks print within STACKS_S of SIGUSR1 (store_host_script.py prints every thread's stack):
    sent to the script's processes of the launch's sessions, not to mpiexec."""
    sessions = {str(proc.pid) for proc in procs}
    for pid, fields in running_processes().items():
        if fields[3] in sessions and SCRIPT.name in command_line(pid):
            os.kill(int(pid), signal.SIGUSR1)
    printed, until = [], time.monotonic() + STACKS_S
    while time.monotonic() < until:
        try:
            printed.append(lines.get(timeout=0.1))
        except queue.Empty:
            pass
    return printed


def _wait(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("scenario", ["stall", "dead"])
@pytest.mark.parametrize("transport", TRANSPORTS)  # the fast tier rotates the transports (helpers/tiers.py)
def test_store_host_that_stops_or_dies_fails_others_within_the_deadline(transport, scenario):
    if transport == "mpi" and NO_MPI:
        pytest.skip(NO_MPI)
    reports = _run(transport, scenario)
    assert sorted(reports) == list(range(1, RANKS)), reports
    for report in reports.values():
        assert report["transport"] == transport, report
        assert report["seconds"] <= found_within(TIMEOUT_S), report
        assert report["kind"] in ("CommTimeoutError", "PeerExitedError", "RuntimeError"), report
        assert report["missing"] == [0] or "rank 0" in report["message"], report
        if scenario == "dead":
            assert "has exited" in report["message"], report
