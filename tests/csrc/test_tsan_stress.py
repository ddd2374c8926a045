"""ThreadSanitizer over the host build of the CUDA kernels' protocol (csrc/cuda on HostPlatform).

``csrc/cuda/host/stress.cpp`` runs 2..4 simulated ranks as threads of one process, each making the
launches the cuda_host backend makes (notify / prologue / dispatch / combine, low-latency send and
receive halves) on shared heap buffers, with geometry drawn per round from a fixed seed (small rings
that wrap, so senders wait for space), and checks every output against a sequential reference. It is
built with ``-fsanitize=thread`` together with ``host/launches.cpp`` and ``csrc/cpu/flags.cpp``, so
TSan sees every cross-thread access of the real protocol and kernel code.

* the clean build passes every round and TSan reports nothing, with the backend's per-call handshake
  and with the low-latency calls run back to back without it (their protocol needs no host sync);
* the test of the test: built with ``-DMOE_COMM_PLANT_RELAXED_TAIL`` (the ring tail published by a
  relaxed store) TSan must report a data race on the ring slots, every run; built with
  ``-DMOE_COMM_PLANT_EARLY_FORWARD_HEAD`` (a forwarder across nodes frees its RDMA slots before it has
  copied them out: an ordering bug in the two-hop forwarding queue) TSan must report the race between
  the sender's put and the forwarder's reads;
* half the rounds run normal mode across 2..3 nodes (kernels/internode.h: RDMA rings with staging and
  drains, forwarders, NVL rings), so every case below covers the two-hop protocol too;
* with launches that outlive their call (async_finish=True), and in normal mode without the
  handshake, it is clean too: the kernels' own barriers order the ranks.

Skips when g++ is missing or cannot build and run a ``-fsanitize=thread`` program."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from helpers.paths import ROOT

CSRC = ROOT / "csrc"
SOURCES = [CSRC / "cuda" / "host" / "stress.cpp", CSRC / "cuda" / "host" / "launches.cpp", CSRC / "cpu" / "flags.cpp"]
FLAGS = ["-std=c++20", "-O1", "-g", "-fsanitize=thread", "-ffp-contract=off", f"-I{CSRC}"]
PLANT_RELAXED_TAIL = "MOE_COMM_PLANT_RELAXED_TAIL"
PLANT_EARLY_FORWARD_HEAD = "MOE_COMM_PLANT_EARLY_FORWARD_HEAD"
TSAN_OPTIONS = "halt_on_error=1 exitcode=66 report_signal_unsafe=0"
TSAN_EXIT = 66
SEED, ROUNDS = 1, 30
COMPILE_TIMEOUT_S, RUN_TIMEOUT_S = 600, 300


def _gxx() -> str:
    gxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: the ThreadSanitizer stress needs it")
    return gxx


def _probe(gxx: str, tmp: Path) -> None:
    """Skips unless a -fsanitize=thread program compiles, links and runs here."""
    src, exe = tmp / "probe.cpp", tmp / "probe"
    src.write_text("#include <thread>\nint main() { int x = 0; std::thread t([&] { x = 1; }); t.join(); return x - 1; }\n")
    built = subprocess.run([gxx, "-std=c++20", "-fsanitize=thread", str(src), "-o", str(exe), "-pthread"],
                           capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if built.returncode != 0:
        pytest.skip(f"g++ -fsanitize=thread does not build a program here (is libtsan installed?): "
                    f"{built.stderr.strip()[-300:]}")
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                         env={**os.environ, "TSAN_OPTIONS": TSAN_OPTIONS})
    if ran.returncode != 0:
        pytest.skip(f"a -fsanitize=thread program does not run here (exit {ran.returncode}): "
                    f"{ran.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def stress(tmp_path_factory) -> Callable[[Optional[str]], Path]:
    """``stress(plant)``: the stress binary built with that planted bug (a ``-D`` name) or clean (None),
    built once per module (the three translation units compile in parallel)."""
    gxx = _gxx()
    tmp = tmp_path_factory.mktemp("tsan_stress")
    _probe(gxx, tmp)
    built: dict[Optional[str], Path] = {}

    def build(plant: Optional[str]) -> Path:
        if plant in built:
            return built[plant]
        out = tmp / (plant or "clean")
        out.mkdir()
        flags = FLAGS + ([f"-D{plant}"] if plant else [])
        begin = time.monotonic()
        jobs = [(src, subprocess.Popen([gxx, *flags, "-c", str(src), "-o", str(out / (src.stem + ".o"))],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                for src in SOURCES]
        errors = []
        for src, job in jobs:
            _, err = job.communicate(timeout=COMPILE_TIMEOUT_S)
            if job.returncode != 0:
                errors.append(f"{src.name}:\n{err}")
        assert not errors, "the stress does not compile:\n" + "\n".join(errors)
        exe = out / "stress"
        link = subprocess.run([gxx, "-fsanitize=thread", *[str(out / (s.stem + ".o")) for s in SOURCES], "-o", str(exe),
                               "-pthread"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        assert link.returncode == 0, f"the stress does not link:\n{link.stderr}"
        print(f"tsan stress ({out.name}): built in {time.monotonic() - begin:.1f} s")
        built[plant] = exe
        return exe

    return build


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess:
    begin = time.monotonic()
    done = subprocess.run([str(exe), "--seed", str(SEED), "--rounds", str(ROUNDS), *args], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, "TSAN_OPTIONS": TSAN_OPTIONS})
    print(f"tsan stress {' '.join(args) or '(default)'}: exit {done.returncode} in {time.monotonic() - begin:.1f} s")
    return done


def _assert_clean(done: subprocess.CompletedProcess) -> None:
    assert "WARNING: ThreadSanitizer" not in done.stderr, f"ThreadSanitizer reported:\n{done.stderr[-12000:]}"
    assert done.returncode == 0, f"the stress failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-6000:]}"
    assert f"stress: {ROUNDS} rounds passed" in done.stdout, done.stdout
    across = re.search(r"(\d+) rounds across nodes", done.stdout)
    assert across and int(across[1]) >= ROUNDS // 4, f"too few rounds across nodes: {done.stdout}"


def test_stress_clean(stress):
    """The backend's call sequence (a handshake before every call), every output checked: no race."""
    _assert_clean(_run(stress(None)))


