"""No index makes a CPU kernel read or write out of bounds: every ``_C`` entry point checks the indices it
receives against the size of the memory they index and raises ValueError naming the function, the
argument, the entry and its value, and every plain-torch ``*_reference`` raises the same ValueError.

Each case plants one bad entry in an otherwise valid call: one past the end, 2**30 (the row of the
tampered handle that once made every rank die with SIGSEGV), 2**62 where the index is int64, and below
the smallest allowed value. The boundary cases (the last valid entry, and -1 where it means "none")
pass, so it is the checks that catch the bad ones, not some other failure. Single process."""
from __future__ import annotations

import re

import pytest
import torch

from moe_comm.core.native import native
from moe_comm.ops import (dispatch_layout, dispatch_layout_reference, permute, permute_reference, take_rows,
                          take_rows_reference, unpermute_reduce, unpermute_reduce_reference)
from moe_comm.ops.combine_reduce import combine_reduce, combine_reduce_reference
from moe_comm.ops.quant import native_rows
from moe_comm.ops.records import (RecordLayout, native_segments, pack_rows, pack_rows_reference, unpack_rows,
                                  unpack_rows_reference)
from moe_comm.protocol.low_latency_layout import (combine_positions, combine_positions_reference, combine_rows,
                                                  combine_rows_reference, low_latency_unpack,
                                                  low_latency_unpack_reference, send_order, send_order_reference)

PATHS = ["native", "reference"]


def _bad(rows: int, low: int, int64: bool = True) -> list[int]:
    """Values outside [low, rows): one past the end, 2**30, 2**62 (int64 indices only), one below low."""
    return [rows, 2 ** 30] + ([2 ** 62] if int64 else []) + [low - 1]


def _outside(fn: str, arg: str, pos: str, value: int, low: int, high: int) -> str:
    """The message both paths give, up to the '(where)' that names the tensor (segment s vs field name)."""
    return re.escape(f"{fn}: {arg}[{pos}] = {value} is outside [{low}, {high}) (")


# ---------------------------------------------------------------------------------------- pack / unpack / gather
def _rows_case():
    """Two fields with different row counts; the second (7 rows) is the tighter bound."""
    layout = RecordLayout.build([("x", torch.float32, 3), ("idx", torch.int64, 2)])
    fields = [torch.arange(36, dtype=torch.float32).view(12, 3), torch.arange(14, dtype=torch.int64).view(7, 2)]
    return layout, fields


def _pack(path: str, src_rows: torch.Tensor) -> torch.Tensor:
    layout, fields = _rows_case()
    return (pack_rows if path == "native" else pack_rows_reference)(layout, fields, src_rows)


@pytest.mark.parametrize("path", PATHS)
def test_pack_rows_accepts_the_last_row_and_minus_one(path):
    layout, fields = _rows_case()
    records = _pack(path, torch.tensor([0, 6, -1, 6, 2, 0]))
    assert torch.equal(layout.view(records, "idx")[1], fields[1][6])
    assert not layout.view(records, "idx")[2].any() and not layout.view(records, "x")[2].any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(7, -1))
def test_pack_rows_rejects_src_rows_outside_every_field(path, value):
    src_rows = torch.tensor([0, 6, -1, value, 2, 0])
    with pytest.raises(ValueError, match=_outside("pack_rows", "src_rows", "3", value, -1, 7)):
        _pack(path, src_rows)


def test_pack_rows_names_the_segment_or_field():
    src_rows = torch.tensor([0, 8])  # inside x's 12 rows, past idx's 7
    with pytest.raises(ValueError, match=re.escape("(rows of segment 1)")):
        _pack("native", src_rows)
    with pytest.raises(ValueError, match=re.escape("(rows of field idx)")):
        _pack("reference", src_rows)


def _unpack(path: str, dst_rows, num_records: int = 6):
    layout, fields = _rows_case()
    records = pack_rows(layout, fields, torch.arange(num_records) % 7)
    outs = [torch.zeros(12, 3), torch.zeros(7, 2, dtype=torch.int64)]
    (unpack_rows if path == "native" else unpack_rows_reference)(layout, records, outs, dst_rows)
    return outs


