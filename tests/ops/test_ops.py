"""Single-process tests of the local ops: each ``_C`` kernel against its plain-torch ``*_reference``
(bitwise), hand-computed examples, and independence from the kernels' thread count."""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

import moe_comm
from moe_comm.core.native import NATIVE_DTYPES, native, native_dtype
from moe_comm.ops import DispatchLayout, dispatch_layout, dispatch_layout_reference, take_rows, take_rows_reference
from moe_comm.ops.combine_reduce import combine_reduce, combine_reduce_reference
from moe_comm.ops.quant import native_rows, quantize_reference
from moe_comm.ops.records import RecordLayout, pack_rows, pack_rows_reference, unpack_rows, unpack_rows_reference

from helpers.bit_checks import assert_same_bits_or_both_nan


def _gen(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across runs, unlike ``hash``)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _assert_layout_equal(got, want) -> None:
    for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {a} != {b}"


# ---------------------------------------------------------------------------------------- layout
def _random_topk(gen, num_tokens, num_topk, num_experts, distinct, hole_frac):
    if distinct:  # DeepEP's routing: top-k of random scores, so ids in a row differ
        idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1).indices
    else:  # repeats allowed
        idx = torch.randint(0, num_experts, (num_tokens, num_topk), generator=gen)
    holes = torch.rand(num_tokens, num_topk, generator=gen) < hole_frac
    return idx.masked_fill(holes, -1).contiguous()


RANKS_EXPERTS = [(1, 8), (4, 8), (8, 8), (3, 12), (4, 12), (1, 99), (3, 99)]


@pytest.mark.parametrize("num_ranks,num_experts", RANKS_EXPERTS)
@pytest.mark.parametrize("num_topk", [1, 3, 8])
@pytest.mark.parametrize("num_tokens", [0, 1, 131])
@pytest.mark.parametrize("distinct", [True, False])
def test_dispatch_layout_random(num_tokens, num_topk, num_ranks, num_experts, distinct):
    gen = _gen(num_tokens, num_topk, num_ranks, num_experts, distinct)
    topk_idx = _random_topk(gen, num_tokens, num_topk, num_experts, distinct, hole_frac=0.2)
    _assert_layout_equal(dispatch_layout(topk_idx, num_ranks, num_experts),
                         dispatch_layout_reference(topk_idx, num_ranks, num_experts))


@pytest.mark.parametrize("num_ranks,num_experts", RANKS_EXPERTS)
@pytest.mark.parametrize("kind", ["all_minus_one", "first_expert", "last_expert", "boundaries", "some_rows_empty"])
def test_dispatch_layout_special(num_ranks, num_experts, kind):
    num_tokens, num_topk = 131, 3
    if kind == "all_minus_one":
        topk_idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    elif kind in ("first_expert", "last_expert"):
        e = 0 if kind == "first_expert" else num_experts - 1
        topk_idx = torch.full((num_tokens, num_topk), e, dtype=torch.int64)
    elif kind == "boundaries":
        choices = torch.tensor([-1, 0, num_experts - 1])
        topk_idx = choices[torch.randint(0, 3, (num_tokens, num_topk), generator=_gen(num_experts))]
    else:
        topk_idx = _random_topk(_gen(num_ranks, num_experts), num_tokens, num_topk, num_experts, True, 0.0)
        topk_idx[::3] = -1
    got = dispatch_layout(topk_idx, num_ranks, num_experts)
    _assert_layout_equal(got, dispatch_layout_reference(topk_idx, num_ranks, num_experts))
    if kind == "all_minus_one":
        assert int(got.num_tokens_per_rank.sum()) == 0 and int(got.num_tokens_per_expert.sum()) == 0
        assert not bool(got.is_token_in_rank.any())
    elif kind == "last_expert":
        assert int(got.num_tokens_per_expert[-1]) == num_tokens * num_topk
        assert int(got.num_tokens_per_rank[-1]) == num_tokens  # a token counts once per rank


