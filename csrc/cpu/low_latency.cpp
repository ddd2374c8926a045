#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "api.h"
#include "bounds.h"
#include "check.h"
#include "parallel.h"
#include "stream.h"

namespace moe_comm::cpu {

int64_t low_latency_send_order(int64_t* msg, int64_t* experts, int64_t* send_counts,
                               const int64_t* topk_idx,
                               int64_t num_tokens, int64_t num_topk, int64_t num_experts, int64_t num_ranks) {
    MC_CHECK(num_ranks > 0 && num_experts >= 0 && num_experts % num_ranks == 0,
             "low_latency_send_order: num_experts " << num_experts << " is not a non-negative multiple of num_ranks "
                                                    << num_ranks);
    MC_CHECK(num_tokens >= 0 && num_topk >= 0, "low_latency_send_order: num_tokens and num_topk must be >= 0, got "
                                                   << num_tokens << ", " << num_topk);
    std::vector<int64_t> start(static_cast<size_t>(num_experts) + 1, 0);
    const int64_t n = num_tokens * num_topk;
    // This counting pass runs on the calling thread and checks every id before using it.
    for (int64_t i = 0; i < n; ++i) {
        const int64_t e = topk_idx[i];
        MC_CHECK(e >= -1 && e < num_experts, "low_latency_send_order: topk_idx[" << i / num_topk << ", "
                                                 << i % num_topk << "] = " << e << " is outside [-1, " << num_experts
                                                 << ") (expert ids of " << num_experts << " experts)");
        if (e >= 0) ++start[static_cast<size_t>(e) + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) start[static_cast<size_t>(e) + 1] += start[static_cast<size_t>(e)];
    const int64_t total = start[static_cast<size_t>(num_experts)];
    const int64_t per_rank = num_experts / num_ranks;
    for (int64_t r = 0; r < num_ranks; ++r)
        send_counts[r] = start[static_cast<size_t>((r + 1) * per_rank)] - start[static_cast<size_t>(r * per_rank)];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t e = topk_idx[i];
        if (e < 0) continue;
        const int64_t pos = start[static_cast<size_t>(e)]++;
        msg[pos] = i;
        experts[pos] = e;
    }
    return total;
}

int64_t low_latency_combine_rows(int64_t* rows,
                                 const int64_t* layout_range,
                                 int64_t num_local_experts, int64_t num_ranks, int64_t rows_per_expert,
                                 int64_t max_rows) {
    MC_CHECK(num_local_experts >= 0 && num_ranks >= 0 && rows_per_expert >= 0 && max_rows >= 0,
             "low_latency_combine_rows: num_local_experts, num_ranks, rows_per_expert and max_rows must be >= 0, got "
                 << num_local_experts << ", " << num_ranks << ", " << rows_per_expert << ", " << max_rows);
    // Pre-pass: every range inside its expert's rows, and all of them inside `rows`.
    int64_t total = 0;
    for (int64_t i = 0; i < num_local_experts * num_ranks; ++i) {
        const int64_t range = layout_range[i];
        const int64_t begin = range >> 32, count = range & 0xFFFFFFFF;
        MC_CHECK(begin >= 0 && begin + count <= rows_per_expert,
                 "low_latency_combine_rows: layout_range[" << i / num_ranks << ", " << i % num_ranks << "] = " << range
                     << " (begin " << begin << ", count " << count << ") spans rows [" << begin << ", "
                     << begin + count << "), outside [0, " << rows_per_expert << ") (rows_per_expert)");
        total += count;  // count < 2^32 and total <= max_rows at every step: no overflow
        MC_CHECK(total <= max_rows, "low_latency_combine_rows: layout_range counts sum to more than max_rows="
                                        << max_rows << " (the room in rows; overlapping ranges?)");
    }
    int64_t n = 0;
    for (int64_t s = 0; s < num_ranks; ++s)
        for (int64_t e = 0; e < num_local_experts; ++e) {
            const int64_t range = layout_range[e * num_ranks + s];
            const int64_t begin = range >> 32, count = range & 0xFFFFFFFF;
            for (int64_t i = 0; i < count; ++i) rows[n++] = e * rows_per_expert + begin + i;
        }
    return n;
}

void low_latency_positions(int32_t* pos, int64_t num_slots, const int64_t* msg, const int64_t* experts, int64_t n,
                           int64_t num_local_experts, int64_t num_ranks, const int64_t* firsts) {
    const char* fn = "low_latency_positions";
    MC_CHECK(num_slots >= 0 && n >= 0 && num_local_experts > 0 && num_ranks > 0,
             fn << ": num_slots and n must be >= 0, num_local_experts and num_ranks > 0, got " << num_slots << ", "
                << n << ", " << num_local_experts << ", " << num_ranks);
    check_indices(fn, "msg", msg, n, 0, 0, num_slots, "slots of num_slots=" + std::to_string(num_slots));
    check_indices(fn, "experts", experts, n, 0, 0, num_local_experts * num_ranks,
                  "experts of " + std::to_string(num_local_experts * num_ranks));
    for (int64_t d = 0; d < num_ranks; ++d)
        MC_CHECK(firsts[d] >= 0 && firsts[d] <= INT32_MAX - n,
                 fn << ": firsts[" << d << "] = " << firsts[d] << " is outside [0, " << INT32_MAX - n
                    << "] (rows past it must fit in int32)");
    std::vector<int64_t> next(firsts, firsts + num_ranks);
    std::fill(pos, pos + num_slots, -1);
    for (int64_t i = 0; i < n; ++i)
        pos[msg[i]] = static_cast<int32_t>(next[static_cast<size_t>(experts[i] / num_local_experts)]++);
}

void low_latency_unpack(uint8_t* recv_x, uint8_t* scales, int32_t* src_info, int32_t* recv_count,
                        int64_t* layout_range,
                        const uint8_t* records, const int64_t* recv_counts, const int64_t* firsts,
                        int64_t num_records, int64_t num_ranks, int64_t num_local_experts, int64_t rows_per_expert,
                        int64_t record_bytes, int64_t x_offset, int64_t x_bytes,
                        int64_t scales_offset, int64_t num_scales, int64_t scale_bytes,
                        int64_t scales_expert_stride, int64_t scales_row_stride, int64_t scales_col_stride,
                        int64_t src_offset, int64_t expert_offset,
                        int num_threads, bool padded) {
    const int64_t E = num_local_experts, R = num_ranks;
    const char* fn = "low_latency_unpack";
    MC_CHECK(num_records >= 0 && R >= 0 && E >= 0 && rows_per_expert >= 0 && record_bytes >= 0,
             fn << ": num_records, num_ranks, num_local_experts, rows_per_expert and record_bytes must be >= 0, got "
                << num_records << ", " << R << ", " << E << ", " << rows_per_expert << ", " << record_bytes);
    // The records read: each source's run inside `records` (each bound checked before adding: no overflow).
    std::vector<int64_t> first(static_cast<size_t>(R));
    int64_t counted = 0;
    for (int64_t s = 0; s < R; ++s) {
        const int64_t at = firsts != nullptr ? firsts[s] : counted;
        MC_CHECK(at >= 0 && at <= num_records,
                 fn << ": firsts[" << s << "] = " << at << " is outside [0, " << num_records << "] (num_records)");
        MC_CHECK(recv_counts[s] >= 0 && recv_counts[s] <= num_records - at,
                 fn << ": recv_counts[" << s << "] = " << recv_counts[s] << " is outside [0, "
                    << num_records - at << "] (records left of num_records=" << num_records << ")");
        first[static_cast<size_t>(s)] = at;
        counted += recv_counts[s];  // <= R * num_records: no overflow
    }
    MC_CHECK(firsts != nullptr || counted == num_records,
             fn << ": recv_counts sum to " << counted << ", but records holds num_records=" << num_records);
    check_in_record(fn, "field x", x_offset, 1, x_bytes, record_bytes);
    check_in_record(fn, "field src", src_offset, 1, sizeof(int32_t), record_bytes);
    check_in_record(fn, "field expert", expert_offset, 1, sizeof(int32_t), record_bytes);
    if (scales != nullptr) check_in_record(fn, "field scales", scales_offset, num_scales, scale_bytes, record_bytes);
    // Pass 1 (sequential, 4 bytes per record): counts per (expert, source) and each record's expert.
    std::vector<int64_t> counts(static_cast<size_t>(E * R), 0);
    std::vector<int32_t> expert_of(static_cast<size_t>(counted));
    std::vector<int64_t> record_of(static_cast<size_t>(counted));
    for (int64_t s = 0, j = 0; s < R; ++s) {
        for (int64_t i = 0; i < recv_counts[s]; ++i, ++j) {
            const int64_t at = first[static_cast<size_t>(s)] + i;
            int32_t e;
            std::memcpy(&e, records + at * record_bytes + expert_offset, sizeof(e));
            MC_CHECK(e >= 0 && e < E, "low_latency_unpack: record " << at << " from rank " << s << " names local expert "
                                                                    << e << ", outside [0, " << E << ")");
            expert_of[static_cast<size_t>(j)] = e;
            record_of[static_cast<size_t>(j)] = at;
            ++counts[static_cast<size_t>(e * R + s)];
        }
    }
    // Rows an earlier call left filled (`padded`; clamped: the rows the clearing below may touch stay inside).
    std::vector<int64_t> filled(static_cast<size_t>(E), rows_per_expert);
    for (int64_t e = 0; e < E; ++e) {
        int64_t row = 0;
        for (int64_t s = 0; s < R; ++s) row += counts[static_cast<size_t>(e * R + s)];
        MC_CHECK(row <= rows_per_expert, "low_latency_unpack: local expert " << e << " receives " << row
                                             << " rows, more than its " << rows_per_expert);
        if (padded) filled[static_cast<size_t>(e)] = std::clamp<int64_t>(recv_count[e], 0, rows_per_expert);
    }
    std::vector<int64_t> begins(static_cast<size_t>(E * R));
    for (int64_t e = 0; e < E; ++e) {
        int64_t row = 0;
        for (int64_t s = 0; s < R; ++s) {
            begins[static_cast<size_t>(e * R + s)] = row;
            layout_range[e * R + s] = (row << 32) | counts[static_cast<size_t>(e * R + s)];
            row += counts[static_cast<size_t>(e * R + s)];
        }
        recv_count[e] = static_cast<int32_t>(row);
    }
    // Destination row of every record: the next free row of its (expert, source) block.
    std::vector<int64_t> dst(static_cast<size_t>(counted));
    std::vector<int64_t> next(begins);
    for (int64_t s = 0, j = 0; s < R; ++s)
        for (int64_t i = 0; i < recv_counts[s]; ++i, ++j) {
            const int64_t e = expert_of[static_cast<size_t>(j)];
            dst[static_cast<size_t>(j)] = e * rows_per_expert + next[static_cast<size_t>(e * R + s)]++;
        }
    // Pass 2 (parallel over records, distinct destinations): copy the fields.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(record_bytes, 1));
    parallel_for(counted, grain, num_threads, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
            const uint8_t* rec = records + record_of[static_cast<size_t>(j)] * record_bytes;
            const int64_t flat = dst[static_cast<size_t>(j)];
            std::memcpy(recv_x + flat * x_bytes, rec + x_offset, static_cast<size_t>(x_bytes));
            std::memcpy(src_info + flat, rec + src_offset, sizeof(int32_t));
            if (scales != nullptr) {
                const int64_t e = flat / rows_per_expert, r = flat % rows_per_expert;
                uint8_t* out = scales + e * scales_expert_stride + r * scales_row_stride;
                for (int64_t c = 0; c < num_scales; ++c)
                    std::memcpy(out + c * scales_col_stride, rec + scales_offset + c * scale_bytes,
                                static_cast<size_t>(scale_bytes));
            }
        }
    });
    // Pass 3 (parallel over experts): the rows past each count are padding, written here so that the
    // outputs may come from recycled memory: zero x and scales, src_info -1 (with `padded`, up to the rows an
    // earlier call filled: those past them hold padding already).
    parallel_for(E, std::max<int64_t>(1, grain / std::max<int64_t>(rows_per_expert, 1)), num_threads,
                 [&](int64_t lo, int64_t hi) {
        for (int64_t e = lo; e < hi; ++e) {
            const int64_t used = recv_count[e], end = std::max(used, filled[static_cast<size_t>(e)]);
            const int64_t pad = end - used;
            if (pad == 0) continue;
            stream_zero(recv_x + (e * rows_per_expert + used) * x_bytes, static_cast<size_t>(pad * x_bytes));
            std::fill(src_info + e * rows_per_expert + used, src_info + e * rows_per_expert + end, -1);
            if (scales == nullptr) continue;
            for (int64_t c = 0; c < num_scales; ++c) {
                uint8_t* column = scales + e * scales_expert_stride + c * scales_col_stride;
                if (scales_row_stride == scale_bytes) {  // DeepEP's layout: a column's rows are contiguous
                    std::memset(column + used * scale_bytes, 0, static_cast<size_t>(pad * scale_bytes));
                    continue;
                }
                for (int64_t r = used; r < end; ++r)
                    std::memset(column + r * scales_row_stride, 0, static_cast<size_t>(scale_bytes));
            }
        }
        stream_fence();
    });
}

}  // namespace moe_comm::cpu
