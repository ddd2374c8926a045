"""Rank 0 hosts the rendezvous store (init_from_env's tcp:// init, as torchrun and mpirun users get),
then stops (SIGSTOP) or dies; the other ranks dispatch and report, one JSON line each, how long
they took to fail and with what. Run as ``store_host_script.py SCENARIO TIMEOUT_S`` by a launcher."""
import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it waits too long

import torch
import torch.distributed as dist

import moe_comm

scenario, timeout_s = sys.argv[1], float(sys.argv[2])
group = moe_comm.init_from_env(timeout_s=60)
try:  # everyone is in: a failure here is the test's setup failing, reported at once
    buf = moe_comm.Buffer(group, timeout_s=timeout_s)
    rank, num_ranks = buf.rank, buf.group_size
    x = torch.full((8, 64), float(rank), dtype=torch.bfloat16)
    idx = torch.arange(8 * 2).view(8, 2) % (4 * num_ranks)
    weights = torch.rand(8, 2)
    buf.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=4 * num_ranks)
except Exception as exc:
    sys.stdout.write(f"SETUP_FAILED {type(exc).__name__}: {exc}\n")
    sys.stdout.flush()
    raise
pids = [None] * num_ranks
dist.all_gather_object(pids, os.getpid(), group=group)
if rank == 0:
    sys.stdout.write(f"STORE_HOST {os.getpid()}\n")
    sys.stdout.flush()
    if scenario == "stall":
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once the others have reported
    os._exit(0)
time.sleep(0.5)  # rank 0 has stopped or exited by now
start = time.monotonic()
try:
    buf.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=4 * num_ranks)
    outcome = ("no exception", "", None)
except Exception as exc:  # reported to the test
    outcome = (type(exc).__name__, str(exc), getattr(exc, "missing_ranks", None))
report = dict(rank=rank, seconds=time.monotonic() - start, kind=outcome[0], message=outcome[1],
              missing=outcome[2], transport=buf.transport_name)
sys.stdout.write("RESULT " + json.dumps(report) + "\n")
sys.stdout.flush()
if buf.transport_name == "mpi":
    # The failed mpi transport aborts the whole job at exit (MPI cannot cancel a collective), which
    # would kill a survivor whose report mpiexec has not forwarded yet: exit once the test has read
    # every report (it marks that in its folder), or after a generous deadline.
    read = os.path.join(os.environ["MOE_COMM_TEST_REPORT_DIR"], "read")
    until = time.monotonic() + 10 * timeout_s
    while not os.path.exists(read) and time.monotonic() < until:
        time.sleep(0.01)
    sys.exit(0)
os._exit(0)  # the store's host is stopped or gone: skip the process group's teardown
