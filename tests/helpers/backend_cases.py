"""Buffer's choice of backend, inside one rank (see test_backends.py)."""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

import moe_comm


def raised(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test asserts on the type and the words
        return type(exc).__name__, str(exc)
    return "none", ""


def choices(group: dist.ProcessGroup) -> dict[str, Any]:
    """What each way of naming a backend gives: the choice made, or the error raised."""
    out: dict[str, Any] = {}
    auto = moe_comm.Buffer(group)
    explicit = moe_comm.Buffer(group, backend="portable")
    out["auto"] = (auto.backend_choice.name, auto.backend_choice.why, repr(auto))
    out["explicit"] = (explicit.backend_choice.name, explicit.backend_choice.why)
    out["cuda"] = raised(lambda: moe_comm.Buffer(group, backend="cuda"))
    out["ascend"] = raised(lambda: moe_comm.Buffer(group, backend="ascend"))
    out["unknown"] = raised(lambda: moe_comm.Buffer(group, backend="tpu"))
    out["not_str"] = raised(lambda: moe_comm.Buffer(group, backend=None))
    os.environ["MOE_COMM_BACKEND"] = "cuda"
    try:
        out["env"] = raised(lambda: moe_comm.Buffer(group))
        out["env_overridden"] = moe_comm.Buffer(group, backend="portable").backend_choice.name
    finally:
        del os.environ["MOE_COMM_BACKEND"]
    out["comm_stream"] = raised(auto.get_comm_stream)
    out["sm90"] = moe_comm.Buffer.is_sm90_compiled()
    return out
