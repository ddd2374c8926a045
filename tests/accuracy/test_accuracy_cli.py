"""``python -m moe_comm.accuracy`` when its Triton-interpreter child fails: the child's own error (its
exception, the traceback's tail, the Triton version) and exit status 2, never a JSONDecodeError.

The child is broken for real, not the parent patched: a ``sitecustomize`` on PYTHONPATH breaks Triton's
interpreter only in processes started with ``TRITON_INTERPRET=1``, which is the child alone (the parent
runs without it and starts the child with it). It fails as Triton 3.9 failed on the FP8 rows kernel.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from moe_comm.ops.impl import interpreter_problem

triton = pytest.importorskip("triton")
if interpreter_problem() is not None:
    pytest.skip(interpreter_problem(), allow_module_level=True)

BREAK_INTERPRETER = """
import os
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton.runtime.interpreter as interpreter

    def create_masked_load(*args, **kwargs):
{body}

    interpreter.InterpreterBuilder.create_masked_load = create_masked_load
"""


def _accuracy_cli(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Runs the CLI with every masked load of the child's interpreter running ``body`` instead."""
    (tmp_path / "sitecustomize.py").write_text(BREAK_INTERPRETER.format(body=textwrap.indent(body, " " * 8)))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # conftest sets it
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # without TileLang's rows (compiling its kernels made this test 44 s in a fresh checkout on the 2-core test
    # machine, 8 s without them); the child under test is the Triton one
    return subprocess.run([sys.executable, "-m", "moe_comm.accuracy", "--impl", "native", "triton"], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)


def test_child_exception_is_reported_with_its_traceback(tmp_path):
    result = _accuracy_cli(tmp_path, 'raise ValueError("mask has unsupported dtype (broken by the test)")')
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "JSONDecodeError" not in result.stderr
    assert f"the Triton interpreter run (triton {triton.__version__}, TRITON_INTERPRET=1" in result.stderr
    # The child's exception, as Triton raised it, and the last frames that led there (a kernel, a wrapper).
    assert "InterpreterError: ValueError('mask has unsupported dtype (broken by the test)')" in result.stderr
    assert 'File "' in result.stderr and "_kernel" in result.stderr, result.stderr[-3000:]
    # The parent's own rows still print, and say what is missing.
    assert "checks pass on cpu/native" in result.stdout
    assert "cpu/triton" not in result.stdout


def test_child_killed_by_a_signal_is_named(tmp_path):
    result = _accuracy_cli(tmp_path, "import signal, sys\n"
                                     "print('about to crash', file=sys.stderr, flush=True)\n"
                                     "os.kill(os.getpid(), signal.SIGSEGV)")
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "JSONDecodeError" not in result.stderr
    assert "was killed by SIGSEGV" in result.stderr and "about to crash" in result.stderr, result.stderr[-3000:]
