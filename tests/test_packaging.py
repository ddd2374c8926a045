"""What ``pip install .`` (build isolation on) and ``pip install moe-comm`` from an sdist need, checked
statically and fast (no compiler, no network): the CMake and scikit-build-core minimums, what the sdist
holds (scikit-build-core packs it in-process, under a second), the NVSHMEM switch and the extras as
docs/install.md documents them, and the reasons ``moe_comm.build_info()`` gives for the modules this
build lacks. tools/install_check.sh (make test-all) runs the builds themselves."""
from __future__ import annotations

import importlib.util
import os
import re
import tarfile

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import moe_comm
from moe_comm.core import native

from helpers.paths import ROOT

try:
    import tomllib
except ImportError:  # Python < 3.11: scikit-build-core's own dependency
    import tomli as tomllib  # type: ignore[no-redef]

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CMAKELISTS = (ROOT / "CMakeLists.txt").read_text()
INSTALL_MD = (ROOT / "docs" / "install.md").read_text()

#: The first CMake that configures moe_comm._cuda (CUDA_STANDARD 20) with nvcc 12+: 3.25.2 added nvcc's
#: -std=c++20 (Modules/Compiler/NVIDIA-CUDA.cmake); Debian 12's 3.25.1 and PyPI's 3.25.0 fail with "Target
#: "_cuda" requires the language dialect "CUDA20" ... CMake does not know the flags to enable it" (with
#: nvcc 13.0, 2026-12-04), 3.25.2 configures and builds every module (docs/install.md).
MIN_CMAKE = Version("3.25.2")
#: The CMake releases below it that are on PyPI or in Debian 12, which the requirement must refuse.
TOO_OLD_CMAKE = ("3.18", "3.24.3", "3.25.0", "3.25.1")
#: The scikit-build-core release that introduced a setting pyproject.toml uses (its changelog): the
#: build-system minimum must be at least the newest of those used. An older one ignores build.requires
#: without a word (0.10.7 does): the NVSHMEM switch would then fail in CMake instead of fetching the wheel.
SKBUILD_SETTINGS_SINCE = {"cmake.version": Version("0.8"), "build.requires": Version("0.11")}
#: Settings older than all of those (a setting in neither table fails the test until it is added).
SKBUILD_OLD_SETTINGS = {"build-dir", "wheel", "wheel.packages", "overrides", "cmake", "cmake.define", "build"}
#: Optional modules, as build_info() names them.
OPTIONAL_PARTS = ("cuda", "cuda_nvshmem")


def _skbuild() -> dict:
    return PYPROJECT["tool"]["scikit-build"]


def _overrides() -> list[dict]:
    return _skbuild().get("overrides", [])


def _build_requires() -> dict[str, Requirement]:
    return {Requirement(r).name: Requirement(r) for r in PYPROJECT["build-system"]["requires"]}


def _minimum(spec: SpecifierSet) -> Version | None:
    """The lowest version ``spec`` admits by a >= or == clause, or None (no lower bound)."""
    lows = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


def _settings_used() -> set[str]:
    """The dotted names of pyproject's [tool.scikit-build] settings (overrides' included)."""
    def walk(table: dict, prefix: str = "") -> set[str]:
        names = set()
        for key, value in table.items():
            name = f"{prefix}{key}"
            names.add(name)
            if isinstance(value, dict) and key not in ("define",):
                names |= walk(value, f"{name}.")
        return names
    used = walk({k: v for k, v in _skbuild().items() if k != "overrides"})
    for override in _overrides():
        used |= {"overrides"} | walk({k: v for k, v in override.items() if k != "if"})
    return used


# ---------------------------------------------------------------------------------------- CMake
def test_cmake_version_requirement_refuses_the_cmakes_that_cannot_configure_cuda20():
    spec = SpecifierSet(_skbuild()["cmake"]["version"])
    admitted = [v for v in TOO_OLD_CMAKE if spec.contains(v)]
    assert not admitted, (f"pyproject.toml's cmake.version {str(spec)!r} admits CMake {admitted}, which cannot "
                          f"configure CUDA_STANDARD 20 with nvcc 12+ (needs >= {MIN_CMAKE})")
    assert _minimum(spec) is not None and _minimum(spec) >= MIN_CMAKE, spec


