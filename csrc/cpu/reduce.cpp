// The combine reduction (api.h: combine_reduce), compiled once per instruction set: this file is
// built for baseline x86-64 / the host ISA as namespace `generic`, and again with -mavx2 -mf16c as
// namespace `avx2`; combine_reduce picks at run time. The arithmetic is the same IEEE fp32 add and
// multiply per element either way (no FMA: -ffp-contract=off), so both give identical bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "api.h"
#include "parallel.h"
#include "stream.h"

#ifndef MOE_COMM_ISA
#define MOE_COMM_ISA generic
#endif

namespace moe_comm::cpu::MOE_COMM_ISA {
namespace {

// Hidden elements accumulated at a time: the accumulator stays in L1 (or registers) while every
// source is added; 1.2x faster than whole rows at hidden 7168 (bench/RESULTS.md).
constexpr int64_t kReduceChunk = 512;

inline float bf16_to_float(uint16_t v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// Round-to-nearest-even, NaN kept quiet: the same rounding torch uses for float -> bfloat16.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    // A select, not a branch, so the store loop vectorizes.
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

template <DType kType>
struct Elem;
template <>
struct Elem<DType::kFloat32> {
    using T = float;
    static float load(T v) { return v; }
    static T store(float f) { return f; }
};
template <>
struct Elem<DType::kBFloat16> {
    using T = uint16_t;
    static float load(T v) { return bf16_to_float(v); }
    static T store(float f) { return float_to_bf16(f); }
};
template <>
struct Elem<DType::kFloat16> {
    using T = _Float16;
    static float load(T v) { return static_cast<float>(v); }
    static T store(float f) { return static_cast<_Float16>(f); }
};

template <DType kType>
void combine_reduce_typed(void* out_raw, float* out_weights,
                          const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                          const void* bias0_raw, const void* bias1_raw,
                          int64_t num_tokens, int64_t num_sources, int64_t hidden,
                          int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                          int num_threads) {
    using E = Elem<kType>;
    using T = typename E::T;
    auto* out = static_cast<T*>(out_raw);
    const auto* bias0 = static_cast<const T*>(bias0_raw);
    const auto* bias1 = static_cast<const T*>(bias1_raw);
    const bool stream = num_tokens * hidden * static_cast<int64_t>(sizeof(T)) >= kStreamBytes;
    parallel_for(num_tokens, grain_rows(record_bytes * num_sources), num_threads, [&](int64_t begin, int64_t end) {
        std::vector<float> wacc(static_cast<size_t>(num_topk));
        alignas(64) float acc[kReduceChunk];
        alignas(64) T rounded[kReduceChunk];
        for (int64_t t = begin; t < end; ++t) {
            for (int64_t h0 = 0; h0 < hidden; h0 += kReduceChunk) {
                const int64_t n = std::min(kReduceChunk, hidden - h0);
                for (int64_t h = 0; h < n; ++h) acc[h] = 0.0f;
                for (int64_t j = 0; j < num_sources; ++j) {
                    const int32_t pos = send_pos[t * num_sources + j];
                    if (pos < 0) continue;
                    const T* __restrict x = reinterpret_cast<const T*>(sources[j] + pos * record_bytes + x_offset) + h0;
                    if (scale == nullptr) {
                        for (int64_t h = 0; h < n; ++h) acc[h] += E::load(x[h]);
                    } else {
                        const float w = scale[t * num_sources + j];
                        for (int64_t h = 0; h < n; ++h) acc[h] += w * E::load(x[h]);
                    }
                }
                if (bias0 != nullptr)
                    for (int64_t h = 0; h < n; ++h) acc[h] += E::load(bias0[t * hidden + h0 + h]);
                if (bias1 != nullptr)
                    for (int64_t h = 0; h < n; ++h) acc[h] += E::load(bias1[t * hidden + h0 + h]);
                T* __restrict o = stream ? rounded : out + t * hidden + h0;
                for (int64_t h = 0; h < n; ++h) o[h] = E::store(acc[h]);
                if (stream)
                    stream_copy(reinterpret_cast<uint8_t*>(out + t * hidden + h0), reinterpret_cast<uint8_t*>(rounded),
                                static_cast<size_t>(n) * sizeof(T));
            }
            if (out_weights != nullptr) {
                std::fill(wacc.begin(), wacc.end(), 0.0f);
                for (int64_t j = 0; j < num_sources; ++j) {
                    const int32_t pos = send_pos[t * num_sources + j];
                    if (pos < 0) continue;
                    const float* w = reinterpret_cast<const float*>(sources[j] + pos * record_bytes + weights_offset);
                    for (int64_t k = 0; k < num_topk; ++k) wacc[k] += w[k];
                }
                for (int64_t k = 0; k < num_topk; ++k) out_weights[t * num_topk + k] = wacc[k];
            }
        }
        if (stream) stream_fence();
    });
}

}  // namespace

void combine_reduce(void* out, float* out_weights,
                    const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                    const void* bias0, const void* bias1,
                    int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                    int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                    int num_threads) {
#define MC_REDUCE(kType)                                                                                        \
    combine_reduce_typed<kType>(out, out_weights, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources, \
                                hidden, record_bytes, x_offset, weights_offset, num_topk, num_threads)
    switch (dtype) {
        case DType::kFloat32: MC_REDUCE(DType::kFloat32); break;
        case DType::kBFloat16: MC_REDUCE(DType::kBFloat16); break;
        case DType::kFloat16: MC_REDUCE(DType::kFloat16); break;
    }
#undef MC_REDUCE
}

}  // namespace moe_comm::cpu::MOE_COMM_ISA
