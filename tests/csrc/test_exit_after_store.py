"""A peer that stores the flag a rank waits for and then exits, between the wait's last look at the flag
and its look at the peer's process: the wait takes the flag (all a dead process stored is there), and
reports the peer exited only when the flag is still short after the peer was seen gone.

``exit_after_store.cpp`` scripts that interleaving on the real waits: the shm transport's
(``csrc/cpu/flags.cpp: flags_wait``) and the CUDA kernels' protocol on the host platform
(``csrc/cuda/protocol/wait.h: wait_at_least, wait_call``), linked with ``-Wl,--wrap=fopen`` so the look at
the peer's process (``process_alive`` opens ``/proc/<pid>/stat``) stores the flag first. Before, each wait
read the flag, then found the peer gone and failed the call: a loaded run of the fast tier once failed so on
``mpi`` (whose wait now also polls again after it sees a peer gone, ``transport/mpi.py: wait_for``)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from helpers.paths import ROOT

SOURCE = ROOT / "tests" / "csrc" / "exit_after_store.cpp"
EXPECTED = """\
shm, stored then exited: reached
shm, exited without storing: peer exited
kernel at least, stored then exited: returned 5
kernel at least, exited without storing: peer exited (peer 1)
kernel call, stored then exited: returned 9
kernel call, exited without storing: peer exited (peer 1)
"""


def test_a_flag_stored_before_its_setter_exited_is_taken(tmp_path):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: this test builds a small C++ program")
    exe = tmp_path / "exit_after_store"
    built = subprocess.run([gxx, "-std=c++20", "-O1", f"-I{ROOT / 'csrc'}", str(SOURCE),
                            str(ROOT / "csrc" / "cpu" / "flags.cpp"), "-Wl,--wrap=fopen", "-pthread", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == EXPECTED
