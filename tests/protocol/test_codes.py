"""The wire codes (moe_comm.protocol.codes): what each names, how the handshake words them, and that every
torch dtype that can travel has one."""
import pytest
import torch

from moe_comm.protocol.codes import UNKNOWN, Field, Fp8Format, Op, WireDType
from moe_comm.protocol.handshake import Handshake, per_rank, show, vector


def test_fp8_format_of_the_flags():
    assert Fp8Format.of(False, True, True) is Fp8Format.BF16  # without use_fp8 the other flags do nothing
    assert Fp8Format.of(True, False, False) is Fp8Format.FP8
    assert Fp8Format.of(True, True, False) is Fp8Format.FP8_ROUND_SCALE
    assert Fp8Format.of(True, True, True) is Fp8Format.FP8_UE8M0
    assert [f.label for f in Fp8Format] == ["bf16", "fp8", "fp8 round_scale", "fp8 ue8m0"]
    assert [(f.round_scale, f.ue8m0) for f in Fp8Format] == [(False, False), (False, False), (True, False),
                                                             (True, True)]


def test_ops_are_named_as_the_buffer_methods():
    assert Op.of_method("low_latency_combine") is Op.LOW_LATENCY_COMBINE
    assert Op.CACHED_DISPATCH.label == "cached dispatch" and Op.CLEAN_LOW_LATENCY_BUFFER.label == \
        "clean_low_latency_buffer"
    with pytest.raises(KeyError):
        Op.of_method("get_dispatch_layout")  # local: no handshake


@pytest.mark.parametrize("name", [m.label for m in WireDType])
def test_every_wire_dtype_round_trips(name):
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    code = WireDType.code(dtype)
    assert WireDType(code).label == name and show(Field.X_DTYPE, code) == name
    assert WireDType.code(None) == UNKNOWN


def test_the_vector_holds_the_fields_in_order_then_the_rows():
    fields = {Field.OP: Op.COMBINE, Field.CALL: 7, Field.HIDDEN: 2048, Field.X_DTYPE: WireDType.code(torch.bfloat16)}
    row = vector(fields, [3, 4], [5, 6], None, [8, 9], 2)
    assert row[:len(Field)] == [int(fields.get(f, UNKNOWN)) for f in Field]
    assert row[len(Field):] == [3, 4, 5, 6, UNKNOWN, UNKNOWN, 8, 9]
    shake = Handshake([row, row])
    assert shake.field(Field.CALL) == [7, 7] and shake.matrix == [[3, 4], [3, 4]]
    assert per_rank(shake, Field.OP) == "rank 0: combine, rank 1: combine"
    assert per_rank(shake, Field.X_DTYPE) == "rank 0: bfloat16, rank 1: bfloat16"


def test_a_code_this_rank_does_not_know_is_shown_as_a_number():
    assert show(Field.OP, 99) == "99" and show(Field.FP8_FORMAT, 7) == "7" and show(Field.HIDDEN, UNKNOWN) == "none"