def test_dispatch_layout_hand_built():
    # 4 ranks x 2 experts: expert e lives on rank e // 2.
    topk_idx = torch.tensor([[0, 5, -1],    # ranks {0, 2}
                             [3, 2, 1],     # ranks {1, 0}; experts 3 and 2 both on rank 1
                             [-1, -1, -1],  # nowhere
                             [7, 7, 6]],    # rank {3}; expert 7 picked twice
                            dtype=torch.int64)
    got = dispatch_layout(topk_idx, 4, 8)
    assert torch.equal(got.num_tokens_per_rank, torch.tensor([2, 1, 1, 1], dtype=torch.int32))
    assert torch.equal(got.num_tokens_per_expert, torch.tensor([1, 1, 1, 1, 0, 1, 1, 2], dtype=torch.int32))
    assert torch.equal(got.is_token_in_rank, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]],
                                                          dtype=torch.bool))
    _assert_layout_equal(got, dispatch_layout_reference(topk_idx, 4, 8))


# ---------------------------------------------------------------------------------------- records
def _random_bits(gen, rows, cols, dtype):
    """Arbitrary bit patterns (NaNs and infs included): copies must move bytes, not values."""
    raw = torch.randint(0, 256, (rows, cols * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)  # fresh: empty views keep odd strides


def _make_fields(gen, num_src, hidden, x_dtype):
    """Fields as dispatch builds them, with awkward strides: x is a strided row slice of a wider
    tensor, scales are column-major, plus top-k ids/weights, source index and an empty field."""
    wide = _random_bits(gen, 2 * num_src + 1, hidden + 5, x_dtype)
    x = wide[1::2, 3:3 + hidden]  # row stride 2 * (hidden + 5), offset 3 columns
    scales = _random_bits(gen, num_src, 3, torch.float32).T.contiguous().T  # column-major
    topk_idx = torch.randint(-1, 64, (num_src, 3), dtype=torch.int64, generator=gen)
    weights = _random_bits(gen, num_src, 3, torch.float32)
    src_idx = torch.randint(0, 1 << 30, (num_src, 1), dtype=torch.int32, generator=gen)
    empty = torch.empty(num_src, 0, dtype=torch.float32)
    specs = [("x", x_dtype, hidden), ("scales", torch.float32, 3), ("empty", torch.float32, 0),
             ("topk_idx", torch.int64, 3), ("weights", torch.float32, 3), ("src_idx", torch.int32, 1)]
    fields = [x, scales, empty, topk_idx, weights, src_idx]
    assert not x.is_contiguous() and not scales.is_contiguous()
    return RecordLayout.build(specs), fields


def _assert_fields_equal(layout, got_records, want_records):
    assert got_records.shape == want_records.shape and got_records.dtype == torch.uint8
    for f in layout.fields:
        assert torch.equal(layout.view(got_records, f.name).view(torch.uint8),
                           layout.view(want_records, f.name).view(torch.uint8)), f"field {f.name} differs"


X_DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("hidden", [1, 7, 33])
@pytest.mark.parametrize("rows", ["sorted", "unsorted_repeats", "single", "zero", "skips"])
def test_pack_rows_matches_reference(x_dtype, hidden, rows):
    gen = _gen(str(x_dtype), hidden, rows)
    num_src = 23
    layout, fields = _make_fields(gen, num_src, hidden, x_dtype)
    src_rows = {"sorted": torch.arange(num_src),
                "unsorted_repeats": torch.randint(0, num_src, (57,), generator=gen),
                "single": torch.tensor([num_src - 1]),
                "zero": torch.empty(0, dtype=torch.int64),
                "skips": torch.where(torch.arange(57) % 3 == 0, -1, torch.randint(0, num_src, (57,), generator=gen))}[rows]
    out = torch.full((src_rows.shape[0], layout.record_bytes), 0xA5, dtype=torch.uint8)  # -1 must zero it
    got = pack_rows(layout, fields, src_rows, out=out)
    _assert_fields_equal(layout, got, pack_rows_reference(layout, fields, src_rows))
    skip = src_rows < 0
    for f, t in zip(layout.fields, fields):  # and each field is exactly the gathered source rows, or zeros
        want = _as_bytes(t[src_rows.clamp(min=0)]).clone()
        want[skip] = 0
        assert torch.equal(layout.view(got, f.name).view(torch.uint8), want)


def _strided_outputs(gen, layout, num_rows):
    """Output tensors with extra rows (must stay untouched) and awkward strides."""
    outs = []
    for i, f in enumerate(layout.fields):
        if i % 2 == 0:  # column-major
            outs.append(_random_bits(gen, f.num_cols, num_rows + 2, f.dtype).T)
        else:  # a row slice of a wider tensor
            outs.append(_random_bits(gen, num_rows + 2, f.num_cols + 3, f.dtype)[:, 1:1 + f.num_cols])
    return outs


@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("hidden", [7, 33])
@pytest.mark.parametrize("num_rows", [0, 1, 19])
def test_unpack_rows_matches_reference(x_dtype, hidden, num_rows):
    gen = _gen(str(x_dtype), hidden, num_rows, "unpack")
    layout = RecordLayout.build([("x", x_dtype, hidden), ("scales", torch.float32, 3), ("empty", torch.int32, 0),
                                 ("topk_idx", torch.int64, 2), ("src_idx", torch.int32, 1)])
    records = torch.randint(0, 256, (num_rows, layout.record_bytes), dtype=torch.uint8, generator=gen)
    got = _strided_outputs(gen, layout, num_rows)
    want = [t.clone() for t in got]
    unpack_rows(layout, records, got)
    unpack_rows_reference(layout, records, want)
    for f, g, w in zip(layout.fields, got, want):
        assert torch.equal(_as_bytes(g), _as_bytes(w)), f"field {f.name} differs"
        assert torch.equal(_as_bytes(g[:num_rows]), layout.view(records, f.name).view(torch.uint8))


@pytest.mark.parametrize("num_rows", [0, 1, 23])
def test_unpack_rows_scatters_to_dst_rows(num_rows):
    gen = _gen(num_rows, "unpack dst")
    layout = RecordLayout.build([("x", torch.bfloat16, 9), ("src", torch.int32, 1)])
    records = torch.randint(0, 256, (num_rows, layout.record_bytes), dtype=torch.uint8, generator=gen)
    dst_rows = torch.randperm(40, generator=gen)[:num_rows]
    got = _strided_outputs(gen, layout, 38)  # 40 rows
    want = [t.clone() for t in got]
    before = [t.clone() for t in got]
    unpack_rows(layout, records, got, dst_rows=dst_rows)
    unpack_rows_reference(layout, records, want, dst_rows=dst_rows)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[dst_rows] = False
    for f, g, w, b in zip(layout.fields, got, want, before):
        assert torch.equal(_as_bytes(g), _as_bytes(w)), f"field {f.name} differs"
        assert torch.equal(_as_bytes(g[dst_rows]), layout.view(records, f.name).view(torch.uint8))
        assert torch.equal(_as_bytes(g[untouched]), _as_bytes(b[untouched]))


def test_pack_rows_leaves_none_fields_to_the_caller():
    gen = _gen("pack none")
    layout = RecordLayout.build([("x", torch.float32, 5), ("expert", torch.int32, 1)])
    x = torch.randn(6, 5, generator=gen)
    src_rows = torch.tensor([5, 0, 0, 3])
    for fn in (pack_rows, pack_rows_reference):
        records = fn(layout, [x, None], src_rows)
        layout.view(records, "expert").copy_(torch.arange(4, dtype=torch.int32).unsqueeze(1))
        assert torch.equal(layout.view(records, "x"), x[src_rows])
        assert layout.view(records, "expert").view(-1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
@pytest.mark.parametrize("num_sources", [1, 3, 8])
def test_combine_reduce_weighted_matches_reference(dtype, num_sources):
    gen = _gen(str(dtype), num_sources, "weighted")
    layout, records, send_pos, _ = _combine_case(gen, dtype, num_sources, with_weights=False)
    scale = torch.randn(send_pos.shape, generator=gen) * 3
    outs = []
    for fn in (combine_reduce, combine_reduce_reference):
        out = torch.full((send_pos.shape[0], layout.field("x").num_cols), 7, dtype=dtype)
        fn(layout, records, send_pos, None, None, out, None, scale=scale)
        outs.append(out)
    _assert_bitwise(outs[0], outs[1])
    # the same sum written out: fp32 multiply, then fp32 add, sources in order, rounded once
    x = layout.view(records, "x").float()
    acc = torch.zeros(send_pos.shape[0], x.shape[1])
    for j in range(num_sources):
        hit = send_pos[:, j] >= 0
        acc[hit] = acc[hit] + scale[hit, j:j + 1] * x[send_pos[hit, j].long()]
    _assert_bitwise(outs[0], acc.to(dtype))


@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_pack_unpack_round_trip(x_dtype):
    gen = _gen(str(x_dtype), "round trip")
    layout, fields = _make_fields(gen, 31, 33, x_dtype)
    src_rows = torch.randint(0, 31, (45,), generator=gen)
    records = pack_rows(layout, fields, src_rows)
    outs = [torch.empty(45, f.num_cols, dtype=f.dtype) for f in layout.fields]
    unpack_rows(layout, records, outs)
    for f, out, t in zip(layout.fields, outs, fields):
        assert torch.equal(_as_bytes(out), _as_bytes(t[src_rows])), f"field {f.name} differs"


# ---------------------------------------------------------------------------------------- combine
def _combine_case(gen, dtype, num_ranks, num_tokens=37, hidden=19, num_topk=3, with_weights=True, num_bias=0):
    specs = [("x", dtype, hidden)] + ([("weights", torch.float32, num_topk)] if with_weights else [])
    layout = RecordLayout.build(specs)
    num_records = 3 * num_tokens
    records = torch.randint(0, 256, (num_records, layout.record_bytes), dtype=torch.uint8, generator=gen)
    # Finite values across magnitudes, so that fp32 addition order shows in the low bits.
    scale = 10.0 ** torch.randint(-3, 4, (num_records, 1), generator=gen)
    layout.view(records, "x").copy_((torch.randn(num_records, hidden, generator=gen) * scale).to(dtype))
    if with_weights:
        layout.view(records, "weights").copy_(torch.rand(num_records, num_topk, generator=gen) * scale)
    send_pos = torch.randint(0, num_records, (num_tokens, num_ranks), generator=gen, dtype=torch.int32)
    send_pos[torch.rand(num_tokens, num_ranks, generator=gen) < 0.3] = -1  # holes
    send_pos[::5] = -1  # tokens with no contributor at all
    biases = [(torch.randn(num_tokens, hidden, generator=gen) * 100).to(dtype) for _ in range(num_bias)]
    return layout, records, send_pos, biases


def _run_combine(fn, layout, records, send_pos, biases, with_weights):
    num_tokens = send_pos.shape[0]
    out = torch.full((num_tokens, layout.field("x").num_cols), 7, dtype=layout.field("x").dtype)
    w = torch.full((num_tokens, layout.field("weights").num_cols), 7.0) if with_weights else None
    b0, b1 = (list(biases) + [None, None])[:2]
    fn(layout, records, send_pos, b0, b1, out, w)
    return out, w


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits (NaNs included)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}.get(a.dtype)
    assert torch.equal(a.view(bits), b.view(bits)) if bits else torch.equal(a, b)


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("num_bias", [0, 1, 2])
def test_combine_reduce_matches_reference(dtype, num_ranks, with_weights, num_bias):
    gen = _gen(str(dtype), num_ranks, with_weights, num_bias)
    layout, records, send_pos, biases = _combine_case(gen, dtype, num_ranks, with_weights=with_weights,
                                                      num_bias=num_bias)
    got, got_w = _run_combine(combine_reduce, layout, records, send_pos, biases, with_weights)
    want, want_w = _run_combine(combine_reduce_reference, layout, records, send_pos, biases, with_weights)
    _assert_bitwise(got, want)
    if with_weights:
        _assert_bitwise(got_w, want_w)
    # A token nobody returned is exactly its bias sum (or zero), weights exactly zero.
    empty = (send_pos < 0).all(dim=1)
    assert bool(empty.any())
    expected = torch.zeros(int(empty.sum()), got.shape[1])
    for b in biases:
        expected = expected + b[empty].float()
    _assert_bitwise(got[empty], expected.to(dtype))
    if with_weights:
        assert torch.equal(got_w[empty], torch.zeros_like(got_w[empty]))


def test_combine_reduce_summation_order_float32():
    # acc = 0; add rank rows in ascending rank order; then + bias0, then + bias1; fp32 throughout.
    layout = RecordLayout.build([("x", torch.float32, 1), ("weights", torch.float32, 1)])
    rows = torch.tensor([[1e8], [1.0], [-1e8]])
    records = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    layout.view(records, "x").copy_(rows)
    layout.view(records, "weights").copy_(rows)
    send_pos = torch.tensor([[0, 1, 2],    # ((0 + 1e8) + 1) + -1e8 = 0: 1e8 + 1 rounds to 1e8 in fp32
                             [2, 0, 1],    # ((0 + -1e8) + 1e8) + 1 = 1
                             [-1, 1, -1],  # only rank 1
                             [-1, -1, -1]], dtype=torch.int32)
    bias0 = torch.full((4, 1), 1.0)
    bias1 = torch.full((4, 1), 0.5)
    for fn in (combine_reduce, combine_reduce_reference):
        out, w = torch.empty(4, 1), torch.empty(4, 1)
        fn(layout, records, send_pos, bias0, bias1, out, w)
        assert out.flatten().tolist() == [1.5, 2.5, 2.5, 1.5]
        assert w.flatten().tolist() == [0.0, 1.0, 1.0, 0.0]  # weights: same order, no bias


def test_combine_reduce_rounds_once_bfloat16():
    # 1 + 2**-8 + 2**-8 = 1 + 2**-7 in fp32, exact in bf16; rounding after each add would give 1.0
    # (1 + 2**-8 is a tie in bf16 and rounds to even).
    layout = RecordLayout.build([("x", torch.bfloat16, 1)])
    records = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    layout.view(records, "x").copy_(torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]]).to(torch.bfloat16))
    send_pos = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    for fn in (combine_reduce, combine_reduce_reference):
        out = torch.empty(1, 1, dtype=torch.bfloat16)
        fn(layout, records, send_pos, None, None, out, None)
        assert out.item() == 1.0 + 2.0 ** -7


