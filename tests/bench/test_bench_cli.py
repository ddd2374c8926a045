"""The benchmarks shipped in the package (``python -m moe_comm.bench NAME``, the ``moe-comm-bench``
script): each runs at tiny shapes in real processes, standalone, under torchrun and under mpirun,
from a directory that is not the repository, writes its JSON where asked (by default under the
current directory) and draws its PNG; ``--plot`` without matplotlib is refused at parsing; and a
wheel built from this tree, installed into a fresh environment, carries them."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path
from typing import Callable

import pytest

import moe_comm
from moe_comm.bench import BENCHMARKS
from moe_comm.bench.transports import default_transports

from helpers.paths import ROOT
from helpers.ports import ATTEMPTS, free_port, port_taken
from helpers.tiers import exhaustive

BIN = Path(sys.executable).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE")
#: the smallest shapes each benchmark accepts: every case still runs and is checked before timing
TINY = {
    "normal": ["--ranks", "2", "--hidden", "128", "--topk", "2", "--experts", "4", "--iters", "2", "--warmup", "1"],
    "low_latency": ["--ranks", "2", "--tokens", "8", "--hidden", "128", "--topk", "2", "--experts", "4",
                    "--compute", "32", "--iters", "2", "--warmup", "1"],
    "moe": ["--ranks", "2", "--tokens", "16", "--hidden", "128", "--inter", "128", "--topk", "2", "--experts", "4",
            "--num-chunks", "2", "--iters", "2", "--warmup", "1"],
    "ops": ["--device", "cpu", "--tokens", "32", "--hidden", "128", "--intermediate", "64", "--experts", "4",
            "--topk", "2", "--ranks", "2", "--warmup", "0", "--reps", "1"],
}
# Where the wheel test's CMake build lives between runs (under the ignored build/, beside the
# editable install's, never shared with it), so that only the first run compiles.
WHEEL_BUILD = ROOT / "build" / "bench-wheel-test"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(cmd: list[str], cwd: Path, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def _bench(name: str, *args: str, cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "moe_comm.bench", name, *TINY[name], *args], cwd, **extra)


def _assert_png(path: Path) -> None:
    """A PNG (magic bytes) that matplotlib reads back as a non-empty image."""
    from matplotlib import image
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    pixels = image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100, pixels.shape


def _assert_normal_record(record: dict, tokens: list[int], transports: list[str], launcher: str) -> None:
    """The keys of normal's JSON record, and the numbers every run must have."""
    for key in ("date_utc", "machine", "git", "bench", "command", "launcher", "config", "byte_rule", "bandwidth_rule",
                "timing", "runs"):
        assert key in record, f"normal's JSON record has no {key!r}: {sorted(record)}"
    assert record["bench"] == "normal" and record["launcher"].startswith(launcher), record["launcher"]
    assert record["config"]["tokens"] == tokens and record["config"]["transports"] == transports
    assert [run["tokens"] for run in record["runs"]] == tokens
    for run in record["runs"]:
        assert run["memcpy_GBps"]["alone"] > 0 and run["memcpy_GBps"]["concurrent"] > 0
        assert run["checks_max_over_ranks"]["transports_bitwise_equal"] == 1.0
        cases = {r["case"]: r for r in run["cases"]}
        ceilings = ["a2a_ceiling"] + (["a2a_ceiling_mpi"] if "mpi" in transports else [])
        for name in [f"{t}_{op}" for t in transports for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16",
                                                                 "dispatch+combine")]:
            row = cases.pop(name)
            assert row["tokens"] == run["tokens"] and row["median_us"] > 0 and row["GBps_per_rank"] > 0
            # every transport row, cuda_host's too, stands against the floor and collective's time
            assert row["floor_us"] > 0 and 0 < row["of_floor"] and row["vs_collective"] > 0, row
            assert len(row["times_us"]) == record["config"]["iters"]
        assert sorted(cases) == sorted(["naive_dispatch", "naive_combine"] + ceilings)


@pytest.mark.exhaustive  # the fast tier's normal runs: under torchrun and mpirun; its plot: low_latency's
def test_normal_standalone_writes_json_and_png(tmp_path):
    out = _bench("normal", "--tokens", "16", "32", "--json", "out/n.json", "--plot", "n.png", cwd=tmp_path)
    assert "== normal: 16 tokens/rank" in out.stdout and "== normal: 32 tokens/rank" in out.stdout
    assert "memcpy_floor_us" in out.stdout and "GB/s_vs_a2a" in out.stdout
    record = json.loads((tmp_path / "out" / "n.json").read_text())
    _assert_normal_record(record, [16, 32], default_transports(), "moe_comm.launch.LocalWorld")
    assert record["machine"]["moe_comm_path"] == str(Path(moe_comm.__file__).resolve().parent)
    _assert_png(tmp_path / "n.png")
    assert not (Path(moe_comm.__file__).parent / "moe_comm_bench_out").exists()


