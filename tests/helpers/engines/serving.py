"""What the serving tests share: the model (``tiny_moe``), the prompts, running ranks under ``torchrun``,
and the comparison with the single-process run."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from helpers.engines import tiny_moe

from helpers.engines.vllm_generate import MAX_TOKENS, engine_kwargs

HERE = Path(__file__).resolve().parent

#: The hidden sizes of the generation tests: 256, a multiple of 128 that is not in vLLM's DeepEP low-latency list,
#: and 2048, that list's smallest entry and the issue's size, where a low-latency call's metadata outgrew shm's
#: 65536-byte cell when vLLM's LOCAL_WORLD_SIZE made 2 ranks of one host 2 nodes.
HIDDENS = (256, 2048)
#: Token-id prompts per hidden size without router near-ties (``MIN_ROUTER_GAP``, asserted by the tests) over
#: the prompt and its greedy continuation, picked from random ones by those gaps. The model is random, so each
#: size needs its own: hidden 256's prompts have a 0.0007 router gap at 2048.
PROMPTS = {256: [[106, 485, 262, 215, 252, 420, 186, 216], [349, 381, 195, 48, 228, 343, 264, 59, 402, 87],
                 [180, 122, 350, 116, 393], [149, 304, 502, 455, 259, 437], [476, 332, 55, 99, 326, 374, 444, 155],
                 [238, 311, 18, 415, 121, 329]],
           2048: [[394, 168, 449, 270, 504, 481, 317, 349, 237], [432, 115, 312, 222, 350, 483],
                  [404, 264, 129, 59, 383, 388, 277], [308, 156, 6, 430, 396, 324, 293, 183, 171, 50],
                  [262, 73, 359, 50, 327], [45, 189, 294]]}
#: The smallest gap between the 2nd and 3rd router logits, and between a step's top-2 logprobs, that the
#: prompts must keep: far above the bf16 differences between one process and expert-parallel ranks.
MIN_ROUTER_GAP = 0.1
MIN_LOGPROB_GAP = 0.04
#: How far a logprob may move between the single-process run and the EP ranks, in bf16 steps of the model's
#: largest logit (the logits are rounded to bf16; EP sums the experts in another order): 0.0625 for logits in
#: [4, 8) (hidden 256; measured up to 0.031), 0.125 in [8, 16) (hidden 2048: logits up to 15.6; measured up to
#: 0.098, high-throughput, where one step, 0.0625, would not do).
LOGPROB_STEPS = 2


class Reference(NamedTuple):
    """The single-process results of a prompt list (in its order), and how far EP ranks' logprobs may move."""
    results: list[dict]
    logprob_tol: float


class Generation(NamedTuple):
    """What ``generate`` returns: per round, each prompt index's result (with the ``max_tokens`` it was asked
    for) and each rank's engine steps (dummy steps included); per rank, ``LOCAL_WORLD_SIZE`` as torchrun set it
    and as vLLM left it."""
    results: dict[str, dict[int, dict]]
    steps: dict[str, list[int]]
    local_world_size: list[dict]


#: One request of a round: (index into the prompt list, max_tokens).
Request = tuple[int, int]