def test_combine_reduce_x_not_first_field():
    gen = _gen("x not first")
    layout = RecordLayout.build([("weights", torch.float32, 3), ("x", torch.float32, 5)])
    records = torch.randint(0, 256, (6, layout.record_bytes), dtype=torch.uint8, generator=gen)
    layout.view(records, "x").copy_(torch.randn(6, 5, generator=gen))
    layout.view(records, "weights").copy_(torch.rand(6, 3, generator=gen))
    send_pos = torch.tensor([[0, 1], [2, -1], [-1, 5]], dtype=torch.int32)
    got, _ = _run_combine(combine_reduce, layout, records, send_pos, [], True)
    want, _ = _run_combine(combine_reduce_reference, layout, records, send_pos, [], True)
    _assert_bitwise(got, want)


# ---------------------------------------------------------------------------------------- build, threads
def test_build_info():
    info = moe_comm.build_info()
    assert info["cpu"] is True
    assert isinstance(info["hardware_threads"], int) and info["hardware_threads"] >= 1
    assert native().hardware_threads() == info["hardware_threads"]


def _segments(layout, tensors):
    """The raw segment tuples of the native API: (ptr, row_stride_B, col_stride_B, elem_B, cols, offset, rows)."""
    return [(t.data_ptr(), t.stride(0) * t.element_size(), t.stride(1) * t.element_size(), t.element_size(),
             f.num_cols, f.offset, t.shape[0]) for f, t in zip(layout.fields, tensors) if f.num_cols]


