"""The codes of the native kernels are C++ enums bound in ``moe_comm._C``, and Python holds no integer copy
of them: the bound enums have the members of ``csrc/cpu``, bound functions take and return members (an int
is a TypeError), and the torch-dtype mappings of ``moe_comm.core.native`` return members. Single process."""
from __future__ import annotations

import pytest
import torch

from moe_comm.core.native import NATIVE_DTYPES, native, native_dtype, native_format
from moe_comm.ops.quant import FORMATS

# The members of each enum in csrc/cpu/api.h and flags.h, in declaration order.
ENUMS = {
    "DType": ["kFloat32", "kBFloat16", "kFloat16"],
    "QuantFormat": ["kE4M3", "kE5M2", "kInt8"],
    "IsaLevel": ["kGeneric", "kAvx2", "kAvx512"],
    "WaitOutcome": ["kReached", "kTimeout", "kProcessExited", "kPastTarget"],
}


@pytest.mark.parametrize("name", list(ENUMS))
def test_enum_is_bound_with_its_members(name):
    codes = getattr(native(), name)
    assert list(codes.__members__) == ENUMS[name]
    for member in codes.__members__.values():
        assert not isinstance(member, int) and member != int(member), f"{member} compares equal to an int"


def test_dtype_mapping_returns_the_members():
    codes = native().DType
    got = {dtype: native_dtype(dtype) for dtype in NATIVE_DTYPES}
    assert got == {torch.float32: codes.kFloat32, torch.bfloat16: codes.kBFloat16, torch.float16: codes.kFloat16}
    assert all(isinstance(member, codes) for member in got.values())
    with pytest.raises(ValueError, match=r"native_dtype: the CPU kernels take .* got torch.float64"):
        native_dtype(torch.float64)


def test_format_mapping_returns_the_members():
    codes = native().QuantFormat
    got = {fmt: native_format(dtype) for fmt, dtype in FORMATS.items()}
    assert got == {"e4m3": codes.kE4M3, "e5m2": codes.kE5M2, "int8": codes.kInt8}
    assert all(isinstance(member, codes) for member in got.values())
    with pytest.raises(ValueError, match=r"native_format: .* got torch.uint8"):
        native_format(torch.uint8)


def _combine(dtype) -> None:
    """A one-token, one-source fp32 reduction of a 4-float record, with ``dtype`` as the element type."""
    out, records, pos = torch.empty(1, 4), torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32)
    native().combine_reduce(out.data_ptr(), 0, [records.data_ptr()], [1], pos.data_ptr(), 0, 0, 0, 1, 1, 4, dtype,
                            16, 0, 0, 0, 1)


def _quantize(dtype, fmt) -> None:
    x, out, scales = torch.zeros(1, 128), torch.empty(1, 128, dtype=torch.uint8), torch.empty(1)
    native().quantize_rows(out.data_ptr(), scales.data_ptr(), x.data_ptr(), 0, 1, 1, 128, 1, dtype, fmt, False,
                           False, 1)


def _dequantize(dtype, fmt) -> None:
    q, out, scales = torch.zeros(1, 128, dtype=torch.uint8), torch.empty(1, 128), torch.ones(1)
    native().dequantize_rows(out.data_ptr(), q.data_ptr(), scales.data_ptr(), 1, 128, dtype, fmt, False, 1)


def test_bound_functions_take_members_not_ints():
    codes = native()
    _combine(codes.DType.kFloat32)
    _quantize(codes.DType.kFloat32, codes.QuantFormat.kInt8)
    _dequantize(codes.DType.kFloat32, codes.QuantFormat.kInt8)
    calls = [lambda: _combine(0), lambda: _combine(codes.QuantFormat.kE4M3),
             lambda: _quantize(0, codes.QuantFormat.kInt8), lambda: _quantize(codes.DType.kFloat32, 2),
             lambda: _dequantize(codes.DType.kFloat32, 2), lambda: _dequantize(codes.QuantFormat.kInt8, 2),
             lambda: codes.set_quantize_rows_isa_cap(2)]
    for call in calls:
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call()


def test_a_member_built_from_an_unknown_value_is_refused():
    """``DType(7)`` is constructible in Python; the kernels still check the code they get."""
    isa = native().quantize_rows_isa()
    with pytest.raises(ValueError, match="combine_reduce: unknown dtype code 7"):
        _combine(native().DType(7))
    with pytest.raises(ValueError, match="quantize_rows: unknown format code 9"):
        _quantize(native().DType.kFloat32, native().QuantFormat(9))
    with pytest.raises(ValueError, match="set_quantize_rows_isa_cap: unknown ISA level 5"):
        native().set_quantize_rows_isa_cap(native().IsaLevel(5))
    assert native().quantize_rows_isa() == isa  # the cap was left as it was


def test_flags_wait_returns_an_outcome_member():
    outcomes = native().WaitOutcome
    flag = torch.zeros(1, dtype=torch.int64)
    native().flag_store(flag.data_ptr(), 5)
    assert native().flags_wait([flag.data_ptr()], [5], [0], 1.0, True) == (-1, outcomes.kReached)
    index, outcome = native().flags_wait([flag.data_ptr()], [3], [0], 1.0, True)
    assert (index, outcome) == (0, outcomes.kPastTarget) and isinstance(outcome, outcomes)
