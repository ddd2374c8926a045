"""``python -m moe_comm.bench NAME [options]`` and the ``moe-comm-bench`` console script: picks the
benchmark by name and hands it the remaining arguments."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from . import BENCHMARKS
from . import __doc__ as _PACKAGE_DOC

__all__ = ["main"]


def _prog() -> str:
    """How this process was started, for usage lines and the JSON record."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m moe_comm.bench" if name in ("", "__main__.py", "-c") else name


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark named by ``argv[0]`` (default: this process's arguments) with the rest;
    returns the exit status (argument errors exit 2 from argparse)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog()
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} NAME [options]",
                                description=" ".join(_PACKAGE_DOC.split("\n\n")[0].split()),
                                epilog=_PACKAGE_DOC.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=sorted(BENCHMARKS), metavar="NAME",
                   help="the benchmark; NAME --help lists its options")
    args = p.parse_args(argv[:1])
    module = importlib.import_module(f".{BENCHMARKS[args.name]}", __package__)
    module.main(argv[1:], prog=f"{prog} {args.name}")
    return 0