# moe's and ops' full runs (13 s and 56 s on the 2-core test machine) are the exhaustive tier's
@pytest.mark.parametrize("name", ["low_latency", exhaustive("moe", id="moe"), exhaustive("ops", id="ops")])
def test_benchmark_runs_once_with_the_default_json_path(tmp_path, name):
    out = _bench(name, "--plot", "p.png", cwd=tmp_path)
    assert f"== {name}:" in out.stdout
    _assert_png(tmp_path / "p.png")  # one token count: the plot draws points
    path = tmp_path / "moe_comm_bench_out" / f"{name}.json"
    assert f"wrote {path}" in out.stdout
    record = json.loads(path.read_text())
    assert record["bench"] == name and len(record["runs"]) == 1, sorted(record)
    run = record["runs"][0]
    if name == "low_latency":
        cases = {r["case"] for r in run["cases"]}
        assert {"a2a_ceiling_fp8", "compute_only"} <= cases and run["memcpy_GBps"]["concurrent"] > 0
        assert {f"{t}_dispatch_fp8_hook_recv" for t in record["config"]["transports"]} <= cases
    elif name == "moe":
        assert {(r["transport"], r["mode"]) for r in run["rows"]} == \
            {(t, m) for t in record["config"]["transports"] for m in record["config"]["modes"]}
        assert not any(run["checks_max_over_ranks"].values())  # bitwise equal to ep_moe_reference
    else:
        assert run["ceilings"]["memory_GBps"] > 0 and all(c["ok"] for c in run["checks"])
        assert {r["op"] for r in run["results"]} >= {"ceiling", "permute", "grouped_gemm", "unpermute_reduce"}


def test_console_script_entry_point():
    from importlib.metadata import entry_points
    found = [ep for ep in entry_points(group="console_scripts") if ep.name == "moe-comm-bench"]
    assert [ep.value for ep in found] == ["moe_comm.bench.cli:main"], found
    from moe_comm.bench import cli
    assert found[0].load() is cli.main
    script = shutil.which("moe-comm-bench", path=str(BIN))
    assert script is not None, f"pip put no moe-comm-bench beside {sys.executable}: reinstall (make setup)"
    out = _run([script, "--help"], ROOT)
    assert out.stdout.startswith("usage: moe-comm-bench NAME [options]")
    assert all(name in out.stdout for name in BENCHMARKS)


def test_plot_without_matplotlib_is_refused_at_parsing(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv = ['moe-comm-bench'] + sys.argv[1:]; "
            "from moe_comm.bench.cli import main; main()")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, "normal", "--ranks", "2", "--plot", "x.png"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "argument --plot: needs matplotlib" in done.stderr and "pip install 'moe-comm[plot]'" in done.stderr, \
        done.stderr
    assert not list(tmp_path.iterdir()), "nothing ran, so nothing was written"
    assert time.monotonic() - t0 < 60, "refused before any rank started"


@pytest.mark.parametrize("args,message", [
    (["--tokens", "0"], "--tokens: wants distinct integers >= 1, got [0]"),
    (["--tokens", "8", "8"], "--tokens: wants distinct integers >= 1, got [8, 8]"),
])
def test_bad_token_counts_are_refused(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "moe_comm.bench", "normal", *args], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_unknown_benchmark_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "moe_comm.bench", "nope"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument NAME: invalid choice: 'nope'" in done.stderr, done.stderr


def _launch(cmd: Callable[[str], list[str]], cwd: Path) -> None:
    """``cmd(port)`` launched with MASTER_PORT=port, until it does not lose its port (helpers/ports.py)."""
    for _ in range(ATTEMPTS):
        port = str(free_port())
        done = subprocess.run(cmd(port), cwd=cwd, env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              capture_output=True, text=True, timeout=300)
        if done.returncode == 0 or not port_taken(done.stdout + done.stderr):
            break
    assert done.returncode == 0, f"{cmd(port)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_normal_under_torchrun(tmp_path):
    _launch(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          port, "-m", "moe_comm.bench", "normal", *TINY["normal"], "--tokens", "16", "--json",
                          "t.json"], tmp_path)
    record = json.loads((tmp_path / "t.json").read_text())
    # mpi needs ranks that are one MPI job, which torchrun's are not
    _assert_normal_record(record, [16], [t for t in default_transports() if t != "mpi"], "torchrun")
    assert record["config"]["ranks"] == 2


