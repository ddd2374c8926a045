"""Wall-clock bounds for the tests, derived from the deadline or delay each test configures.

A test that times something states its bound against the timeout it passes (``timeout_s=`` of a
Buffer, a rank's sleep), through one of these helpers, never as a bare number:

    found_within(d)  "ended by its deadline d, not long after":  d <= elapsed < found_within(d)
    before(d)        "noticed at once, not at its deadline d":   elapsed < before(d)
    well_before(d)   "did not wait for a delay (or sleep) of d": elapsed < well_before(d)

The margins are for this project's test machine: 2 cores shared by the ranks of a local world
(2-4 processes) and by other test runs. There (load average about 3), a rank that timed out raised
2-15 ms after its deadline, a peer's exit was noticed in 13-52 ms, and a call that does not wait
for a peer delayed 1.5 s returned in 0.1-25 ms. The margins are tens to hundreds of times those,
and each still fails the bug it is there to catch (a wait to the deadline, or for the peer).
"""
from __future__ import annotations

from moe_comm.transport.collective import STORE_WAIT_S

__all__ = ["EXIT_S", "LATE_S", "MEET_S", "SCHEDULING_S", "STACKS_S", "STARTUP_S", "before", "found_within",
           "well_before"]

#: How late, past the moment it could, a rank of a local world may get to run on the loaded machine
#: (a full `make test` keeps both cores busy for minutes; the 2-15 ms measured above, times 200).
SCHEDULING_S = 3.0

#: The shortest deadline for a wait that every rank must reach before any can pass it (a Buffer's
#: construction on ``mpi``, whose communicator duplication is collective; each call under shrink, where a
#: late rank is masked): ranks that left a barrier
#: together reach it up to ``SCHEDULING_S`` apart. At 2 s, three ranks on the loaded machine (two busy
#: loops beside the fast tier) all timed out building the buffer.
MEET_S = 2 * SCHEDULING_S

#: How long past its deadline a rank may take to raise: the library's own allowance (reading the
#: rendezvous store for the late ranks' names takes at most ``STORE_WAIT_S``; the README promises
#: "the deadline plus at most 1 s"), then ``SCHEDULING_S``.
LATE_S = STORE_WAIT_S + SCHEDULING_S

#: How long a fresh rank process may take to start (Python, then importing torch and moe_comm) before
#: any deadline of its own runs: 1.6 s measured alone, several times that while 3 ranks start at
#: once on the loaded machine.
STARTUP_S = 20.0

#: How long a process that was just ended (a closed world's rank, a killed one) may take to be gone:
#: torch's teardown takes a few hundred ms alone, and seconds while other ranks load both cores.
EXIT_S = 10.0

#: How long a rank still running past a test's deadline gets to print every thread's stack (SIGUSR1, which the
#: test scripts hand to faulthandler) before the test kills it.
STACKS_S = 2.0


def found_within(deadline_s: float) -> float:
    """Upper bound on the time from a call to the error of its deadline of ``deadline_s`` seconds
    (``deadline_s + LATE_S``), for "timed out at the deadline, not long after": a wait that ran to
    a later deadline (the world's, a second one) exceeds it once that adds more than ``LATE_S``."""
    return deadline_s + LATE_S


def before(deadline_s: float) -> float:
    """Upper bound for "noticed at once, not at the deadline of ``deadline_s`` seconds" (a peer's
    exit, a refusal): ``min(LATE_S, deadline_s / 2)``. Noticing is a poll of tens of milliseconds
    plus the slack ``LATE_S``; a wait that ran to the deadline took at least ``deadline_s``, so
    capping the bound at half of it keeps the two apart however short the deadline."""
    return min(LATE_S, deadline_s / 2)


def well_before(delay_s: float) -> float:
    """Upper bound for "did not wait for the peer delayed by ``delay_s`` seconds" (or for a rank's
    sleep of ``delay_s``): ``delay_s / 2``. A call that waited took at least ``delay_s``; the half
    left over is the slack for scheduling (0.75 s at the 1.5 s delays of the hook and async tests,
    against the 0.1-25 ms such a call takes here)."""
    return delay_s / 2
