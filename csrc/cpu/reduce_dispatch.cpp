// combine_reduce: checks its indices, then runs the AVX2 build of reduce.cpp where the CPU has it,
// else the generic build. combine_reduce_logfmt: the same checks, then reduce_logfmt.cpp.
#include "api.h"
#include "bounds.h"
#include "check.h"
#include "../common/logfmt.h"

#include <atomic>
#include <string_view>

namespace moe_comm::cpu {

// The per-ISA builds of reduce.cpp: api.h's signature without source_rows (checked here, once).
using CombineReduce = void(void* out, float* out_weights,
                           const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                           const void* bias0, const void* bias1,
                           int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                           int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                           int num_threads);
namespace generic {
CombineReduce combine_reduce;
}
#ifdef MOE_COMM_HAVE_AVX2
namespace avx2 {
CombineReduce combine_reduce;
}
#endif

namespace logfmt_reduce {
void combine_reduce_logfmt(void* out, const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                           const void* bias0, const void* bias1, int64_t num_tokens, int64_t num_sources,
                           int64_t hidden, DType dtype, int64_t record_bytes, int64_t x_offset, int num_threads);
}

namespace {

// Throws unless every send_pos[t, j] is in [-1, source_rows[j]) (run before the parallel kernel).
void check_send_pos(const int32_t* send_pos, const int64_t* source_rows, int64_t num_tokens, int64_t num_sources) {
    for (int64_t j = 0; j < num_sources; ++j)
        MC_CHECK(source_rows[j] >= 0,
                 "combine_reduce: source_rows[" << j << "] = " << source_rows[j] << " is negative");
    // NOTES: accumulate a flag over the whole array (no early exit), which the compiler can vectorize;
    // only a bad array pays for the second scan that names the entry.
    bool bad = false;
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int32_t* pos = send_pos + t * num_sources;
        for (int64_t j = 0; j < num_sources; ++j) bad |= pos[j] < -1 || pos[j] >= source_rows[j];
    }
    if (!bad) return;
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t j = 0; j < num_sources; ++j) {
            const int32_t p = send_pos[t * num_sources + j];
            MC_CHECK(p >= -1 && p < source_rows[j], "combine_reduce: send_pos[" << t << ", " << j << "] = " << p
                                                        << " is outside [-1, " << source_rows[j] << ") (rows of source "
                                                        << j << ")");
        }
}

}  // namespace

void combine_reduce(void* out, float* out_weights,
                    const uint8_t* const* sources, const int64_t* source_rows, const int32_t* send_pos,
                    const float* scale,
                    const void* bias0, const void* bias1,
                    int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                    int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                    int num_threads) {
    MC_CHECK(is_float_row(dtype),
             "combine_reduce: dtype must be FLOAT32, BFLOAT16 or FLOAT16, got DType code " << static_cast<int>(dtype));
    MC_CHECK(num_tokens >= 0 && num_sources >= 0 && hidden >= 0 && record_bytes >= 0 && num_topk >= 0,
             "combine_reduce: num_tokens, num_sources, hidden, record_bytes and num_topk must be >= 0, got "
                 << num_tokens << ", " << num_sources << ", " << hidden << ", " << record_bytes << ", " << num_topk);
    check_in_record("combine_reduce", "field x", x_offset, hidden, dtype == DType::kFloat32 ? 4 : 2, record_bytes);
    if (out_weights != nullptr)
        check_in_record("combine_reduce", "field weights", weights_offset, num_topk, sizeof(float), record_bytes);
    check_send_pos(send_pos, source_rows, num_tokens, num_sources);
#ifdef MOE_COMM_HAVE_AVX2
    if (std::string_view(combine_reduce_isa()) == "avx2")
        return avx2::combine_reduce(out, out_weights, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources,
                                    hidden, dtype, record_bytes, x_offset, weights_offset, num_topk, num_threads);
#endif
    generic::combine_reduce(out, out_weights, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources, hidden,
                            dtype, record_bytes, x_offset, weights_offset, num_topk, num_threads);
}

void combine_reduce_logfmt(void* out,
                           const uint8_t* const* sources, const int64_t* source_rows, const int32_t* send_pos,
                           const float* scale, const void* bias0, const void* bias1,
                           int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                           int64_t record_bytes, int64_t x_offset, int num_threads) {
    MC_CHECK(is_float_row(dtype),
             "combine_reduce_logfmt: dtype must be FLOAT32, BFLOAT16 or FLOAT16, got DType code "
                 << static_cast<int>(dtype));
    MC_CHECK(logfmt::valid_hidden(hidden),
             "combine_reduce_logfmt: hidden must be a positive multiple of " << logfmt::kGroup << ", got " << hidden);
    MC_CHECK(num_tokens >= 0 && num_sources >= 0 && record_bytes >= 0,
             "combine_reduce_logfmt: num_tokens, num_sources and record_bytes must be >= 0, got "
                 << num_tokens << ", " << num_sources << ", " << record_bytes);
    check_in_record("combine_reduce_logfmt", "LogFMT field x", x_offset, logfmt::max_row_bytes(hidden), 1,
                    record_bytes);
    check_send_pos(send_pos, source_rows, num_tokens, num_sources);
    logfmt_reduce::combine_reduce_logfmt(out, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources, hidden,
                                         dtype, record_bytes, x_offset, num_threads);
}

namespace {
std::atomic<bool> generic_only{false};
}

void set_combine_reduce_generic(bool generic) { generic_only.store(generic); }

const char* combine_reduce_isa() {
#ifdef MOE_COMM_HAVE_AVX2
    static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (has_avx2 && !generic_only.load(std::memory_order_relaxed)) return "avx2";
#endif
    return "generic";
}

}  // namespace moe_comm::cpu
