"""Runs one of DeepEP's own test scripts (V1's and V2's), unmodified, on CPU ranks against moe-comm.

    python tools/deepep_tests/run.py V1/tests/test_low_latency.py -- --num-processes 4 --use-logfmt
    python tools/deepep_tests/run.py V1/tests/test_internode.py --nodes 2 -- --num-processes 8
    python tools/deepep_tests/run.py V2/tests/elastic/test_ep.py -- --num-processes 2 --num-tokens 64

V1 is a DeepEP checkout at its last V1 commit (``bfded34``), V2 one of its main branch: V2's tests
(``tests/elastic``) import DeepEP's test utilities from the same checkout (``deep_ep/utils``).

The script runs as DeepEP documents (``python tests/test_x.py ...`` from its folder; with ``--nodes N``,
N copies with ``WORLD_SIZE=N RANK=i``, as on N machines, each copy's ranks one node), with
``cuda_on_cpu/sitecustomize.py`` first on PYTHONPATH: it maps CUDA to the CPU and gloo and ``import
deep_ep`` to moe-comm (its docstring lists exactly what it changes). Prints which of the script's asserts
ran (in any rank). Exits with the script's status (the first failing copy's); a copy that outlives
``--timeout`` is killed with its ranks and reported as a failure.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_comm.launch.ports import free_port

HERE = Path(__file__).resolve().parent


#: how long the ranks of a run past its deadline get to print their stacks before they are killed
_STACKS_S = 2.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path, help="a DeepEP test script (tests/test_*.py)")
    parser.add_argument("--nodes", type=int, default=1, help="copies to start, as DeepEP's WORLD_SIZE (nodes)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the run is killed")
    cut = argv.index("--") if "--" in argv else len(argv)
    opts, args = parser.parse_args(argv[:cut]), argv[cut + 1:]  # the script's arguments follow --
    script = opts.script.resolve()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE / "cuda_on_cpu"), os.environ.get("PYTHONPATH", "")]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
               WORLD_SIZE=str(opts.nodes))
    env.setdefault("MOE_COMM_NUM_THREADS", "1")
    if opts.nodes > 1 and "--num-processes" in args:
        # each copy's ranks are one node, also below DeepEP's 8 ranks a node (core/topology.py)
        env.setdefault("MOE_COMM_RANKS_PER_NODE", args[args.index("--num-processes") + 1])
    utils = script.parent.parent.parent / "deep_ep" / "utils"  # V2's tests/elastic/*.py use DeepEP's utilities
    if script.parent.name == "elastic" and utils.is_dir():
        env["MOE_COMM_DEEPEP_UTILS"] = str(utils)
    census = tempfile.mkdtemp(prefix="deepep-asserts-")
    env.update(MOE_COMM_DEEPEP_SCRIPT=str(script), MOE_COMM_DEEPEP_ASSERTS=census)
    procs = [subprocess.Popen([sys.executable, script.name, *args], cwd=script.parent, start_new_session=True,
                              env=dict(env, RANK=str(node))) for node in range(opts.nodes)]
    deadline = time.monotonic() + opts.timeout
    status = 0
    try:
        for p in procs:
            code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            status = status or code
    except subprocess.TimeoutExpired:
        print(f"run.py: {script.name} still running after {opts.timeout:.0f} s: its ranks' stacks, then killed",
              file=sys.stderr, flush=True)
        for p in procs:  # cuda_on_cpu/sitecustomize.py prints every thread's stack on SIGUSR1
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGUSR1)
        time.sleep(_STACKS_S)
        status = 124
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        print(assert_report(script, census), file=sys.stderr)
        shutil.rmtree(census, ignore_errors=True)
    return status


def assert_report(script: Path, census: str) -> str:
    """Which of ``script``'s ``assert`` statements ran in any of its processes (from ``census``)."""
    source = script.read_text().splitlines()
    lines = sorted({n.lineno for n in ast.walk(ast.parse("\n".join(source))) if isinstance(n, ast.Assert)})
    hit: set[int] = set()
    for name in [n for n in os.listdir(census) if n.startswith("asserts.")]:  # not a killed rank's part file
        with open(os.path.join(census, name)) as f:
            hit.update(json.load(f))
    missed = [n for n in lines if n not in hit]
    shown = "; ".join(f"line {n}: {source[n - 1].strip()[:60]}" for n in missed)
    return f"run.py: {script.name}: {len(lines) - len(missed)} of {len(lines)} asserts ran" + \
        (f"; not run: {shown}" if missed else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
