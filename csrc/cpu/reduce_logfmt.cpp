// The combine reduction over LogFMT rows (api.h: combine_reduce_logfmt; its checks run in
// reduce_dispatch.cpp): each returned row is decoded straight into the fp32 accumulator, one pass, in
// combine_reduce's order (sources ascending, then the biases), then rounded once to the output dtype.
#include <algorithm>
#include <vector>

#include "api.h"
#include "elem.h"
#include "parallel.h"
#include "../common/logfmt.h"

namespace moe_comm::cpu::logfmt_reduce {
namespace {

template <DType kType>
void reduce_typed(void* out_raw, const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                  const void* bias0_raw, const void* bias1_raw, int64_t num_tokens, int64_t num_sources, int64_t hidden,
                  int64_t record_bytes, int64_t x_offset, int num_threads) {
    using E = Elem<kType>;
    using T = typename E::T;
    auto* out = static_cast<T*>(out_raw);
    const auto* bias0 = static_cast<const T*>(bias0_raw);
    const auto* bias1 = static_cast<const T*>(bias1_raw);
    parallel_for(num_tokens, grain_rows(logfmt::max_row_bytes(hidden) * num_sources), num_threads,
                 [&](int64_t begin, int64_t end) {
        std::vector<float> acc(static_cast<size_t>(hidden));
        for (int64_t t = begin; t < end; ++t) {
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < num_sources; ++j) {
                const int32_t pos = send_pos[t * num_sources + j];
                if (pos < 0) continue;
                const float w = scale == nullptr ? 1.0f : scale[t * num_sources + j];
                logfmt::decode_accumulate_row(sources[j] + pos * record_bytes + x_offset, hidden, w, acc.data());
            }
            for (const T* bias : {bias0, bias1})
                if (bias != nullptr)
                    for (int64_t h = 0; h < hidden; ++h) acc[h] += E::load(bias[t * hidden + h]);
            for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = E::store(acc[h]);
        }
    });
}

}  // namespace

// combine_reduce_logfmt after its checks.
void combine_reduce_logfmt(void* out, const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                           const void* bias0, const void* bias1, int64_t num_tokens, int64_t num_sources,
                           int64_t hidden, DType dtype, int64_t record_bytes, int64_t x_offset, int num_threads) {
#define MC_REDUCE(kType)                                                                                      \
    reduce_typed<kType>(out, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources, hidden, record_bytes, \
                        x_offset, num_threads)
    switch (dtype) {
        case DType::kFloat32: MC_REDUCE(DType::kFloat32); break;
        case DType::kBFloat16: MC_REDUCE(DType::kBFloat16); break;
        case DType::kFloat16: MC_REDUCE(DType::kFloat16); break;
        default: break;  // refused by the checked entry point (reduce_dispatch.cpp)
    }
#undef MC_REDUCE
}

}  // namespace moe_comm::cpu::logfmt_reduce
