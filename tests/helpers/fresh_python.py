"""Code run in a fresh interpreter, for tests where import state matters (the ``deep_ep`` alias,
engine plugins)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, path: str = "", **env: str) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a new interpreter with ``env`` added, ``path`` prepended to PYTHONPATH,
    and MOE_COMM_DEEP_EP set only if ``env`` gives it."""
    environ = {k: v for k, v in os.environ.items() if k != "MOE_COMM_DEEP_EP"}
    environ.update(env)
    if path:
        environ["PYTHONPATH"] = path + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True,
                          timeout=300)
