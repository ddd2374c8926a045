"""Command-line options that every benchmark spells the same way: where the ranks come from, the
token counts to run, and where the JSON record and the plot go."""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from typing import Optional, Sequence

from .record import default_json_path
from .transports import TRANSPORTS, default_transports

__all__ = ["add_rank_args", "add_tokens_arg", "add_output_args", "plot_path", "command_line", "PLOT_EXTRA"]

#: What to install for ``--plot``.
PLOT_EXTRA = "pip install 'moe-comm[plot]'"


class _DistinctPositive(argparse.Action):
    """A list of distinct integers >= 1 (token counts: each is one run and one point of the plot)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Sequence[int],
                 option_string: Optional[str] = None) -> None:
        if any(v < 1 for v in values) or len(set(values)) != len(values):
            parser.error(f"{option_string}: wants distinct integers >= 1, got {list(values)}")
        setattr(namespace, self.dest, list(values))


def add_tokens_arg(p: argparse.ArgumentParser, default: Optional[int], what: str) -> None:
    """``--tokens N [N ...]``: ``what`` (tokens per rank); each count is its own run, all in one launch."""
    p.add_argument("--tokens", type=int, nargs="+", action=_DistinctPositive,
                   default=None if default is None else [default], metavar="N",
                   help=f"{what}; several values run one after another in the same launch, one plot point "
                        f"each (default: {default if default is not None else 'per device'})")


def add_rank_args(p: argparse.ArgumentParser, ranks: int) -> None:
    """``--ranks``, ``--transports`` and ``--threads-per-rank`` of the distributed benchmarks."""
    p.add_argument("--ranks", type=int, default=ranks, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--transports", nargs="+", default=default_transports(), choices=TRANSPORTS,
                   help="transports compared side by side (the first one's outputs are the reference)")
    p.add_argument("--threads-per-rank", type=int, default=0, help="0: cpu_count // local ranks, at least 1")


def plot_path(value: str) -> str:
    """``--plot``'s type: the path, once matplotlib imports (else the argument is refused)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as e:
        raise argparse.ArgumentTypeError(f"needs matplotlib, which is not installed ({e}); {PLOT_EXTRA}") from e
    return value


def add_output_args(p: argparse.ArgumentParser, bench: str) -> None:
    """``--json PATH`` (default ``moe_comm_bench_out/<bench>.json`` in the current directory) and
    ``--plot PATH`` (off by default; needs matplotlib)."""
    p.add_argument("--json", default=default_json_path(bench), metavar="PATH",
                   help="where the JSON record goes (default: %(default)s, under the current directory)")
    p.add_argument("--plot", type=plot_path, default=None, metavar="PATH",
                   help=f"also draw latency and bandwidth against tokens per rank to PATH (.png; {PLOT_EXTRA})")


def command_line(prog: str, argv: Optional[Sequence[str]]) -> str:
    """The command as a shell would take it, for the JSON record: ``prog`` then ``argv`` (None: this
    process's arguments)."""
    return " ".join([prog, shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