def test_cmake_minimum_required_is_at_least_the_cuda20_minimum():
    found = re.search(r"^cmake_minimum_required\(VERSION ([0-9.]+)", CMAKELISTS, re.M)
    assert found, "CMakeLists.txt has no cmake_minimum_required(VERSION ...)"
    assert Version(found.group(1)) >= MIN_CMAKE, \
        f"CMakeLists.txt's cmake_minimum_required is {found.group(1)}, below {MIN_CMAKE} (CUDA_STANDARD 20 with nvcc)"


# ------------------------------------------------------------------------------- build-system
def test_build_requires_pybind11_and_a_scikit_build_core_with_the_settings_used():
    requires = _build_requires()
    assert "pybind11" in requires, f"build-system.requires lacks pybind11: {list(requires)}"
    assert PYPROJECT["build-system"]["build-backend"] == "scikit_build_core.build"
    assert "scikit-build-core" in requires, f"build-system.requires lacks scikit-build-core: {list(requires)}"
    used = _settings_used()
    unknown = sorted(used - set(SKBUILD_SETTINGS_SINCE) - SKBUILD_OLD_SETTINGS)
    assert not unknown, f"settings without a known first scikit-build-core release (add them here): {unknown}"
    needed = max(since for name, since in SKBUILD_SETTINGS_SINCE.items() if name in used)
    minimum = _minimum(requires["scikit-build-core"].specifier)
    assert minimum is not None and minimum >= needed, \
        f"build-system.requires has {requires['scikit-build-core']}; the settings used need >= {needed}"


def test_build_requires_no_torch():
    """The extensions do not link libtorch: an isolated build must not fetch a (multi-GB) torch."""
    names = set(_build_requires()) | {Requirement(r).name for o in _overrides() for r in o.get("build", {}).get("requires", [])}
    assert not names & {"torch", "pytorch"}, names


# ------------------------------------------------------------------------------------ sdist
@pytest.fixture(scope="module")
def sdist_members(tmp_path_factory) -> set[str]:
    """The files of the sdist scikit-build-core makes of this tree (its PEP 517 hook, in-process: no
    isolated environment, no compiler), without the leading moe_comm-VERSION/."""
    build = pytest.importorskip("scikit_build_core.build")
    out = tmp_path_factory.mktemp("sdist")
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)  # the hook packs the current directory
        name = build.build_sdist(str(out))
    finally:
        os.chdir(cwd)
    with tarfile.open(out / name) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}


def test_sdist_holds_what_the_build_needs(sdist_members):
    needed = {"pyproject.toml", "CMakeLists.txt", PYPROJECT["project"]["readme"]}
    needed |= set(re.findall(r"(?<![\w/])(csrc/[\w/.-]+\.(?:cpp|cu|py))\b", CMAKELISTS))  # the sources CMake names
    needed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".h", ".cuh", ".hpp", ".cpp", ".cu", ".py")}
    needed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "moe_comm").rglob("*.py")}
    assert len(needed) > 100, "found too few sources to check"
    missing = sorted(needed - sdist_members)
    assert not missing, f"the sdist would lack {len(missing)} files the build needs: {missing[:20]}"


def test_sdist_holds_no_build_outputs(sdist_members):
    leaked = sorted(m for m in sdist_members
                    if m.endswith((".so", ".o", ".pyc")) or m.split("/")[0] in ("build", ".venv", ".git"))
    assert not leaked, f"the sdist would carry build outputs or environments: {leaked[:20]}"


# ----------------------------------------------------------------------- the NVSHMEM switch, docs
def _nvshmem_switch() -> dict[str, tuple[str, list[str], dict]]:
    """{wheel flavour (cu13): (environment variable, build.requires, cmake.define)} of pyproject's overrides."""
    found = {}
    for override in _overrides():
        for var, pattern in override.get("if", {}).get("env", {}).items():
            requires = override.get("build", {}).get("requires", [])
            if any(Requirement(r).name.startswith("nvidia-nvshmem-") for r in requires):
                flavour = re.fullmatch(r"\^?(cu\d+)\$?", pattern)
                assert flavour, f"override if.env.{var} = {pattern!r}: expected an anchored cuXY"
                found[flavour.group(1)] = (var, requires, override.get("cmake", {}).get("define", {}))
    return found


