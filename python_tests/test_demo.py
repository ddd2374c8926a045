"""``make demo``'s job runs end to end at a small size and passes its own checks (both modes)."""
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_passes_both_modes():
    run = subprocess.run([sys.executable, str(DEMO), "--ranks", "2", "--tokens", "48", "--hidden", "256", "--ffn",
                          "128", "--experts", "8", "--decode-tokens", "16", "--iters", "1", "--warmup", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "prefill (normal)" in run.stdout and "decode (low-latency)" in run.stdout
    assert "transport" in run.stdout and "shm" in run.stdout  # the default for CPU ranks
    assert "\nPASS: calc_diff" in run.stdout, run.stdout
