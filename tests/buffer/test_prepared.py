"""Prepared low-latency calls: after a first call of a signature, later calls run as one native call per op
half (docs/layout.md, "The path of a call"), bitwise equal to the checked path's, on every world kind (those
without prepared calls run the checked path for both Buffers)."""
import pytest

from helpers.prepared_cases import (MAX_PYTHON_CALLS, normal_prepared_equals_checked, normal_python_calls,
                                   prepared_equals_checked, python_calls, two_batches)

#: the world kinds whose low-latency calls are prepared (the cuda backend's too: test_cuda_backend.py)
PREPARED_KINDS = ("shm", "cuda_host")
#: the world kinds whose normal-mode calls are prepared (the kernels' run as their launches): at most this many
#: Python calls per op
NORMAL_PREPARED_KINDS = ("shm",)
MAX_NORMAL_PYTHON_CALLS = 25


@pytest.mark.every_transport
def test_prepared_calls_equal_the_checked_path(worlds, transport):
    # one hidden size on the kernels: their buffer halves move with it, so calls of different sizes in a row
    # overlap (docs/status.md, known limits)
    for result in worlds(3).run(prepared_equals_checked, 36, transport != "cuda_host"):
        assert result["differ"] == 0, result
        # a prepared call for every signature the run used, where the kind prepares them
        assert result["prepared"] == (result["signatures"] if transport in PREPARED_KINDS else (0, 0)), result


@pytest.mark.every_transport
def test_two_batches_and_pending_hooks(worlds):
    for result in worlds(2).run(two_batches, 4):
        assert result["differ"] == 0, result


@pytest.mark.parametrize("transport", PREPARED_KINDS, indirect=True)
def test_a_prepared_op_half_is_a_few_python_calls(worlds):
    for counts in worlds(2).run(python_calls):
        assert max(counts.values()) <= MAX_PYTHON_CALLS, counts


@pytest.mark.every_transport
def test_prepared_normal_calls_equal_the_checked_path(worlds, transport):
    for result in worlds(3).run(normal_prepared_equals_checked, 24):
        assert result["differ"] == 0, result
        assert result["prepared"] == (result["signatures"] if transport in NORMAL_PREPARED_KINDS else (0, 0)), result


@pytest.mark.parametrize("transport", NORMAL_PREPARED_KINDS, indirect=True)
def test_a_prepared_normal_op_is_a_few_python_calls(worlds):
    for counts in worlds(2).run(normal_python_calls):
        assert max(counts.values()) <= MAX_NORMAL_PYTHON_CALLS, counts