def test_dispatch_layout_thread_count_independent():
    num_tokens, num_ranks, num_experts = 3 * 4096 + 17, 8, 64  # > 4096 tokens per thread for 2 threads
    topk_idx = _random_topk(_gen("threads layout"), num_tokens, 8, num_experts, True, 0.1)
    results = []
    for threads in (1, 2):
        per_rank = torch.empty(num_ranks, dtype=torch.int32)
        per_expert = torch.empty(num_experts, dtype=torch.int32)
        in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool)
        native().dispatch_layout(per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(), topk_idx.data_ptr(),
                                 num_tokens, 8, num_ranks, num_experts, threads)
        results.append((per_rank, per_expert, in_rank))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    _assert_layout_equal(DispatchLayout(*results[1]), dispatch_layout_reference(topk_idx, num_ranks, num_experts))


def test_pack_unpack_thread_count_independent():
    gen = _gen("threads rows")
    layout, fields = _make_fields(gen, 1500, 501, torch.bfloat16)  # ~1.1 KiB records
    num_rows = 3 * (1 << 20) // layout.record_bytes  # ~3 MiB: 2 threads at 1 MiB per thread
    src_rows = torch.randint(0, 1500, (num_rows,), generator=gen)
    packed = []
    for threads in (1, 2):
        records = torch.zeros(num_rows, layout.record_bytes, dtype=torch.uint8)
        native().pack_rows(records.data_ptr(), _segments(layout, fields), src_rows.data_ptr(), num_rows,
                           layout.record_bytes, threads)
        packed.append(records)
    _assert_fields_equal(layout, packed[0], packed[1])
    _assert_fields_equal(layout, packed[1], pack_rows_reference(layout, fields, src_rows))
    unpacked = []
    for threads in (1, 2):
        outs = [torch.zeros(num_rows, f.num_cols, dtype=f.dtype).T.contiguous().T for f in layout.fields]
        native().unpack_rows(_segments(layout, outs), packed[0].data_ptr(), 0, num_rows, layout.record_bytes, threads)
        unpacked.append(outs)
    for f, a, b, t in zip(layout.fields, *unpacked, fields):
        assert torch.equal(_as_bytes(a), _as_bytes(b)), f"field {f.name} differs"
        assert torch.equal(_as_bytes(a), _as_bytes(t[src_rows])), f"field {f.name} differs"


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
def test_combine_reduce_thread_count_independent(dtype):
    gen = _gen(str(dtype), "threads combine")
    num_ranks, num_tokens, hidden, num_topk = 4, 1200, 256, 8
    layout, records, send_pos, biases = _combine_case(gen, dtype, num_ranks, num_tokens, hidden, num_topk, True, 2)
    # The kernel splits above 1 MiB of returned rows per thread.
    assert num_tokens * num_ranks * layout.record_bytes > 2 * (1 << 20)
    w_field = layout.field("weights")
    outs = []
    for threads in (1, 2):
        out = torch.empty(num_tokens, hidden, dtype=dtype)
        w = torch.empty(num_tokens, num_topk)
        native().combine_reduce(out.data_ptr(), w.data_ptr(), [records.data_ptr()] * num_ranks,
                                [records.shape[0]] * num_ranks, send_pos.data_ptr(), 0,
                                biases[0].data_ptr(), biases[1].data_ptr(), num_tokens, num_ranks, hidden,
                                native_dtype(dtype), layout.record_bytes, layout.field("x").offset, w_field.offset,
                                num_topk, threads)
        outs.append((out, w))
    _assert_bitwise(outs[0][0], outs[1][0])
    _assert_bitwise(outs[0][1], outs[1][1])
    want, want_w = _run_combine(combine_reduce_reference, layout, records, send_pos, biases, True)
    _assert_bitwise(outs[1][0], want)
    _assert_bitwise(outs[1][1], want_w)