@pytest.mark.parametrize("path", PATHS)
def test_unpack_rows_accepts_the_last_row(path):
    outs = _unpack(path, torch.tensor([0, 2, 4, 6, 1, 3]))
    assert torch.equal(outs[1][6], torch.tensor([6, 7]))  # record 3 came from row 3 of idx
    assert torch.equal(_unpack(path, None, num_records=7)[1][:7], torch.arange(14).view(7, 2))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(7, 0) + [-2])
def test_unpack_rows_rejects_dst_rows_outside_every_field(path, value):
    with pytest.raises(ValueError, match=_outside("unpack_rows", "dst_rows", "3", value, 0, 7)):
        _unpack(path, torch.tensor([0, 2, 4, value, 1, 3]))


@pytest.mark.parametrize("path", PATHS)
def test_unpack_rows_without_dst_rows_rejects_more_records_than_rows(path):
    with pytest.raises(ValueError, match=r"unpack_rows: num_rows = 8 \(without dst_rows\) is more than the 7 rows of "):
        _unpack(path, None, num_records=8)


def _gather(path: str, rows: torch.Tensor) -> torch.Tensor:
    src = torch.arange(21, dtype=torch.float32).view(7, 3)
    out = torch.empty(rows.shape[0], 3)
    (take_rows if path == "native" else take_rows_reference)(out, src, rows)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_take_rows_accepts_the_last_row_and_minus_one(path):
    out = _gather(path, torch.tensor([6, -1, 0]))
    assert torch.equal(out, torch.tensor([[18.0, 19, 20], [0, 0, 0], [0, 1, 2]]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(7, -1))
def test_take_rows_rejects_rows_outside_src(path, value):
    with pytest.raises(ValueError,
                       match=_outside("take_rows", "rows", "1", value, -1, 7) + re.escape("rows of src)")):
        _gather(path, torch.tensor([6, value, 0]))


# ---------------------------------------------------------------------------------------- combine_reduce
SOURCE_ROWS = [5, 12, 3]


def _combine(path: str, send_pos: torch.Tensor) -> torch.Tensor:
    layout = RecordLayout.build([("x", torch.float32, 4)])
    records = [torch.arange(n * 4, dtype=torch.float32).view(n, 4).view(torch.uint8) for n in SOURCE_ROWS]
    out = torch.empty(send_pos.shape[0], 4)
    (combine_reduce if path == "native" else combine_reduce_reference)(layout, records, send_pos, None, None, out,
                                                                       None)
    return out


def _send_pos(bad: int = 11) -> torch.Tensor:
    pos = torch.tensor([[0, 1, 2], [4, 11, -1], [-1, -1, -1], [1, 0, 0], [2, 3, 1], [3, 7, 2]], dtype=torch.int32)
    pos[5, 1] = bad
    return pos


@pytest.mark.parametrize("path", PATHS)
def test_combine_reduce_accepts_the_last_record_of_each_source(path):
    out = _combine(path, _send_pos())
    assert torch.equal(out[1], torch.tensor([16.0, 17, 18, 19]) + torch.tensor([44.0, 45, 46, 47]))  # 4 of 0, 11 of 1
    assert not out[2].any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(12, -1, int64=False))
def test_combine_reduce_rejects_send_pos_outside_its_source(path, value):
    with pytest.raises(ValueError, match=_outside("combine_reduce", "send_pos", "5, 1", value, -1, 12)
                       + re.escape("rows of source 1)")):
        _combine(path, _send_pos(value))


@pytest.mark.parametrize("path", PATHS)
def test_combine_reduce_checks_each_source_against_its_own_rows(path):
    pos = _send_pos()
    pos[0, 2] = 3  # fine for source 1 (12 rows), one past the end of source 2 (3 rows)
    with pytest.raises(ValueError, match=_outside("combine_reduce", "send_pos", "0, 2", 3, -1, 3)):
        _combine(path, pos)


