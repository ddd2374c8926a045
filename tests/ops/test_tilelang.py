"""The TileLang programs' own parts, on their CPU build: the integer float codec against torch's casts
for every code, how ``impl="tilelang"`` is chosen and refused, and run-to-run bit identity.
(Every op against its reference: ``test_fused_ops.py``'s ``cpu-tilelang`` cases; the CUDA build:
``test_tilelang_compile.py``.) No ``from __future__ import annotations``: TileLang reads a ``T.prim_func``'s
annotations as objects."""

import os
import subprocess
import sys

import pytest
import torch

tilelang = pytest.importorskip("tilelang", reason="tilelang does not import: install moe-comm[tilelang]")

from moe_comm import ops  # noqa: E402
from moe_comm.accuracy.suite import CASES  # noqa: E402
from moe_comm.ops.fp8 import GROUP  # noqa: E402
from moe_comm.ops.impl import TILELANG_OPS, TILELANG_RANGE  # noqa: E402
from moe_comm.ops.tilelang import build, codec, grouped_gemm, rows  # noqa: E402

from helpers.bit_checks import assert_same_bits_or_both_nan  # noqa: E402

FORMATS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e4m3": torch.float8_e4m3fn,
           "float8_e5m2": torch.float8_e5m2}


def _roundtrip_program(d, dtype: str):
    import tilelang.language as T
    n = T.dynamic("n")
    storage = codec.FORMATS[dtype].storage

    @T.prim_func
    def roundtrip(x: T.Tensor((n,), "float32"), q: T.Tensor((n,), storage), y: T.Tensor((n,), "float32")):
        with d.kernel(T.ceildiv(n, 256)) as b:
            for i in T.serial(256):
                if b * 256 + i < n:
                    q[b * 256 + i] = codec.encode(x[b * 256 + i], dtype)
                    y[b * 256 + i] = codec.decode(q[b * 256 + i], dtype)

    return roundtrip


@pytest.mark.parametrize("dtype", sorted(FORMATS))
def test_codec_matches_torch_for_every_code(dtype):
    """decode is exact for every code; encode rounds like torch's cast: every representable value, every
    midpoint between neighbours (ties to even), values beyond both ends, zeros, NaN and infinities."""
    torch_dtype = FORMATS[dtype]
    width = torch_dtype.itemsize * 8
    storage = {8: torch.uint8, 16: torch.uint16}[width]
    codes = torch.arange(1 << width, dtype=torch.int64).to({8: torch.uint8, 16: torch.int16}[width])
    values = codes.view(torch_dtype).float()
    finite = values[values.isfinite()].unique()
    top = torch.finfo(torch_dtype).max
    x = torch.cat([values, (finite[:-1] + finite[1:]) / 2, torch.tensor([0.0, -0.0, float("nan"), float("inf"),
                                                                          -float("inf"), 1e-30, -1e-30])])
    if torch_dtype is torch.float8_e4m3fn:  # no infinities: saturating, as CUDA's satfinite cast
        x = torch.cat([x[x.isnan() | (x.abs() <= top)], torch.tensor([top * 1.5, -top * 1.5])])
        want = torch.where(x.isnan(), x, x.clamp(-top, top)).to(torch_dtype)
    else:
        x = torch.cat([x, torch.tensor([top * 1.5, -top * 1.5])])
        want = x.to(torch_dtype)
    kernel = build.cpu_kernel(_roundtrip_program, dtype)
    q, y = torch.empty(x.numel(), dtype=storage), torch.empty(x.numel())
    kernel(x, q, y)
    assert_same_bits_or_both_nan(q.view(torch_dtype), want, f"encode {dtype}")
    assert_same_bits_or_both_nan(y, want.float(), f"decode {dtype}")


def test_constants_match_the_ops():
    assert rows.GROUP == grouped_gemm.SCALE_BLOCK == GROUP


