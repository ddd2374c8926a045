// The combine reduction (api.h: combine_reduce), compiled once per instruction set: this file is
// built for baseline x86-64 / the host ISA as namespace `generic`, and again with -mavx2 -mf16c as
// namespace `avx2`; combine_reduce picks at run time. The arithmetic is the same IEEE fp32 add and
// multiply per element either way (no FMA: -ffp-contract=off), so both give identical bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "api.h"
#include "elem.h"
#include "parallel.h"
#include "stream.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef MOE_COMM_ISA
#define MOE_COMM_ISA generic
#endif

namespace moe_comm::cpu::MOE_COMM_ISA {
namespace {

// Hidden elements accumulated at a time: the accumulator stays in L1 (or registers) while every
// source is added; 1.2x faster than whole rows at hidden 7168 (bench/RESULTS.md).
constexpr int64_t kReduceChunk = 512;

#if defined(__AVX2__)
// bf16 rows by hand: GCC's vectorization of the generic loop spends its time converting. Same
// arithmetic per element (fp32 multiply, then add, sources in order, then biases), so same bits.
inline __m256 bf16x8_load(const uint16_t* p) {
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(widened, 16));
}

// float_to_bf16 on 8 lanes: round to nearest even, NaN -> 0x7fc0.
inline __m128i bf16x8_round(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i v = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

inline void bf16x8_store(uint16_t* dst, __m128i v, bool stream) {
    if (stream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
    else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), v);
}

// One output row: out[h] = round(((0 + w_0 x_0[h] + ...) + bias0[h]) + bias1[h]) for h < hidden,
// 32 elements at a time (the tail is left to the generic loop); returns how many were done.
int64_t reduce_row_bf16(uint16_t* out, const uint16_t* const* rows, const float* weights, int64_t num_rows,
                        const uint16_t* bias0, const uint16_t* bias1, int64_t hidden, bool stream) {
    int64_t h = 0;
    for (; h + 32 <= hidden; h += 32) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t j = 0; j < num_rows; ++j) {
            const uint16_t* x = rows[j] + h;
            if (weights == nullptr) {
                for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_ps(acc[q], bf16x8_load(x + 8 * q));
            } else {
                const __m256 w = _mm256_set1_ps(weights[j]);
                for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_ps(acc[q], _mm256_mul_ps(w, bf16x8_load(x + 8 * q)));
            }
        }
        for (const uint16_t* bias : {bias0, bias1})
            if (bias != nullptr)
                for (int q = 0; q < 4; ++q) acc[q] = _mm256_add_ps(acc[q], bf16x8_load(bias + h + 8 * q));
        for (int q = 0; q < 4; ++q) bf16x8_store(out + h + 8 * q, bf16x8_round(acc[q]), stream);
    }
    return h;
}
#endif

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
#if defined(__AVX2__)
        std::vector<const uint16_t*> rows(static_cast<size_t>(num_sources));
        std::vector<float> weights(static_cast<size_t>(num_sources));
#endif
        for (int64_t t = begin; t < end; ++t) {
            int64_t done = 0;
#if defined(__AVX2__)
            if constexpr (kType == DType::kBFloat16) {
                int64_t n = 0;
                for (int64_t j = 0; j < num_sources; ++j) {
                    const int32_t pos = send_pos[t * num_sources + j];
                    if (pos < 0) continue;
                    rows[n] = reinterpret_cast<const uint16_t*>(sources[j] + pos * record_bytes + x_offset);
                    weights[n++] = scale == nullptr ? 1.0f : scale[t * num_sources + j];
                }
                done = reduce_row_bf16(out + t * hidden, rows.data(), scale == nullptr ? nullptr : weights.data(), n,
                                       bias0 == nullptr ? nullptr : bias0 + t * hidden,
                                       bias1 == nullptr ? nullptr : bias1 + t * hidden, hidden, stream);
            }
#endif
            for (int64_t h0 = done; h0 < hidden; h0 += kReduceChunk) {
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
        default: break;  // refused by the checked entry point (reduce_dispatch.cpp)
    }
#undef MC_REDUCE
}

}  // namespace moe_comm::cpu::MOE_COMM_ISA