def test_combine_reduce_native_checks_before_its_threads_start():
    """Two threads, several MiB of rows, the bad entry in the last token: the check runs on the calling
    thread (an exception in a worker would call std::terminate and end this process)."""
    num_tokens, hidden = 2048, 1024
    records = torch.zeros(num_tokens, hidden * 4, dtype=torch.uint8)
    pos = torch.arange(num_tokens, dtype=torch.int32).view(-1, 1).repeat(1, 2).contiguous()
    pos[-1, 1] = 2 ** 30
    out = torch.empty(num_tokens, hidden)
    with pytest.raises(ValueError, match=_outside("combine_reduce", "send_pos", f"{num_tokens - 1}, 1", 2 ** 30, -1,
                                                  num_tokens)):
        native().combine_reduce(out.data_ptr(), 0, [records.data_ptr()] * 2, [num_tokens] * 2, pos.data_ptr(), 0, 0,
                                0, num_tokens, 2, hidden, native().DType.FLOAT32, records.shape[1], 0, 0, 0, 2)


def test_combine_reduce_wrapper_checks_the_tensors_behind_the_pointers():
    layout = RecordLayout.build([("x", torch.float32, 4)])
    records = torch.zeros(3, 16, dtype=torch.uint8)
    pos = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"combine_reduce: out must be \[2, 4\] torch.float32"):
        combine_reduce(layout, records, pos, None, None, torch.empty(1, 4), None)
    with pytest.raises(ValueError, match=r"combine_reduce: send_pos must be \[2, 1\] torch.int32"):
        combine_reduce(layout, records, pos.long(), None, None, torch.empty(2, 4), None)
    with pytest.raises(ValueError,
                       match=r"combine_reduce: records\[0\] must be a contiguous \[rows, 16\] uint8 tensor"):
        combine_reduce(layout, records[:, :8], pos, None, None, torch.empty(2, 4), None)


# ---------------------------------------------------------------------------------------- raw native checks
def test_segments_must_fit_in_a_record():
    layout, fields = _rows_case()
    segs = native_segments(layout, fields)
    records = torch.empty(2, layout.record_bytes, dtype=torch.uint8)
    rows = torch.zeros(2, dtype=torch.int64)
    past = [segs[0], segs[1][:5] + (layout.record_bytes - 8, segs[1][6])]  # 16 bytes of idx at record_bytes - 8
    with pytest.raises(ValueError, match=r"pack_rows: segment 1 \(2 x 8 bytes at byte 24\) does not fit in a record "
                                         r"of record_bytes=32"):
        native().pack_rows(records.data_ptr(), past, rows.data_ptr(), 2, layout.record_bytes, 1)
    native().pack_rows(records.data_ptr(), segs, rows.data_ptr(), 2, layout.record_bytes, 1)  # the layout's own fit


def test_pack_rows_native_checks_before_its_threads_start():
    src = torch.zeros(4096, 1024, dtype=torch.uint8)  # 4 MiB of records: two threads
    rows = torch.zeros(4096, dtype=torch.int64)
    rows[-1] = 4096
    records = torch.empty(4096, 1024, dtype=torch.uint8)
    segment = (src.data_ptr(), 1024, 1, 1, 1024, 0, src.shape[0])
    with pytest.raises(ValueError, match=_outside("pack_rows", "src_rows", "4095", 4096, -1, 4096)):
        native().pack_rows(records.data_ptr(), [segment], rows.data_ptr(), 4096, 1024, 2)


# ---------------------------------------------------------------------------------------- quantize_rows
def _quantize(source, num_rows: int = 6):
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    return native_rows(x, num_rows, "e4m3", False, False, source=source, source_div=2)


def test_quantize_rows_accepts_the_last_row_and_minus_one():
    q, _ = _quantize(torch.tensor([7, -1, 0, 6, 1, 2]))  # 7 // 2 == 3, the last of x's 4 rows
    assert torch.equal(q[0].view(torch.uint8), q[3].view(torch.uint8)) and not q[1].view(torch.uint8).any()
    _quantize(None, num_rows=4)


