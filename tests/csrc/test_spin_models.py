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

from helpers.paths import ROOT
from helpers.tiers import exhaustive

MODELS = ROOT / "tools" / "spin"
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


@pytest.mark.parametrize("chunk,tokens", [(2, 7), exhaustive(3, 7), exhaustive(3, 5), (4, 7)])
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


@pytest.mark.parametrize("ranks,barriers", [(3, 3), exhaustive(2, 4), exhaustive(4, 2)])
def test_barrier_verifies(ranks: int, barriers: int, tmp_path: Path,
                          record_property: Callable[[str, object], None]) -> None:
    """With monotonic arrival counters, no rank leaves a barrier before every rank has entered it, over
    consecutive barriers, and no rank is left waiting."""
    assert_verified(search("barrier.pml", {"R": ranks, "E": barriers}, tmp_path), record_property)


def test_barrier_off_by_one_is_caught(tmp_path: Path) -> None:
    """Waiting for arrive[i] >= e - 1 lets a rank leave barrier e before the others entered it."""
    result = search("barrier.pml", {"R": 3, "E": 3, "OFF_BY_ONE": None}, tmp_path)
    assert_found(result, "assertion violated")


@pytest.mark.parametrize("ranks,calls", [exhaustive(2, 3), exhaustive(2, 4), (3, 3)])
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


@pytest.mark.parametrize("rdma_slots,rdma_chunk,nvl_slots,nvl_chunk,tokens",
                         [exhaustive(2, 1, 2, 1, 3), exhaustive(4, 2, 2, 1, 5), (4, 2, 3, 2, 5)])
