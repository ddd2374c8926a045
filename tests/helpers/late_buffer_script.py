"""Ranks started as torchrun/mpirun would (rank 0 hosts the rendezvous store): the last rank comes to the
Buffer's construction past its deadline, so every rank's construction fails; each prints ``FAILED <error>``
and exits with the error. Run as ``late_buffer_script.py TIMEOUT_S`` by a launcher (RANK and WORLD_SIZE set)."""
import faulthandler
import os
import signal
import sys
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it waits too long

import moe_comm

timeout_s = float(sys.argv[1])
group = moe_comm.init_from_env(timeout_s=60)
if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    time.sleep(timeout_s + 2.0)
try:
    moe_comm.Buffer(group, timeout_s=timeout_s)
except Exception as exc:
    sys.stdout.write(f"FAILED {type(exc).__name__}\n")
    sys.stdout.flush()
    raise
sys.stdout.write("BUILT\n")
