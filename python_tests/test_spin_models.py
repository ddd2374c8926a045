"""The SPIN models of the kernels' synchronisation protocol (tools/spin) verify for small sizes, and the
bugs planted in them are found.

Each case generates the verifier (``spin -a`` with the sizes as ``-D`` defines), compiles it for a
safety search (assertions and invalid end states) and runs it in ``tmp_path``, where pan also writes
its trail files. A verified case needs 0 errors, a search the depth limit did not cut short, and every
statement of every process reached (so no assertion is vacuous); its number of states is recorded as
the ``states`` property. A planted-bug case needs an error of the expected kind.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

MODELS = Path(__file__).resolve().parents[1] / "tools" / "spin"
SPIN = shutil.which("spin")
GCC = shutil.which("gcc")

pytestmark = [
    pytest.mark.skipif(SPIN is None,
                       reason="spin is not installed (Debian package spin: apt-get install spin)"),
    pytest.mark.skipif(GCC is None, reason="gcc is not installed (SPIN compiles its verifiers with it)"),
]

# Far deeper than any model's search (a few hundred steps); pan says when it is not.
MAX_DEPTH = 100_000
TIMEOUT_S = 60

Defines = dict[str, int | None]


@dataclass
class Search:
    """What pan reported."""
    errors: int
    states: int
    first_error: str | None   # e.g. "assertion violated (...)", "invalid end state"
    output: str


def search(model: str, defines: Defines, tmp_path: Path) -> Search:
    """Generate, compile and run the safety verifier of ``model`` with ``defines`` (None: no value)."""
    shutil.copy(MODELS / model, tmp_path)
    flags = [f"-D{name}" if value is None else f"-D{name}={value}" for name, value in defines.items()]
    for command in ([SPIN, *flags, "-a", model], [GCC, "-O2", "-DSAFETY", "-o", "pan", "pan.c"]):
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = subprocess.run(["./pan", f"-m{MAX_DEPTH}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=TIMEOUT_S).stdout
    errors = re.search(r"errors: (\d+)", output)
    states = re.search(r"(\d+) states, stored", output)
    assert errors and states, output
    first_error = re.search(r"^pan:1: (.*?) \(at depth \d+\)$", output, re.MULTILINE)
    return Search(int(errors[1]), int(states[1]), first_error[1] if first_error else None, output)


def assert_verified(result: Search, record_property: Callable[[str, object], None]) -> None:
    """0 errors over the whole state space, with every statement reached."""
    assert result.errors == 0, result.output
    assert "max search depth too small" not in result.output, result.output
    assert "search not completed" not in result.output.lower(), result.output
    unreached = re.findall(r"\((\d+) of \d+ states\)", result.output)
    assert unreached and set(unreached) == {"0"}, result.output
    record_property("states", result.states)


def assert_found(result: Search, kind: str) -> None:
    """The search found an error, the first one of kind ``kind``."""
    assert result.errors > 0 and result.first_error is not None, result.output
    assert result.first_error.startswith(kind), result.output


@pytest.mark.parametrize("chunk,tokens", [(2, 7), (3, 7), (3, 5), (4, 7)])
def test_ring_verifies(chunk: int, tokens: int, tmp_path: Path,
                       record_property: Callable[[str, object], None]) -> None:
    """A ring of 4 slots with chunks of at most ``chunk`` <= 4 tokens delivers every token intact (no
    slot overwritten before it is read, none read stale) and both sides finish."""
    assert_verified(search("ring.pml", {"RING_SIZE": 4, "CHUNK": chunk, "NUM_TOKENS": tokens}, tmp_path),
                    record_property)


def test_ring_two_calls_verify(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """Two calls in a row on one ring, the receiver resetting head and tail before the barrier between
    them: the second call's tokens arrive intact too, and both sides finish."""
    assert_verified(search("ring.pml", {"RING_SIZE": 4, "CHUNK": 2, "NUM_TOKENS": 7, "CALLS": 2}, tmp_path),
                    record_property)


def test_ring_chunk_larger_than_ring_deadlocks(tmp_path: Path) -> None:
    """A chunk of 5 tokens never fits a ring of 4 slots: SPIN reports the deadlock as an invalid end
    state."""
    result = search("ring.pml", {"RING_SIZE": 4, "CHUNK": 5, "NUM_TOKENS": 7}, tmp_path)
    assert_found(result, "invalid end state")


def test_ring_free_slot_off_by_one_is_caught(tmp_path: Path) -> None:
    """Counting one free slot too many lets the sender overwrite a slot the receiver has not read:
    the content assertion fails (it is not vacuous)."""
    result = search("ring.pml", {"RING_SIZE": 4, "CHUNK": 2, "NUM_TOKENS": 7, "FREE_OFF_BY_ONE": None},
                    tmp_path)
    assert_found(result, "assertion violated")


def test_ring_reset_after_barrier_is_caught(tmp_path: Path) -> None:
    """Resetting the counters after the barrier between two calls can erase the tail the sender has
    already published for the next call: the receiver waits forever (invalid end state)."""
    result = search("ring.pml", {"RING_SIZE": 4, "CHUNK": 2, "NUM_TOKENS": 7, "CALLS": 2,
                                 "RESET_AFTER_BARRIER": None}, tmp_path)
    assert_found(result, "invalid end state")


@pytest.mark.parametrize("ranks,barriers", [(3, 3), (2, 4), (4, 2)])
def test_barrier_verifies(ranks: int, barriers: int, tmp_path: Path,
                          record_property: Callable[[str, object], None]) -> None:
    """With monotonic arrival counters, no rank leaves a barrier before every rank has entered it, over
    consecutive barriers, and no rank is left waiting."""
    assert_verified(search("barrier.pml", {"R": ranks, "E": barriers}, tmp_path), record_property)


def test_barrier_off_by_one_is_caught(tmp_path: Path) -> None:
    """Waiting for arrive[i] >= e - 1 lets a rank leave barrier e before the others entered it."""
    result = search("barrier.pml", {"R": 3, "E": 3, "OFF_BY_ONE": None}, tmp_path)
    assert_found(result, "assertion violated")


@pytest.mark.parametrize("ranks,calls", [(2, 3), (2, 4), (3, 3)])
def test_ll_double_buffer_verifies(ranks: int, calls: int, tmp_path: Path,
                                   record_property: Callable[[str, object], None]) -> None:
    """With calls alternating between two halves, every receiver reads the current call's payload from
    every sender (not an older or newer call's), and no rank is left waiting."""
    assert_verified(search("ll_double_buffer.pml", {"R": ranks, "N": calls}, tmp_path), record_property)


def test_ll_single_buffer_is_caught(tmp_path: Path) -> None:
    """With one half for every call, a fast sender's next call overwrites a payload before its
    receiver has read it: the payload assertion fails."""
    result = search("ll_double_buffer.pml", {"R": 2, "N": 3, "HALVES": 1}, tmp_path)
    assert_found(result, "assertion violated")
