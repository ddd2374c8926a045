#include <cstring>
#include <vector>

#include "api.h"
#include "check.h"
#include "parallel.h"

namespace moe_comm::cpu {
namespace {

// Rows smaller than this are copied by one thread: starting a thread costs ~10-30 us.
constexpr int64_t kBytesPerThread = 1 << 20;

int64_t grain_rows(int64_t record_bytes) {
    return std::max<int64_t>(1, kBytesPerThread / std::max<int64_t>(record_bytes, 1));
}

// Copies one row of a field between strided storage and a contiguous run of bytes.
inline void copy_field(uint8_t* dst, int64_t dst_col_stride, const uint8_t* src, int64_t src_col_stride,
                       int64_t elem_bytes, int64_t num_cols) {
    if (dst_col_stride == elem_bytes && src_col_stride == elem_bytes) {
        std::memcpy(dst, src, static_cast<size_t>(elem_bytes * num_cols));
        return;
    }
    for (int64_t c = 0; c < num_cols; ++c)
        std::memcpy(dst + c * dst_col_stride, src + c * src_col_stride, static_cast<size_t>(elem_bytes));
}

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
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
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
                          const uint8_t* records, const int32_t* send_pos, const float* scale,
                          const void* bias0_raw, const void* bias1_raw,
                          int64_t num_tokens, int64_t num_sources, int64_t hidden,
                          int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                          int num_threads) {
    using E = Elem<kType>;
    using T = typename E::T;
    auto* out = static_cast<T*>(out_raw);
    const auto* bias0 = static_cast<const T*>(bias0_raw);
    const auto* bias1 = static_cast<const T*>(bias1_raw);
    parallel_for(num_tokens, grain_rows(record_bytes * num_sources), num_threads, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(static_cast<size_t>(hidden));
        std::vector<float> wacc(static_cast<size_t>(num_topk));
        for (int64_t t = begin; t < end; ++t) {
            std::fill(acc.begin(), acc.end(), 0.0f);
            std::fill(wacc.begin(), wacc.end(), 0.0f);
            for (int64_t j = 0; j < num_sources; ++j) {
                const int32_t pos = send_pos[t * num_sources + j];
                if (pos < 0) continue;
                const uint8_t* rec = records + pos * record_bytes;
                const T* x = reinterpret_cast<const T*>(rec + x_offset);
                if (scale == nullptr) {
                    for (int64_t h = 0; h < hidden; ++h) acc[h] += E::load(x[h]);
                } else {
                    const float w = scale[t * num_sources + j];
                    for (int64_t h = 0; h < hidden; ++h) acc[h] += w * E::load(x[h]);
                }
                if (out_weights != nullptr) {
                    const float* w = reinterpret_cast<const float*>(rec + weights_offset);
                    for (int64_t k = 0; k < num_topk; ++k) wacc[k] += w[k];
                }
            }
            if (bias0 != nullptr)
                for (int64_t h = 0; h < hidden; ++h) acc[h] += E::load(bias0[t * hidden + h]);
            if (bias1 != nullptr)
                for (int64_t h = 0; h < hidden; ++h) acc[h] += E::load(bias1[t * hidden + h]);
            for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = E::store(acc[h]);
            if (out_weights != nullptr)
                for (int64_t k = 0; k < num_topk; ++k) out_weights[t * num_topk + k] = wacc[k];
        }
    });
}

}  // namespace

void pack_rows(uint8_t* records,
               const Segment* segments, int num_segments, const int64_t* src_rows,
               int64_t num_rows, int64_t record_bytes,
               int num_threads) {
    parallel_for(num_rows, grain_rows(record_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            uint8_t* rec = records + i * record_bytes;
            for (int s = 0; s < num_segments; ++s) {
                const Segment& seg = segments[s];
                copy_field(rec + seg.offset, seg.elem_bytes, seg.data + src_rows[i] * seg.row_stride, seg.col_stride,
                           seg.elem_bytes, seg.num_cols);
            }
        }
    });
}

void unpack_rows(const Segment* segments, int num_segments,
                 const uint8_t* records, const int64_t* dst_rows,
                 int64_t num_rows, int64_t record_bytes,
                 int num_threads) {
    parallel_for(num_rows, grain_rows(record_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const uint8_t* rec = records + i * record_bytes;
            const int64_t row = dst_rows == nullptr ? i : dst_rows[i];
            for (int s = 0; s < num_segments; ++s) {
                const Segment& seg = segments[s];
                copy_field(seg.data + row * seg.row_stride, seg.col_stride, rec + seg.offset, seg.elem_bytes,
                           seg.elem_bytes, seg.num_cols);
            }
        }
    });
}

void combine_reduce(void* out, float* out_weights,
                    const uint8_t* records, const int32_t* send_pos, const float* scale,
                    const void* bias0, const void* bias1,
                    int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                    int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                    int num_threads) {
    switch (dtype) {
        case DType::kFloat32:
            return combine_reduce_typed<DType::kFloat32>(out, out_weights, records, send_pos, scale, bias0, bias1, num_tokens,
                                                         num_sources, hidden, record_bytes, x_offset, weights_offset, num_topk, num_threads);
        case DType::kBFloat16:
            return combine_reduce_typed<DType::kBFloat16>(out, out_weights, records, send_pos, scale, bias0, bias1, num_tokens,
                                                          num_sources, hidden, record_bytes, x_offset, weights_offset, num_topk, num_threads);
        case DType::kFloat16:
            return combine_reduce_typed<DType::kFloat16>(out, out_weights, records, send_pos, scale, bias0, bias1, num_tokens,
                                                         num_sources, hidden, record_bytes, x_offset, weights_offset, num_topk, num_threads);
    }
    MC_CHECK(false, "combine_reduce: unknown dtype code " << static_cast<int>(dtype));
}

}  // namespace moe_comm::cpu
