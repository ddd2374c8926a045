"""Runs DeepEP's own tests, unmodified, on CPU ranks against moe-comm: imported at interpreter start
(this folder is put first on PYTHONPATH by ``tools/deepep_tests/run.py``), in the test's process and
in every rank ``torch.multiprocessing.spawn`` starts.

What it maps, and nothing else:
- ``import deep_ep`` gives moe-comm (``moe_comm.integrations.install_deep_ep_alias``).
- CUDA devices become the CPU: ``device='cuda'`` in any torch call, ``.cuda()``, ``.to('cuda')``,
  ``torch.set_default_device('cuda')``; ``torch.cuda.set_device/synchronize/current_device`` are no-ops.
- ``dist.init_process_group('nccl', device_id=...)`` becomes gloo, and ``dist.all_gather_into_tensor``
  takes NCCL's output shapes (``[R, T, K]`` for a ``[T, K]`` input); ``dist.all_to_all_single`` sends
  float8 tensors as their bytes (gloo has no float8 type).
- For DeepEP V2's tests (``tests/elastic``), ``deep_ep.utils`` also finds DeepEP's own test utilities
  in the checkout (``MOE_COMM_DEEPEP_UTILS``, set by ``run.py``), and ``deep_ep._C`` is a stand-in for
  the few native calls they make (an NCCL communicator, the domain sizes).
- Which of the script's ``assert`` statements ran, in any rank, is recorded (a line trace of the script's
  own file) for ``run.py`` to report.
- ``SIGUSR1`` prints every thread's stack to stderr: ``run.py`` sends it to a run that ran past its
  ``--timeout`` before it kills it, so that a hang says where it was.
- DeepEP's GPU timing helpers (``bench``: CUDA events and an L2 flush; ``bench_kineto``: a CUDA
  kineto trace parsed by kernel name) become one timed call on the CPU, because the tests' tuning
  loops call them thousands of times and bench_kineto's traces hold no CUDA kernels here. Their return
  shapes are kept, so the tests' printing and bookkeeping run as written.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import types
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

    all_to_all = dist.all_to_all_single

    def all_to_all_single(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        # gloo has no float8 type: its bytes travel instead (DeepEP V2's reference dispatch sends FP8 data)
        if output.dtype in _FLOAT8 and input.dtype == output.dtype:
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        return all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single
    _FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _bench(fn: Any, num_warmups: int = 50, num_tests: int = 50, post_fn: Any = None) -> tuple[float, float, float]:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    if post_fn is not None:
        post_fn()
    return elapsed, elapsed, elapsed


def _bench_kineto(fn: Any, kernel_names: Any, num_tests: int = 30, suppress_kineto_output: bool = False,
                  trace_path: Any = None, barrier_comm_profiling: bool = False,
                  num_kernels_per_period: int = 1, **kwargs: Any) -> Any:
    # kwargs: V2's further keywords (its ``barrier``) only shape the GPU trace
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    per = elapsed / len(names)
    times = [per if num_kernels_per_period == 1 else [per / num_kernels_per_period] * num_kernels_per_period
             for _ in names]
    return times if isinstance(kernel_names, tuple) else times[0]


_TIMING_MODULES = ("utils", "deep_ep.utils.testing")  # DeepEP V1's tests/utils.py, V2's deep_ep/utils/testing.py


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


class _NativeStandIn(types.ModuleType):
    """``deep_ep._C`` for DeepEP V2's test utilities (``deep_ep/utils/envs.py`` and ``comm.py`` import it):
    the NCCL communicator they make becomes a number standing for (ranks, rank), and the domain sizes
    come from the harness's nodes (``WORLD_SIZE`` copies of the script), as DeepEP derives them from NCCL."""

    def __init__(self) -> None:
        super().__init__("deep_ep._C")
        import moe_comm
        self.EventHandle, self.Config, self.topk_idx_t = moe_comm.EventHandle, moe_comm.Config, moe_comm.topk_idx_t
        self._comms: list[tuple[int, int]] = []

    @staticmethod
    def get_local_nccl_unique_id() -> bytes:
        return b"moe-comm"

    def create_nccl_comm(self, unique_id: Any, num_ranks: int, rank: int) -> int:
        self._comms.append((num_ranks, rank))
        return len(self._comms) - 1

    @staticmethod
    def destroy_nccl_comm(comm: int) -> None:
        return None

    def get_physical_domain_size(self, comm: int) -> tuple[int, int]:
        num_ranks = self._comms[comm][0]
        nodes = int(os.environ.get("WORLD_SIZE", "1"))
        return (nodes, num_ranks // nodes) if num_ranks % nodes == 0 else (1, num_ranks)

    def get_logical_domain_size(self, comm: int, allow_hybrid_mode: bool = True) -> tuple[int, int]:
        nodes, per_node = self.get_physical_domain_size(comm)
        return (nodes, per_node) if allow_hybrid_mode and nodes > 1 else (1, nodes * per_node)


def _install_deepep_utils(folder: str) -> None:
    """DeepEP V2's tests import DeepEP's own test utilities (``deep_ep.utils.math``, ``refs``, ``gate``,
    ``envs``, ``testing``): they are found in ``folder`` (a DeepEP checkout's ``deep_ep/utils``)."""
    import deep_ep
    sys.modules["deep_ep._C"] = deep_ep._C = _NativeStandIn()  # type: ignore[attr-defined]
    deep_ep.utils.__path__ = [folder]  # type: ignore[attr-defined]


def _count_asserts(script: str, folder: str) -> None:
    """Records which ``assert`` statements of ``script`` run in this process (a line trace of that file
    only), written at exit to ``folder/asserts.<pid>`` for ``run.py`` to report."""
    import ast
    import atexit
    import json
    import threading
    with open(script) as f:
        lines = {n.lineno for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Assert)}
    hit: set[int] = set()

    def in_script(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno in lines:
            hit.add(frame.f_lineno)
        return in_script

    abspath = os.path.abspath  # bound now: at interpreter exit, module globals are torn down under the trace

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return in_script if abspath(frame.f_code.co_filename) == script else None

    def write() -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        # written whole or not at all: torch's spawn kills the other ranks when one fails, maybe mid-write
        part = os.path.join(folder, f"part.{os.getpid()}")
        with open(part, "w") as f:
            f.write(json.dumps(sorted(hit)))
        os.replace(part, os.path.join(folder, f"asserts.{os.getpid()}"))

    sys.settrace(on_call)
    threading.settrace(on_call)
    atexit.register(write)


def _install() -> None:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    script, folder = os.environ.get("MOE_COMM_DEEPEP_SCRIPT"), os.environ.get("MOE_COMM_DEEPEP_ASSERTS")
    if script and folder:
        _count_asserts(script, folder)
    _install_torch()
    from moe_comm.integrations import install_deep_ep_alias
    install_deep_ep_alias()
    sys.meta_path.insert(0, _PatchTimers())
    folder = os.environ.get("MOE_COMM_DEEPEP_UTILS")
    if folder:
        _install_deepep_utils(folder)


_install()