def test_forward_verifies(rdma_slots: int, rdma_chunk: int, nvl_slots: int, nvl_chunk: int, tokens: int,
                          tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """Two-hop dispatch, 2 senders of ``tokens`` tokens each through one forwarder to 2 receivers, at
    chunk sizes the kernel accepts (RDMA chunk <= half the RDMA ring, NVL chunk < NVL ring), with the
    RDMA puts and head signals landing late: the forwarder reads every token intact from the RDMA ring
    (no slot overwritten before it is forwarded), each receiver reads its tokens intact and in order,
    and every rank finishes."""
    defines: Defines = {"NS": 2, "ND": 2, "NUM_TOKENS": tokens, "RDMA_SLOTS": rdma_slots,
                        "RDMA_CHUNK": rdma_chunk, "NVL_SLOTS": nvl_slots, "NVL_CHUNK": nvl_chunk}
    assert_verified(search("forward.pml", defines, tmp_path), record_property)


def test_forward_two_calls_verify(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """Two dispatch calls in a row, each rank resetting the counters in its own memory before the barrier
    between them and each sender draining its head signals first: the second call's tokens arrive
    intact too, and every rank finishes."""
    defines: Defines = {"NS": 2, "ND": 2, "NUM_TOKENS": 3, "RDMA_SLOTS": 2, "RDMA_CHUNK": 1,
                        "NVL_SLOTS": 2, "NVL_CHUNK": 1, "CALLS": 2}
    assert_verified(search("forward.pml", defines, tmp_path), record_property)


def test_forward_early_rdma_head_is_caught(tmp_path: Path) -> None:
    """Signalling the RDMA head as soon as the tail is read, before the batch is forwarded, lets the
    sender overwrite a slot the forwarder has not copied yet: a content assertion fails."""
    result = search("forward.pml", {"NS": 2, "ND": 2, "NUM_TOKENS": 3, "RDMA_SLOTS": 2, "RDMA_CHUNK": 1,
                                    "NVL_SLOTS": 2, "NVL_CHUNK": 1, "EARLY_RDMA_HEAD": None}, tmp_path)
    assert_found(result, "assertion violated")


def test_forward_no_drain_is_caught(tmp_path: Path) -> None:
    """Without the sender's drain, the forwarder's last head signal of call 1 can land after the sender
    reset its head: call 2 starts with a stale head, the sender overruns the ring, and a content
    assertion fails. (One sender suffices.)"""
    result = search("forward.pml", {"NS": 1, "ND": 2, "NUM_TOKENS": 3, "RDMA_SLOTS": 2, "RDMA_CHUNK": 1,
                                    "NVL_SLOTS": 2, "NVL_CHUNK": 1, "CALLS": 2, "NO_DRAIN": None}, tmp_path)
    assert_found(result, "assertion violated")


def test_forward_nvl_chunk_larger_than_ring_deadlocks(tmp_path: Path) -> None:
    """A batch of 3 tokens all for receiver 0 never fits its NVL ring of 2 slots (the check NVL_CHUNK <
    NVL_SLOTS lifted): SPIN reports the deadlock as an invalid end state."""
    result = search("forward.pml", {"NS": 2, "ND": 2, "NUM_TOKENS": 3, "RDMA_SLOTS": 4, "RDMA_CHUNK": 2,
                                    "NVL_SLOTS": 2, "NVL_CHUNK": 3, "CHUNK_TOO_BIG": None}, tmp_path)
    assert_found(result, "invalid end state")


@pytest.mark.parametrize("rdma_slots,rdma_chunk,nvl_slots,nvl_chunk,tokens",
                         [exhaustive(2, 1, 2, 1, 3), (4, 2, 2, 1, 4), exhaustive(2, 1, 3, 2, 4)])
def test_forward_combine_verifies(rdma_slots: int, rdma_chunk: int, nvl_slots: int, nvl_chunk: int,
                                  tokens: int, tmp_path: Path,
                                  record_property: Callable[[str, object], None]) -> None:
    """Two-hop combine, one source of ``tokens`` tokens whose partials come from the forwarders of 2
    nodes, one of them summing the rows of 2 returners, at chunk sizes the kernel accepts, with lazy
    head publication and the RDMA puts and head signals landing late: every row and every partial is
    read intact (no slot overwritten before it is read) and every rank finishes."""
    defines: Defines = {"NS": 1, "NN": 2, "ND": 2, "ND_REST": 1, "NUM_TOKENS": tokens,
                        "RDMA_SLOTS": rdma_slots, "RDMA_CHUNK": rdma_chunk, "NVL_SLOTS": nvl_slots,
                        "NVL_CHUNK": nvl_chunk}
    assert_verified(search("forward_combine.pml", defines, tmp_path), record_property)


def test_forward_combine_early_nvl_head_is_caught(tmp_path: Path) -> None:
    """Freeing a returner's NVL slot before the forwarder has read the row in it lets the returner
    overwrite the row: the forwarder's row assertion fails."""
    result = search("forward_combine.pml", {"NS": 1, "NN": 2, "ND": 2, "ND_REST": 1, "NUM_TOKENS": 3,
                                            "RDMA_SLOTS": 2, "RDMA_CHUNK": 1, "NVL_SLOTS": 2, "NVL_CHUNK": 1,
                                            "EARLY_NVL_HEAD": None}, tmp_path)
    assert_found(result, "assertion violated")


@pytest.mark.parametrize("ranks,calls", [(2, 3), exhaustive(2, 4), (3, 3)])
def test_ll_posts_verify(ranks: int, calls: int, tmp_path: Path,
                         record_property: Callable[[str, object], None]) -> None:
    """The shm transport's posts (the call header in the data path), two calls in flight: every
    receiver judges the header and reads the rows of the call it receives, from every sender, and no
    rank is left waiting."""
    assert_verified(search("ll_posts.pml", {"R": ranks, "N": calls}, tmp_path), record_property)


@pytest.mark.parametrize("bug,kind", [("HEADER_AFTER_PUBLISH", "assertion violated"),
                                      ("NO_FLOW_CONTROL", "invalid end state"),
                                      ("STALE_ACCEPTED", "assertion violated")])
def test_ll_posts_planted_bugs_are_caught(bug: str, kind: str, tmp_path: Path) -> None:
    """A header published before it is written (a stale header judged), a post that does not wait for
    its slot to be consumed (the call two back overwritten: the receiver's exact wait never ends), and a
    receiver that accepts a stale call's signal are each found."""
    assert_found(search("ll_posts.pml", {"R": 2, "N": 3, bug: None}, tmp_path), kind)


@pytest.mark.parametrize("ranks,calls", [(2, 3), exhaustive(2, 5), (3, 3)])
def test_ll_call_headers_verify(ranks: int, calls: int, tmp_path: Path,
                                record_property: Callable[[str, object], None]) -> None:
    """The CUDA kernels' call headers (flow control, header then sequence word, rows then count, exact
    waits, counts zeroed by their reader), two calls in flight: every receiver judges the header and
    reads the rows of the call it receives, from every sender, and no rank is left waiting."""
    assert_verified(search("ll_call_headers.pml", {"R": ranks, "N": calls}, tmp_path), record_property)


@pytest.mark.parametrize("bug,kind", [("HEADER_AFTER_PUBLISH", "assertion violated"),
                                      ("ROWS_AFTER_SIGNAL", "assertion violated"),
                                      ("NO_FLOW_CONTROL", "invalid end state"),
                                      ("STALE_ACCEPTED", "assertion violated")])
def test_ll_call_headers_planted_bugs_are_caught(bug: str, kind: str, tmp_path: Path) -> None:
    """A sequence word published before its header, a count before its rows, a send that does not wait
    for call n - 2 to be consumed (a count overwritten before it is read: the exact wait never ends), and a
    receive that accepts a stale call's signal are each found."""
    assert_found(search("ll_call_headers.pml", {"R": 2, "N": 3, bug: None}, tmp_path), kind)