def test_the_extra_admits_the_tested_range():
    """pyproject's ``tilelang`` extra and ``TILELANG_RANGE`` (what moe-comm accepts at run time) agree."""
    import re
    from helpers.paths import ROOT
    extra = re.search(r'^tilelang = \["tilelang>=([\d.]+),<([\d.]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    low, high = ((tuple(int(p) for p in v.split(".")) + (0, 0))[:3] for v in extra.groups())
    assert (low, high) == TILELANG_RANGE


def test_every_op_with_a_program_takes_tilelang():
    assert set(TILELANG_OPS) <= set(ops.__all__)


def test_refusals_name_the_reason(monkeypatch):
    x = torch.randn(4, 256).bfloat16()
    idx = torch.tensor([[0, 1], [1, -1], [0, 0], [1, 1]])
    with pytest.raises(ValueError, match=r"dispatch_layout: impl 'tilelang' has no program for this op; it has one "
                                         r"for \['permute'"):
        ops.dispatch_layout(idx, 2, 2, impl="tilelang")
    with pytest.raises(ValueError, match="permute: impl 'tilelang' has no int8 program"):
        ops.permute(x, idx, 2, quant="int8", impl="tilelang")
    with pytest.raises(ValueError, match="dequantize: impl 'tilelang' has no int8 program"):
        ops.dequantize(torch.zeros(4, 256, dtype=torch.int8), torch.ones(4), impl="tilelang")
    # A dtype without a program is refused whatever the number of rows (an empty call too).
    for tokens in (4, 0):
        with pytest.raises(ValueError, match=r"unpermute_reduce: impl 'tilelang' takes \[.*got torch.float64"):
            ops.unpermute_reduce(x[:tokens], idx[:tokens].clamp(min=0), torch.ones(tokens, 2),
                                 out_dtype=torch.float64, impl="tilelang")
        q, s = ops.quantize(x[:tokens], "e4m3")
        with pytest.raises(ValueError, match=r"dequantize: impl 'tilelang' takes \[.*got torch.float64"):
            ops.dequantize(q, s, torch.float64, impl="tilelang")
    # The variable picks TileLang where it has a program and the native op elsewhere.
    monkeypatch.setenv("MOE_COMM_OPS_IMPL", "tilelang")
    assert ops.resolve("dispatch_layout", x.device, None) == "native"
    assert ops.resolve("grouped_gemm", x.device, None) == "tilelang"
    assert torch.equal(ops.dispatch_layout(idx, 2, 2).num_tokens_per_rank, torch.tensor([2, 3], dtype=torch.int32))


def test_without_tilelang_the_error_names_the_extra():
    code = ("import sys; sys.modules['tilelang'] = None\n"
            "import torch\nfrom moe_comm import ops\n"
            "try:\n    ops.quantize(torch.ones(2, 128), impl='tilelang')\n"
            "except ValueError as exc:\n    print(exc)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MOE_COMM_OPS_IMPL": ""})
    assert "quantize: impl 'tilelang' cannot run on cpu tensors: tilelang does not import" in child.stdout, \
        child.stdout + child.stderr
    assert "pip install moe-comm[tilelang]" in child.stdout


def test_same_bits_run_after_run():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 256, generator=g).bfloat16()
    idx = torch.randint(-1, 4, (70, 2), generator=g)
    w13 = (torch.randn(4, 256, 256, generator=g) / 16).bfloat16()
    w2 = (torch.randn(4, 256, 128, generator=g) / 16).bfloat16()
    weights = torch.rand(70, 2, generator=g)

    def layer():
        perm = ops.permute(x, idx, 4, impl="tilelang")
        y = ops.expert_ffn(perm.x, w13, w2, expert_offsets=perm.expert_offsets, impl="tilelang")
        return ops.unpermute_reduce(y, perm.row_of, weights, impl="tilelang")

    first = layer()
    assert torch.equal(first.view(torch.int16), layer().view(torch.int16))
    assert first.abs().sum() > 0


def test_accuracy_cli_picks_implementations(tmp_path):
    """``python -m moe_comm.accuracy --impl native tilelang``: rows of those two only, TileLang's included,
    every one passing; ``--impl native`` never imports TileLang."""
    import json
    rows_path = tmp_path / "rows.json"
    child = subprocess.run([sys.executable, "-m", "moe_comm.accuracy", "--impl", "native", "tilelang", "--json",
                            str(rows_path)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    rows = json.loads(rows_path.read_text())
    assert {r["impl"] for r in rows} == {"native", "tilelang"} and all(r["passed"] for r in rows)
    assert {r["op"] for r in rows if r["impl"] == "tilelang"} == set(CASES) & set(TILELANG_OPS)
    code = ("import sys\nfrom moe_comm.accuracy.suite import main\nmain(['--impl', 'native'])\n"
            "assert 'tilelang' not in sys.modules, 'imported TileLang'\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0 and "cpu/native" in child.stdout, child.stdout[-2000:] + child.stderr[-2000:]
