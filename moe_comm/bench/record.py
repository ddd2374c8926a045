"""The JSON record every benchmark writes: what ran (command, launcher, config), where (machine,
library versions, the source commit when run from a git checkout), when, and the results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import moe_comm

__all__ = ["OUT_DIR", "default_json_path", "write_json", "publish", "machine_info", "git_commit"]

#: Where a benchmark writes its JSON unless ``--json`` says otherwise: relative to the current
#: directory, never inside the installed package.
OUT_DIR = "moe_comm_bench_out"


def default_json_path(bench: str) -> str:
    """``moe_comm_bench_out/<bench>.json`` under the current directory."""
    return str(Path(OUT_DIR) / f"{bench}.json")


def git_commit() -> dict[str, Any]:
    """HEAD and whether the tree has changes, when ``moe_comm`` is imported from a git checkout (an
    editable install); both None for an installed wheel or when git fails."""
    root = Path(moe_comm.__file__).resolve().parent.parent
    if not (root / ".git").exists():  # site-packages: a venv inside some repository must not name its commit
        return {"commit": None, "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip() != ""
        return {"commit": head, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    """Host, CPU count, platform and library versions (and where moe_comm was imported from)."""
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "moe_comm": moe_comm.__version__,
            "moe_comm_path": str(Path(moe_comm.__file__).resolve().parent), "gpu": torch.cuda.is_available()}


def write_json(path: str, record: dict[str, Any]) -> str:
    """Writes ``record`` with ``date_utc``, ``machine`` and ``git`` put first to ``path``, creating its
    folders; returns the absolute path written."""
    record = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "git": git_commit(), **record}
    out = Path(path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return str(out)


def publish(record: dict[str, Any], json_path: str, plot_path: Optional[str], title: str,
            panels: Callable[[dict[str, Any]], list]) -> None:
    """Writes ``record`` to ``json_path`` and, when ``plot_path`` is given, ``panels(record)`` (a list of
    ``plot.Panel``) drawn under ``title`` to ``plot_path``; prints each path written."""
    print(f"wrote {write_json(json_path, record)}")
    if plot_path:
        from .plot import plot  # matplotlib only when asked for (--plot checked it imports)
        print(f"wrote {plot(plot_path, title, panels(record))}")
