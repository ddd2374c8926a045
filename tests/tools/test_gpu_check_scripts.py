"""tools/gpu_check.sh and its entry points (tools/gpu_check/), checked without a GPU: the script parses,
every entry point answers --help, the parts that need no GPU run (the _cuda_host references, the
multi-process harness on _cuda_host over /dev/shm, the comparison and the summary), and the script's
time boxes stay inside the 8 minutes one GPU run may take."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT

SCRIPT = ROOT / "tools" / "gpu_check.sh"
GC = ROOT / "tools" / "gpu_check"
ENTRY_POINTS = ("machine.py", "emulated.py", "ipc_ranks.py", "graph.py", "buffer_graph.py", "bench.py", "summary.py")
LIMIT_S = 480  # 8 minutes: the longest one run of the script may take


def _run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _module(name: str):
    if str(GC) not in sys.path:
        sys.path.insert(0, str(GC))
    key = f"gpu_check_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, GC / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def _steps() -> list[tuple[str, int]]:
    """(name, box) of every step the script runs: `step NAME BOX ...` and `sanitize NAME BOX ...` lines."""
    out = []
    for line in SCRIPT.read_text().splitlines():
        m = re.match(r"^\s*(?:\w+=\S+\s+)*(step|sanitize)\s+\"?([\w$]+)\"?\s+\"?(\$?\w+)\"?\s", line + " ")
        if m and m.group(2) != "$1":
            assert m.group(3).isdigit(), f"a step without a literal time box: {line}"
            out.append((m.group(2), int(m.group(3))))
    return out


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_time_boxes_stay_under_eight_minutes():
    steps = _steps()
    names = [n for n, _ in steps]
    assert len(names) == len(set(names)), names
    for required in ("machine", "build", "import", "pytest_emulated", "ipc", "graph", "bench", "sanitizer_memcheck",
                     "sanitizer_synccheck", "summary"):
        assert required in names, f"{required} is not a step of {SCRIPT.name}"
    text = SCRIPT.read_text()
    grace = re.findall(r"timeout -k (\d+) \"\$box\"", text)
    assert len(grace) == 1, "every step runs under the one `timeout -k GRACE \"$box\"` of step()"
    total = sum(box for _, box in steps) + int(grace[0]) * len(steps)
    assert total < LIMIT_S, f"time boxes {dict(steps)} + {grace[0]} s grace each = {total} s >= {LIMIT_S} s"
    # nothing else waits unboxed: every python or pytest command of the script is a step's
    for line in text.replace("\\\n", " ").splitlines():
        s = line.strip()
        if s.startswith("#") or not s:
            continue
        if re.match(r'^"\$PY"', s) or s.startswith("pytest"):
            pytest.fail(f"a command outside any step's time box: {s}")


def test_readme_lists_every_step_with_its_box():
    readme = (GC / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) \|", readme, re.M))
    assert rows == {n: str(b) for n, b in _steps()}, "tools/gpu_check/README.md's table is not the script's steps"
    total = sum(b for _, b in _steps())
    assert f"add up to {total} s" in readme


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_help(entry):
    proc = _run(GC / entry, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_emulated_host_reference(tmp_path):
    """The _cuda_host half of emulated.py (what the GPU run compares with), every case, R = 2, 3, 8."""
    out = tmp_path / "emulated.json"
    proc = _run(GC / "emulated.py", "--ranks", 2, 3, 8, "--host-only", "--json", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and len(rec["checks"]) == 3 * 8  # ranks x cases (emulated.CASES)
    proc = _run(GC / "emulated.py", "--ranks", 2, "--small", "--host-only")
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_emulated_refuses_to_pass_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "e.json"
    proc = _run(GC / "emulated.py", "--ranks", 2, "--small", "--json", out)
    assert proc.returncode == 1 and not json.loads(out.read_text())["ok"]


def test_ipc_harness_on_the_host_build(tmp_path):
    """ipc_ranks.py's processes, all-gathers, teardown and comparison, on _cuda_host over /dev/shm."""
    out = tmp_path / "ipc.json"
    before = set(Path("/dev/shm").iterdir()) if Path("/dev/shm").is_dir() else set()
    # generous deadlines: on a loaded 2-core machine the ranks' spin-waits share the cores
    proc = _run(GC / "ipc_ranks.py", "--ranks", 2, 3, "--host-only", "--timeout", 30, "--deadline", 90, "--json", out,
                timeout=240)
    failed = out.read_text() if out.is_file() else "no record"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + failed[-3000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and set(rec["checks"]) == {"R2", "R3"}
    for R, check in (("R2", rec["checks"]["R2"]), ("R3", rec["checks"]["R3"])):
        assert set(check["cases"]) == {"normal_bf16", "normal_fp8", "internode_bf16", "internode_fp8", "ll_bf16",
                                       "ll_fp8", "ll_fp8_ue8m0", "ll_bf16_logfmt"}
        assert all(len(c["ranks"]) == int(R[1:]) for c in check["cases"].values())
    left = {p for p in (set(Path("/dev/shm").iterdir()) - before) if "gpu_check" in p.name}
    assert not left, f"ipc_ranks.py left {left}"


def test_buffer_graph_harness_on_the_host_build(tmp_path):
    """buffer_graph.py's eager half on the cuda_host backend (2 and 3 processes): repeated eager steps are
    bitwise equal, another hidden size on the last rank fails every rank at the hook, the next step works."""
    out = tmp_path / "bg.json"
    proc = _run(GC / "buffer_graph.py", "--ranks", 2, 3, "--backend", "cuda_host", "--timeout", 30, "--json", out,
                timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and set(rec["checks"]) == {"R2", "R3"}
    for check in rec["checks"].values():
        messages = {r["mismatch"] for r in check["ranks"]}
        assert len(messages) == 1 and "ranks disagree on hidden" in messages.pop(), check


def test_buffer_graph_needs_the_gpu(tmp_path):
    """buffer_graph.py's graph half off the GPU machine: a failed record saying why, never a pass."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = tmp_path / "bg.json"
    proc = _run(GC / "buffer_graph.py", "--ranks", 2, "--json", out)
    rec = json.loads(out.read_text())
    assert proc.returncode == 1 and not rec["ok"] and "needs the GPU" in json.dumps(rec), rec


def test_nvshmem_link_needs_the_gpu(tmp_path):
    """ipc_ranks.py --link nvshmem off the GPU machine: a failed record saying why, never a pass."""
    out = tmp_path / "nv.json"
    proc = _run(GC / "ipc_ranks.py", "--ranks", 2, "--host-only", "--link", "nvshmem", "--json", out)
    rec = json.loads(out.read_text())
    assert proc.returncode == 1 and not rec["ok"], rec
    assert "needs the GPU" in json.dumps(rec)


def test_internode_semantics_catch_a_flat_sum():
    """The across-nodes meaning of combine is the two-level sum: a flat sum over the ranks (what the
    intranode kernels give) fails it where the two differ in bf16."""
    h = _module("harness")
    import torch
    s = h.InternodeShape(R=8, node_ranks=4, K=5)  # up to 4 ranks of a node: its partial bf16(3x) rounds
    ins = h.internode_inputs(s)
    ref = h.InternodeCase(h.HostSide(8), s, ins).run()
    assert not h.sanity(ins, ref, s)
    flat = {r: dict(o) for r, o in ref.items()}
    for r, o in flat.items():
        x, n_t = ins[r]["x"].float(), ins[r]["in_rank"].sum(1).float().unsqueeze(1)
        o["out"] = torch.where(n_t > 0, (x * n_t).to(torch.bfloat16), torch.zeros((), dtype=torch.bfloat16))
    assert any("combine's out" in line for line in h.sanity(ins, flat, s))


def test_compare_and_semantics_catch_a_flipped_byte():
    h = _module("harness")
    import torch
    s = h.NormalShape(R=2)
    ins = h.normal_inputs(s)
    ref = h.NormalCase(h.HostSide(2), s, ins).run()
    assert h.compare(ref, ref) == [] and h.sanity(ins, ref, s) == []
    bad = {r: {k: v.clone() for k, v in o.items()} for r, o in ref.items()}
    bad[1]["recv_x"].view(torch.uint8).view(-1)[5] ^= 1
    assert any("recv_x" in line for line in h.compare(ref, bad))
    assert any("rank 1" in line for line in h.semantics(ins, bad, s))
    bad = {r: {k: v.clone() for k, v in o.items()} for r, o in ref.items()}
    bad[0]["out"].view(torch.uint8).view(-1)[0] ^= 0x80
    assert any("combine" in line for line in h.semantics(ins, bad, s))
    ls = h.LowLatencyShape(R=2)
    lins = h.low_latency_inputs(ls)
    lref = h.LowLatencyCase(h.HostSide(2), ls, lins).run()
    assert h.ll_semantics(lins, lref, ls) == []
    lbad = {r: {k: v.clone() for k, v in o.items()} for r, o in lref.items()}
    lbad[0]["src_info"][0, 0] += 1
    assert h.ll_semantics(lins, lbad, ls)
    assert h.unpack(h.pack(lref)).keys() == lref.keys() and h.compare(lref, h.unpack(h.pack(lref))) == []


def test_merge_gives_one_value_or_one_per_rank():
    h = _module("harness")
    assert h.merge([(1, 2, True), (1, 3, True)]) == (1, [2, 3], True)


def test_bench_helpers():
    b = _module("bench")
    st = b.stats([1e-6 * x for x in range(1, 22)])
    assert st["median_us"] == pytest.approx(11.0) and st["iters"] == 21
    msg = ("moe_comm._cuda: dispatch: its 1280 blocks wait on each other, so they must all be resident at once, "
           "and this GPU holds 528 of them (use fewer channels: Config.num_sms): cudaErrorCooperativeLaunchTooLarge: "
           "too many blocks in cooperative launch")
    assert b._too_large(RuntimeError(msg)) == ("dispatch", 528)
    assert b._too_large(RuntimeError("moe_comm._cuda: combine (launch): cudaErrorInvalidValue")) is None
    data = {"checks": {"normal_R8": {"dispatch": {"call": {"of_copy": 0.7}, "kernel": {"of_copy": 0.8}},
                                     "combine": {"call": {"of_copy": 0.5}, "kernel": {"of_copy": 0.55}}},
                       "ll_R8_fp8": {"eager": {"dispatch": {"median_us": 35.0}, "combine": {"median_us": 70.0}},
                                     "graph": {"dispatch": {"median_us": 20.0}}}}}
    t = b.targets(data)
    assert t["normal_R8_dispatch_of_copy"]["met"] is True and t["normal_R8_combine_of_copy"]["met"] is False
    assert t["ll_R8_fp8_dispatch_us"]["met"] is True and t["ll_R8_fp8_combine_us"]["met"] is False
    assert t["ll_R8_bf16_dispatch_us"]["met"] is None
    assert "target" in b.report({**data, "targets": t})


def test_summary_verdicts(tmp_path):
    (tmp_path / "steps.tsv").write_text("machine\t0\t1.0\t10\nbuild\t0\t30.5\t90\nipc\t1\t3\t45\n"
                                        "sanitizer_memcheck\t0\t12\t35\nsanitizer_synccheck\t1\t2\t35\n"
                                        "pytest_emulated\t0\t9\t45\nbench\t124\t70\t70\naccuracy\t-1\t0\t25\n")
    (tmp_path / "ipc.json").write_text(json.dumps({"ok": False, "checks": {"R2": {"ok": False}}}))
    (tmp_path / "sanitizer_memcheck.log").write_text("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")
    (tmp_path / "sanitizer_synccheck.log").write_text("========= Error: Device not supported\n")
    (tmp_path / "pytest_emulated.xml").write_text(
        '<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"/>'
        '<testcase classname="t" name="c"><skipped message="needs a CUDA GPU"/></testcase></testsuite></testsuites>')
    proc = _run(GC / "summary.py", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["pass"] == {"machine": True, "build": True, "ipc": False, "sanitizer_memcheck": True,
                         "sanitizer_synccheck": False, "pytest_emulated": False, "bench": False, "accuracy": False}
    assert s["steps"]["sanitizer_synccheck"]["sanitizer"]["status"] == "refused"
    assert s["steps"]["bench"]["timed_out"] and s["steps"]["accuracy"]["skipped"]
    assert s["steps"]["build"]["seconds"] == 30.5 and not s["all_pass"]


# The emulated side's launches on a stand-in for moe_comm._cuda that keeps its calling convention (one value
# for all ranks or one per rank where bindings.cpp takes `int | Sequence[int]`, a plain value elsewhere,
# the stream last) and runs each rank on moe_comm._cuda_host: the harness's device-side argument lists,
# checked here without a GPU.
PER_RANK = {  # positions of the per-rank arguments of each _cuda method (csrc/cuda/device/bindings.cpp)
    "notify": set(range(11)) - {0, 4}, "prologue": set(), "dispatch": set(range(18)) - {3},
    "combine": set(range(17)) - {1, 2, 3, 4}, "ll_dispatch": set(range(16)) - {0, 1, 4, 5, 6, 7, 8},
    "ll_combine": set(range(11)) - {0, 1, 4},
}


class _FakeEmulated:
    def __init__(self, objs, kind):
        self.objs, self.kind, self.R = objs, kind, len(objs)

    def _split(self, method, args):
        *args, stream = args
        assert isinstance(stream, int)
        key = method if self.kind == "normal" else f"ll_{method}"
        per_rank = PER_RANK[key]
        for i, a in enumerate(args):
            if isinstance(a, list):
                assert i in per_rank, f"{method}: argument {i} is a list, but _cuda takes one value there"
                assert len(a) == self.R
        return [tuple(a[r] if isinstance(a, list) else a for a in args) for r in range(self.R)]

    def __getattr__(self, method):
        def call(*args):
            per = self._split(method, args)
            if self.kind == "normal":
                import threading
                out = [None] * self.R
                ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, getattr(self.objs[r], method)(*per[r])))
                      for r in range(self.R)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                return out
            self.records = [getattr(self.objs[r], method)(*per[r]) for r in range(self.R)]
            return None
        return call

    def check(self):
        return getattr(self, "records", [None] * self.R)


def _fake_emulated_side(R):
    h = _module("harness")
    import os

    import torch

    from moe_comm import _cuda_host

    class FakeCuda:
        DType = _cuda_host.DType
        normal_bytes = staticmethod(_cuda_host.normal_bytes)
        dispatch_slot_bytes = staticmethod(_cuda_host.dispatch_slot_bytes)
        low_latency_bytes = staticmethod(_cuda_host.low_latency_bytes)

        @staticmethod
        def synchronize(stream):
            assert stream == 0

        class Normal:
            @staticmethod
            def emulated(bases, timeout_s, C, chunk, L, slots, slot_bytes):
                return _FakeEmulated([_cuda_host.Normal(bases, [os.getpid()] * R, r, timeout_s, C, chunk, L, slots,
                                                        slot_bytes) for r in range(R)], "normal")

        class LowLatency:
            @staticmethod
            def emulated(bases, timeout_s, L, M, H):
                return _FakeEmulated([_cuda_host.LowLatency(bases, [os.getpid()] * R, r, timeout_s, L, M, H)
                                      for r in range(R)], "ll")

    class Side(h.EmulatedSide):
        def __init__(self):
            self.mod, self.R, self.timeout_s = FakeCuda, R, 30.0
            self.device, self.served, self._keep = torch.device("cpu"), list(range(R)), []

        def stream(self):
            return 0

        def buffers(self, nbytes):
            bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(R)]
            self._keep += bufs
            return [b.data_ptr() for b in bufs]

    return Side()


@pytest.mark.parametrize("R", [2, 8])
def test_emulated_argument_lists_on_a_stand_in(R):
    h = _module("harness")
    for fp8 in (False, True):
        s = h.NormalShape(R=R, fp8=fp8)
        ins = h.normal_inputs(s)
        ref = h.NormalCase(h.HostSide(R), s, ins).run()
        got = h.NormalCase(_fake_emulated_side(R), s, ins).run()
        assert h.compare(ref, got) == []
    for fmt in h.LL_FORMATS:
        s = h.LowLatencyShape(R=R, fmt=fmt)
        ins = h.low_latency_inputs(s)
        ref = h.LowLatencyCase(h.HostSide(R), s, ins).run()
        got = h.LowLatencyCase(_fake_emulated_side(R), s, ins).run()
        assert h.compare(ref, got) == [] and h.ll_semantics(ins, got, s) == []


def test_stand_in_refuses_a_list_where_cuda_takes_one_value():
    fake = _FakeEmulated([None, None], "normal")
    with pytest.raises(AssertionError, match="argument 1"):
        fake._split("combine", (1, [256, 256], 512, 0, 0, *([0] * 12), 0))
    assert fake._split("prologue", (3, 0)) == [(3,), (3,)]


def test_buffer_graph_compiled_calls_on_the_host_build(tmp_path):
    """buffer_graph.py --compiled on the cuda_host backend: the decode step under torch.compile (without CUDA
    graphs: CPU tensors) equals the eager step bitwise on every call, and an eager step after it too."""
    out = tmp_path / "cg.json"
    proc = _run(GC / "buffer_graph.py", "--ranks", 2, "--backend", "cuda_host", "--compiled", 4, "--timeout", 30,
                "--json", out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] and all(r["compiled"] == 4 and not r["compiled_unequal"] for r in rec["checks"]["R2"]["ranks"])
