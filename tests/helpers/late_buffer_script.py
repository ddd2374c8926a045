"""Ranks started as torchrun/mpirun would (rank 0 hosts the rendezvous store): the last rank comes to the
Buffer's construction past its deadline, so every rank's construction fails; each prints ``STARTED`` once its
group is up (start-up on a loaded machine is not what the test bounds), then ``FAILED <error>``
and exits with the error; a rank still exiting STACKS_AFTER_S after that prints every thread's stack (so a slow
exit says where its time went even when it ends before the test's deadline). Run as ``late_buffer_script.py
TIMEOUT_S STACKS_AFTER_S`` by a launcher (RANK and WORLD_SIZE set)."""
import faulthandler
import os
import signal
import sys
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it waits too long

import moe_comm

timeout_s, stacks_after_s = float(sys.argv[1]), float(sys.argv[2])
group = moe_comm.init_from_env(timeout_s=60)
sys.stdout.write("STARTED\n")
sys.stdout.flush()
if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    time.sleep(timeout_s + 2.0)
try:
    moe_comm.Buffer(group, timeout_s=timeout_s)
except Exception as exc:
    sys.stdout.write(f"FAILED {type(exc).__name__}\n")
    sys.stdout.flush()
    faulthandler.dump_traceback_later(stacks_after_s, file=sys.stdout)  # armed through the exit's atexit handlers
    raise
sys.stdout.write("BUILT\n")
