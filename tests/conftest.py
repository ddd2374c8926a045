"""Shared fixtures: one pool of local gloo ranks per world size, reused across tests; the check that
the session leaves /dev/shm as it found it; the test tiers (``helpers/tiers.py``: ``--tier fast|all``)."""
from __future__ import annotations

import concurrent.futures
import gc
import os
import time
from typing import Callable

import pytest

from moe_comm.launch import LocalWorld
from moe_comm.launch.mpiexec import shm_holders

from helpers.processes import running_processes
from helpers.tiers import fast_selection, tier_of
from helpers.transports import NO_MPI, WORLD_KINDS, local_world

# Keep each rank single-threaded: several ranks share 2 cores.
os.environ.setdefault("MOE_COMM_NUM_THREADS", "1")
# TileLang keeps compiled kernels in ~/.tilelang by default: the tests keep theirs in the ignored build/.
os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                         "build", "tilelang-cache"))


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's CPU interpreter, which Triton reads when a kernel
# module is imported (so before any test runs). With a GPU they compile, and the CPU-interpreter
# cases skip with that reason.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# NOTES: the CUDA kernels' CPU-side checks (SPIN models, the ThreadSanitizer stress, the nvcc build and
# its SASS lint) skip, saying which tool is missing, where a tool is absent. `make test` sets
# MOE_COMM_REQUIRE_TOOLS=1: there a skip for a missing tool is a failure, so a CI machine without
# them cannot pass those checks by skipping them.
_TOOLS = ("spin is not installed", "gcc is not installed", "g++ is not installed", "-fsanitize=thread",
          "nvcc not found", "nvdisasm not found", "ip is not installed", "unshare is not installed",
          "torch-npu is not installed", "tilelang does not import")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("fast", "all"), default=None,
                     help="fast (default; make test): each case once, world kinds rotated; all (make test-all): "
                          "every case on every world kind, and the tests marked exhaustive. Also MOE_COMM_TEST_TIER.")


_LOOP_MS = pytest.StashKey[float]()
_SHM_BEFORE = pytest.StashKey[set]()  # /dev/shm's entries when the session started
_SHM_LEFT = pytest.StashKey[str]()  # what the session left there, said in the terminal summary


def _loop_ms() -> float:
    """Milliseconds a 10**6-step Python loop takes here (best of 3): the machine's speed, printed so that the
    suite's wall time in one run (CI's, a developer's) can be compared with another's (docs/testing.md "Times")."""
    best = float("inf")
    for _ in range(3):
        start, total = time.perf_counter(), 0
        for i in range(10**6):
            total += i
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def pytest_report_header(config):
    return f"moe-comm test tier: {tier_of(config.getoption('--tier'))} (helpers/tiers.py)"


def pytest_sessionstart(session):
    if _is_xdist_worker(session.config):
        return
    session.config.stash[_LOOP_MS] = _loop_ms()  # before any test loads the machine
    if os.path.isdir(_SHM):
        session.config.stash[_SHM_BEFORE] = set(os.listdir(_SHM))


def pytest_terminal_summary(terminalreporter, config):
    """Printed under -q too (make test), unlike the header."""
    if _LOOP_MS in config.stash:
        terminalreporter.write_line(f"machine speed at the start: a 10**6-step Python loop took "
                                    f"{config.stash[_LOOP_MS]:.0f} ms")
    if _SHM_LEFT in config.stash:
        terminalreporter.write_sep("=", "/dev/shm", red=True)
        terminalreporter.write_line(config.stash[_SHM_LEFT])


def pytest_collection_modifyitems(config, items):
    """The fast tier drops what only the exhaustive tier runs (helpers/tiers.py says what and why)."""
    if tier_of(config.getoption("--tier")) == "all":
        return
    kept = fast_selection(items, WORLD_KINDS)
    kept_ids = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in kept_ids]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("MOE_COMM_REQUIRE_TOOLS") == "1":
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(tool in reason for tool in _TOOLS):
            report.outcome = "failed"
            report.longrepr = f"MOE_COMM_REQUIRE_TOOLS=1 (make test) needs this check to run: {reason}"