def _nonfinite_combine_case(dtype):
    """A reduction whose rows hold NaN, infinities and the largest finite value (sums that overflow)."""
    layout, records, send_pos, biases = _combine_case(_gen(str(dtype), "isa"), dtype, 3, 300, 1100, 4, True, 2)
    x = layout.view(records, "x").view(dtype)
    x[::7, ::5] = float("nan")
    x[1::7, 1::5] = float("inf")
    x[2::7, 2::5] = -float("inf")
    x[3::7, 3::5] = torch.finfo(dtype).max
    return layout, records, send_pos, biases


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
def test_combine_reduce_nonfinite_matches_reference(dtype):
    """On the build this CPU runs, NaN, infinities and overflowing sums reduce as the reference does
    (test_combine_reduce_builds_agree_bitwise ties the other build to this one)."""
    case = _nonfinite_combine_case(dtype)
    got, _ = _run_combine(combine_reduce, *case, True)
    want, _ = _run_combine(combine_reduce_reference, *case, True)
    assert bool(got.isnan().any()) and bool(got.isinf().any())
    # torch keeps a NaN's sign and payload when rounding to 16 bits, the kernels write the canonical
    # quiet NaN: compare NaN positions, and bits elsewhere
    assert torch.equal(got.isnan(), want.isnan())
    _assert_bitwise(got.masked_fill(got.isnan(), 0), want.masked_fill(want.isnan(), 0))