def test_normal_under_mpirun(tmp_path):
    mpirun = shutil.which("mpirun", path=str(BIN)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install 'moe-comm[mpi]' provides MPICH's)")
    _launch(lambda port: [mpirun, "-n", "2", sys.executable, "-m", "moe_comm.bench", "normal", *TINY["normal"],
                          "--tokens", "16", "--json", "m.json"], tmp_path)
    record = json.loads((tmp_path / "m.json").read_text())
    _assert_normal_record(record, [16], default_transports(), "mpirun")
    assert record["config"]["ranks"] == 2 and "mpi" in record["config"]["transports"]  # and MPI_Alltoallv beside


def _build_wheel(out: Path) -> Path:
    """A wheel of this tree (CPU modules only), built in ``WHEEL_BUILD`` under a lock (concurrent runs)."""
    WHEEL_BUILD.mkdir(parents=True, exist_ok=True)
    with open(WHEEL_BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
              "-C", f"build-dir={WHEEL_BUILD}/{{wheel_tag}}", "-C", "cmake.define.MOE_COMM_CUDA=OFF", str(ROOT)],
             ROOT, timeout=900)
    (wheel,) = out.glob("moe_comm-*.whl")
    return wheel


@pytest.mark.exhaustive  # builds a wheel (make test-all also runs tools/install_check.sh)
def test_installed_wheel_carries_the_benchmarks(tmp_path):
    """``pip install`` of a wheel into a fresh venv (no moe-comm source anywhere on its path; torch and
    the other dependencies from this venv's site-packages as a plain path entry, whose .pth files, the
    editable install's among them, do not run) gives ``moe-comm-bench`` and ``python -m moe_comm.bench``."""
    wheel = _build_wheel(tmp_path / "wheels")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"moe_comm/bench/__main__.py", "moe_comm/bench/cli.py", "moe_comm/bench/plot.py"} <= set(names)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path).stdout.strip())
    (site / "dependencies_from_dev_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", str(wheel)], tmp_path)
    where = _run([str(py), "-c", "import moe_comm, moe_comm._C; print(moe_comm.__file__)"], tmp_path).stdout.strip()
    assert Path(where).is_relative_to(site), f"moe_comm imported from {where}, not the installed wheel in {site}"
    work = tmp_path / "elsewhere"
    work.mkdir()
    _run([str(venv / "bin" / "moe-comm-bench"), "normal", *TINY["normal"], "--tokens", "16",
          "--transports", "shm", "collective", "--plot", "w.png"], work)
    record = json.loads((work / "moe_comm_bench_out" / "normal.json").read_text())
    _assert_normal_record(record, [16], ["shm", "collective"], "moe_comm.launch.LocalWorld")
    assert Path(record["machine"]["moe_comm_path"]).is_relative_to(site), record["machine"]
    assert record["git"] == {"commit": None, "dirty": None}  # an installed package names no checkout's commit
    assert record["command"].startswith("moe-comm-bench normal")
    _assert_png(work / "w.png")
    out = _run([str(py), "-m", "moe_comm.bench", "ops", "--help"], work)
    assert "--plot PATH" in out.stdout


_BAD_SHAPES = [(["--experts", "3"], "--experts (3) must be a multiple of the rank count (2)"),
               (["--hidden", "100"], "--hidden (100) must be a multiple of 128 for the FP8 scales"),
               (["--topk", "0"], "need 1 <= --topk <= --experts and --iters >= 1")]


#: Every bad shape on every routing benchmark; the fast tier pairs each benchmark with one shape.
@pytest.mark.parametrize("bench,flags,message", [
    pytest.param(bench, flags, message, id=f"{bench}-{flags[0]}", marks=() if i == j else pytest.mark.exhaustive)
    for i, bench in enumerate(["normal", "low_latency", "moe"]) for j, (flags, message) in enumerate(_BAD_SHAPES)])
def test_routing_benchmarks_refuse_a_bad_shape_before_launching(bench, flags, message):
    done = subprocess.run([sys.executable, "-m", "moe_comm.bench", bench, "--ranks", "2", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"{bench}: {message}" in done.stderr, done.stderr[-2000:]


@pytest.mark.exhaustive  # torch.compile of the layer on every transport: 38 s (the layer's compile has its own tests)
def test_moe_benchmark_times_the_compiled_layer(tmp_path):
    _bench("moe", "--compile", "--modes", "sequential", "low_latency", cwd=tmp_path)
    record = json.loads((tmp_path / "moe_comm_bench_out" / "moe.json").read_text())
    run = record["runs"][0]
    assert record["config"]["compile"] is True
    assert not any(run["checks_max_over_ranks"].values())  # the compiled layer too, bit for bit
    assert {f"{r['transport']}_{r['mode']}_compiled_mismatched" for r in run["rows"]} <= set(run["checks_max_over_ranks"])
    for row in run["rows"]:
        assert row["compiled_us"] > 0 and row["compile_s"] > 0 and row["compiled_vs_eager"] > 0, row
