"""Runs DeepEP's own tests, unmodified, on CPU ranks against moe-comm: imported at interpreter start
(this folder is put first on PYTHONPATH by ``tools/deepep_tests/run.py``), in the test's process and
in every rank ``torch.multiprocessing.spawn`` starts.

What it maps, and nothing else:
- ``import deep_ep`` gives moe-comm (``moe_comm.integrations.install_deep_ep_alias``).
- CUDA devices become the CPU: ``device='cuda'`` in any torch call, ``.cuda()``, ``.to('cuda')``,
  ``torch.set_default_device('cuda')``; ``torch.cuda.set_device/synchronize/current_device`` are no-ops.
- ``dist.init_process_group('nccl', device_id=...)`` becomes gloo, and ``dist.all_gather_into_tensor``
  takes NCCL's output shapes (``[R, T, K]`` for a ``[T, K]`` input).
- DeepEP's GPU timing helpers (``bench``: CUDA events and an L2 flush; ``bench_kineto``: a CUDA
  kineto trace parsed by kernel name) become one timed call on the CPU, because the tests' tuning
  loops call them thousands of times and bench_kineto's traces hold no CUDA kernels here. Their return
  shapes are kept, so the tests' printing and bookkeeping run as written.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
from typing import Any


def _cpu(device: Any) -> Any:
    import torch
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _install_torch() -> None:
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        """Rewrites CUDA devices to the CPU in every torch call."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            name = getattr(func, "__name__", "")
            if name == "cuda":  # Tensor.cuda(...)
                return args[0]
            if name == "to":
                args = tuple(_cpu(a) for a in args)
            return func(*args, **kwargs)

    mode = CudaToCpu()
    mode.__enter__()  # for the whole process (the main thread: DeepEP's tests are single-threaded)

    set_default = torch.set_default_device
    torch.set_default_device = lambda device: set_default(_cpu(device))
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: 0

    init = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        args = tuple("gloo" if a == "nccl" else a for a in args)
        return init(*args, **kwargs)

    dist.init_process_group = init_process_group

    gather = dist.all_gather_into_tensor

    def all_gather_into_tensor(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        # NCCL takes any output of world-size times the input's elements (DeepEP passes [R, T, K] for a
        # [T, K] input); gloo wants the rows concatenated
        if output.dim() == input.dim() + 1:
            output = output.view(-1, *input.shape[1:])
        return gather(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = all_gather_into_tensor


def _bench(fn: Any, num_warmups: int = 50, num_tests: int = 50, post_fn: Any = None) -> tuple[float, float, float]:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    if post_fn is not None:
        post_fn()
    return elapsed, elapsed, elapsed


def _bench_kineto(fn: Any, kernel_names: Any, num_tests: int = 30, suppress_kineto_output: bool = False,
                  trace_path: Any = None, barrier_comm_profiling: bool = False,
                  num_kernels_per_period: int = 1) -> Any:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    per = elapsed / len(names)
    times = [per if num_kernels_per_period == 1 else [per / num_kernels_per_period] * num_kernels_per_period
             for _ in names]
    return times if isinstance(kernel_names, tuple) else times[0]


_TIMING_MODULES = ("utils",)  # DeepEP v1 tests/utils.py


class _PatchTimers(importlib.abc.MetaPathFinder):
    """After DeepEP's ``tests/utils.py`` is imported, swaps in the CPU timers."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _TIMING_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            if hasattr(module, "bench"):
                module.bench = _bench
            if hasattr(module, "bench_kineto"):
                module.bench_kineto = _bench_kineto

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _install() -> None:
    _install_torch()
    from moe_comm.integrations import install_deep_ep_alias
    install_deep_ep_alias()
    sys.meta_path.insert(0, _PatchTimers())


_install()
