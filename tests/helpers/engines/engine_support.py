"""Helpers of the engine tests. They run only where the engine is installed (``make test-engines`` builds one
environment per engine: vLLM 0.32 with Megatron-Core 0.16.1, and SGLang 0.5.23); elsewhere they
skip with that reason. Each test starts its own ranks, since the engines keep process-wide state."""
from __future__ import annotations

import importlib.metadata
import os

import pytest

from moe_comm.launch import LocalWorld


def require(distribution: str, version: str) -> None:
    """Skips the calling module unless ``distribution`` is installed at ``version``; fails instead
    when the test environment variable MOE_COMM_REQUIRE_ENGINES (a comma list, set by
    ``make test-engines``) names it, so a broken engine install cannot pass as skipped."""
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == version:
        return
    reason = (f"{distribution} {version} is not installed (make test-engines installs it)" if found is None else
              f"these tests pin {distribution} {version}; this environment has {found}")
    if distribution in os.environ.get("MOE_COMM_REQUIRE_ENGINES", "").split(","):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def run_ranks(fn, cfg: dict, transport: str, world_size: int = 2) -> list:
    """``fn(group, cfg)`` on ``world_size`` fresh gloo ranks using ``transport``."""
    with LocalWorld(world_size, timeout_s=600, threads_per_rank=1, env={"MOE_COMM_TRANSPORT": transport}) as world:
        return world.run(fn, cfg)
