"""The SASS lint (tools/sass_lint): the flag operations of the CUDA kernels compile, for sm_90 and
sm_100, to system-scope strong stores after a system fence (publishes) and system-scope strong acquire
loads in every spin loop (waits); and the lint finds the bugs planted in them.

Needs nvcc and nvdisasm (the `nvidia-cuda-nvdisasm` wheel; cuobjdump, which runs nvdisasm, is used
when it is there too); no GPU. Each (arch, variant) is compiled once per module.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT
from helpers.tiers import exhaustive

_spec = importlib.util.spec_from_file_location("sass_lint", ROOT / "tools" / "sass_lint" / "lint.py")
lint = importlib.util.module_from_spec(_spec)
sys.modules["sass_lint"] = lint  # dataclasses resolve their module by name
_spec.loader.exec_module(lint)

NVCC = lint.find_nvcc()
DISASM = lint.find_disassembler()

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda*/bin)"),
    pytest.mark.skipif(DISASM is None, reason="nvdisasm not found (PATH, /usr/local/cuda*/bin, site-packages "
                                              "nvidia/*/bin): pip install nvidia-cuda-nvdisasm"),
]

ARCHS = ("sm_90", "sm_100")
PLANT = "MOE_COMM_PLANT_RELAXED_TAIL"
PUBLISHES = sorted(n for n, s in lint.PROBES.items() if s.publish)
WAITS = sorted(n for n, s in lint.PROBES.items() if s.wait)


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    """(arch, defines) -> disassembly, compiled on first use."""
    out = tmp_path_factory.mktemp("sass_lint")
    cache: dict = {}

    def get(arch: str, defines: tuple = (), include: Path = ROOT / "csrc") -> str:
        key = (arch, defines, str(include))
        if key not in cache:
            d = out / f"v{len(cache)}"
            d.mkdir()
            cache[key] = lint.disassemble(lint.compile_probe(arch, d, defines, NVCC, include=include), DISASM)
        return cache[key]
    return get


def _by_probe(results):
    return {r.probe: r for r in results}


@pytest.mark.parametrize("arch", ARCHS)
def test_real_headers_pass(sass, arch):
    results = lint.check_sass(sass(arch), arch)
    report = lint.format_report(results)
    assert {r.probe for r in results} == set(lint.PROBES), report
    assert all(r.ok for r in results), report
    for r in results:  # every probe showed what it checks
        spec = lint.PROBES[r.probe]
        assert not spec.publish or any(o.startswith("publish:") for o in r.observed), report
        assert not spec.wait or any(o.startswith("wait:") for o in r.observed), report


@pytest.mark.parametrize("arch", ARCHS)
def test_planted_relaxed_tail_is_found(sass, arch):
    results = _by_probe(lint.check_sass(sass(arch, (PLANT,)), arch))
    report = lint.format_report(list(results.values()))
    bad = results["probe_ring_publish_tail"]
    assert not bad.ok, report
    assert any("fence" in v.message and any("STRONG.SYS" in line for line in v.lines) for v in bad.violations), report
    assert all(r.ok for name, r in results.items() if name != "probe_ring_publish_tail"), report


# The platform's flag operations, mutated in a copy of csrc: each must fail every probe of its kind.
MUTATIONS = {
    "release store -> relaxed": ("st.release.sys.global.s64", "st.relaxed.sys.global.s64", PUBLISHES),
    "release store -> gpu scope": ("st.release.sys.global.s64", "st.release.gpu.global.s64", PUBLISHES),
    "release store -> weak": ("st.release.sys.global.s64", "st.global.s64", PUBLISHES),
    "acquire load -> relaxed": ("ld.acquire.sys.global.s64", "ld.relaxed.sys.global.s64", WAITS),
    "acquire load -> gpu scope": ("ld.acquire.sys.global.s64", "ld.acquire.gpu.global.s64", WAITS),
    "acquire load -> non-coherent": ("ld.acquire.sys.global.s64", "ld.global.nc.s64", WAITS),
}


@pytest.fixture(scope="module")
def mutated(tmp_path_factory):
    """mutation -> the disassembly (sm_90) of the probes built on a copy of csrc with that mutation."""
    cache: dict = {}

    def get(name: str, sass) -> str:
        if name not in cache:
            old, new, _ = MUTATIONS[name]
            csrc = tmp_path_factory.mktemp("mutation") / "csrc"
            for part in ("common", "cuda/platform", "cuda/protocol", "cuda/kernels"):  # what probe.cu includes
                shutil.copytree(ROOT / "csrc" / part, csrc / part)
            device = csrc / "cuda" / "platform" / "device.cuh"
            text = device.read_text()
            assert old in text, f"{old!r} is no longer in {device.name}: update MUTATIONS"
            device.write_text(text.replace(old, new))
            cache[name] = sass("sm_90", (), csrc)
        return cache[name]
    return get


# the fast tier plants one mutation of each kind (a publish, a wait); each costs a build of the probes
@pytest.mark.parametrize("mutation", [m if m in ("release store -> relaxed", "acquire load -> gpu scope")
                                      else exhaustive(m, id=m) for m in MUTATIONS])
def test_mutated_platform_is_found(sass, mutated, mutation):
    results = lint.check_sass(mutated(mutation, sass), "sm_90")
    report = lint.format_report(results)
    assert sorted(r.probe for r in results if not r.ok) == MUTATIONS[mutation][2], report


def test_nc_load_in_spin_loop_is_reported(sass, mutated):
    results = _by_probe(lint.check_sass(mutated("acquire load -> non-coherent", sass), "sm_90"))
    for name in WAITS:
        nc = [v for v in results[name].violations if "non-coherent" in v.message]
        assert nc and all(".CONSTANT" in line or ".NC" in line for line in nc[0].lines), \
            lint.format_report([results[name]])


def test_cli_exit_status(capsys):
    assert lint.main(["--arch", "sm_90"]) == 0
    assert "probe_ring_publish_tail" in capsys.readouterr().out
    assert lint.main(["--arch", "sm_90", "-D", PLANT]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION sm_90 probe_ring_publish_tail" in out and "STG.E.64.STRONG.SYS" in out
