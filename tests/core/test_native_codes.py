"""The codes of the native kernels are C++ enums bound in ``moe_comm._C``: the shared ones (``DType``,
``WaitOutcome``, the FP8 constants) come from the one table in ``csrc/common/codes.h``, which every CUDA
module binds too, and Python's copies (``WireDType``, ``ops.fp8``, ``core.config``) are checked against it
here. Bound functions take and return members (an int is a TypeError), and the torch-dtype mappings of
``moe_comm.core.native`` return members. Single process."""
from __future__ import annotations

import pytest
import torch

from moe_comm.core.config import NUM_MAX_NVL_PEERS
from moe_comm.core.native import NATIVE_DTYPES, native, native_dtype, native_format
from moe_comm.ops import fp8
from moe_comm.ops.quant import FORMATS
from moe_comm.protocol.codes import WireDType

# The members of each enum in csrc/common/codes.h and csrc/cpu/api.h, in declaration order.
ENUMS = {
    "DType": [m.name for m in WireDType],
    "QuantFormat": ["E4M3", "E5M2", "INT8"],
    "IsaLevel": ["GENERIC", "AVX2", "AVX512"],
    "WaitOutcome": ["REACHED", "TIMEOUT", "PEER_EXITED", "PAST_TARGET", "MISMATCH"],
}


@pytest.mark.parametrize("name", list(ENUMS))
def test_enum_is_bound_with_its_members(name):
    codes = getattr(native(), name)
    assert list(codes.__members__) == ENUMS[name]
    for member in codes.__members__.values():
        assert not isinstance(member, int) and member != int(member), f"{member} compares equal to an int"


def test_python_copies_of_the_shared_codes_are_the_tables():
    """WireDType is codes.h's DType member for member (name and value); the Python constants equal the
    kernels' (the Triton kernels' torch-free copy of the FP8 group too)."""
    assert {name: int(m) for name, m in native().DType.__members__.items()} == {m.name: m.value for m in WireDType}
    assert (native().FP8_GROUP, native().MAX_NODE_RANKS) == (fp8.GROUP, NUM_MAX_NVL_PEERS)
    assert native().AMAX_FLOOR == torch.tensor(fp8.AMAX_FLOOR, dtype=torch.float32).item()


def test_the_triton_kernels_group_is_the_tables():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'moe-comm[triton]')")
    from moe_comm.ops.triton import quant  # torch-free, so it keeps its own copy
    assert quant.GROUP == native().FP8_GROUP


def test_dtype_mapping_returns_the_members():
    codes = native().DType
    got = {dtype: native_dtype(dtype) for dtype in NATIVE_DTYPES}
    assert got == {torch.float32: codes.FLOAT32, torch.bfloat16: codes.BFLOAT16, torch.float16: codes.FLOAT16}
    assert all(isinstance(member, codes) for member in got.values())
    with pytest.raises(ValueError, match=r"native_dtype: the kernels take .* got torch.float64"):
        native_dtype(torch.float64)


def test_format_mapping_returns_the_members():
    codes = native().QuantFormat
    got = {fmt: native_format(dtype) for fmt, dtype in FORMATS.items()}
    assert got == {"e4m3": codes.E4M3, "e5m2": codes.E5M2, "int8": codes.INT8}
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
    _combine(codes.DType.FLOAT32)
    _quantize(codes.DType.FLOAT32, codes.QuantFormat.INT8)
    _dequantize(codes.DType.FLOAT32, codes.QuantFormat.INT8)
    calls = [lambda: _combine(0), lambda: _combine(codes.QuantFormat.E4M3),
             lambda: _quantize(0, codes.QuantFormat.INT8), lambda: _quantize(codes.DType.FLOAT32, 2),
             lambda: _dequantize(codes.DType.FLOAT32, 2), lambda: _dequantize(codes.QuantFormat.INT8, 2),
             lambda: codes.set_quantize_rows_isa_cap(2)]
    for call in calls:
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call()


def test_a_member_built_from_an_unknown_value_is_refused():
    """``DType(99)`` is constructible in Python, and DType.INT32 is a member the float kernels do not take;
    the kernels check the code they get."""
    isa = native().quantize_rows_isa()
    for code in (native().DType(99), native().DType.INT32):
        with pytest.raises(ValueError, match=f"combine_reduce: dtype must be FLOAT32, BFLOAT16 or FLOAT16, "
                                             f"got DType code {int(code)}"):
            _combine(code)
    with pytest.raises(ValueError, match="quantize_rows: dtype must be FLOAT32, BFLOAT16 or FLOAT16, got DType code 8"):
        _quantize(native().DType.INT64, native().QuantFormat.INT8)
    with pytest.raises(ValueError, match="quantize_rows: unknown format code 9"):
        _quantize(native().DType.FLOAT32, native().QuantFormat(9))
    with pytest.raises(ValueError, match="set_quantize_rows_isa_cap: unknown ISA level 5"):
        native().set_quantize_rows_isa_cap(native().IsaLevel(5))
    assert native().quantize_rows_isa() == isa  # the cap was left as it was


def test_flags_wait_returns_an_outcome_member():
    outcomes = native().WaitOutcome
    flag = torch.zeros(1, dtype=torch.int64)
    native().flag_store(flag.data_ptr(), 5)
    assert native().flags_wait([flag.data_ptr()], [5], [0], 1.0, True) == (-1, outcomes.REACHED)
    index, outcome = native().flags_wait([flag.data_ptr()], [3], [0], 1.0, True)
    assert (index, outcome) == (0, outcomes.PAST_TARGET) and isinstance(outcome, outcomes)
