"""The session-wide checks of tests/conftest.py fail a test session: a session that leaves an entry in
/dev/shm fails, on one pytest process and on pytest-xdist workers (make test), naming the entry."""
import os
import subprocess
import sys

import pytest

from helpers.deadlines import STARTUP_S

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LEAKY_TEST = '''
import os

def test_leaves_an_entry_in_dev_shm():
    with open(os.path.join("/dev/shm", os.environ["PLANTED_LEAK"]), "wb") as f:
        f.write(b"x" * 4096)
'''


@pytest.mark.parametrize("workers", [0, 2])
def test_a_session_that_leaves_a_dev_shm_entry_fails_and_names_it(tmp_path, workers):
    name = f"planted_leak_{os.getpid()}_{workers}"  # not moe_comm_*: any world's start sweeps those when unheld
    (tmp_path / "test_leaky.py").write_text(_LEAKY_TEST)
    # tests/conftest.py as a plugin (-p conftest from tests/ on the path), on a session of its own
    env = dict(os.environ, PLANTED_LEAK=name, MOE_COMM_TEST_SHM_SETTLE_S="0.5",
               PYTHONPATH=os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")])))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                              "-n", str(workers), "--rootdir", str(tmp_path), str(tmp_path)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=6 * STARTUP_S)
    finally:
        leaked = os.path.join("/dev/shm", name)
        found = os.path.exists(leaked)
        if found:
            os.unlink(leaked)
    out = run.stdout + run.stderr
    assert found, out  # the inner test ran and planted its leak
    assert "1 passed" in out, out
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert f"{name}: 4096 bytes, held by no process" in out, out