@pytest.mark.parametrize("value", _bad(8, -1))
def test_quantize_rows_rejects_source_outside_x(value):
    with pytest.raises(ValueError, match=_outside("quantize_rows", "source", "2", value, -1, 8)
                       + re.escape("source / source_div indexes the 4 rows of x, source_div=2)")):
        _quantize(torch.tensor([7, -1, value, 6, 1, 2]))


def test_quantize_rows_without_source_rejects_more_rows_than_x():
    with pytest.raises(ValueError,
                       match=r"quantize_rows: num_rows = 5 \(without source\) is more than the 4 rows of x"):
        _quantize(None, num_rows=5)


# ---------------------------------------------------------------------------------------- expert ids
def _topk(value: int) -> torch.Tensor:
    return torch.tensor([[0, 7], [value, -1], [3, 5]])


@pytest.mark.parametrize("path", PATHS)
def test_dispatch_layout_accepts_the_last_expert(path):
    layout = (dispatch_layout(_topk(7), 2, 8, impl="native") if path == "native"
              else dispatch_layout_reference(_topk(7), 2, 8))
    assert layout.num_tokens_per_expert.tolist() == [1, 0, 0, 1, 0, 1, 0, 2]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(8, -1))
def test_dispatch_layout_rejects_expert_ids_outside_the_experts(path, value):
    with pytest.raises(ValueError, match=_outside("dispatch_layout", "topk_idx", "1, 0", value, -1, 8)):
        if path == "native":
            dispatch_layout(_topk(value), 2, 8, impl="native")
        else:
            dispatch_layout_reference(_topk(value), 2, 8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(8, -1))
def test_send_order_rejects_expert_ids_outside_the_experts(path, value):
    assert (send_order if path == "native" else send_order_reference)(_topk(7), 8, 2)[2] == [2, 3]
    with pytest.raises(ValueError, match=_outside("low_latency_send_order", "topk_idx", "1, 0", value, -1, 8)):
        (send_order if path == "native" else send_order_reference)(_topk(value), 8, 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(8, -1))
