"""What the serving tests share: the model (``tiny_moe``), the prompts, running ranks under ``torchrun``,
and the comparison with the single-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.engines import tiny_moe

from helpers.engines.vllm_generate import engine_kwargs

HERE = Path(__file__).resolve().parent

#: Token-id prompts without router near-ties (``MIN_ROUTER_GAP``, asserted by the tests) over the prompt
#: and its greedy continuation (picked from random ones by those gaps); rank 0 gets 4, rank 1 gets 2.
PROMPTS = [[106, 485, 262, 215, 252, 420, 186, 216], [349, 381, 195, 48, 228, 343, 264, 59, 402, 87],
           [180, 122, 350, 116, 393], [149, 304, 502, 455, 259, 437], [476, 332, 55, 99, 326, 374, 444, 155],
           [238, 311, 18, 415, 121, 329]]
#: The smallest gap between the 2nd and 3rd router logits, and between a step's top-2 logprobs, that the
#: prompts must keep: far above the bf16 differences between one process and expert-parallel ranks.
MIN_ROUTER_GAP = 0.1
MIN_LOGPROB_GAP = 0.04
#: How far a logprob may move between the single-process run and the EP ranks: two bf16 steps of a logit in
#: [4, 8) (the logits are rounded to bf16; EP sums the experts in another order; measured up to 0.031).
LOGPROB_TOL = 0.0625
HIDDEN = 256  # a multiple of 128 that is not in vLLM's DeepEP low-latency list (smallest 2048)


def split(prompts: list, ranks: int) -> list[list]:
    """Consecutive parts, rank 0's twice as long as each other rank's (4 and 2 of 6 on 2 ranks)."""
    cuts = [0] + [len(prompts) * (r + 1) // (ranks + 1) for r in range(1, ranks)] + [len(prompts)]
    return [prompts[cuts[r]:cuts[r + 1]] for r in range(ranks)]


def run_ranks(script: Path, args: list[str], ranks: int, env: dict[str, str], timeout: int = 600
              ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node ranks script *args`` with ``env`` added; output captured."""
    environ = {**os.environ, **env}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(29500 + os.getpid() % 1000), str(script), *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=timeout)


def generate(model: Path, backend: str, ranks: int, transport: str, work: Path) -> list[dict]:
    """Greedy results of ``PROMPTS`` in their original order, from ``ranks`` vLLM ranks."""
    work.mkdir(parents=True, exist_ok=True)
    parts = split(list(range(len(PROMPTS))), ranks)
    (work / "prompts.json").write_text(json.dumps([[PROMPTS[i] for i in part] for part in parts]))
    env = {"MOE_COMM_DEEP_EP": "1", "MOE_COMM_TRANSPORT": transport} if ranks > 1 else {}
    done = run_ranks(HERE / "vllm_generate.py", [str(model), backend, str(work / "prompts.json"), str(work)], ranks,
                     env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    results: list = [None] * len(PROMPTS)
    for rank, part in enumerate(parts):
        for i, result in zip(part, json.loads((work / f"rank{rank}.json").read_text())):
            results[i] = result
    return results


def check_clear_cut(model: Path, reference: list[dict]) -> None:
    """The prompts have no near-ties: router (over prompt and continuation) and greedy choice."""
    sequences = [p + r["tokens"] for p, r in zip(PROMPTS, reference)]
    gap = tiny_moe.router_margin(model, sequences)
    assert gap >= MIN_ROUTER_GAP, f"router near-tie: 2nd-3rd logit gap {gap:.4f} < {MIN_ROUTER_GAP}"
    for i, r in enumerate(reference):
        gaps = [top[0] - top[1] for top in r["logprobs"]]
        assert min(gaps) >= MIN_LOGPROB_GAP, f"prompt {i}: greedy near-tie, top-2 logprob gaps {gaps}"


def compare(results: list[dict], reference: list[dict]) -> None:
    """Greedy tokens equal, and the chosen tokens' logprobs within ``LOGPROB_TOL``."""
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got["tokens"] == want["tokens"], (i, got["tokens"], want["tokens"])
        diff = max(abs(a[0] - b[0]) for a, b in zip(got["logprobs"], want["logprobs"]))
        assert diff <= LOGPROB_TOL, f"prompt {i}: logprob differs by {diff:.4f} > {LOGPROB_TOL}"


def serve_args() -> list[str]:
    """``engine_kwargs`` of one engine as ``vllm serve`` flags (the server picks its own executor)."""
    flags = []
    for key, value in engine_kwargs(1, "").items():
        if key == "distributed_executor_backend":
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def wait_ready(server: subprocess.Popen, port: int, log: Path, timeout: float = 400) -> None:
    """Until the server answers ``/health``; fails with its log if it exits or the deadline passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"the server did not answer within {timeout} s:\n{log.read_text()[-6000:]}")
