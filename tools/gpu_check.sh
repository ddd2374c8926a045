#!/usr/bin/env bash
# One run on a GPU machine (the `device` tool's H200): build, then the CUDA and compiled-Triton checks
# and benchmarks of moe_comm.ops; the benchmark runs before the tile sweep, since it is what RESULTS records.
# Uses the machine's own python3/torch/triton; writes logs to $OUT.
#   bash tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
step machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
step build
CMAKE_ARGS="-DMOE_COMM_CUDA=OFF" timeout 240 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
step accuracy
timeout 150 python3 -m moe_comm.accuracy --no-interpreter --json "$OUT/accuracy_gpu.json" 2>&1 | tee "$OUT/accuracy_gpu.txt" | grep -v " pass *$"
step tests
timeout 150 python3 -m pytest -q -p no:cacheprovider python_tests/test_fused_ops.py python_tests/test_cuda.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
step bench
timeout 200 python3 bench/bench_ops.py --device cuda --json "$OUT/bench_ops_gpu.json" 2>&1 | tee "$OUT/bench_ops_gpu.txt"
step tune
timeout 200 python3 bench/tune_grouped_gemm.py 2>&1 | tee "$OUT/tune_gemm_gpu.txt"
step done