def test_permute_rejects_expert_ids_outside_the_experts(path, value):
    x = torch.randn(3, 4)
    (permute if path == "native" else permute_reference)(x, _topk(7), 8)
    with pytest.raises(ValueError, match=r"permute: topk_idx entries must be -1 or in \[0, 8\)"):
        (permute if path == "native" else permute_reference)(x, _topk(value), 8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", _bad(5, -1))
def test_unpermute_reduce_rejects_rows_outside_y(path, value):
    y, weights = torch.randn(5, 4), torch.rand(2, 2)
    fn = unpermute_reduce if path == "native" else unpermute_reduce_reference
    fn(y, torch.tensor([[4, -1], [0, 2]]), weights)
    with pytest.raises(ValueError, match=r"unpermute_reduce: row_of entries must be -1 or in \[0, 5\) \(y's rows\)"):
        fn(y, torch.tensor([[4, -1], [value, 2]]), weights)


# ---------------------------------------------------------------------------------------- low-latency combine rows
LOCAL, RANKS, ROWS = 2, 3, 4


def _ranges(begin: int, count: int) -> torch.Tensor:
    """Valid disjoint ranges, then entry [1, 2] replaced by (begin, count)."""
    r = torch.tensor([[(0 << 32) | 1, (1 << 32) | 2, (3 << 32) | 1], [(0 << 32) | 0, (0 << 32) | 2, (2 << 32) | 1]])
    r[1, 2] = (begin << 32) | count
    return r


@pytest.mark.parametrize("path", PATHS)
def test_combine_rows_accepts_a_range_that_ends_at_rows_per_expert(path):
    rows = (combine_rows if path == "native" else combine_rows_reference)(_ranges(2, 2), ROWS)
    assert rows.tolist() == [0, 1, 2, 4, 5, 3, 6, 7]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("begin,count", [(3, 2), (2 ** 30, 1), (0, 2 ** 30), (-1, 2), (-(2 ** 30), 1)])
def test_combine_rows_rejects_ranges_outside_the_expert(path, begin, count):
    value = (begin << 32) | count
    with pytest.raises(ValueError, match=re.escape(
            f"low_latency_combine_rows: layout_range[1, 2] = {value} (begin {begin}, count {count}) spans rows "
            f"[{begin}, {begin + count}), outside [0, {ROWS}) (rows_per_expert)")):
        (combine_rows if path == "native" else combine_rows_reference)(_ranges(begin, count), ROWS)


@pytest.mark.parametrize("path", PATHS)
def test_combine_rows_rejects_overlapping_ranges_that_overflow_the_rows(path):
    fn = combine_rows if path == "native" else combine_rows_reference
    full = torch.full((LOCAL, RANKS), 0, dtype=torch.int64)
    full[:, 0] = ROWS  # begin 0, count ROWS: exactly LOCAL * ROWS rows, the room there is
    assert fn(full, ROWS).shape[0] == LOCAL * ROWS
    full[1, 1] = 1  # one more row, overlapping: one past the room
    with pytest.raises(ValueError, match=r"low_latency_combine_rows: layout_range counts sum to more than "
                                         rf"max_rows={LOCAL * ROWS} \(the room in rows; overlapping ranges\?\)"):
        fn(full, ROWS)
    with pytest.raises(ValueError, match=r"counts sum to more than max_rows"):
        fn(torch.full((LOCAL, RANKS), ROWS, dtype=torch.int64), ROWS)  # every range the whole expert


# ---------------------------------------------------------------------------------------- combine positions
def _positions_case():
    """T = 3 tokens, K = 2, 2 ranks of 2 experts; send order by expert, then token."""
    topk = torch.tensor([[3, 0], [1, -1], [2, 0]])
    msg, experts, _ = send_order(topk, 4, 2)
    return msg, experts


@pytest.mark.parametrize("path", PATHS)
def test_combine_positions_places_each_message_after_its_destination_first(path):
    msg, experts = _positions_case()  # to rank 0: (0,1) (2,1) (1,0); to rank 1: (2,0) (0,0)
    pos = (combine_positions if path == "native" else combine_positions_reference)(msg, experts, 6, 2, 2, [10, 40])
    assert pos.tolist() == [41, 10, 12, -1, 40, 11]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arg,entry,value", [("msg", 2, v) for v in _bad(6, 0)] +
                         [("experts", 4, v) for v in _bad(4, 0)])
def test_combine_positions_rejects_entries_outside_their_range(path, arg, entry, value):
    """msg indexes the T * K = 6 slots, experts the 4 experts."""
    msg, experts = _positions_case()
    {"msg": msg, "experts": experts}[arg][entry] = value
    high = 6 if arg == "msg" else 4
    with pytest.raises(ValueError, match=_outside("low_latency_positions", arg, str(entry), value, 0, high)):
        (combine_positions if path == "native" else combine_positions_reference)(msg, experts, 6, 2, 2, [0, 3])


def test_combine_positions_rejects_firsts_past_int32():
    msg, experts = _positions_case()
    with pytest.raises(ValueError, match=re.escape("low_latency_positions: firsts[1] = 2147483647 is outside "
                                                   "[0, 2147483642]")):
        combine_positions(msg, experts, 6, 2, 2, [0, 2 ** 31 - 1])


# ---------------------------------------------------------------------------------------- low-latency unpack
def _ll_records(counts: list[int]):
    layout = RecordLayout.build([("x", torch.uint8, 16), ("src", torch.int32, 1), ("expert", torch.int32, 1)])
    n = sum(counts)
    records = torch.zeros(n, layout.record_bytes, dtype=torch.uint8)
    layout.view(records, "x").copy_(torch.arange(n * 16).view(n, 16) % 251)
    layout.view(records, "src").copy_(torch.arange(n, dtype=torch.int32).unsqueeze(1))
    layout.view(records, "expert").copy_((torch.arange(n, dtype=torch.int32) % 2).unsqueeze(1))
    return layout, records


