"""The planted bugs of ``make test-mutants`` (tools/mutants/run.py), as data.

Each mutant replaces one snippet of one file in a scratch copy of the repository (never the working
tree): ``old`` must occur exactly once in ``file``, or the run stops and says so (the code moved on:
update the mutant). Each is a bug a developer could plausibly write, that compiles and imports, and that
changes what a user sees; the fast test tier (``python -m pytest tests``) must fail on every one.
``hints``: test files run first (whole files: the fast tier thins its cases per module, so a file is
its unit), to find the kill sooner; the rest of the fast tier still runs after them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    description: str
    hints: Tuple[str, ...] = ()


MUTANTS: Tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ shm flags (csrc/cpu/flags.cpp)
    Mutant(
        id="flags-zombie-alive",
        file="csrc/cpu/flags.cpp",
        old="return paren == nullptr || (paren[1] != '\\0' && paren[2] != 'Z' && paren[2] != 'X');",
        new="return paren == nullptr || (paren[1] != '\\0' && paren[2] != 'X');",
        description="an exited but unreaped peer (zombie, state Z) counts as alive: waiters on it sit out "
                    "the whole deadline instead of reporting the exit",
        hints=("tests/transport/test_shm.py", "tests/transport/test_store_host.py"),
    ),
    Mutant(
        id="flags-exact-ignored",
        file="csrc/cpu/flags.cpp",
        old="if (value < targets[i] || (exact && value > targets[i])) {",
        new="if (value < targets[i] || (!exact && value > targets[i])) {",
        description="the exact/at-least test is inverted: an exact wait takes a flag past its target as "
                    "arrived (a setter out of step goes unnoticed) and an at-least wait reports it as past",
        hints=("tests/transport/test_shm.py",),
    ),
    # ------------------------------------------------------------------ dispatch layout (csrc/cpu/layout.cpp)
    Mutant(
        id="layout-rank-counted-per-slot",
        file="csrc/cpu/layout.cpp",
        old="if (!in_rank[r]) {\n                        in_rank[r] = true;\n                        ++rh[r];\n"
            "                    }",
        new="in_rank[r] = true;\n                    ++rh[r];",
        description="num_tokens_per_rank counts a token once per top-k slot on the rank, not once per rank "
                    "(two experts of one rank count it twice)",
        hints=("tests/csrc/test_native_bounds.py", "tests/buffer/test_reference.py"),
    ),
    # ------------------------------------------------------------------ combine reduction (csrc/cpu/reduce.cpp)
    Mutant(
        id="reduce-sources-reversed",
        file="csrc/cpu/reduce.cpp",
        old="for (int64_t j = 0; j < num_rows; ++j) {\n            const uint16_t* x = rows[j] + h;",
        new="for (int64_t j = num_rows - 1; j >= 0; --j) {\n            const uint16_t* x = rows[j] + h;",
        description="the AVX2 bf16 combine sums its sources last to first (\"addition commutes\"): other "
                    "fp32 roundings, so other bits than the reference and the generic build",
        hints=("tests/backends/test_cuda_backend.py", "tests/buffer/test_reference.py"),
    ),
    # ------------------------------------------------------------------ FP8 / UE8M0 casts
    Mutant(
        id="fp8-ties-away",
        file="csrc/common/numeric.h",
        old="const uint32_t odd = (bits >> kDrop) & 1u;",
        new="const uint32_t odd = (bits >> (kDrop - 1)) & 1u;",
        description="the float8 casts (E4M3/E5M2) read the round bit where the kept lsb belongs (a shift "
                    "off by one): ties round away from zero instead of to even",
        hints=("tests/buffer/test_low_latency.py", "tests/ops/test_fp8.py"),
    ),
    Mutant(
        id="ue8m0-exponent-floor",
        file="csrc/cpu/quant.cpp",
        old="- 127u + ((bits & kMantissa) != 0 ? 1u : 0u);",
        new="- 127u;",
        description="the power-of-two (round_scale / UE8M0) scale rounds its exponent down, not up: "
                    "amax / 448 not a power of two gives a scale too small, and codes saturate",
        hints=("tests/backends/test_cuda_backend.py", "tests/ops/test_fp8.py"),
    ),
    # ------------------------------------------------------------------ LogFMT (csrc/common/logfmt.h)
    Mutant(
        id="logfmt-decode-code-offset",
        file="csrc/common/logfmt.h",
        old="exp2(add_rn(mul_rn(add_rn(static_cast<float>(code), -1.0f), dv.step), dv.log_amin))",
        new="exp2(add_rn(mul_rn(static_cast<float>(code), dv.step), dv.log_amin))",
        description="the LogFMT decoder takes code k as level k, not k - 1 (code 1 is 2^log_amin): every "
                    "cast value comes back one step too large",
        hints=("tests/ops/test_logfmt.py", "tests/buffer/test_logfmt_combine.py"),
    ),
    # ------------------------------------------------------------------ cuda_host ring publish (csrc/cuda/protocol/ring.h)
    Mutant(
        id="ring-tail-before-data",
        file="csrc/cuda/protocol/ring.h",
        old="        for (int64_t i = sent; i < sent + n; ++i) fill(ring.slot(i), i);\n"
            "        G::sync();\n"
            "        sent += n;\n"
            "        if (G::leader()) ring_publish_tail<P>(ring, sent);\n",
        new="        if (G::leader()) ring_publish_tail<P>(ring, sent + n);\n"
            "        for (int64_t i = sent; i < sent + n; ++i) fill(ring.slot(i), i);\n"
            "        G::sync();\n"
            "        sent += n;\n",
        description="the ring sender publishes its tail before it writes the slots: the receiver may read "
                    "slots not yet written (a data race)",
        hints=("tests/csrc/test_tsan_stress.py", "tests/backends/test_cuda_host.py"),
    ),
    # ------------------------------------------------------------------ call agreement (moe_comm/protocol/agreement.py)
    Mutant(
        id="agreement-peer-rejection-ignored",
        file="moe_comm/protocol/agreement.py",
        old="return [r for r, flag in enumerate(shake.field(Field.REJECTED)) if flag > 0]",
        new="return [r for r, flag in enumerate(shake.field(Field.REJECTED)) if flag > 0 and r < 0]",
        description="the verdict ignores the rejected bit: the other ranks judge the rejecting rank's empty "
                    "vector as arguments, and fail with a wrong message instead of its reason",
        hints=("tests/protocol/test_agreement.py",),
    ),
    Mutant(
        id="posted-headers-not-compared",
        file="moe_comm/protocol/agreement.py",
        old="                check(shake, op, compare)\n                if verdict is not None:",
        new="                if verdict is not None:",
        description="the verdict judges call numbers and rejections but not the vectors' fields and counts: "
                    "a rank with another hidden size or M goes unnoticed (low-latency headers and handshakes)",
        hints=("tests/buffer/test_faults.py", "tests/buffer/test_ll_no_round_trip.py"),
    ),
    # ------------------------------------------------------------------ shm posts (moe_comm/transport/shm.py)
    Mutant(
        id="shm-post-regions-overlap",
        file="moe_comm/transport/shm.py",
        old="rows_at = _post_rows_offset(len(self.local), header_bytes) + me * room * record_bytes",
        new="rows_at = _post_rows_offset(len(self.local), header_bytes) + me * room",
        description="a source's region in the receiver's slot is placed in rows, not bytes: sources' rows "
                    "overlap and overwrite each other",
        hints=("tests/buffer/test_low_latency.py",),
    ),
    # ------------------------------------------------------------------ kernels' call headers (csrc/cuda/kernels/low_latency.h)
    Mutant(
        id="kernel-verdict-compares-nothing",
        file="csrc/common/call_header.h",
        old="if (!is_rejected && !((compare >> w) & 1)) continue;",
        new="if (!is_rejected && !((compare >> w) & 0)) continue;",
        description="the native verdict on call headers (the kernels' receive, the shm receive's first check) "
                    "judges only the rejected bits: a rank with another hidden size, expert count or format is "
                    "read as if it agreed (rows at other offsets)",
        hints=("tests/buffer/test_ll_no_round_trip.py", "tests/buffer/test_faults.py"),
    ),
    Mutant(
        id="mismatch-record-kept",
        file="moe_comm/backends/cuda/device_kernels.py",
        old="            self.kernel.clear()",
        new="            pass",
        description="the device builds' adapter keeps a MISMATCH record after its verdict was raised: the "
                    "buffer should go on, but every later receive reports the old mismatch (and, on a GPU, "
                    "the record stops every later launch)",
        hints=("tests/backends/test_cuda_backend.py",),
    ),
    Mutant(
        id="capture-waits-on-the-host",
        file="moe_comm/backends/cuda/device_kernels.py",
        old="        if not receive or self.comm.capturing():",
        new="        if not receive:",
        description="a receive under CUDA-graph capture synchronises the comm stream and reads the record on "
                    "the host, which a capture refuses: a Buffer-level low-latency step cannot be captured",
        hints=("tests/backends/test_cuda_backend.py",),
    ),
    Mutant(
        id="call-number-from-the-launch-argument",
        file="csrc/cuda/kernels/low_latency.h",
        old="    c.call = ll_call_number(k.half, *calls);",
        new="    (void)calls;",
        description="a launch with a call header takes its call number from its argument instead of the count "
                    "in its buffer: a CUDA graph's replay posts the captured number again, and its peers, on "
                    "the next call, wait for a header that never comes",
        hints=("tests/backends/test_cuda_host.py",),
    ),
    # ------------------------------------------------------------------ kernels' LogFMT combine (csrc/cuda/kernels/low_latency.h)
    Mutant(
        id="kernel-logfmt-row-truncated",
        file="csrc/cuda/kernels/low_latency.h",
        old="const int64_t row_bytes = a.logfmt ? logfmt::max_row_bytes(l.hidden) : 2 * l.hidden;",
        new="const int64_t row_bytes = 2 * l.hidden;",
        description="the kernels' LogFMT combine puts 2 * hidden bytes of each encoded row: a row with raw "
                    "chunks (larger than that) arrives cut short",
        hints=("tests/buffer/test_logfmt_combine.py",),
    ),
    # ------------------------------------------------------------------ handle validation (moe_comm/protocol/handle.py)
    Mutant(
        id="handle-send-head-unchecked",
        file="moe_comm/protocol/handle.py",
        old="wrong = handle.sent[2]\n",
        new="wrong = None\n",
        description="a combine handle's send_head is no longer checked against is_token_in_rank (the check "
                    "dropped as redundant): a tampered handle combines the wrong rows",
        hints=("tests/protocol/test_agreement.py", "tests/buffer/test_errors.py"),
    ),
    Mutant(
        id="handle-recv-rows-transposed",
        file="moe_comm/protocol/handle.py",
        old="return int(self.rank_prefix_matrix[-1, rank].item())",
        new="return int(self.rank_prefix_matrix[rank, -1].item())",
        description="the rows a rank received are read from its row of rank_prefix_matrix (what ranks "
                    "0..rank sent to the last rank), not from the last row's column",
        hints=("tests/buffer/test_intranode.py", "tests/protocol/test_agreement.py"),
    ),
    # ------------------------------------------------------------------ shrink masks (moe_comm/protocol/shrink.py)
    Mutant(
        id="shrink-late-not-noted",
        file="moe_comm/protocol/shrink.py",
        old="return [MARK, call] + _bitmap(masked, num_ranks) + _bitmap(late, num_ranks)",
        new="return [MARK, call] + _bitmap(masked, num_ranks) + _bitmap(masked, num_ranks)",
        description="a shrink note repeats the masked set where the late set belongs (copy-paste): ranks "
                    "that saw a peer late do not tell the others, and the masks differ between ranks",
        hints=("tests/protocol/test_shrink.py",),
    ),
    # ------------------------------------------------------------------ MPI deadline (moe_comm/transport/mpi.py)
    Mutant(
        id="mpi-deadline-restarts",
        file="moe_comm/transport/mpi.py",
        old="next_check = now + _LIVENESS_EVERY_S\n",
        new="deadline, next_check = now + self.timeout_s, now + _LIVENESS_EVERY_S\n",
        description="the MPI wait restarts its deadline at every liveness check: while the late peer's "
                    "process lives, the wait never times out",
        hints=("tests/transport/test_mpi.py",),
    ),
    Mutant(
        id="mpi-late-ranks-off-by-one",
        file="moe_comm/transport/mpi.py",
        old="late = [r for r, n in zip(self._host_ranks, counts) if n < self._entered]",
        new="late = [r for r, n in zip(self._host_ranks, counts) if n <= self._entered]",
        description="the MPI timeout names as late every rank at this rank's exchange count too (<= for <): "
                    "the ranks that did arrive are blamed",
        hints=("tests/transport/test_mpi.py",),
    ),
    # ------------------------------------------------------------------ LocalWorld's forked ranks
    Mutant(
        id="rank-ignores-dead-owner",
        file="moe_comm/launch/spawned.py",
        old="if self._owner is not None and not self._owner.is_alive():",
        new="if self._owner is not None and self._owner.is_alive() is None:",
        description="an idle rank no longer notices that the process that started its world is gone: "
                    "after a CI timeout kills the test run, its ranks and the forkserver wait for ever",
        hints=("tests/launch/test_launch.py",),
    ),
    Mutant(
        id="forked-rank-skips-mpi-finalize",
        file="moe_comm/launch/spawned.py",
        old="if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():",
        new="if mpi is not None and mpi.Is_initialized() and mpi.Is_finalized():",
        description="a forked rank that initialised MPI leaves without MPI_Finalize: MPICH's segment "
                    "stays named in /dev/shm",
        hints=("tests/transport/test_mpi.py",),
    ),
    # ------------------------------------------------------------------ ops permute / unpermute
    Mutant(
        id="permute-inclusive-prefix",
        file="moe_comm/ops/permute.py",
        old="first_of_expert = (per_expert.cumsum(0) - per_expert)[expert]",
        new="first_of_expert = per_expert.cumsum(0)[expert]",
        description="permute places a routed row by the inclusive prefix of the expert counts where the "
                    "exclusive one belongs: rows land one expert's count too early",
        hints=("tests/ops/test_fused_ops.py",),
    ),
    Mutant(
        id="unpermute-weights-dropped",
        file="moe_comm/ops/unpermute.py",
        old="combine_reduce(layout, records, row_of.to(torch.int32), None, None, out, None, scale=topk_weights)",
        new="combine_reduce(layout, records, row_of.to(torch.int32), None, None, out, None, scale=None)",
        description="the native unpermute_reduce forgets the top-k weights: an unweighted sum of the "
                    "expert rows",
        hints=("tests/ops/test_fused_ops.py",),
    ),
    # ------------------------------------------------------------------ low-latency posts and receives (csrc/cpu)
    Mutant(
        id="post-rows-of-the-first-destination",
        file="csrc/cpu/post.cpp",
        old="pack_rows(rows, p.segments, p.num_segments, p.src_rows + first, count, p.record_bytes, p.num_threads);",
        new="pack_rows(rows, p.segments, p.num_segments, p.src_rows, count, p.record_bytes, p.num_threads);",
        description="the shm transport's native post gathers every destination's records from the start of the "
                    "send order: ranks past the first receive another rank's tokens",
        hints=("tests/csrc/test_native_bounds.py", "tests/buffer/test_low_latency.py"),
    ),
    Mutant(
        id="ll-unpack-padding-skipped",
        file="csrc/cpu/low_latency.cpp",
        old="if (pad == 0) continue;",
        new="if (pad >= 0) continue;",
        description="the low-latency receive leaves the rows past each count as the recycled memory held them: "
                    "outputs differ run to run where they must be zero (src_info -1)",
        hints=("tests/csrc/test_native_bounds.py", "tests/buffer/test_output_digests.py"),
    ),
    Mutant(
        id="combine-positions-shifted",
        file="csrc/cpu/low_latency.cpp",
        old="pos[msg[i]] = static_cast<int32_t>(next[static_cast<size_t>(experts[i] / num_local_experts)]++);",
        new="pos[msg[i]] = static_cast<int32_t>(++next[static_cast<size_t>(experts[i] / num_local_experts)]);",
        description="a low-latency combine finds each message's returned row one row late: weights meet the "
                    "next message's expert output",
        hints=("tests/csrc/test_native_bounds.py", "tests/buffer/test_low_latency.py"),
    ),
    Mutant(
        id="topk-summary-repeats-none",
        file="csrc/cpu/layout.cpp",
        old="if (row[static_cast<size_t>(k)] >= 0 && row[static_cast<size_t>(k)] == row[static_cast<size_t>(k - 1)]) {",
        new="if (row[static_cast<size_t>(k)] >= 0 && row[static_cast<size_t>(k)] == row[static_cast<size_t>(k - 1)] + 1) {",
        description="the top-k checks' native pass looks for neighbouring experts instead of repeated ones: a row "
                    "that picks an expert twice is let through, and rows of consecutive experts are refused",
        hints=("tests/csrc/test_native_bounds.py", "tests/buffer/test_errors.py"),
    ),
    # ------------------------------------------------------------------ a Triton kernel (moe_comm/ops/triton/)
    Mutant(
        id="triton-unpermute-skips-row0",
        file="moe_comm/ops/triton/unpermute.py",
        old="if row >= 0:",
        new="if row > 0:",
        description="the Triton unpermute kernel tests row > 0 for \"routed\" (row_of is -1 when not): the "
                    "expert output in row 0 is dropped from its token",
        hints=("tests/ops/test_fused_ops.py",),
    ),
    Mutant(
        id="triton-cast-ties-down",
        file="moe_comm/ops/triton/rounding.py",
        old="rounded = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)",
        new="rounded = (bits + ((1 << (DROP - 1)) - 1)) & ~((1 << DROP) - 1)",
        description="the Triton kernels' cast to bf16/fp16/fp8 rounds ties down, not to even (the odd-bit "
                    "term left out): other bits than torch's casts",
        hints=("tests/ops/test_fused_ops.py",),
    ),
    # ------------------------------------------------------------------ torch.compile (moe_comm/buffer/library.py)
    Mutant(
        id="fake-scales-row-major",
        file="moe_comm/buffer/library.py",
        old="scales = x.new_empty((local, width, rows), dtype=dtype).transpose(1, 2)",
        new="scales = x.new_empty((local, rows, width), dtype=dtype)",
        description="the fake of the low-latency dispatch gives its FP8 scales row-major where the call returns "
                    "them column-major (DeepEP's layout): a compiled graph assumes the wrong strides",
        hints=("tests/compile/test_compiled_buffer.py",),
    ),
    Mutant(
        id="state-not-chained",
        file="moe_comm/buffer/library.py",
        old="    *outputs, buffer._op_state = result\n",
        new="    *outputs, _ = result\n",
        description="a compiled call drops the state its op returns: the buffer's calls no longer form one "
                    "chain, so the compiler may reorder them or drop one whose outputs go unused",
        hints=("tests/compile/test_compiled_buffer.py",),
    ),
    Mutant(
        id="dispatch-backward-unmasked-weights",
        file="moe_comm/buffer/library.py",
        old="else torch.where(recv_idx >= 0, grad_weights, 0.0)",
        new="else grad_weights",
        description="the dispatch's backward sums the received weights' gradients at every slot, also where the "
                    "dispatch set the weight to 0 (another rank's expert): wrong top-k weight gradients",
        hints=("tests/compile/test_compiled_buffer.py",),
    ),
    Mutant(
        id="shm-empty-rows-keep-dtype",
        file="moe_comm/transport/shm.py",
        old="        data = input.contiguous().view(torch.uint8).view(input.shape[0], row_bytes)\n",
        new="        data = input.contiguous().view(torch.uint8).view(input.shape[0], row_bytes) if input.numel() "
            "else input\n",
        description="a rank that sends no rows in a small all-to-all keeps its input's dtype, so the rows it "
                    "receives from other hosts are sized as its own dtype's elements: garbage internode handles",
        hints=("tests/buffer/test_internode.py",),
    ),
    # ------------------------------------------------------------------ ElasticBuffer (DeepEP V2's API)
    Mutant(
        id="elastic-combine-rank-order",
        file="moe_comm/buffer/elastic_combine.py",
        old="    pos = slot_rows if rank_of_slot is None else torch.where(last_of_group(rank_of_slot), slot_rows, -1)\n",
        new="    pos = slot_rows if rank_of_slot is None else torch.where(last_of_group(rank_of_slot), slot_rows, -1)\n"
            "    pos = pos.gather(1, rank_of_slot.clamp(min=0).argsort(dim=1, stable=True)) if rank_of_slot is not None "
            "else pos\n",
        description="the V2 combine sums a token's ranks in rank order instead of the order of their last top-k "
                    "slots: not bitwise DeepEP V2's result",
        hints=("tests/buffer/test_elastic.py",),
    ),
    Mutant(
        id="elastic-expanded-unaligned",
        file="moe_comm/buffer/elastic_layout.py",
        old="    first_row = torch.cat([zero, aligned(counts64, alignment).cumsum(0)])\n",
        new="    first_row = torch.cat([zero, counts64.cumsum(0)])\n",
        description="the expanded layout starts each expert's rows right after the previous expert's, not at a "
                    "multiple of expert_alignment: the rows disagree with psum_num_recv_tokens_per_expert",
        hints=("tests/buffer/test_elastic.py",),
    ),
    # ------------------------------------------------------------------ TileLang programs (moe_comm/ops/tilelang)
    Mutant(
        id="tilelang-encode-ties-down",
        file="moe_comm/ops/tilelang/codec.py",
        old="    rounded = (magnitude_bits + T.uint32((1 << (drop - 1)) - 1) + ((magnitude_bits >> T.uint32(drop)) & "
            "T.uint32(1))) \\\n",
        new="    rounded = (magnitude_bits + T.uint32((1 << (drop - 1)) - 1)) \\\n",
        description="the CPU build's narrow-float encoder rounds exact ties down instead of to even: FP8 codes "
                    "differ from torch's cast at every odd-mantissa tie",
        hints=("tests/ops/test_tilelang.py", "tests/ops/test_fused_ops.py"),
    ),
    Mutant(
        id="tilelang-gemm-fp8-scale-column",
        file="moe_comm/ops/tilelang/grouped_gemm.py",
        old="b_scales[experts[tile_index], (col0 + j) // SCALE_BLOCK, step]",
        new="b_scales[experts[tile_index], j // SCALE_BLOCK, step]",
        description="the FP8 grouped GEMM scales every column block with the weight scales of the first 128 "
                    "output columns (the tile's own column offset is dropped)",
        hints=("tests/ops/test_fused_ops.py",),
    ),
    Mutant(
        id="tilelang-covers-int8",
        file="moe_comm/ops/impl.py",
        old="    return op in TILELANG_OPS and fmt not in TILELANG_MISSING_FORMATS\n",
        new="    return op in TILELANG_OPS\n",
        description="the TileLang coverage test forgets the cast formats without a program: an INT8 permute, "
                    "quantize or dequantize on impl 'tilelang' reaches the FP8 programs instead of a clear error",
        hints=("tests/ops/test_tilelang.py",),
    ),
    Mutant(
        id="tilelang-empty-dtype-unchecked",
        file="moe_comm/ops/unpermute.py",
        old=("        tilelang_launch.dtype_name(\"unpermute_reduce\", out_dtype)\n"
             "        out = torch.empty(num_tokens, y.shape[1], dtype=out_dtype, device=y.device)\n"
             "        if out.numel():\n"
             "            tilelang_launch.unpermute("),
        new=("        out = torch.empty(num_tokens, y.shape[1], dtype=out_dtype, device=y.device)\n"
             "        if out.numel():\n"
             "            tilelang_launch.dtype_name(\"unpermute_reduce\", out_dtype)\n"
             "            tilelang_launch.unpermute("),
        description="unpermute_reduce on impl 'tilelang' checks the output dtype only when there are rows: an "
                    "empty call with a dtype no program writes returns instead of refusing",
        hints=("tests/ops/test_tilelang.py",),
    ),
    # ------------------------------------------------------------------ prepared calls (csrc/cpu/prepared*, bindings)
    Mutant(
        id="prepared-ll-stale-hidden",
        file="csrc/python/prepared_bindings.cpp",
        old="            xa.shape[1] != g_.hidden || !xa.contiguous() || "
            "!read_tensor(topk_idx, torch, torch.int64, 2, &ta) ||",
        new="            !xa.contiguous() || !read_tensor(topk_idx, torch, torch.int64, 2, &ta) ||",
        description="a prepared low-latency dispatch takes x of another hidden size than its signature's first call "
                    "(hidden is not in the key): rows are read at the old width",
        hints=("tests/buffer/test_prepared.py",),
    ),
    Mutant(
        id="prepared-normal-stale-hidden",
        file="csrc/python/prepared_bindings.cpp",
        old="!read_tensor(x, t, x_dtype_, 2, &xa) || xa.shape[1] != hidden_ ||",
        new="!read_tensor(x, t, x_dtype_, 2, &xa) ||",
        description="a prepared normal-mode dispatch takes x of another hidden size than its signature's first "
                    "call: rows are packed at the old width",
        hints=("tests/buffer/test_prepared.py",),
    ),
    Mutant(
        id="prepared-topk-duplicate-taken",
        file="csrc/cpu/prepared.cpp",
        old="return lo >= -1 && hi < num_experts && dup_row < 0;",
        new="return lo >= -1 && hi < num_experts;",
        description="a prepared low-latency call skips the value check for an expert picked twice in one row: "
                    "the call runs (and sends the token twice) where the checked path refuses it on every rank",
        hints=("tests/buffer/test_errors.py", "tests/buffer/test_fuzz.py"),
    ),
    Mutant(
        id="prepared-ll-one-half",
        file="csrc/cpu/prepared.cpp",
        old="const DispatchHalf& out = halves_[half];",
        new="const DispatchHalf& out = halves_[0];",
        description="a prepared low-latency dispatch always unpacks into buffer half 0 while its results name the "
                    "call's own half: every second call returns the outputs of an older one",
        hints=("tests/buffer/test_prepared.py",),
    ),
    Mutant(
        id="prepared-kernel-one-half",
        file="csrc/cuda/python/prepared_low_latency.h",
        old="const PreparedOutputs& o = outputs_[(call - 1) & 1];",
        new="const PreparedOutputs& o = outputs_[0];",
        description="the kernels' prepared dispatch (every build) always writes buffer half 0: the results of a "
                    "call on half 1 are never written",
        hints=("tests/buffer/test_prepared.py", "tests/backends/test_cuda_backend.py"),
    ),
    Mutant(
        id="prepared-wrong-signature-local",
        file="moe_comm/backends/base.py",
        old="                    return getattr(self, checked)(*args, **kwargs)\n",
        new="                    raise\n",
        description="a fast-path Buffer method called with a wrong signature raises its TypeError on that rank "
                    "only: the other ranks wait for a call that never comes",
        hints=("tests/buffer/test_fuzz.py",),
    ),
    Mutant(
        id="prepared-padding-not-cleared",
        file="csrc/cpu/low_latency.cpp",
        old="if (padded) filled[static_cast<size_t>(e)] = std::clamp<int64_t>(recv_count[e], 0, rows_per_expert);",
        new="if (padded) filled[static_cast<size_t>(e)] = 0;",
        description="a prepared dispatch's receive clears no padding in its buffer half: rows an earlier call "
                    "filled past this call's counts keep that call's data (and src_info)",
        hints=("tests/buffer/test_prepared.py",),
    ),
    Mutant(
        id="collective-post-after-close",
        file="moe_comm/transport/collective.py",
        old="        self._close_poster(self.timeout_s + STORE_WAIT_S)\n        self._closed = True\n",
        new="        self._close_poster()\n",
        description="destroy on the collective transport neither waits for the posts on its thread nor closes: "
                    "a hooked call's late rows fall back to the group and meet the next Buffer's handshake",
        hints=("tests/buffer/test_destroy_pending.py",),
    ),
    Mutant(
        id="rejoin-epoch-scope-reused",
        file="moe_comm/transport/admission.py",
        old='        return self._key("epoch", epoch)\n',
        new='        return self._key("epoch", 1)\n',
        description="every epoch builds its group under the first epoch's keys: the members of a later epoch meet "
                    "the addresses of an older membership (its dead and replaced processes)",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="rejoin-admission-not-on-rank-0",
        file="moe_comm/protocol/agreement.py",
        old="                if joiners:",
        new="                if joiners and me:",
        description="rank 0 does not take the admission its handshake decided: the other survivors admit the "
                    "replacement at a dispatch where rank 0 does not",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="rejoin-waits-for-every-masked-rank",
        file="moe_comm/protocol/agreement.py",
        old="                if joiners:",
        new="                if joiners and joiners == union:",
        description="a replacement is admitted only once every masked rank has one ready: with two ranks dead and "
                    "one replacement, the survivors never take it in and it gives up",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="rejoin-absent-not-masked",
        file="moe_comm/buffer/rejoin.py",
        old="            for r in absent:\n                runtime.mask_rank(r, True)\n",
        new="",
        description="an epoch's absent ranks (masked ranks with no replacement, reserved slots) are not masked from "
                    "its start: the epoch's first call waits a whole deadline for them",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="rejoin-absent-rank-counted-dead",
        file="moe_comm/buffer/rejoin.py",
        old="            gone = {r for r in exited() if r not in joiners and r not in absent}",
        new="            gone = {r for r in exited() if r not in joiners}",
        description="the survivors take the exited process of an absent rank (dead, no replacement) for a member of "
                    "the new epoch that died: every admission while another rank is masked aborts",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="admission-spent-token-ready",
        file="moe_comm/transport/admission.py",
        old="                if token and not self._spent(r, token):",
        new="                if token:",
        description="a joiner's token invited to an epoch that aborted still counts as ready: a survivor done first "
                    "with its side of the abort flags the dead joiner again, and the survivors spend a deadline on "
                    "one more epoch",
        hints=("tests/transport/test_admission.py",),
    ),
    Mutant(
        id="diagnostics-other-sessions",
        file="tests/helpers/processes.py",
        old="        if fields[3] not in sessions:",
        new="        if fields[3] in sessions:",
        description="the report of ranks past their deadline lists every process but theirs: the next silent "
                    "rank's wait is lost among the machine's processes",
        hints=("tests/tools/test_diagnostics.py",),
    ),
    Mutant(
        id="send-half-order-compares-ends",
        file="tests/helpers/ll_late_cases.py",
        old='if r[f"{call}_send"][1] >= late[f"{call}_send"][0]]',
        new='if r[f"{call}_send"][1] >= late[f"{call}_send"][1]]',
        description="the check that a punctual send half did not wait compares its end with the late rank's "
                    "end, not its start: a send half that waited for the late rank's call passes",
        hints=("tests/buffer/test_ll_no_round_trip.py",),
    ),
    Mutant(
        id="shm-wait-flag-before-liveness",
        file="csrc/cpu/flags.cpp",
        old="if (pids[i] > 0 && !process_alive(pids[i]) && flag_load(flags[i]) < targets[i]) {",
        new="if (pids[i] > 0 && flag_load(flags[i]) < targets[i] && !process_alive(pids[i])) {",
        description="the shm wait reads a peer's flag before it looks at the peer's process: a peer that stored "
                    "the flag and exited in between fails a call whose data had all arrived",
        hints=("tests/csrc/test_exit_after_store.py",),
    ),
    Mutant(
        id="mpi-wait-no-drain-after-exit",
        file="moe_comm/transport/mpi.py",
        old="_DRAIN_POLLS = 100",
        new="_DRAIN_POLLS = 0",
        description="an mpi wait that finds its peer exited fails at once, without polling its requests again: a "
                    "peer that sent its rows and exited after the last poll fails a call whose rows had arrived",
        hints=("tests/transport/test_mpi.py",),
    ),
    Mutant(
        id="mpi-wait-blames-a-finished-peer",
        file="moe_comm/transport/mpi.py",
        old="return finished == entered >= index",
        new="return False",
        description="an mpi wait that finds a peer exited fails even when that peer had finished the exchange: a "
                    "rank that sent its rows and exited while another rank was late fails its peers' call",
        hints=("tests/transport/test_mpi.py",),
    ),
    Mutant(
        id="collective-no-abort-at-exit",
        file="moe_comm/transport/collective.py",
        old="                if self._on_group:\n                    _abort_group_at_exit(transport.group)\n",
        new="",
        description="an exchange on the process group itself that failed at its deadline (a Buffer whose "
                    "construction timed out) leaves the group to be torn down at exit: every rank sits out "
                    "init_from_env's 30 s exit barrier, which cannot complete, then the group's teardown",
        hints=("tests/transport/test_exit_after_failure.py",),
    ),
    Mutant(
        id="kernel-wait-no-load-after-exit",
        file="csrc/cuda/protocol/wait.h",
        old="    gone = P::peer_exited(w.pids, peer);\n    return false;",
        new="    if (P::peer_exited(w.pids, peer)) {\n"
            "        report<P>(w, WaitOutcome::kPeerExited, kind, peer, channel, seen, wanted);\n"
            "        return true;\n"
            "    }\n"
            "    return false;",
        description="a kernel wait (host platform) that finds its peer exited fails at once, without loading the "
                    "flag again: a peer that stored the flag and exited after the last load fails the launch",
        hints=("tests/csrc/test_exit_after_store.py",),
    ),
    Mutant(
        id="rejoin-survivors-keep-call-count",
        file="moe_comm/buffer/buffer.py",
        old="            old, self.runtime = self.runtime, runtime\n",
        new="            old, self.runtime = self.runtime, runtime\n"
            "            runtime.agreement.calls = old.agreement.calls\n",
        description="the survivors carry their call count into the new epoch while the replacement starts from the "
                    "first call (and buffer half) of it",
        hints=("tests/buffer/test_rejoin.py",),
    ),
    Mutant(
        id="store-gather-blocking-read",
        file="moe_comm/transport/store_gather.py",
        old="                value = store.compare_set(key, _ABSENT, _ABSENT)",
        new="                value = store.get(key)",
        description="a shrink gather reads a row it saw with a blocking get: a row its writer deleted since blocks the "
                    "late reader for the store's timeout instead of finding it out of step",
        hints=("tests/transport/test_store_gather.py",),
    ),
    Mutant(
        id="store-gather-zero-ms-wait",
        file="moe_comm/transport/store_gather.py",
        old="            if remaining >= 1e-3:",
        new="            if remaining > 0:",
        description="the last slice of a shrink gather's deadline may be under a millisecond, which the store reads as "
                    "no deadline: the wait never ends",
        hints=("tests/transport/test_store_gather.py",),
    ),
    Mutant(
        id="store-gather-keeps-two",
        file="moe_comm/transport/store_gather.py",
        old="KEPT = 8\n",
        new="KEPT = 2\n",
        description="a writer keeps only its last two rows: a rank it found late, coming while a third rank's note lets "
                    "the writer go on, finds the row gone and never sends its note",
        hints=("tests/transport/test_store_gather.py",),
    ),
    Mutant(
        id="start-failure-not-recorded",
        file="moe_comm/transport/admission.py",
        old="                word = self._settle(key, _START_FAILED + _text(here))\n",
        new="                return None, [r for r in range(self.num_ranks) if r not in here]\n",
        description="a rank that gives up a start short of ranks (fewer than min_ranks at its deadline) leaves no "
                    "word: a rank that comes later starts with ranks that have gone and times out in their group",
        hints=("tests/transport/test_admission.py",),
    ),
    # ------------------------------------------------------------------ the test session's own checks (tests/conftest.py)
    Mutant(
        id="session-shm-leak-only-reported",
        file="tests/conftest.py",
        old="        session.exitstatus = pytest.ExitCode.TESTS_FAILED\n",
        new="",
        description="the /dev/shm check prints what a session left in its summary but leaves the exit status alone: "
                    "make test and CI pass on a leak",
        hints=("tests/tools/test_session_checks.py",),
    ),
)
