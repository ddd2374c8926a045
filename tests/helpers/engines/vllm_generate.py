"""One rank of vLLM offline generation, as a user runs it under ``torchrun --nproc-per-node N``:

    torchrun --nproc-per-node 2 vllm_generate.py MODEL BACKEND PROMPTS.json OUT_DIR

With N > 1 the ranks are vLLM data-parallel ranks with expert parallelism (``external_launcher``) and the
MoE layers use ``all2all_backend=BACKEND``; with N = 1 the model runs whole in one process (the
reference). PROMPTS.json holds one list of token-id prompts per rank; each rank writes the greedy
tokens and, per step, the top-2 logprobs to OUT_DIR/rank<r>.json."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAX_TOKENS = 8


def engine_kwargs(world: int, backend: str) -> dict:
    """What the tests give ``vllm.LLM`` besides the model: eager, a small CPU KV cache, greedy-friendly."""
    kwargs = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, max_num_seqs=8, seed=0,
                  gpu_memory_utilization=0.08, distributed_executor_backend="external_launcher")
    if world > 1:
        kwargs.update(data_parallel_size=world, enable_expert_parallel=True, all2all_backend=backend)
    return kwargs


def main() -> None:
    model, backend, prompts_file, out_dir = sys.argv[1:5]
    from vllm import LLM, SamplingParams

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    prompts = json.loads(Path(prompts_file).read_text())[rank]
    llm = LLM(model=model, **engine_kwargs(world, backend))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2))
    results = []
    for out in outputs:
        completion = out.outputs[0]
        steps = [sorted(((lp.logprob, t) for t, lp in step.items()), reverse=True)[:2] for step in completion.logprobs]
        results.append({"tokens": list(completion.token_ids), "logprobs": [[lp for lp, _ in s] for s in steps]})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":  # vLLM starts processes by spawn, which re-imports this file
    main()
