"""What the entry points of tools/gpu_check share: the import path, a JSON record written on every exit,
and one place that runs a named check so that its failure is recorded and the next check still runs."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (str(HERE), str(ROOT)):  # the harness, then moe_comm from this checkout (an editable install maps
    if p not in sys.path:          # its built modules there too)
        sys.path.insert(0, p)


class Record:
    """A JSON record at ``path`` (None: printed only), rewritten after every check, so that a step killed by
    its time box still leaves what it had done."""

    def __init__(self, path: Optional[str], **head: Any):
        self.path = path
        self.data: dict[str, Any] = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **head,
                                     "checks": {}}
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.t0, 3)
        self.data["ok"] = bool(self.data["checks"]) and all(c.get("ok") for c in self.data["checks"].values())
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path + ".tmp"
            Path(tmp).write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            os.replace(tmp, self.path)

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Runs ``fn`` (returns a dict with ``ok``), records it, or its exception as a failure."""
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            out = fn()
        except BaseException as exc:  # noqa: BLE001 - recorded, and the next check runs
            if isinstance(exc, KeyboardInterrupt):
                raise
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        out["seconds"] = round(time.perf_counter() - t0, 3)
        self.data["checks"][name] = out
        brief = {k: v for k, v in out.items() if k not in ("traceback",)}
        print(f"    {'ok' if out.get('ok') else 'FAIL'}: {json.dumps(brief, default=str)[:600]}", flush=True)
        if not out.get("ok") and "traceback" in out:
            print(out["traceback"], flush=True)
        self.save()
        return out

    def finish(self) -> int:
        self.save()
        print(json.dumps({"ok": self.data["ok"], "seconds": self.data["seconds"],
                          "failed": [k for k, c in self.data["checks"].items() if not c.get("ok")]}), flush=True)
        return 0 if self.data["ok"] else 1


def gpu_present() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False