@pytest.fixture(autouse=True)
def _seeded_rng():
    """Every test draws the same random data on every run (MOE_COMM_TEST_SEED picks another draw)."""
    import torch
    torch.manual_seed(int(os.environ.get("MOE_COMM_TEST_SEED", "0")))


_SHM = "/dev/shm"
# How long processes that just ended (ranks, mpiexec jobs) may take to let go of their files (a loaded
# machine: the fast tier beside two busy loops once found entries still held after 15 s).
# MOE_COMM_TEST_SHM_SETTLE_S shortens it for tests/tools/test_session_checks.py's planted leaks.
_SHM_SETTLE_S = float(os.environ.get("MOE_COMM_TEST_SHM_SETTLE_S", "60"))


def _session_pids() -> set[int]:
    """This process and its descendants."""
    parents = {int(pid): int(fields[1]) for pid, fields in running_processes().items()}
    ours, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    return ours


def _new_shm_entries(before: set[str]) -> dict[str, str]:
    """Entries of /dev/shm that are not in ``before`` and are this session's: nobody holds them (left
    behind), or a process of this session still does. Entries that only live processes outside this
    session map or hold open (another program, another test run on this host) are not. Values say
    the size and who holds the entry."""
    holders, _ = shm_holders()
    ours = _session_pids()
    found = {}
    for name in sorted(set(os.listdir(_SHM)) - before):
        held = holders.get(name, set())
        if held and not held & ours:
            continue
        try:
            size = os.stat(os.path.join(_SHM, name)).st_size
        except FileNotFoundError:
            continue
        found[name] = f"{size} bytes, " + (f"held by this session's pids {sorted(held & ours)}" if held else
                                           "held by no process")
    return found


def _is_xdist_worker(config) -> bool:
    """A pytest-xdist worker (make test runs the fast tier on two): the session-wide checks are the controller's."""
    return hasattr(config, "workerinput")


def _shm_left_by(before: set[str]) -> dict[str, str]:
    """This session's new /dev/shm entries, once ended processes have had _SHM_SETTLE_S to let go of theirs."""
    deadline = time.monotonic() + _SHM_SETTLE_S
    while True:
        gc.collect()  # objects that own semaphores (queues of closed worlds) let go of them when collected
        left = _new_shm_entries(before)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def pytest_sessionfinish(session, exitstatus):
    """The session leaves /dev/shm as it found it: after every pooled world is closed (every worker's, under
    pytest-xdist: this runs in the controller once they have all ended), no entry created during the session
    remains (moe-comm's segments and counters, MPICH's segments, multiprocessing's semaphores, anything else).
    An entry left fails the session."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    left = _shm_left_by(before)
    if left:
        session.config.stash[_SHM_LEFT] = (
            f"the test session left {len(left)} entries in {_SHM} (after {_SHM_SETTLE_S:g} s for ended processes to "
            f"let go; a concurrent test run on this host that leaks shows here too):\n"
            + "\n".join(f"  {name}: {what}" for name, what in left.items()))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def _world_pool():
    pool: dict[tuple[int, str], LocalWorld] = {}
    yield pool
    # Closed side by side: each close mostly waits for its ranks to leave their group and exit.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(pool))) as closing:
        list(closing.map(lambda world: world.close(), pool.values()))
    pool.clear()  # their multiprocessing queues (named semaphores) go with them


@pytest.fixture(params=WORLD_KINDS)
def transport(request) -> str:
    """What the buffers of ``worlds`` run on: the transport ``Buffer(transport="auto")`` picks under
    the portable backend, or ``cuda_host`` (that backend, over shm)."""
    if request.param == "mpi" and NO_MPI:
        pytest.skip(NO_MPI)
    return request.param


@pytest.fixture
def worlds(_world_pool, transport) -> Callable[[int], LocalWorld]:
    """``worlds(n)`` returns a live ``LocalWorld`` of n ranks whose buffers use ``transport``,
    starting (or restarting) it on demand; worlds are shared across tests."""

    def get(n: int) -> LocalWorld:
        key = (n, transport)
        if key not in _world_pool or _world_pool[key].closed:
            _world_pool[key] = local_world(n, transport, timeout_s=240, threads_per_rank=1)
        return _world_pool[key]

    return get