def _ll_outputs(rows: int = 8):
    return [torch.zeros(2, rows, 16, dtype=torch.uint8), None, torch.full((2, rows), -1, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)]


def _unpack_ll(path: str, records_counts: list[int], recv_counts: list[int], rows: int = 8):
    layout, records = _ll_records(records_counts)
    outs = _ll_outputs(rows)
    (low_latency_unpack if path == "native" else low_latency_unpack_reference)(layout, records, recv_counts, *outs)
    return outs


@pytest.mark.parametrize("path", PATHS)
def test_low_latency_unpack_accepts_counts_that_sum_to_the_records(path):
    outs = _unpack_ll(path, [3, 5], [3, 5], rows=4)  # 4 records per expert: exactly its rows
    assert outs[4].tolist() == [4, 4]


def test_low_latency_unpack_places_records_out_of_expert_order_alike_on_both_paths():
    """_ll_records alternates experts inside each source's block (senders order them by expert): both
    paths still put each record at the next free row of its (expert, source) block, inside the expert."""
    got, want = _unpack_ll("native", [3, 5], [3, 5], rows=4), _unpack_ll("reference", [3, 5], [3, 5], rows=4)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    assert got[2].tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]  # src: records 0, 2 from rank 0, then 4, 6 from rank 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recv_counts,message", [
    ([3, 6], "recv_counts[1] = 6 is outside [0, 5] (records left of num_records=8)"),
    ([2 ** 30, 0], "recv_counts[0] = 1073741824 is outside [0, 8] (records left of num_records=8)"),
    ([2 ** 62, 2 ** 62], "recv_counts[0] = 4611686018427387904 is outside [0, 8]"),
    ([-1, 9], "recv_counts[0] = -1 is outside [0, 8]"),
    ([3, 4], "recv_counts sum to 7, but records holds num_records=8"),
])
def test_low_latency_unpack_rejects_counts_that_do_not_sum_to_the_records(path, recv_counts, message):
    with pytest.raises(ValueError, match=re.escape(f"low_latency_unpack: {message}")):
        _unpack_ll(path, [3, 5], recv_counts)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("expert", [2, 2 ** 30, -1, -(2 ** 31)])
def test_low_latency_unpack_rejects_expert_ids_outside_the_local_experts(path, expert):
    layout, records = _ll_records([3, 5])
    layout.view(records, "expert")[4] = expert
    with pytest.raises(ValueError, match=re.escape(f"low_latency_unpack: record 4 from rank 1 names local expert "
                                                   f"{expert}, outside [0, 2)")):
        (low_latency_unpack if path == "native" else low_latency_unpack_reference)(layout, records, [3, 5],
                                                                                   *_ll_outputs())


@pytest.mark.parametrize("path", PATHS)
def test_low_latency_unpack_rejects_an_expert_past_its_rows(path):
    with pytest.raises(ValueError, match=r"low_latency_unpack: local expert 0 receives 5 rows, more than its 4"):
        _unpack_ll(path, [4, 5], [4, 5], rows=4)  # 9 records alternate experts: expert 0 gets 5


@pytest.mark.parametrize("path", PATHS)
def test_low_latency_unpack_writes_the_padding(path):
    """Outputs may be recycled memory: every row past a count ends zero (src_info -1) on both paths."""
    layout, records = _ll_records([3, 5])
    outs = [torch.full((2, 8, 16), 0x5A, dtype=torch.uint8), None, torch.full((2, 8), 77, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)]
    (low_latency_unpack if path == "native" else low_latency_unpack_reference)(layout, records, [3, 5], *outs)
    want = _unpack_ll(path, [3, 5], [3, 5])  # into zeros and -1
    for a, b in zip(outs, want):
        assert (a is None and b is None) or torch.equal(a, b)
    assert outs[4].tolist() == [4, 4] and not outs[0][:, 4:].any() and (outs[2][:, 4:] == -1).all()