def split(prompts: list, ranks: int) -> list[list]:
    """Consecutive parts, rank 0's twice as long as each other rank's (4 and 2 of 6 on 2 ranks)."""
    cuts = [0] + [len(prompts) * (r + 1) // (ranks + 1) for r in range(1, ranks)] + [len(prompts)]
    return [prompts[cuts[r]:cuts[r + 1]] for r in range(ranks)]


def workloads(prompts: list[list[int]], ranks: int) -> dict[str, list[list[Request]]]:
    """The rounds that ``ranks`` ranks generate, in order, by name: per rank, its requests. One rank has the
    whole list; on several, every round asks for every prompt once, and the ranks get different amounts of work."""
    everyone = list(range(len(prompts)))
    if ranks == 1:
        return {"whole": [[(i, MAX_TOKENS) for i in everyone]]}
    short = min(everyone, key=lambda i: len(prompts[i]))
    others = [i for i in everyone if i != short]
    return {"uneven": [[(i, MAX_TOKENS) for i in part] for part in split(everyone, ranks)],
            # the last rank prefills its one short prompt for one token, then runs vLLM's dummy steps (its MoE
            # layers still dispatch and combine with the others) while the other ranks decode
            "dummy-steps": [[(i, MAX_TOKENS) for i in part] for part in split(others, ranks - 1)] + [[(short, 1)]]}


def write_rounds(path: Path, prompts: list[list[int]], rounds: dict[str, list[list[Request]]]) -> None:
    """``rounds`` as ``vllm_generate.py`` reads them: the requests' prompts written out."""
    path.write_text(json.dumps([[[{"prompt": prompts[i], "max_tokens": n} for i, n in requests]
                                 for requests in ranks] for ranks in rounds.values()]))


def run_ranks(script: Path, args: list[str], ranks: int, env: dict[str, str], timeout: int = 600
              ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node ranks script *args`` with ``env`` added; output captured."""
    environ = {**os.environ, **env}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(29500 + os.getpid() % 1000), str(script), *args]
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=timeout)


def rank_errors(stderr: str) -> list[str]:
    """The exception lines of the ranks in torchrun's output (``[rank<r>]: SomeError: ...``), in order: each
    rank's cause, which the tail of the output may not show when a peer's traceback follows it."""
    return [line for line in stderr.splitlines() if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception)\b", line)]


def generate(model: Path, prompts: list[list[int]], backend: str, ranks: int, transport: str, work: Path
             ) -> Generation:
    """Greedy generation of the rounds of ``workloads(prompts, ranks)`` on ``ranks`` vLLM ranks, one engine
    each; fails with each rank's error if a rank fails."""
    work.mkdir(parents=True, exist_ok=True)
    rounds = workloads(prompts, ranks)
    write_rounds(work / "rounds.json", prompts, rounds)
    env = {"MOE_COMM_DEEP_EP": "1", "MOE_COMM_TRANSPORT": transport} if ranks > 1 else {}
    done = run_ranks(HERE / "vllm_generate.py", [str(model), backend, str(work / "rounds.json"), str(work)], ranks,
                     env)
    assert done.returncode == 0, "\n".join(rank_errors(done.stderr)) + "\n" + done.stdout[-3000:] + done.stderr[-6000:]
    records = [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    results: dict[str, dict[int, dict]] = {}
    for n, (name, requests) in enumerate(rounds.items()):
        results[name] = {i: {**result, "max_tokens": max_tokens} for record, mine in zip(records, requests, strict=True)
                         for (i, max_tokens), result in zip(mine, record["rounds"][n], strict=True)}
    return Generation(results, {name: [record["steps"][n] for record in records] for n, name in enumerate(rounds)},
                      [record["local_world_size"] for record in records])


def bf16_step(value: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at ``value``'s magnitude."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def reference(model: Path, prompts: list[list[int]], work: Path) -> Reference:
    """The single-process run of ``prompts``, checked to have no near-ties: router (over prompt and
    continuation) and greedy choice."""
    whole = generate(model, prompts, "none", 1, "shm", work).results["whole"]
    results = [whole[i] for i in range(len(prompts))]
    gap, largest = tiny_moe.margins(model, [p + r["tokens"] for p, r in zip(prompts, results, strict=True)])
    assert gap >= MIN_ROUTER_GAP, f"router near-tie: 2nd-3rd logit gap {gap:.4f} < {MIN_ROUTER_GAP}"
    for i, r in enumerate(results):
        gaps = [top[0] - top[1] for top in r["logprobs"]]
        assert min(gaps) >= MIN_LOGPROB_GAP, f"prompt {i}: greedy near-tie, top-2 logprob gaps {gaps}"
    return Reference(results, LOGPROB_STEPS * bf16_step(largest))


def compare(results: dict[int, dict], reference: Reference, label: str = "") -> None:
    """Each result's greedy tokens equal to the first ``max_tokens`` of the reference's for its prompt, and the
    chosen tokens' logprobs within the reference's tolerance; ``label`` starts the failure messages."""
    for i, got in sorted(results.items()):
        want = reference.results[i]
        assert got["tokens"] == want["tokens"][:got["max_tokens"]], (label, i, got["tokens"], want["tokens"])
        diff = max(abs(a[0] - b[0]) for a, b in zip(got["logprobs"], want["logprobs"]))
        assert diff <= reference.logprob_tol, f"{label} prompt {i}: logprob differs by {diff:.4f} > " \
                                              f"{reference.logprob_tol}"


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
