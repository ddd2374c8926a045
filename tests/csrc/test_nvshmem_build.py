"""moe_comm._cuda_nvshmem (csrc/cuda/nvshmem, built against the nvidia-nvshmem-cu13 wheel), checked on
the CPU where nvcc and the wheel exist:

- it was built, imports in a fresh interpreter without a GPU, and reports the wheel's version as both
  its build version and the loaded host library's;
- the built file needs libnvshmem_host.so.3 and finds it through RUNPATH $ORIGIN/../nvidia/nvshmem/lib;
  NVSHMEM's bootstrap plugin is found beside the host library;
- moe_comm.backends.cuda.nvshmem_lib turns a missing host library, a module that was not built and a
  version mismatch into NvshmemUnavailableError with what to install; it preloads the wheel's host
  library for a module that is not beside the wheel;
- every kernel of csrc/cuda/nvshmem/*.cu, compiled with -rdc=true for sm_90 and sm_100 with ``-Xptxas -v``,
  has __launch_bounds__, fits its registers in them and spills nothing (NVSHMEM's own functions aside);
- with a GPU (one PE): init, alloc, peer_ptr, a put-with-signal to itself, a bounded wait and its timeout.

MOE_COMM_REQUIRE_TOOLS=1 (make test) turns a skip for a missing nvcc, wheel or readelf into a failure.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.paths import ROOT
from helpers.ptxas import MAX_REGISTERS, NVCC, REGISTER_FILE, launch_bounds, ptxas_report

NVSHMEM_SRC = ROOT / "csrc" / "cuda" / "nvshmem"
SOURCES = sorted(NVSHMEM_SRC.glob("*.cu"))
ARCHS = ("sm_90", "sm_100")  # the build's (CMakeLists.txt MOE_COMM_NVSHMEM_ARCHITECTURES)
PROBE_KERNELS = {"put_signal_probe_kernel", "wait_signal_probe_kernel"}  # kernels.cu's
WHEEL = "nvidia-nvshmem-cu13"
HOST_LIBRARY = "libnvshmem_host.so.3"
RUNPATH = "$ORIGIN/../nvidia/nvshmem/lib"


def _skip_or_fail(reason: str) -> None:
    """Skips, or fails under MOE_COMM_REQUIRE_TOOLS=1 (make test), where a missing tool must not pass."""
    if os.environ.get("MOE_COMM_REQUIRE_TOOLS") == "1":
        pytest.fail(f"MOE_COMM_REQUIRE_TOOLS=1 (make test) needs this check to run: {reason}")
    pytest.skip(reason)


def _wheel_version() -> str | None:
    try:
        return importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None


def _wheel_root() -> Path | None:
    """The nvidia/nvshmem folder of the installed wheel (include/, lib/)."""
    spec = importlib.util.find_spec("nvidia.nvshmem")
    if spec is None or not spec.submodule_search_locations:
        return None
    for p in spec.submodule_search_locations:
        if (Path(p) / "include" / "nvshmem.h").is_file():
            return Path(p)
    return None


def _require_toolchain() -> Path:
    """The wheel's folder; skips (fails under make test) without nvcc or the wheel."""
    if NVCC is None:
        _skip_or_fail("nvcc not found (PATH, /usr/local/cuda/bin): moe_comm._cuda_nvshmem is not built")
    root = _wheel_root()
    if _wheel_version() is None or root is None:
        _skip_or_fail(f"the {WHEEL} wheel is not installed (make setup installs it: Makefile NVSHMEM_SPEC): "
                      "moe_comm._cuda_nvshmem is not built")
    return root


def _built_module_path() -> Path:
    """The built moe_comm._cuda_nvshmem file (fails when nvcc and the wheel are there but it is not)."""
    _require_toolchain()
    args = os.environ.get("CMAKE_ARGS", "").upper().replace(" ", "")
    if "MOE_COMM_NVSHMEM=OFF" in args or "MOE_COMM_CUDA=OFF" in args:
        pytest.skip("CMAKE_ARGS builds without moe_comm._cuda_nvshmem")
    spec = importlib.util.find_spec("moe_comm._cuda_nvshmem")
    if spec is None or not spec.origin:
        pytest.fail(f"nvcc ({NVCC}) and the {WHEEL} wheel are here, but moe_comm._cuda_nvshmem was not built: "
                    "rebuild with `pip install --no-build-isolation -e .` (CMake option MOE_COMM_NVSHMEM=AUTO)")
    return Path(spec.origin)


