"""The cuda_host stream (``backends/cuda/host_stream.py``): launches run once each, in submission order,
whether the stream's thread or a caller waiting for one runs it; a failure is raised once."""
import threading

import pytest

from moe_comm.backends.cuda.host_stream import HostStream


def test_launches_run_once_each_in_order_on_either_thread():
    ran, threads = [], set()
    stream = HostStream(lambda op, record: None)

    def launch(i: int) -> None:
        ran.append(i)
        threads.add(threading.current_thread().name)

    for i in range(200):
        job = stream.submit("op", lambda i=i: launch(i))
        if i % 3 == 0:
            job.wait()  # a caller that waits at once: it may run the launch itself
    stream.synchronize()
    stream.close()
    assert ran == list(range(200))
    assert threads <= {threading.current_thread().name, "moe_comm cuda_host stream"}


def test_a_failed_launch_is_raised_once_to_the_first_waiter():
    stream = HostStream(lambda op, record: None)

    def fail() -> None:
        raise RuntimeError("launch failed")

    job = stream.submit("op", fail)
    with pytest.raises(RuntimeError, match="launch failed"):
        job.wait()
    job.wait()  # seen: not raised again
    stream.submit("op", lambda: None).wait()
    stream.close()


def test_the_record_is_checked_by_the_waiter():
    seen = []
    stream = HostStream(lambda op, record: seen.append((op, record)))
    stream.run("receive", lambda: 7)
    stream.close()
    assert seen == [("receive", 7)]
