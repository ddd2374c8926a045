"""The device build of csrc/cuda (moe_comm._cuda), checked where nvcc exists, GPU or not:

- every kernel of csrc/cuda/device/kernels.cu, compiled for sm_90 and sm_100 with ``-Xptxas -v``,
  has explicit ``__launch_bounds__``, spills nothing, and uses no more registers than its bounds
  allow (65536 / threads per block / min blocks per SM, at most 255);
- moe_comm._cuda was built, imports without a GPU, and shares _cuda_host's enums and buffer layout
  (one source of layout, kernels/buffer_layout.h, for both builds).
"""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers.paths import ROOT
from helpers.ptxas import MAX_REGISTERS, NVCC, REGISTER_FILE, launch_bounds, ptxas_report
from helpers.tiers import exhaustive

KERNELS = ROOT / "csrc" / "cuda" / "device" / "kernels.cu"

#: Every __global__ of kernels.cu (a missing one fails: a kernel renamed or dropped is a change to see).
EXPECTED_KERNELS = {
    "layout_kernel", "notify_kernel", "prologue_kernel", "dispatch_kernel", "combine_kernel", "ll_cast_kernel",
    "ll_dispatch_send_kernel", "ll_dispatch_recv_kernel", "ll_combine_send_kernel", "ll_combine_wait_kernel",
    "ll_combine_reduce_kernel", "internode_notify_kernel", "internode_prologue_kernel", "internode_dispatch_kernel",
    "internode_combine_kernel",
    # the header steps of a low-latency call (roles.cuh), per batch: dispatch, combine, a host rejection
    *(f"ll_{step}_kernel[{args}]" for step in ("stage", "post", "judge", "consumed")
      for args in ("LowLatencyDispatchArgs", "LowLatencyCombineArgs")),
    *(f"ll_{step}_kernel[NoArgs]" for step in ("stage", "post", "consumed")),  # a rejection receives nothing
}
ARCHS = ("sm_90", "sm_100")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): "
                                                      "no device build of csrc/cuda to check")


@pytest.fixture(scope="module", params=["sm_90", exhaustive("sm_100", id="sm_100")])  # the fast tier: sm_90
def compiled(request, tmp_path_factory) -> tuple[str, dict[str, dict[str, int]], dict[str, tuple[int, int]]]:
    """kernels.cu compiled once per architecture: (arch, ptxas report, launch bounds)."""
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): no device build of csrc/cuda to check")
    arch = request.param
    out = tmp_path_factory.mktemp(f"kernels_{arch}")
    # The build's device flags (CMakeLists.txt), for one real architecture; --keep leaves the PTX.
    cmd = [NVCC, "-std=c++20", "-O3", "--fmad=false", "--Werror=all-warnings", "-cubin", f"-arch={arch}",
           "-Xptxas", "-v", "--keep", "--keep-dir", str(out), "-o", str(out / "kernels.cubin"), str(KERNELS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (out / "ptxas.txt").write_text(log)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-4000:]}"
    ptx = "\n".join(p.read_text() for p in out.glob("*.ptx"))
    return arch, ptxas_report(log), launch_bounds(ptx)


@needs_nvcc
def test_every_kernel_is_compiled(compiled):
    arch, report, bounds = compiled
    assert set(report) == EXPECTED_KERNELS, f"{arch}: ptxas compiled {sorted(report)}"
    assert set(bounds) == EXPECTED_KERNELS, f"{arch}: the PTX has entries {sorted(bounds)}"


@needs_nvcc
def test_kernels_have_launch_bounds(compiled):
    arch, _, bounds = compiled
    missing = sorted(k for k, (threads, _) in bounds.items() if threads == 0)
    assert not missing, f"{arch}: kernels without __launch_bounds__: {missing}"


@needs_nvcc
def test_no_spills(compiled):
    arch, report, _ = compiled
    spilled = {k: v for k, v in report.items() if v.get("spill_stores", -1) != 0 or v.get("spill_loads", -1) != 0}
    assert not spilled, f"{arch}: kernels that spill registers (ptxas -v): {spilled}"