@pytest.mark.parametrize("dtype", list(NATIVE_DTYPES))
def test_combine_reduce_builds_agree_bitwise(dtype):
    """The AVX2 build of the reduction and the generic build give the same bits, NaNs included."""
    if native().combine_reduce_isa() == "generic":
        pytest.skip("this CPU runs only the generic build of combine_reduce (no AVX2 + F16C): no other build "
                    "to compare it with")
    case = _nonfinite_combine_case(dtype)
    results = []
    try:
        for generic in (False, True):
            native().set_combine_reduce_generic(generic)
            results.append((native().combine_reduce_isa(), _run_combine(combine_reduce, *case, True)))
    finally:
        native().set_combine_reduce_generic(False)
    (isa_a, (out_a, w_a)), (isa_b, (out_b, w_b)) = results
    assert (isa_a, isa_b) == ("avx2", "generic")
    assert bool(out_a.isnan().any()) and bool(out_a.isinf().any())
    _assert_bitwise(out_a, out_b)
    _assert_bitwise(w_a, w_b)


def test_combine_reduce_per_source_records():
    """Records split into one tensor per source (rows read in place) reduce exactly as one shared tensor."""
    gen = _gen("per source")
    dtype, num_ranks = torch.bfloat16, 3
    layout, records, send_pos, biases = _combine_case(gen, dtype, num_ranks, 200, 256, 4, False, 1)
    want, _ = _run_combine(combine_reduce, layout, records, send_pos, biases, False)
    # Source j's rows become their own tensor (a copy elsewhere in memory), positions made relative.
    blocks, rel = [], send_pos.clone()
    for j in range(num_ranks):
        used = send_pos[:, j][send_pos[:, j] >= 0].long()
        begin = int(used.min()) if used.numel() else 0
        end = int(used.max()) + 1 if used.numel() else 0
        blocks.append(records[begin:end].clone())
        rel[:, j] = torch.where(send_pos[:, j] >= 0, send_pos[:, j] - begin, -1)
    for fn in (combine_reduce, combine_reduce_reference):
        got, _ = _run_combine(fn, layout, blocks, rel, biases, False)
        _assert_bitwise(got, want)


