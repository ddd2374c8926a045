"""``make demo``'s job runs end to end at a small size and passes its own checks (every layer mode)."""
import subprocess
import sys

import pytest

from helpers.paths import ROOT
from helpers.tiers import exhaustive

DEMO = ROOT / "examples" / "demo.py"


@pytest.mark.parametrize("backend", ["auto", exhaustive("cuda_host")])
def test_demo_passes_every_mode(backend):
    """On the default backend (portable over shm, for CPU ranks) and on the CUDA kernels' host build."""
    run = subprocess.run([sys.executable, str(DEMO), "--ranks", "2", "--tokens", "48", "--hidden", "256", "--ffn",
                          "128", "--experts", "8", "--decode-tokens", "16", "--iters", "1", "--warmup", "0",
                          "--backend", backend], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for mode in ("sequential", "chunked", "low_latency", "two_batch"):
        assert f" {mode} " in run.stdout, run.stdout
    assert "transport shm" in run.stdout  # the default for CPU ranks
    assert f"backend {'portable' if backend == 'auto' else backend}," in run.stdout, run.stdout
    assert "\nPASS: 4 of 4 modes bitwise equal to the reference" in run.stdout, run.stdout