def test_low_latency_without_handshake_is_clean(stress):
    """Low-latency calls back to back with no host rendezvous (as a captured CUDA graph runs them): the
    count signals, combine flags and alternating halves alone order every access."""
    _assert_clean(_run(stress(None), "--no-handshake"))


@pytest.mark.exhaustive  # the fast tier's planted race: the early forward head below (and the ring-tail mutant)
def test_planted_relaxed_tail_is_reported(stress):
    """The test of the test: a ring tail published by a relaxed store lets the receiver read slots the
    sender's copy is not ordered before; TSan must say so, on the ring's payload copies."""
    done = _run(stress(PLANT_RELAXED_TAIL))
    assert "WARNING: ThreadSanitizer: data race" in done.stderr, \
        f"TSan did not report the planted relaxed tail (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-6000:]}"
    assert done.returncode == TSAN_EXIT, done.stderr[-6000:]
    report = done.stderr.split("WARNING: ThreadSanitizer: data race", 1)[1].split("SUMMARY:", 1)[0]
    assert any(f in report for f in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
                                     "internode_forward", "internode_nvl_recv")), \
        f"TSan reported a race, but not on the rings' payload:\n{report}"


def test_async_launches_are_clean(stress):
    """The backend with async_finish=True: each rank's normal-mode launches run in order on its stream
    thread, so the next call's handshake may pass while the previous launch still runs. (This found
    notify writing peers' cells before any barrier of its call, racing a peer's previous launch; notify
    now opens with a barrier, as DeepEP's notify_dispatch does.)"""
    _assert_clean(_run(stress(None), "--async"))


@pytest.mark.exhaustive  # the fast tier's run without a handshake: the low-latency one above
def test_normal_mode_without_handshake_is_clean(stress):
    """Normal-mode calls back to back with no host rendezvous between them: the kernels' barriers alone
    keep the ranks apart (what a device launch without a host handshake relies on)."""
    _assert_clean(_run(stress(None), "--no-handshake-normal"))


def test_planted_early_forward_head_is_reported(stress):
    """The test of the test, across nodes: a forwarder that frees its RDMA ring slots (signals the
    sender's head) before it has copied them out to the node's ranks lets the sender's next put
    overwrite a slot still being read. TSan must report that race, between the RDMA sender's put and
    the forwarder's reads."""
    done = _run(stress(PLANT_EARLY_FORWARD_HEAD))
    assert "WARNING: ThreadSanitizer: data race" in done.stderr, \
        f"TSan did not report the planted early head (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-6000:]}"
    assert done.returncode == TSAN_EXIT, done.stderr[-6000:]
    report = done.stderr.split("WARNING: ThreadSanitizer: data race", 1)[1].split("SUMMARY:", 1)[0]
    assert "internode_forward" in report and "internode_rdma_send" in report, \
        f"TSan reported a race, but not between the RDMA sender and the forwarder:\n{report}"