@pytest.mark.parametrize("dtype,cols,strided", [(torch.bfloat16, 7168, False), (torch.int32, 1, False),
                                                (torch.float32, 5, True), (torch.uint8, 37, False)])
def test_take_rows_matches_reference(dtype, cols, strided):
    gen = _gen("gather", str(dtype), cols, strided)
    src = torch.randint(0, 100, (700, cols * (2 if strided else 1)), generator=gen).to(dtype)
    src = src[:, ::2] if strided else src
    rows = torch.randint(0, 700, (900,), generator=gen)  # repeats allowed; 900 x 14 KB streams
    rows[::7] = -1  # zero rows
    got = torch.ones(900, cols, dtype=dtype)
    want = torch.ones(900, cols, dtype=dtype)
    take_rows(got, src, rows)
    take_rows_reference(want, src, rows)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not bool(got[rows < 0].view(torch.uint8).any())


# Each build of quantize_rows: the IsaLevel that caps the kernel at it, and the name quantize_rows_isa() gives it.
QUANT_BUILDS = [("AVX512", "avx512"), ("AVX2", "avx2"), ("GENERIC", "generic")]


@contextlib.contextmanager
def _quantize_rows_build(cap: str, isa: str):
    """Runs the block on the ``isa`` build of quantize_rows (capped at IsaLevel ``cap``); skips where this CPU
    has no such build, so a CPU with fewer builds does not run one build several times."""
    native().set_quantize_rows_isa_cap(getattr(native().IsaLevel, cap))
    try:
        if native().quantize_rows_isa() != isa:
            pytest.skip(f"this CPU has no {isa} build of quantize_rows (capped at {cap} it runs "
                        f"{native().quantize_rows_isa()}, which another case tests)")
        yield
    finally:
        native().set_quantize_rows_isa_cap(native().IsaLevel.AVX512)


