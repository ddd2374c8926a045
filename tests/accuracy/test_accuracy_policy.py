"""``accuracy.check``'s non-finite policy: the output's NaN, +Inf and -Inf must be exactly the reference's,
the limits apply to the rest, and a reference with no finite value never passes vacuously."""
import math

import pytest
import torch

from moe_comm.accuracy import AccuracyError, check

NAN, INF = math.nan, math.inf
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def _reference(seed: int = 0) -> torch.Tensor:
    """fp64 normal data with NaN, +Inf and -Inf at fixed positions."""
    ref = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref[0, 0], ref[3, 5], ref[7, 15] = NAN, INF, -INF
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_nan_reference_and_all_nan_output_pass_saying_nothing_finite_was_compared(dtype):
    ref = torch.full((4, 8), NAN, dtype=torch.float64)
    report = check("all nan", torch.full((4, 8), NAN, dtype=dtype), ref, dtype)
    assert report.passed
    assert report.metrics["finite_compared"] == 0
    assert "no finite values compared" in report.reason


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_inf_reference_fails_on_one_flipped_sign(dtype):
    ref = torch.tensor([INF, -INF] * 8, dtype=torch.float64)
    assert check("all inf", ref.to(dtype), ref, dtype).passed
    out = ref.to(dtype)
    out[5] = -out[5]
    with pytest.raises(AccuracyError, match=r"1 NaN/Inf elements where the reference has the other one.*"
                                            r"no finite values compared"):
        check("one flipped inf", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_nan_reference_fails_on_a_finite_output(dtype):
    ref = torch.full((4, 8), NAN, dtype=torch.float64)
    with pytest.raises(AccuracyError, match=r"32 finite elements where the reference is NaN/Inf"):
        check("finite for nan", torch.zeros(4, 8, dtype=dtype), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_nonfinite_output_where_the_reference_is_finite_fails(dtype, value):
    ref = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = ref.to(dtype)
    out[2, 3] = value
    with pytest.raises(AccuracyError, match=r"^finite ref: 1 NaN/Inf elements where the reference is finite$"):
        check("finite ref", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matching_nonfinite_positions_and_close_finite_values_pass(dtype):
    ref = _reference()
    report = check("mixed", ref.to(dtype), ref, dtype)
    assert report.passed and report.reason == ""
    assert report.metrics["finite_compared"] == ref.numel() - 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_matching_nonfinite_positions_do_not_excuse_far_finite_values(dtype):
    ref = _reference()
    out = ref.to(dtype)
    out[1] *= 2
    with pytest.raises(AccuracyError, match="calc_diff"):
        check("far", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", [(0, 0), (3, 5), (7, 15)], ids=["nan", "+inf", "-inf"])
def test_a_nonfinite_value_moved_to_a_neighbour_fails(dtype, position):
    ref = _reference()
    out = ref.to(dtype)
    row, col = position
    neighbour = (row, col - 1 if col else col + 1)
    out[neighbour], out[position] = out[position].clone(), ref[neighbour].to(dtype)
    with pytest.raises(AccuracyError, match=r"^moved: 1 NaN/Inf elements where the reference is finite; "
                                            r"1 finite elements where the reference is NaN/Inf$"):
        check("moved", out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_for_inf_and_inf_for_nan_fail(dtype):
    ref = _reference()
    out = ref.to(dtype)
    out[0, 0], out[3, 5] = INF, NAN
    with pytest.raises(AccuracyError, match=r"2 NaN/Inf elements where the reference has the other one"):
        check("swapped kinds", out, ref, dtype)