def test_nvshmem_switch_builds_against_the_extras_floor_and_requires_the_module():
    """The build gets the lowest NVSHMEM the [cuXY] extra admits, exactly: the module needs a host library
    at least as new as its build, so a build against a newer wheel would refuse what the extra allows."""
    switch = _nvshmem_switch()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(switch) == {"cu12", "cu13"}, f"NVSHMEM overrides for {sorted(switch)}; the extras are cu12, cu13"
    for flavour, (var, requires, define) in switch.items():
        extra = Requirement(extras[flavour][0])
        floor = _minimum(extra.specifier)
        assert [str(Requirement(r)) for r in requires] == [f"{extra.name}=={floor}"], \
            f"{var}={flavour} fetches {requires} for the build; the [{flavour}] extra installs {extra}"
        assert define.get("MOE_COMM_NVSHMEM") == "ON", f"{var}={flavour} must make a missing NVSHMEM an error"
        assert f"$ENV{{{var}}}" in CMAKELISTS, f"CMakeLists.txt does not check {var}'s value"


def test_nvshmem_switch_is_documented_as_it_is_spelled():
    for flavour, (var, requires, _) in _nvshmem_switch().items():
        assert f"{var}={flavour}" in INSTALL_MD, f"docs/install.md does not show the switch {var}={flavour}"
    assert "MOE_COMM_NVSHMEM=" in INSTALL_MD and "NVSHMEM_DIR" in INSTALL_MD


def test_every_extra_is_documented():
    extras = PYPROJECT["project"]["optional-dependencies"]
    undocumented = sorted(e for e in extras if f"[{e}]" not in INSTALL_MD)
    assert not undocumented, f"docs/install.md does not mention the extras {undocumented}"


def test_documented_build_minimums_match_pyproject():
    cmake_min = _minimum(SpecifierSet(_skbuild()["cmake"]["version"]))
    assert f"CMake {cmake_min}" in INSTALL_MD, f"docs/install.md does not state the CMake minimum {cmake_min}"
    skbuild_min = _minimum(_build_requires()["scikit-build-core"].specifier)
    assert f"scikit-build-core {skbuild_min}" in INSTALL_MD, \
        f"docs/install.md does not state the scikit-build-core minimum {skbuild_min}"
    assert "tools/install_check.sh" in INSTALL_MD


# --------------------------------------------------------------------------- build_info's reasons
def test_build_info_says_why_for_each_missing_part_and_only_for_those():
    info = moe_comm.build_info()
    assert isinstance(info.get("cuda_nvshmem"), bool), info
    for part in OPTIONAL_PARTS:
        present = importlib.util.find_spec(f"moe_comm._{part}") is not None
        why = info.get(f"{part}_not_built")
        if present:
            assert why is None, f"moe_comm._{part} is built, yet build_info() says it is not: {why!r}"
        else:
            assert info[part] is False, info
            assert isinstance(why, str) and why, f"moe_comm._{part} is missing and build_info() does not say why"


def test_the_c_extension_records_cmakes_reasons_for_this_build():
    """moe_comm._C's reasons (compile definitions from CMakeLists.txt): "" exactly for the modules built."""
    c_info = native.native().build_info()
    for part in OPTIONAL_PARTS:
        present = importlib.util.find_spec(f"moe_comm._{part}") is not None
        why = c_info.get(f"{part}_not_built")
        assert isinstance(why, str), f"moe_comm._C's build_info() has no {part}_not_built (rebuild: pip install .)"
        assert (why == "") == present, f"moe_comm._{part} {'is' if present else 'is not'} built; _C says {why!r}"


def test_build_info_reports_a_module_that_went_missing(monkeypatch):
    """A module CMake built but that is not there (a removed file) gets a reason too, not silence."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "moe_comm._cuda_nvshmem" else real(name, *a))
    info = native.build_info()
    assert info["cuda_nvshmem"] is False
    assert info["cuda_nvshmem_not_built"], info