@pytest.mark.parametrize("cap,isa", QUANT_BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rows_builds_agree_bitwise(dtype, cap, isa):
    """Each build of the C++ cast the CPU can run (AVX-512, AVX2, generic) gives the reference's codes and
    scales bit for bit, gathering rows (zero rows included) or not, with NaN and Inf present."""
    gen = _gen(str(dtype), "quant isa")
    x = (torch.randn(37, 1536, generator=gen) * 2.0 ** torch.randint(-30, 12, (37, 1), generator=gen)).to(dtype)
    x[2, 7], x[5, 1000], x[9] = float("nan"), -float("inf"), 0.0
    source = torch.randint(-1, 37 * 2, (50,), generator=gen)
    cases = (("e4m3", False, False), ("e4m3", True, True), ("e5m2", True, False), ("int8", False, False))
    with _quantize_rows_build(cap, isa):
        for fmt, round_scale, ue8m0 in cases:
            q, s = native_rows(x, 50, fmt, round_scale, ue8m0, source=source, source_div=2)
            rows = torch.where(source >= 0, source // 2, 0)
            gathered = torch.where((source >= 0)[:, None], x[rows], torch.zeros((), dtype=dtype))
            q_ref, s_ref = quantize_reference(gathered, fmt, round_scale=round_scale, use_ue8m0=ue8m0)
            assert_same_bits_or_both_nan(q, q_ref, f"{fmt} codes, {isa}")
            assert_same_bits_or_both_nan(s, s_ref, f"{fmt} scales, {isa}")


@pytest.mark.parametrize("cap,isa", QUANT_BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_rows_every_code_on_every_build(dtype, cap, isa):
    """The C++ dequantize gives the reference's bits for every FP8 and INT8 code, under fp32 scales from
    tiny to huge and every UE8M0 exponent byte, on each build the CPU can run."""
    gen = _gen(str(dtype), "dequant isa")
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).repeat(4, 1).reshape(8, 128)  # every code, 4x
    fp32_scales = (2.0 ** torch.randint(-140, 120, (8, 1), generator=gen).float()) * torch.rand(8, 1, generator=gen)
    exponent_bytes = torch.arange(256, dtype=torch.int64).to(torch.uint8)[torch.randperm(256, generator=gen)[:32]]
    cases = []
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = codes.view(fp8).repeat(1, 4)  # [8, 512]: 4 groups of 128 per row
        cases.append((q, fp32_scales.repeat(1, 4)))
        cases.append((q, exponent_bytes.view(8, 4).view(torch.int32).reshape(8, 1)))
    cases.append((codes.view(torch.int8), fp32_scales.reshape(8)))
    with _quantize_rows_build(cap, isa):
        for q, scales in cases:
            got = moe_comm.ops.dequantize(q, scales, dtype, impl="native")
            want = moe_comm.ops.dequantize_reference(q, scales, dtype)
            assert_same_bits_or_both_nan(got, want, f"{q.dtype} {scales.dtype} scales, {isa}")