def _fresh(code: str, *, no_site: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter (``-S``: no site hooks, sys.path set by the code itself), without
    LD_LIBRARY_PATH or LD_PRELOAD, so only RUNPATH and the code decide which libraries load."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH")}
    cmd = [sys.executable] + (["-S"] if no_site else []) + ["-c", textwrap.dedent(code)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT.parent))


def _last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- (a) built, imports, versions
def test_module_imports_without_a_gpu_and_reports_the_wheel_version():
    _built_module_path()
    proc = _fresh("""
        import json
        from moe_comm.backends.cuda import nvshmem_lib
        m = nvshmem_lib.load()
        maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'nvshmem' in l.split()[-1]})
        print(json.dumps({"build": list(m.BUILD_VERSION), "runtime": list(m.runtime_version()),
                          "uid_bytes": m.UNIQUE_ID_BYTES, "initialized": m.initialized(),
                          "available": nvshmem_lib.available(), "file": m.__file__, "maps": maps}))
    """)
    out = _last_json(proc)
    wheel = tuple(int(v) for v in _wheel_version().split(".")[:3])
    assert tuple(out["build"]) == wheel, out
    assert tuple(out["runtime"]) == wheel, out
    assert out["uid_bytes"] == 128 and out["initialized"] is False and out["available"] is None
    # the host library came from the installed wheel, beside the module's site-packages
    host = [p for p in out["maps"] if p.endswith(HOST_LIBRARY)]
    assert host and Path(host[0]).parent == (_wheel_root() / "lib").resolve(), out["maps"]


def test_nothing_initializes_before_init_and_init_fails_cleanly_without_a_gpu():
    """Calls that need init() raise instead of crashing; without a GPU, init() raises the CUDA error
    (NVSHMEM's own init would exit the process or stop at 'bootstrapped'). The unique id needs no GPU,
    and making it loads NVSHMEM's bootstrap plugin from the wheel (the host library's RPATH ${ORIGIN})."""
    _built_module_path()
    proc = _fresh("""
        import json
        from moe_comm.backends.cuda import nvshmem_lib
        m = nvshmem_lib.load()
        out = {}
        for name, call in [("my_pe", m.my_pe), ("alloc", lambda: m.alloc(64)), ("barrier_all", m.barrier_all),
                           ("put_signal_probe", lambda: m.put_signal_probe(0, 0, 0, 0, 1, 0)),
                           ("wait_signal_probe", lambda: m.wait_signal_probe(0, 1, 1.0, 0))]:
            try:
                call()
                out[name] = None
            except RuntimeError as exc:
                out[name] = str(exc)
        try:
            uid = m.unique_id()
            out["uid_len"] = len(uid)
        except RuntimeError as exc:  # no usable network interface: the plugin was still loaded
            uid, out["uid_error"] = b"\\0" * m.UNIQUE_ID_BYTES, str(exc)
        out["maps"] = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'nvshmem' in l.split()[-1]})
        try:
            import torch
            out["gpu"] = torch.cuda.is_available()
        except ImportError:
            out["gpu"] = False
        if not out["gpu"]:
            try:
                m.init(uid, 0, 1)
                out["init"] = None
            except RuntimeError as exc:
                out["init"] = str(exc)
            out["initialized_after"] = m.initialized()
            m.finalize()  # nothing to finalize: no error
        print(json.dumps(out))
    """)
    out = _last_json(proc)
    for name in ("my_pe", "alloc", "barrier_all", "put_signal_probe", "wait_signal_probe"):
        assert out[name] and "not initialized" in out[name], (name, out[name])
    if "uid_len" in out:
        assert out["uid_len"] == 128
    plugin = [p for p in out["maps"] if p.endswith("nvshmem_bootstrap_uid.so.3")]
    assert plugin and Path(plugin[0]).parent == (_wheel_root() / "lib").resolve(), out["maps"]
    if not out["gpu"]:
        assert out["init"] and "cudaFree(0)" in out["init"] and "cudaError" in out["init"], out["init"]
        assert out["initialized_after"] is False


