# Two commands do everything on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moe-comm-installed
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy pybind11 "scikit-build-core>=0.10" cmake ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test,mpi]"
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py --ranks 4

test: setup
	$(PY) -m pytest -q python_tests

bench: setup
	$(PY) bench/bench_normal.py --ranks 4
	$(PY) bench/bench_low_latency.py --ranks 4
	$(PY) bench/bench_kernels.py

clean:
	rm -rf $(VENV) build
