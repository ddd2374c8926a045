"""One rank of vLLM offline generation, as a user runs it under ``torchrun --nproc-per-node N``:

    torchrun --nproc-per-node 2 vllm_generate.py MODEL BACKEND ROUNDS.json OUT_DIR

With N > 1 the ranks are vLLM data-parallel ranks with expert parallelism (``external_launcher``) and the
MoE layers use ``all2all_backend=BACKEND``; with N = 1 the model runs whole in one process (the
reference). ROUNDS.json holds the rounds, one ``LLM.generate`` call each on the same engine; a round holds one
list of requests (``{"prompt": token ids, "max_tokens": n}``) per rank. Each rank writes to OUT_DIR/rank<r>.json,
per round and request, the greedy tokens and, per step, the top-2 logprobs; per round, how many engine steps
the rank ran; and ``LOCAL_WORLD_SIZE`` as torchrun set it and as the engine left it (vLLM's CPU platform sets it
to the tensor-parallel size). The environment is the caller's and vLLM's: nothing here sets a variable."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAX_TOKENS = 8


def engine_kwargs(world: int, backend: str) -> dict:
    """What the tests give ``vllm.LLM`` besides the model: eager, a small CPU KV cache, greedy-friendly, and the
    batch limit of the issue's configuration (128 tokens a step; vLLM's CPU default is 4096)."""
    kwargs = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8,
                  seed=0, gpu_memory_utilization=0.08, distributed_executor_backend="external_launcher")
    if world > 1:
        kwargs.update(data_parallel_size=world, enable_expert_parallel=True, all2all_backend=backend)
    return kwargs


def main() -> None:
    model, backend, rounds_file, out_dir = sys.argv[1:5]
    launched = os.environ.get("LOCAL_WORLD_SIZE")  # before vLLM's platform rewrites it
    from vllm import LLM, SamplingParams

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    llm = LLM(model=model, **engine_kwargs(world, backend))
    record = {"local_world_size": {"torchrun": launched, "vllm": os.environ.get("LOCAL_WORLD_SIZE")}, "rounds": [],
              "steps": []}
    engine_steps = 0  # LLM.generate steps the engine until no rank has requests: dummy steps are counted too
    engine_step = llm.llm_engine.step

    def counted_step() -> list:
        nonlocal engine_steps
        engine_steps += 1
        return engine_step()

    llm.llm_engine.step = counted_step
    for requests in json.loads(Path(rounds_file).read_text()):
        mine, before = requests[rank], engine_steps
        outputs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in mine],
                               [SamplingParams(max_tokens=r["max_tokens"], temperature=0, logprobs=2) for r in mine])
        results = []
        for out in outputs:
            completion = out.outputs[0]
            steps = [sorted(((lp.logprob, t) for t, lp in step.items()), reverse=True)[:2]
                     for step in completion.logprobs]
            results.append({"tokens": list(completion.token_ids), "logprobs": [[lp for lp, _ in s] for s in steps]})
        record["rounds"].append(results)
        record["steps"].append(engine_steps - before)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":  # vLLM starts processes by spawn, which re-imports this file
    main()