# ---------------------------------------------------------------------- (b) NEEDED and RUNPATH
def test_module_needs_the_host_library_through_an_origin_runpath():
    so = _built_module_path()
    readelf = shutil.which("readelf")
    if readelf is None:
        _skip_or_fail("readelf not found (binutils): cannot read the module's dynamic section")
    dyn = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[([^\]]+)\]", dyn)
    assert HOST_LIBRARY in needed, needed
    assert not any("cudart" in n for n in needed), f"cudart must be static: {needed}"
    assert runpath and runpath[0].split(":") == [RUNPATH], runpath
    # and that path, from where the module is installed, is the wheel's lib folder
    assert (so.parent / "../nvidia/nvshmem/lib").resolve() == (_wheel_root() / "lib").resolve()
    # NVSHMEM's host library dlopens its bootstrap plugins by name, through its own RPATH ${ORIGIN}
    host_dyn = subprocess.run([readelf, "-d", str(_wheel_root() / "lib" / HOST_LIBRARY)], capture_output=True,
                              text=True, check=True).stdout
    assert re.search(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[\$\{?ORIGIN\}?\]", host_dyn), host_dyn
    assert (_wheel_root() / "lib" / "nvshmem_bootstrap_uid.so.3").is_file()


# ---------------------------------------------------------------------- (c) clear errors
# A fresh interpreter with -S: sys.path is the temporary layout first, then the stdlib and the venv's
# site-packages (for torch; no .pth hooks, so the editable install's redirect does not apply).
_PRELUDE = """
    import json, sys, importlib.abc
    sys.path[:0] = [{layout!r}]
    sys.path.append({site!r})
    HIDE = {hide!r}
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if HIDE and (name == "nvidia.nvshmem" or name.startswith("nvidia.nvshmem.")):
                raise ModuleNotFoundError(f"hidden by the test: {{name}}", name=name)
            return None
    sys.meta_path.insert(0, Hide())
    import moe_comm
    assert moe_comm.__file__.startswith({layout!r}), moe_comm.__file__
    if any(l.rstrip().endswith("{host}") for l in open("/proc/self/maps")):
        print(json.dumps({{"skip": "{host} was loaded before moe-comm asked for it (by torch?)"}}))
        raise SystemExit(0)
    from moe_comm.backends.cuda import nvshmem_lib
"""


def _layout(tmp_path: Path, so: Path | None) -> Path:
    """tmp/site/moe_comm: the package's Python files, plus ``so`` (the built module) if given: no
    nvidia/nvshmem/lib beside it."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "moe_comm", site / "moe_comm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if so is not None:
        shutil.copy2(so, site / "moe_comm" / so.name)
    assert not (site / "nvidia").exists()
    return site


def _run_in_layout(site: Path, hide: bool, body: str) -> dict:
    venv_site = str(Path(importlib.util.find_spec("torch").origin).parents[1])
    code = textwrap.dedent(_PRELUDE).format(layout=str(site), site=venv_site, hide=hide, host=HOST_LIBRARY)
    out = _last_json(_fresh(code + textwrap.dedent(body), no_site=True))
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


_TRY_LOAD = """
    out = {}
    try:
        m = nvshmem_lib.load()
        out.update(loaded=True, runtime=list(m.runtime_version()), file=m.__file__)
    except nvshmem_lib.NvshmemUnavailableError as exc:
        out.update(loaded=False, error=str(exc), type=type(exc).__name__,
                   is_runtime_error=isinstance(exc, RuntimeError))
    out["available"] = nvshmem_lib.available()
    out["maps"] = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'nvshmem' in l.split()[-1]})
    print(json.dumps(out))