def test_low_latency_unpack_wrapper_checks_the_outputs():
    layout, records = _ll_records([3, 5])
    outs = _ll_outputs()
    outs[3] = torch.zeros(2, 1, dtype=torch.int64)  # layout_range for 1 rank, 2 ranks' counts
    with pytest.raises(ValueError, match=r"low_latency_unpack: layout_range must be a contiguous \[2, 2\] torch.int64"):
        low_latency_unpack(layout, records, [3, 5], *outs)
    outs = _ll_outputs()
    outs[0] = torch.zeros(2, 8, 8, dtype=torch.uint8)  # rows of 8 bytes for 16-byte x
    with pytest.raises(ValueError, match=r"low_latency_unpack: recv_x must be a contiguous \[E_loc, rows, H\] tensor "
                                         r"of 16-byte rows"):
        low_latency_unpack(layout, records, [3, 5], *outs)


def test_index_dtypes_the_native_paths_read_are_checked():
    layout, fields = _rows_case()
    with pytest.raises(ValueError, match=r"pack_rows: src_rows must be \[2\] int64, got \[2\] torch.int32"):
        pack_rows(layout, fields, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"dispatch_layout: topk_idx must be int64, got torch.int32"):
        dispatch_layout(_topk(1).int(), 2, 8, impl="native")
    with pytest.raises(ValueError, match=r"quantize_rows: source must be \[6\] int64, got \[5\] torch.int64"):
        _quantize(torch.zeros(5, dtype=torch.int64))


def test_native_paths_refuse_tensors_off_the_cpu():
    """The native kernels dereference data_ptr(): a tensor on another device (meta here) is a ValueError."""
    layout, fields = _rows_case()
    with pytest.raises(ValueError, match=r"pack_rows: field idx must be on the CPU like the others"):
        pack_rows(layout, [fields[0], fields[1].to("meta")], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"take_rows: src must be on the CPU like the others"):
        take_rows(torch.empty(2, 3), torch.empty(7, 3, device="meta"), torch.zeros(2, dtype=torch.int64))
    comb = RecordLayout.build([("x", torch.float32, 4)])
    with pytest.raises(ValueError, match=r"combine_reduce: records\[0\] must be a contiguous \[rows, 16\] uint8 tensor "
                                         r"on the CPU, got \[3, 16\] torch.uint8 strides \(16, 1\) on meta"):
        combine_reduce(comb, torch.zeros(3, 16, dtype=torch.uint8, device="meta"), torch.zeros(2, 1, dtype=torch.int32),
                       None, None, torch.empty(2, 4), None)


# ---------------------------------------------------------------------------------------- post_records
def _post(counts: list[int], firsts: list[int], slot_bytes: int = 256, header_at: int = 0, rows_at: int = 64,
          free_at: int = 0):
    """Two destinations' slots (plain memory), one 16-byte field gathered from 6 source rows, a 2-word header."""
    import os
    slots = torch.full((2, slot_bytes), 0x5A, dtype=torch.uint8)
    flags = torch.zeros(2, 2, dtype=torch.int64)  # [dest][consumed, arrived]
    src = torch.arange(6 * 16, dtype=torch.uint8).view(6, 16)
    rows = torch.tensor([5, 0, 3, 1], dtype=torch.int64)
    header = torch.tensor([7, 9], dtype=torch.int64).view(torch.uint8)
    index, outcome = native().post_records(
        [slots[d].data_ptr() for d in range(2)], [flags[d, 0].data_ptr() for d in range(2)],
        [flags[d, 1].data_ptr() for d in range(2)], [os.getpid()] * 2, slot_bytes, free_at, 3, 0.2,
        header.data_ptr(), 16, header_at, rows_at, counts, firsts, [(src.data_ptr(), 16, 1, 1, 16, 0, 6)],
        rows.data_ptr(), 4, 16, 0, 0, 1)
    return slots, flags, src, (index, outcome)