@needs_nvcc
def test_registers_within_launch_bounds(compiled):
    arch, report, bounds = compiled
    over = {}
    for kernel, (threads, min_blocks) in bounds.items():
        budget = min(MAX_REGISTERS, REGISTER_FILE // max(1, threads * min_blocks))
        used = report[kernel]["registers"]
        if used > budget:
            over[kernel] = f"{used} registers > {budget} ({threads} threads x {min_blocks} blocks)"
    assert not over, f"{arch}: {over}"


# ---------------------------------------------------------------------- the built module
def _cuda_module():
    if NVCC is None:
        pytest.skip("nvcc not found (PATH, /usr/local/cuda/bin): moe_comm._cuda is not expected")
    if "MOE_COMM_CUDA=OFF" in os.environ.get("CMAKE_ARGS", "").upper().replace(" ", ""):
        pytest.skip("CMAKE_ARGS builds with MOE_COMM_CUDA=OFF")
    try:
        from moe_comm import _cuda
    except ImportError as exc:
        pytest.fail(f"nvcc is at {NVCC}, but moe_comm._cuda did not import ({exc}): build with "
                    f"MOE_COMM_CUDA=AUTO (or ON): `pip install --no-build-isolation -e .`")
    return _cuda


@needs_nvcc
def test_module_imports_without_a_gpu():
    cuda = _cuda_module()
    assert cuda.device_count() >= 0  # 0 here without a driver or GPU, and no exception
    assert cuda.MAX_EMULATED_RANKS == 8


@needs_nvcc
def test_enums_match_the_host_build():
    from moe_comm import _cuda_host as host
    cuda = _cuda_module()
    for enum in ("WaitKind", "WaitOutcome", "DType"):
        ours, theirs = getattr(cuda, enum), getattr(host, enum)
        assert [(e.name, int(e.value)) for e in ours.__members__.values()] == \
            [(e.name, int(e.value)) for e in theirs.__members__.values()], enum


@pytest.mark.parametrize("R, C, L, slots, slot_bytes", [(1, 1, 1, 1, 1), (2, 4, 3, 128, 7169), (8, 10, 32, 256, 14358),
                                                        (4, 24, 8, 512, 100)])
@needs_nvcc
def test_normal_layout_matches_the_host_build(R, C, L, slots, slot_bytes):
    from moe_comm import _cuda_host as host
    cuda = _cuda_module()
    assert cuda.normal_bytes(R, C, L, slots, slot_bytes) == host.normal_bytes(R, C, L, slots, slot_bytes)
    assert cuda.dispatch_slot_bytes(slot_bytes, 56, 8) == host.dispatch_slot_bytes(slot_bytes, 56, 8)


@pytest.mark.parametrize("R, L, M, H", [(1, 1, 1, 128), (2, 6, 64, 256), (8, 32, 128, 7168), (3, 4, 37, 2048)])
@needs_nvcc
def test_low_latency_layout_matches_the_host_build(R, L, M, H):
    from moe_comm import _cuda_host as host
    cuda = _cuda_module()
    assert cuda.low_latency_bytes(R, L, M, H) == host.low_latency_bytes(R, L, M, H)


@pytest.mark.parametrize("Rn, NL, C, L, nvl_slots, nvl_slot, rdma_slots, rdma_slot",
                         [(2, 1, 1, 1, 2, 1, 2, 5), (2, 8, 10, 32, 288, 14358, 128, 14362),
                          (8, 8, 12, 4, 720, 7200, 128, 100), (3, 2, 4, 0, 4, 100, 4, 100)])
@needs_nvcc
def test_internode_layout_matches_the_host_build(Rn, NL, C, L, nvl_slots, nvl_slot, rdma_slots, rdma_slot):
    from moe_comm import _cuda_host as host
    cuda = _cuda_module()
    args = (Rn, NL, C, L, nvl_slots, nvl_slot, rdma_slots, rdma_slot)
    assert cuda.internode_bytes(*args) == host.internode_bytes(*args)
    assert (cuda.MAX_NODES, cuda.MAX_NODE_RANKS) == (host.MAX_NODES, host.MAX_NODE_RANKS)


@needs_nvcc
def test_constructors_need_a_gpu():
    """Without a device, building a launcher fails with the CUDA error instead of crashing."""
    cuda = _cuda_module()
    if cuda.device_count() > 0:
        pytest.skip("a GPU is present: the kernels' own checks run on it")
    with pytest.raises(RuntimeError, match="cuda"):
        cuda.Normal([0], [0], 0, 1.0, 1, 1, 1, 1, 16)
    with pytest.raises(RuntimeError, match="cuda"):
        cuda.LowLatency.emulated([0, 0], 1.0, 1, 1, 128)
    with pytest.raises(RuntimeError, match="cuda"):
        cuda.Internode.emulated([0, 0], [0, 0], 1, 1.0, 1, 1, 1, 1, 4, 64, 4, 64)


# ---------------------------------------------------------------------- emulated ranks on a GPU
# The device build against the host build on the same raw inputs: R ranks as threads of moe_comm._cuda_host
# (CPU tensors) and as the emulated ranks of one launch of moe_comm._cuda (one GPU). Outputs must be
# bitwise equal. The host half runs everywhere (so the harness stays in step with both interfaces).
TIMEOUT_S = 30.0


def _gpu_available() -> bool:
    try:
        import torch

        from moe_comm import _cuda
    except ImportError:
        return False
    return torch.cuda.is_available() and _cuda.device_count() > 0


needs_gpu = pytest.mark.skipif(not _gpu_available(), reason="needs a CUDA GPU and moe_comm._cuda")


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


class _Side:
    """Launches of one build: per-rank objects of _cuda_host (a thread per rank where ranks wait on each
    other), or one emulated object of _cuda serving every rank."""

    def __init__(self, name: str, R: int):
        import torch

        from moe_comm import _cuda_host
        self.name, self.R = name, R
        if name == "host":
            self.mod, self.device = _cuda_host, torch.device("cpu")
        else:
            from moe_comm import _cuda
            self.mod, self.device = _cuda, torch.device("cuda")

    def stream(self) -> int:
        import torch
        return torch.cuda.current_stream().cuda_stream

    def normal(self, bases, C, chunk, L, slots, slot_bytes):
        ptrs = [_ptr(b) for b in bases]
        if self.name == "host":
            return [self.mod.Normal(ptrs, [os.getpid()] * self.R, r, TIMEOUT_S, C, chunk, L, slots, slot_bytes)
                    for r in range(self.R)]
        return self.mod.Normal.emulated(ptrs, TIMEOUT_S, C, chunk, L, slots, slot_bytes)

    def low_latency(self, bases, L, M, H):
        ptrs = [_ptr(b) for b in bases]
        if self.name == "host":
            return [self.mod.LowLatency(ptrs, [os.getpid()] * self.R, r, TIMEOUT_S, L, M, H) for r in range(self.R)]
        return self.mod.LowLatency.emulated(ptrs, TIMEOUT_S, L, M, H)

    def launch(self, objs, method: str, args: list[tuple], parallel: bool = False, normal: bool = True) -> None:
        """Every rank's ``method(*args[r])``; asserts no launch reported an error."""
        if self.name == "host":
            results: list = [None] * self.R
            errors: list = []

            def one(r: int) -> None:
                try:
                    results[r] = getattr(objs[r], method)(*args[r])
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
            if parallel:
                import threading
                threads = [threading.Thread(target=one, args=(r,)) for r in range(self.R)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                for r in range(self.R):
                    one(r)
            if errors:
                raise errors[0]
            assert results == [None] * self.R, f"{method}: {results}"
            return
        # one launch: an argument equal on every rank passes as one value, the others as a list
        merged = [v[0] if all(x == v[0] for x in v) else list(v) for v in zip(*args)]
        out = getattr(objs, method)(*merged, self.stream())
        if not normal:  # low latency: enqueued; synchronise, then read the records
            self.mod.synchronize(self.stream())
            out = objs.check()
        assert out == [None] * self.R, f"{method}: {out}"


def _routing(R: int, L: int, T: int, K: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    E = R * L
    topk = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    for r in range(R):
        topk[r][r % T, 0] = -1  # a dropped slot
    return g, topk


def _normal(side_name: str, R=3, C=2, L=2, H=256, T=40, K=3, chunk=4, slots=16):
    """notify -> dispatch -> prologue -> combine of R ranks; every output, per rank, on the CPU."""
    import torch
    side = _Side(side_name, R)
    mod, dev = side.mod, side.device
    g, topks = _routing(R, L, T, K, 11)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    ws = [torch.rand(T, K, generator=g) for _ in range(R)]
    E, per = R * L, max(-(-T // C), 1)
    ins = []
    for r in range(R):
        topk = topks[r]
        in_rank = torch.zeros(T, R, dtype=torch.uint8)
        for k in range(K):
            ok = topk[:, k] >= 0
            in_rank[ok.nonzero()[:, 0], topk[ok, k] // L] = 1
        chan = torch.zeros(R, C, dtype=torch.int64)
        for t, d in in_rank.nonzero().tolist():
            chan[d, t // per] += 1
        send_pos = torch.where(in_rank.bool(), in_rank.to(torch.int64).cumsum(0) - 1, -1).to(torch.int32)
        ins.append(dict(x=xs[r], topk=topk, w=ws[r], in_rank=in_rank, rows=in_rank.sum(0).to(torch.int64),
                        per_expert=torch.bincount(topk[topk >= 0], minlength=E).to(torch.int64),
                        chan=chan.cumsum(1).contiguous(), send_pos=send_pos))
    ins = [{k: v.to(dev) for k, v in i.items()} for i in ins]
    slot_d = mod.dispatch_slot_bytes(2 * H, 0, K)
    slot_c = 2 * H + 4 * K
    nbytes = max(mod.normal_bytes(R, C, L, slots, slot_d), mod.normal_bytes(R, C, L, slots, slot_c))
    bases = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(R)]
    nd, nc = side.normal(bases, C, chunk, L, slots, slot_d), side.normal(bases, C, chunk, L, slots, slot_c)

    z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
    notes = [dict(rank_prefix=z(R, R, dtype=torch.int32), recv_offset=z(R), chan_starts=z(R, C), chan_counts=z(R, C),
                  per_expert=z(L), num_recv=z(1)) for _ in range(R)]
    side.launch(nd, "notify", [(1, _ptr(i["rows"]), _ptr(i["per_expert"]), _ptr(i["chan"]), 1,
                                _ptr(n["rank_prefix"]), _ptr(n["recv_offset"]), _ptr(n["chan_starts"]),
                                _ptr(n["chan_counts"]), _ptr(n["per_expert"]), _ptr(n["num_recv"]))
                               for i, n in zip(ins, notes)], parallel=True)
    outs = []
    for n in notes:
        N = int(n["num_recv"].item())
        outs.append(dict(recv_x=z(N, H, dtype=torch.bfloat16), recv_idx=z(N, K), recv_w=z(N, K, dtype=torch.float32),
                         recv_src=z(N, dtype=torch.int32), out=z(T, H, dtype=torch.bfloat16),
                         out_w=z(T, K, dtype=torch.float32)))
    side.launch(nd, "dispatch", [(T, 2 * H, 0, K, _ptr(i["x"]), 0, _ptr(i["topk"]), _ptr(i["w"]), _ptr(i["in_rank"]),
                                  _ptr(i["chan"]), _ptr(n["recv_offset"]), _ptr(n["chan_starts"]),
                                  _ptr(n["chan_counts"]), _ptr(o["recv_x"]), 0, _ptr(o["recv_idx"]),
                                  _ptr(o["recv_w"]), _ptr(o["recv_src"]))
                                 for i, n, o in zip(ins, notes, outs)], parallel=True)
    side.launch(nc, "prologue", [(2,)] * R, parallel=True)
    side.launch(nc, "combine", [(T, H, 2 * H, K, mod.DType.BFLOAT16, _ptr(o["recv_x"]), _ptr(o["recv_w"]),
                                 _ptr(n["recv_offset"]), _ptr(n["chan_starts"]), _ptr(n["chan_counts"]),
                                 _ptr(i["in_rank"]), _ptr(i["chan"]), _ptr(i["send_pos"]), 0, 0, _ptr(o["out"]),
                                 _ptr(o["out_w"]))
                                for i, n, o in zip(ins, notes, outs)], parallel=True)
    return [{k: v.cpu() for k, v in {**n, **o}.items()} for n, o in zip(notes, outs)], [
        {k: v.cpu() for k, v in i.items()} for i in ins]


def _layout(side_name: str, R=3, L=2, T=300, K=4):
    """The layout kernel of R ranks (one id out of range); its outputs, per rank, on the CPU."""
    import torch
    side = _Side(side_name, R)
    dev = side.device
    _, topks = _routing(R, L, T, K, 13)
    topks[1][5, 2] = R * L  # out of range: flagged in bad
    topks = [t.to(dev) for t in topks]
    outs = [dict(per_rank=torch.zeros(R, dtype=torch.int64, device=dev),
                 per_expert=torch.zeros(R * L, dtype=torch.int64, device=dev),
                 in_rank=torch.zeros(T, R, dtype=torch.uint8, device=dev),
                 bad=torch.zeros(1, dtype=torch.int64, device=dev)) for _ in range(R)]
    args = [(T, K, R, R * L, _ptr(t), _ptr(o["per_rank"]), _ptr(o["per_expert"]), _ptr(o["in_rank"]), _ptr(o["bad"]))
            for t, o in zip(topks, outs)]
    if side_name == "host":
        for a in args:
            assert side.mod.layout(*a) is None
    else:
        side.mod.layout(*[v[0] if all(x == v[0] for x in v) else list(v) for v in zip(*args)], side.stream())
        side.mod.synchronize(side.stream())
    return [{k: v.cpu() for k, v in o.items()} for o in outs]


# the dispatch's cast, per format; "_logfmt": the combine's rows travel LogFMT-10 encoded
_LL_FORMATS = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8_ue8m0": (True, True, True),
               "bf16_logfmt": (False, False, False)}


def _low_latency(side_name: str, fmt: str, R=3, L=2, M=8, H=256, T=7, K=3):
    """dispatch (send, receive) -> combine (send, receive) of R ranks; every output, per rank, on the CPU."""
    import torch
    side = _Side(side_name, R)
    mod, dev = side.mod, side.device
    fp8, round_scale, ue8m0 = _LL_FORMATS[fmt]
    g, topks = _routing(R, L, T, K, 12)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(R)]
    ws = [torch.rand(T, K, generator=g).to(dev) for _ in range(R)]
    ys = [torch.randn(L, R * M, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(R)]
    topks = [t.to(dev) for t in topks]
    groups = H // 128
    num_scales = (groups // 4 if ue8m0 else groups) if fp8 else 0
    nbytes = mod.low_latency_bytes(R, L, M, H)
    bases = [torch.zeros(nbytes, dtype=torch.uint8, device=dev) for _ in range(R)]
    skip = [torch.zeros(R, dtype=torch.uint8, device=dev) for _ in range(R)]
    u8 = lambda n: torch.zeros(n, dtype=torch.uint8, device=dev)  # noqa: E731
    outs = [dict(recv_x=u8(L * R * M * (H if fp8 else 2 * H)), recv_scales=u8(L * num_scales * R * M * 4),
                 src_info=torch.zeros(L, R * M, dtype=torch.int32, device=dev),
                 layout_range=torch.zeros(L, R, dtype=torch.int64, device=dev),
                 recv_count=torch.zeros(L, dtype=torch.int32, device=dev),
                 out=torch.zeros(T, H, dtype=torch.bfloat16, device=dev)) for _ in range(R)]
    obj = side.low_latency(bases, L, M, H)
    for receive in (False, True):
        side.launch(obj, "dispatch", [(receive, 1, _ptr(skip[r]), T, 4 * num_scales, K, fp8, round_scale, ue8m0,
                                       _ptr(xs[r]), _ptr(topks[r]), _ptr(o["recv_x"]),
                                       _ptr(o["recv_scales"]) if fp8 else 0, _ptr(o["src_info"]),
                                       _ptr(o["layout_range"]), _ptr(o["recv_count"]))
                                      for r, o in enumerate(outs)], normal=False)
    for receive in (False, True):
        side.launch(obj, "combine", [(receive, 2, _ptr(skip[r]), T, K, _ptr(ys[r]), _ptr(o["src_info"]),
                                      _ptr(o["layout_range"]), _ptr(topks[r]), _ptr(ws[r]), _ptr(o["out"]),
                                      fmt.endswith("_logfmt"))
                                     for r, o in enumerate(outs)], normal=False)
    return [{k: v.cpu() for k, v in o.items()} for o in outs], [t.cpu() for t in topks]


def _assert_same(host: list[dict], device: list[dict]) -> None:
    import torch
    for r, (h, d) in enumerate(zip(host, device)):
        for k in h:
            a, b = h[k], d[k]
            if a.dtype == torch.bfloat16:
                a, b = a.view(torch.int16), b.view(torch.int16)
            assert a.shape == b.shape and torch.equal(a, b), f"rank {r}: {k} differs between _cuda_host and _cuda"


def test_emulation_harness_on_the_host_build():
    """The host half of the GPU comparison: the harness drives _cuda_host to sane results."""
    import torch
    R = 3
    outs, ins = _normal("host", R=R)
    for r in range(R):
        sent = torch.stack([i["rows"] for i in ins])  # [source][dest]
        assert torch.equal(outs[r]["rank_prefix"], sent.cumsum(0).to(torch.int32))
        assert int(outs[r]["num_recv"]) == int(sent[:, r].sum())
        weights = outs[r]["out_w"]
        assert torch.isfinite(weights).all() and (weights != 0).any()
    lay = _layout("host", R=R)
    assert [int(o["bad"]) for o in lay] == [0, 1, 0]
    assert all(int(o["per_rank"].sum()) == int(o["in_rank"].sum()) for o in lay)
    for fmt in _LL_FORMATS:
        outs_ll, topks = _low_latency("host", fmt, R=R)
        L = outs_ll[0]["recv_count"].numel()
        for r in range(R):
            mine = sum(int(((t >= r * L) & (t < (r + 1) * L)).sum()) for t in topks)
            assert int(outs_ll[r]["recv_count"].sum()) == mine, fmt


@needs_gpu
def test_emulated_layout_matches_the_host_build():
    _assert_same(_layout("host"), _layout("device"))


@needs_gpu
def test_emulated_normal_mode_matches_the_host_build():
    _assert_same(_normal("host")[0], _normal("device")[0])


@needs_gpu
@pytest.mark.parametrize("fmt", list(_LL_FORMATS))
def test_emulated_low_latency_matches_the_host_build(fmt):
    _assert_same(_low_latency("host", fmt)[0], _low_latency("device", fmt)[0])


# ---------------------------------------------------------------------- emulated ranks at R = 2, 4, 8 (GPU)
# The same comparison at every emulated rank count up to a node's 8 (MAX_EMULATED_RANKS): normal mode in bf16
# (the harness above) and in FP8 (e4m3 codes + fp32 scales, then a bf16 combine: tools/gpu_check/harness.py,
# the harness of tools/gpu_check.sh), low latency in bf16, FP8 and FP8 with UE8M0 scales at hidden 512
# (4 groups of 128, so the packed UE8M0 scales are one int32, not none).
EMULATED_RANKS = (2, 4, 8)


def _gpu_check_harness():
    import importlib.util
    import sys
    path = ROOT / "tools" / "gpu_check" / "harness.py"
    name = "moe_comm_gpu_check_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@needs_gpu
@pytest.mark.parametrize("R", EMULATED_RANKS)
def test_emulated_normal_mode_bf16_matches_the_host_build_at(R):
    _assert_same(_normal("host", R=R)[0], _normal("device", R=R)[0])


@needs_gpu
@pytest.mark.parametrize("R", EMULATED_RANKS)
def test_emulated_normal_mode_fp8_matches_the_host_build_at(R):
    h = _gpu_check_harness()
    shape = h.NormalShape(R=R, fp8=True)
    ins = h.normal_inputs(shape)
    ref = h.NormalCase(h.HostSide(R, TIMEOUT_S), shape, ins).run()
    assert not h.sanity(ins, ref, shape)
    got = h.NormalCase(h.EmulatedSide(R, TIMEOUT_S), shape, ins).run()
    bad = h.compare(ref, got)
    assert not bad, "\n".join(bad)


@needs_gpu
@pytest.mark.parametrize("fmt", list(_LL_FORMATS))
@pytest.mark.parametrize("R", EMULATED_RANKS)
def test_emulated_low_latency_matches_the_host_build_at(R, fmt):
    _assert_same(_low_latency("host", fmt, R=R, H=512)[0], _low_latency("device", fmt, R=R, H=512)[0])


def test_emulated_cases_cover_every_rank_count_and_format():
    """The GPU cases above span R = 2..8 emulated ranks, normal bf16 + FP8 and every low-latency format
    (what tools/gpu_check.sh's pytest step is for); and the FP8 harness runs on the host build here."""
    assert max(EMULATED_RANKS) == 8 and min(EMULATED_RANKS) == 2
    assert set(_LL_FORMATS) == {"bf16", "fp8", "fp8_ue8m0", "bf16_logfmt"}
    h = _gpu_check_harness()
    shape = h.NormalShape(R=2, fp8=True)
    ins = h.normal_inputs(shape)
    ref = h.NormalCase(h.HostSide(2, TIMEOUT_S), shape, ins).run()
    assert not h.sanity(ins, ref, shape)
    assert all(o["recv_scales"].shape[1] == shape.H // 128 and (o["recv_scales"] != 0).any() for o in ref.values())


# ---------------------------------------------------------------------- across nodes (emulated)
# The internode kernels (csrc/cuda/kernels/internode.h) of moe_comm._cuda, every rank of 2..4 emulated
# nodes in each launch (RDMA rings over DirectLink, forwarders, node rings), against _cuda_host's threads.
INTERNODE_SPLITS = ((2, 1), (2, 2), (2, 4), (4, 2))


def _internode(side, R: int, node_ranks: int, fp8: bool):
    h = _gpu_check_harness()
    shape = h.InternodeShape(R=R, node_ranks=node_ranks, fp8=fp8, slots=8, chunk=3, combine_chunk=2, rdma_slots=4,
                             rdma_chunk=2)
    ins = h.internode_inputs(shape)
    return h, shape, ins, h.InternodeCase(side, shape, ins).run()


@pytest.mark.parametrize("fp8", [False, True])
def test_internode_harness_on_the_host_build(fp8):
    """The host half of the GPU comparison across nodes (runs everywhere): the harness drives _cuda_host's
    Internode to results with DeepEP's meaning (rows by source rank and token, the forwarders' counts,
    the two-level combine sum)."""
    h = _gpu_check_harness()
    h_, shape, ins, ref = _internode(h.HostSide(6, TIMEOUT_S), 6, 3, fp8)
    bad = h.sanity(ins, ref, shape)
    assert not bad, "\n".join(bad)


@needs_gpu
@pytest.mark.parametrize("nodes,node_ranks", INTERNODE_SPLITS)
@pytest.mark.parametrize("fp8", [False, True])
def test_emulated_internode_matches_the_host_build_at(nodes, node_ranks, fp8):
    h = _gpu_check_harness()
    R = nodes * node_ranks
    _, _, _, ref = _internode(h.HostSide(R, TIMEOUT_S), R, node_ranks, fp8)
    _, _, _, got = _internode(h.EmulatedSide(R, TIMEOUT_S), R, node_ranks, fp8)
    bad = h.compare(ref, got)
    assert not bad, "\n".join(bad)