"""


def test_missing_host_library_is_one_clear_error(tmp_path):
    so = _built_module_path()
    out = _run_in_layout(_layout(tmp_path, so), hide=True, body=_TRY_LOAD)
    assert out["loaded"] is False and out["type"] == "NvshmemUnavailableError" and out["is_runtime_error"], out
    build = ".".join(_wheel_version().split(".")[:3])
    assert HOST_LIBRARY in out["error"], out["error"]
    assert f"pip install '{WHEEL}>={build}'" in out["error"], out["error"]
    assert out["available"] == out["error"]


def test_relocated_module_finds_the_wheel_by_preloading(tmp_path):
    """The same layout with nvidia.nvshmem importable: load() preloads its host library, so a module
    whose RUNPATH leads nowhere still loads."""
    so = _built_module_path()
    site = _layout(tmp_path, so)
    out = _run_in_layout(site, hide=False, body=_TRY_LOAD)
    assert out["loaded"] is True and out["available"] is None, out
    assert out["file"].startswith(str(site)), out["file"]
    host = [p for p in out["maps"] if p.endswith(HOST_LIBRARY)]
    assert host and Path(host[0]).parent == (_wheel_root() / "lib").resolve(), out["maps"]


def test_module_not_built_is_one_clear_error(tmp_path):
    out = _run_in_layout(_layout(tmp_path, None), hide=True, body=_TRY_LOAD)
    assert out["loaded"] is False and out["type"] == "NvshmemUnavailableError", out
    for words in ("was not built", "build_info()['cuda_nvshmem_not_built']",
                  "MOE_COMM_NVSHMEM_WHEEL=cu13 pip install '.[cu13]'", "CMAKE_ARGS=-DMOE_COMM_NVSHMEM=ON", "nvcc"):
        assert words in out["error"], (words, out["error"])


@pytest.mark.parametrize("build, runtime, ok", [
    ((3, 4, 5), (3, 4, 5), True), ((3, 4, 5), (3, 4, 9), True), ((3, 4, 5), (3, 8, 0), True),
    ((3, 4, 5), (3, 4, 4), False), ((3, 4, 5), (3, 3, 9), False), ((3, 4, 5), (4, 0, 0), False),
    ((3, 4, 5), (2, 9, 9), False),
])
def test_version_rule(build, runtime, ok):
    from moe_comm.backends.cuda.nvshmem_lib import version_problem
    problem = version_problem(build, runtime)
    if ok:
        assert problem is None
    else:
        fmt = lambda v: ".".join(map(str, v))  # noqa: E731
        assert problem and fmt(build) in problem and fmt(runtime) in problem, problem


def test_version_rule_matches_the_module():
    """nvshmem_lib.version_problem and the module's own incompatibility() (runtime.cpp, what init()
    enforces) agree."""
    _built_module_path()
    from moe_comm.backends.cuda import nvshmem_lib
    m = nvshmem_lib.load()
    for runtime in [(3, 4, 5), (3, 4, 6), (3, 5, 0), (3, 4, 4), (3, 0, 0), (4, 4, 5), (2, 4, 5)]:
        ours = nvshmem_lib.version_problem((3, 4, 5), runtime)
        theirs = m.incompatibility((3, 4, 5), runtime)
        assert (ours is None) == (theirs == ""), (runtime, ours, theirs)
        if theirs:
            assert "3.4.5" in theirs and ".".join(map(str, runtime)) in theirs


def test_build_versions_are_readable_from_the_file():
    """What load() names when the module cannot be imported: the NVSHMEM and CUDA versions of the build,
    read from the file, equal to what the module reports once imported; and the wheel to install."""
    so = _built_module_path()
    from moe_comm.backends.cuda import nvshmem_lib
    m = nvshmem_lib.load()
    version, cudart = nvshmem_lib.build_info_of(so)
    assert version == tuple(int(v) for v in _wheel_version().split(".")[:3]) == m.BUILD_VERSION
    assert cudart == m.BUILD_CUDART_VERSION and cudart // 1000 >= 12
    assert nvshmem_lib.wheel_name(cudart) == f"nvidia-nvshmem-cu{cudart // 1000}"
    assert WHEEL == nvshmem_lib.wheel_name(cudart)  # the build this file checks is CUDA 13's


# ---------------------------------------------------------------------- (d) ptxas budgets
def _spill_rule():
    """ptxas_spills.py, the build's compiler launcher: which functions must not spill."""
    spec = importlib.util.spec_from_file_location("moe_comm_ptxas_spills", NVSHMEM_SRC / "ptxas_spills.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Each file for each architecture; the fast tier compiles each file once, for alternating architectures.
_COMPILES = [pytest.param((a, s.name), id=f"{s.name}-{a}", marks=() if (i + j) % 2 == 0 else pytest.mark.exhaustive)
             for i, a in enumerate(ARCHS) for j, s in enumerate(SOURCES)]


@pytest.fixture(scope="module", params=_COMPILES)
def compiled(request, tmp_path_factory):
    """Each .cu of csrc/cuda/nvshmem compiled once per architecture as the build does (relocatable
    device code, the wheel's include dir as a system one): (arch, file, ptxas log, report, bounds)."""
    root = _require_toolchain()
    arch, name = request.param
    out = tmp_path_factory.mktemp(f"nvshmem_{Path(name).stem}_{arch}")
    cmd = [NVCC, "-std=c++20", "-O3", "--fmad=false", "--Werror=all-warnings", "-rdc=true", "-cubin", f"-arch={arch}",
           "-Xptxas", "-v", "--keep", "--keep-dir", str(out), "-isystem", str(root / "include"),
           "-o", str(out / "kernels.cubin"), str(NVSHMEM_SRC / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-4000:]}"
    ptx = "\n".join(p.read_text() for p in out.glob("*.ptx"))
    return arch, name, log, ptxas_report(log), launch_bounds(ptx)


def test_every_kernel_has_launch_bounds(compiled):
    arch, name, _, report, bounds = compiled
    if name == "kernels.cu":
        assert PROBE_KERNELS <= set(bounds), f"{arch}: {sorted(bounds)}"
    assert bounds, f"{name}: no kernels"
    assert set(bounds) <= set(report), f"{arch} {name}: ptxas compiled {sorted(report)}"
    missing = sorted(k for k, (threads, _) in bounds.items() if threads == 0)
    assert not missing, f"{arch} {name}: kernels without __launch_bounds__: {missing}"


def test_our_functions_do_not_spill(compiled):
    arch, name, log, report, bounds = compiled
    rule = _spill_rule()
    spills = rule.spills(log)
    ours = {f: s for f, s in spills.items() if rule.ours(f)}
    assert not ours, f"{arch} {name}: our functions spill registers (ptxas -v): {ours}"
    for kernel in bounds:  # the rule counts every kernel as ours
        assert report[kernel].get("spill_stores") == 0 and report[kernel].get("spill_loads") == 0, (kernel, report)
    # what the rule lets pass is NVSHMEM's own code (nvshmemi_quiet<> in 3.4.5)
    assert all(re.match(r"^(_Z[NL]*\d+)?nvshmem", f) for f in spills if not rule.ours(f)), spills


def test_registers_within_launch_bounds(compiled):
    arch, name, _, report, bounds = compiled
    over = {}
    for kernel, (threads, min_blocks) in bounds.items():
        budget = min(MAX_REGISTERS, REGISTER_FILE // max(1, threads * min_blocks))
        if report[kernel]["registers"] > budget:
            over[kernel] = f"{report[kernel]['registers']} registers > {budget} ({threads} x {min_blocks})"
    assert not over, f"{arch} {name}: {over}"


def test_spill_rule_tells_ours_from_nvshmem():
    rule = _spill_rule()
    log = textwrap.dedent("""\
        ptxas info    : Function properties for _Z14nvshmemi_quietIL13threadgroup_t3EEvv
            8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
        ptxas info    : Function properties for __nv_static_32__ab_10_kernels_cu_cd__ZN8moe_comm4cuda7nvshmem43_GLOBAL__N__ab24wait_signal_probe_kernelEPmmlPl
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 24 registers, used 0 barriers
        ptxas info    : Function properties for _ZN8moe_comm4cuda7nvshmem6helperEv
            16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
        """)
    spills = rule.spills(log)
    assert spills == {"_Z14nvshmemi_quietIL13threadgroup_t3EEvv": (8, 8), "_ZN8moe_comm4cuda7nvshmem6helperEv": (4, 4)}
    assert not rule.ours("_Z14nvshmemi_quietIL13threadgroup_t3EEvv") and not rule.ours("nvshmemx_foo")
    assert rule.ours("_ZN8moe_comm4cuda7nvshmem6helperEv")
    assert rule.ours("__nv_static_32__ab_10_kernels_cu_cd__ZN8moe_comm4cuda7nvshmem43_GLOBAL__N__ab24put_kernelEv")


# ---------------------------------------------------------------------- with a GPU: one PE
def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
def test_one_pe_put_signal_and_bounded_wait_on_a_gpu():
    _built_module_path()
    proc = _fresh("""
        import json, torch
        from moe_comm.backends.cuda import nvshmem_lib
        m = nvshmem_lib.load()
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")  # the primary context, current
        m.init(m.unique_id(), 0, 1)
        out = {"pe": m.my_pe(), "n": m.n_pes()}
        n = 4096
        base = m.alloc(n + 64)
        out["self_ptr"] = m.peer_ptr(base, 0) == base
        sig = base + n

        class View:  # raw device memory as a tensor (no copy)
            def __init__(self, ptr, count, typestr):
                self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (ptr, False),
                                                 "version": 2}
        dst = torch.as_tensor(View(base, n, "|u1"), device="cuda")
        flag = torch.as_tensor(View(sig, 1, "<u8"), device="cuda")
        src = (torch.arange(n, device="cuda") % 251).to(torch.uint8)
        err = torch.zeros(m.PROBE_ERROR_WORDS, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        m.put_signal_probe(base, src.data_ptr(), n, sig, 7, 0)
        m.wait_signal_probe(sig, 7, 10.0, err.data_ptr())
        torch.cuda.synchronize()
        out["copied"] = bool(torch.equal(dst, src))
        out["signal"] = int(flag.item())
        out["err"] = err.tolist()
        m.wait_signal_probe(sig, 8, 0.01, err.data_ptr())  # never comes: the deadline ends it
        torch.cuda.synchronize()
        out["timeout"] = err.tolist()
        m.barrier_all()
        m.free(base)
        m.finalize()
        print(json.dumps(out))
    """, timeout=240)
    out = _last_json(proc)
    assert out["pe"] == 0 and out["n"] == 1 and out["self_ptr"], out
    assert out["copied"] and out["signal"] == 7 and out["err"] == [0, 0], out
    assert out["timeout"] == [1, 7], out
