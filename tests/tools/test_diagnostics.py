"""The report a test prints when its ranks run past their deadline (``helpers/processes.py``)."""
import os
import re
import subprocess
import time

from helpers.deadlines import STARTUP_S
from helpers.processes import describe_sessions, proc_stat, running_processes


def test_describe_sessions_lists_the_sessions_processes_with_their_states():
    spinner = subprocess.Popen(["sh", "-c", "sleep 60 & while :; do :; done"], start_new_session=True)
    try:
        # until the shell's child sleeps: just forked, before it has run sleep, it is runnable too
        deadline = time.monotonic() + STARTUP_S
        while not any(f[1] == str(spinner.pid) and f[0] == "S" for f in running_processes().values()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        report = describe_sessions([spinner.pid], sample_s=0.5)
    finally:
        os.killpg(spinner.pid, 9)
        spinner.wait()
    listed = dict(re.findall(r"^pid (\d+) session \d+ state (\S)", report, re.M))
    assert listed.get(str(spinner.pid)) == "R", report  # the busy loop runs
    assert str(os.getpid()) not in listed, report       # only the sessions asked for
    assert sorted(listed.values()) == ["R", "S"], report  # and the sleep beside it waits
    assert "busiest: " in report and "load average: " in report, report


def test_proc_stat_of_a_gone_process_is_none():
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert proc_stat(proc.pid) is None
    assert proc_stat(os.getpid())[3] == str(os.getsid(0))