def test_post_records_writes_headers_rows_and_flags():
    slots, flags, src, (index, outcome) = _post([1, 3], [0, 1])
    assert index == -1 and outcome == native().WaitOutcome.REACHED
    assert slots[0, :16].view(torch.int64).tolist() == [7, 9] == slots[1, :16].view(torch.int64).tolist()
    assert torch.equal(slots[0, 64:80], src[5]) and (slots[0, 80:] == 0x5A).all()
    assert torch.equal(slots[1, 64:112].view(3, 16), src[[0, 3, 1]])
    assert flags[:, 1].tolist() == [3, 3]


def test_post_records_waits_for_a_free_slot_and_names_the_destination():
    slots, flags, _, (index, outcome) = _post([1, 3], [0, 1], free_at=1)  # consumed stays 0: nobody frees it
    assert index == 0 and outcome == native().WaitOutcome.TIMEOUT
    assert flags[:, 1].tolist() == [0, 0] and (slots == 0x5A).all()  # nothing written


@pytest.mark.parametrize("counts,firsts,message", [
    ([1, 13], [0, 1], "counts[1] = 13 is outside [0, 12] (the records a slot holds)"),
    ([1, -1], [0, 1], "counts[1] = -1 is outside [0, 12]"),
    ([1, 3], [0, 2], "records [2, +3) of destination 1 are outside the gather's 4"),
    ([1, 3], [2 ** 62, 1], "records [4611686018427387904, +1) of destination 0 are outside the gather's 4"),
])
def test_post_records_rejects_records_outside_the_slot_or_the_gather(counts, firsts, message):
    with pytest.raises(ValueError, match=re.escape(f"post_records: {message}")):
        _post(counts, firsts)


@pytest.mark.parametrize("value", _bad(6, -1))
def test_post_records_checks_every_gathered_row_before_writing(value):
    """A bad row of the last destination's records: nothing goes to the first one either."""
    import os
    slots = torch.full((2, 256), 0x5A, dtype=torch.uint8)
    flags = torch.zeros(2, 2, dtype=torch.int64)
    src = torch.zeros(6, 16, dtype=torch.uint8)
    rows = torch.tensor([5, 0, 3, value], dtype=torch.int64)
    with pytest.raises(ValueError, match=_outside("post_records", "src_rows", "3", value, -1, 6)):
        native().post_records([slots[d].data_ptr() for d in range(2)], [flags[d, 0].data_ptr() for d in range(2)],
                              [flags[d, 1].data_ptr() for d in range(2)], [os.getpid()] * 2, 256, 0, 3, 0.2,
                              src.data_ptr(), 16, 0, 64, [1, 3], [0, 1], [(src.data_ptr(), 16, 1, 1, 16, 0, 6)],
                              rows.data_ptr(), 4, 16, 0, 0, 1)
    assert (slots == 0x5A).all() and not flags.any()


def test_post_records_rejects_a_header_or_rows_outside_the_slot():
    with pytest.raises(ValueError, match=re.escape("post_records: the header [248, +16) is outside the slot of 256")):
        _post([1, 3], [0, 1], header_at=248)
    with pytest.raises(ValueError, match=re.escape("post_records: rows_at 300 is outside the slot of 256 bytes")):
        _post([1, 3], [0, 1], rows_at=300)


# ---------------------------------------------------------------------------------------- topk_summary
@pytest.mark.parametrize("topk", [
    [[3, 0], [1, -1], [2, 0]],
    [[3, 3], [1, 1], [-1, -1]],       # row 0 repeats 3 (row 1 too, later)
    [[-1, 2, 0, 2, 0], [5, 5, 1, 1, 7]],  # the smallest repeated expert of the first such row
    [[-4, 9]],
])
def test_topk_summary_matches_its_reference(topk):
    from moe_comm.ops.layout import topk_summary, topk_summary_reference
    t = torch.tensor(topk)
    assert topk_summary(t) == topk_summary_reference(t)
    assert topk_summary(t[:0]) == topk_summary_reference(t[:0]) == (0, 0, -1, -1)
