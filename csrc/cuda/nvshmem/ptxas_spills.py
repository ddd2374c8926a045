"""The CUDA compiler launcher of moe_comm._cuda_nvshmem (CMakeLists.txt): runs the nvcc command it is
given (which carries ``-Xptxas=-v``) and fails the compile when ptxas reports a register spill in a
function that is not NVSHMEM's own.

Why: every relocatable translation unit that includes ``nvshmem.h`` (3.4.5) gets NVSHMEM's
``nvshmemi_quiet<...>`` instantiations from its headers, and ptxas reports 8 bytes of spill in each
(a register saved around a call, in NVSHMEM's code). ``-Xptxas=--warn-on-spills,--warning-as-error``
(what moe_comm._cuda builds with) would therefore fail on NVSHMEM's code, so this target leaves out
``--warn-on-spills`` (every other warning stays an error: ``--Werror=all-warnings``) and this launcher
holds our own functions to zero spills instead. ptxas's report lines are not echoed; everything else is.

Usage (CMake does it): python ptxas_spills.py nvcc ARGS...
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

#: NVSHMEM's own functions: C names and C++ names whose first component starts with ``nvshmem``
#: (``_Z14nvshmemi_quiet...``), optionally behind nvcc's ``__nv_static_<id>__`` prefix of internal
#: linkage. Ours live in namespace moe_comm (``_ZN8moe_comm...``).
NVSHMEM_NAME = re.compile(r"^(?:__nv_static_\w*?__)?(?:_Z[NL]*\d+)?nvshmem")
REPORT_LINE = re.compile(r"^ptxas info\s*:|^\s+\d+ bytes stack frame, \d+ bytes spill stores")


def spills(log: str) -> dict[str, tuple[int, int]]:
    """Functions with spill stores or loads in a ``ptxas -v`` log: name -> (stores, loads)."""
    out: dict[str, tuple[int, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            stores, loads = int(m.group(1)), int(m.group(2))
            if stores or loads:
                out[current] = (stores, loads)
            current = None
    return out


def ours(name: str) -> bool:
    return NVSHMEM_NAME.match(name) is None


def main(argv: list[str]) -> int:
    if not argv:
        print("ptxas_spills.py: no compiler command", file=sys.stderr)
        return 2
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout
    shown = "\n".join(line for line in log.splitlines() if not REPORT_LINE.match(line)).strip()
    if shown:
        print(shown, file=sys.stderr)
    if proc.returncode != 0:
        return proc.returncode
    bad = {name: s for name, s in spills(log).items() if ours(name)}
    if bad:
        for name, (stores, loads) in sorted(bad.items()):
            print(f"ptxas_spills.py: error: registers spilled in {name}: {stores} bytes spill stores, "
                  f"{loads} bytes spill loads", file=sys.stderr)
        if "-o" in argv[:-1]:  # no object left behind: the next build compiles it again
            Path(argv[argv.index("-o") + 1]).unlink(missing_ok=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
