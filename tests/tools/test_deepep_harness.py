"""The harness that runs DeepEP's own tests on CPU ranks (tools/deepep_tests): it runs a script
written the way DeepEP's are (CUDA devices, NCCL, torch.multiprocessing.spawn, ``import deep_ep``)
and reports its failures and which of its asserts ran; with MOE_COMM_DEEPEP_TESTS naming DeepEP v1's
tests/ folder it runs those, with MOE_COMM_DEEPEP_V2 naming a checkout of DeepEP's main branch its V2
tests (docs/engines.md, "DeepEP's own tests", has the results and how to get the folders)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.paths import ROOT
from helpers.tiers import exhaustive

RUN = ROOT / "tools" / "deepep_tests" / "run.py"

SCRIPT = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist
    import deep_ep

    def loop(local_rank, num_local_ranks):
        dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                world_size=num_local_ranks, rank=local_rank, device_id=torch.device(f"cuda:{local_rank}"))
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("cuda")
        torch.cuda.set_device(local_rank)
        assert getattr(deep_ep, "MOE_COMM", False), "deep_ep is not moe-comm's"
        group = dist.new_group(list(range(num_local_ranks)))
        buffer = deep_ep.Buffer(group, int(1e8), 0, explicitly_destroy=True)
        x = torch.ones((16, 256), device="cuda") * local_rank
        topk = torch.arange(16, device="cuda").view(-1, 1).repeat(1, 2) % 8
        layout = buffer.get_dispatch_layout(topk, 8)
        recv_x, _, _, counts, handle, _ = buffer.dispatch(x.cuda(), num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk,
            topk_weights=torch.ones((16, 2), dtype=torch.float32, device="cuda"))
        gathered = torch.empty((num_local_ranks, 16, 2), dtype=topk.dtype, device="cuda")
        dist.all_gather_into_tensor(gathered, topk, group=group)
        assert recv_x.device.type == "cpu" and recv_x.shape[0] == int(handle[0][-1, local_rank])
        assert RESULT, "planted failure"
        torch.cuda.synchronize()
        buffer.destroy()
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        torch.multiprocessing.spawn(loop, args=(2,), nprocs=2)
''')


# The self-tests start 4 Pythons with torch (run.py, the script, its 2 ranks): 20 s idle; at the end of the
# fast tier beside two busy loops one took 3 min and one was still importing torch at 270 s.
SELF_TEST_S = 600


def _run(script: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUN), str(script), "--timeout", str(timeout - 30), "--", *args],
                          capture_output=True, text=True, timeout=timeout)


# a passing script: the exhaustive tier (and every run of DeepEP's own tests through the harness)
@pytest.mark.parametrize("result", [exhaustive(True, id="True"), False])
def test_harness_runs_a_deepep_style_script_and_reports_failures(tmp_path, result):
    script = tmp_path / "test_style.py"
    script.write_text(SCRIPT.replace("RESULT", str(result)))
    done = _run(script, timeout=SELF_TEST_S)
    if result:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        assert done.returncode != 0 and "planted failure" in done.stderr, done.stderr[-3000:]
    # the report counts the asserts the ranks ran (the script's three, the last of them failing or not)
    assert "test_style.py: 3 of 3 asserts ran" in done.stderr, done.stderr[-3000:]


def test_harness_reports_asserts_that_did_not_run(tmp_path):
    script = tmp_path / "test_style.py"
    script.write_text(SCRIPT.replace("assert RESULT", "if False:\n            assert False").replace("RESULT", "True"))
    done = _run(script, timeout=SELF_TEST_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test_style.py: 2 of 3 asserts ran; not run: line" in done.stderr, done.stderr[-3000:]


DEEPEP_TESTS = os.environ.get("MOE_COMM_DEEPEP_TESTS")
needs_deepep = pytest.mark.skipif(not DEEPEP_TESTS, reason="set MOE_COMM_DEEPEP_TESTS to DeepEP v1's tests/ folder "
                                  "(not shipped: DeepEP's files are not copied here) to run DeepEP's own tests")

# (script, harness options, script arguments, environment): small shapes so each runs in about a
# minute on 2 cores; the shrink test's stopped ranks each cost one deadline, so it gets a short one
DEEPEP_RUNS = [
    ("test_intranode.py", [], ["--num-processes", "2", "--num-tokens", "128", "--hidden", "1024", "--num-experts", "16"],
     {}),
    ("test_intranode.py", [], ["--num-processes", "4", "--num-tokens", "64", "--hidden", "512", "--num-experts", "16"],
     {}),
    ("test_low_latency.py", [], ["--num-processes", "2", "--num-tokens", "32", "--hidden", "1024", "--num-experts", "16"],
     {}),
    ("test_low_latency.py", [], ["--num-processes", "4", "--num-tokens", "32", "--hidden", "1024", "--num-experts", "16",
                                 "--use-logfmt"], {}),
    ("test_low_latency.py", [], ["--num-processes", "6", "--num-tokens", "16", "--hidden", "1024", "--num-experts", "12",
                                 "--shrink-test"], {"MOE_COMM_TIMEOUT_S": "10"}),
    ("test_internode.py", ["--nodes", "2"], ["--num-processes", "8", "--num-tokens", "64", "--hidden", "512",
                                             "--num-experts", "32"], {}),
]


@needs_deepep
@pytest.mark.parametrize("script,options,args,env", DEEPEP_RUNS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v if isinstance(v, str) else "")
def test_deepep_own_tests(script, options, args, env):
    _own_test(Path(DEEPEP_TESTS) / script, options, args, env)


def _own_test(path: Path, options: list, args: list, env: dict) -> None:
    done = subprocess.run([sys.executable, str(RUN), str(path), *options, "--timeout", "1200", "--", *args],
                          capture_output=True, text=True, timeout=1300, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(done.stderr.splitlines()[-1])  # the assert report


DEEPEP_V2 = os.environ.get("MOE_COMM_DEEPEP_V2")
needs_deepep_v2 = pytest.mark.skipif(not DEEPEP_V2, reason="set MOE_COMM_DEEPEP_V2 to a DeepEP checkout of its "
                                     "main branch (tests/elastic and deep_ep/utils; not shipped) to run DeepEP V2's "
                                     "own tests")
_SMALL = ["--num-tokens", "32", "--hidden", "256", "--num-experts", "8", "--num-topk", "4"]
# (script, harness options, script arguments, environment): test_ep.py's 144 cases each, 1-3 minutes on 2 cores
DEEPEP_V2_RUNS = [
    ("test_ep.py", [], ["--num-processes", "2", *_SMALL], {}),
    ("test_ep.py", [], ["--num-processes", "2", *_SMALL, "--masked-ratio", "0.1"], {"MOE_COMM_BACKEND": "cuda_host"}),
    ("test_ep.py", [], ["--num-processes", "2", *_SMALL, "--do-cpu-sync", "0", "--masked-ratio", "0.2",
                        "--skip-perf-test"], {}),
    ("test_ep.py", [], ["--num-processes", "2", *_SMALL, "--deterministic", "--skip-perf-test"], {}),
    ("test_ep.py", [], ["--num-processes", "3", "--num-tokens", "24", "--hidden", "128", "--num-experts", "12",
                        "--num-topk", "4", "--allow-multiple-reduction", "0", "--skip-perf-test"], {}),
    ("test_ep.py", [], ["--num-processes", "4", "--num-tokens", "16", "--hidden", "256", "--num-experts", "16",
                        "--num-topk", "6", "--masked-ratio", "0.1", "--skip-perf-test"], {}),
    ("test_ep.py", ["--nodes", "2"], ["--num-processes", "2", "--num-tokens", "16", "--hidden", "256",
                                      "--num-experts", "16", "--num-topk", "6", "--skip-perf-test"], {}),
    ("test_barrier.py", [], ["--num-processes", "2"], {}),
]


@needs_deepep_v2
@pytest.mark.parametrize("script,options,args,env", DEEPEP_V2_RUNS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v if isinstance(v, str) else
                         " ".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_deepep_v2_own_tests(script, options, args, env):
    _own_test(Path(DEEPEP_V2) / "tests" / "elastic" / script, options, args, env)
