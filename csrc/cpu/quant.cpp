// Per-token FP8 / INT8 quantization and dequantization (api.h: quantize_rows, dequantize_rows),
// bit-identical to the torch references: every step is the same IEEE fp32 operation (no FMA:
// -ffp-contract=off), and the float8 roundings round as torch's casts do (nearest even; the overflow
// rules below, checked against torch bit for bit by the tests), written as selects so the loops vectorize.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "api.h"
#include "bounds.h"
#include "check.h"
#include "elem.h"
#include "parallel.h"

namespace moe_comm::cpu {
namespace {

constexpr int64_t kGroup = kFp8Group;
constexpr uint32_t kMantissa = (1u << 23) - 1;

using numeric::to_e4m3;
using numeric::to_e5m2;

// max(1e-4, max |x|) of n values, NaN if any is NaN (as torch's amax and maximum). With the sign bit
// cleared, float order is integer order of the bits and every NaN is above Inf, so this is one
// integer max reduction, which vectorizes.
inline float abs_max(const float* x, int64_t n) {
    uint32_t top = bits_of(kAmaxFloor);
    for (int64_t i = 0; i < n; ++i) top = std::max(top, bits_of(x[i]) & 0x7fffffffu);
    return top > 0x7f800000u ? std::numeric_limits<float>::quiet_NaN() : from_bits(top);
}

template <uint8_t (*kCast)(float)>
void fp8_row(uint8_t* out, uint8_t* scales, const float* x, int64_t hidden, float q_max, float q_max_inv,
             bool round_scale, bool ue8m0) {
    for (int64_t g = 0; g < hidden / kGroup; ++g) {
        const float* xg = x + g * kGroup;
        const float amax = abs_max(xg, kGroup);
        float scale, scale_inv;
        if (round_scale) {
            const uint32_t bits = bits_of(amax * q_max_inv);
            const uint32_t exponent = ((bits >> 23) & 0xffu) - 127u + ((bits & kMantissa) != 0 ? 1u : 0u);
            scale = from_bits((127u - exponent) << 23);
            scale_inv = from_bits((127u + exponent) << 23);
        } else {
            scale = q_max / amax;
            scale_inv = amax * q_max_inv;
        }
        uint8_t* og = out + g * kGroup;
        for (int64_t i = 0; i < kGroup; ++i) og[i] = kCast(xg[i] * scale);
        if (ue8m0)
            scales[g] = static_cast<uint8_t>(bits_of(scale_inv) >> 23);
        else
            std::memcpy(scales + g * sizeof(float), &scale_inv, sizeof(float));
    }
}

void int8_row(int8_t* out, float* scale_out, const float* x, int64_t hidden) {
    const float scale = 127.0f / abs_max(x, hidden);
    for (int64_t i = 0; i < hidden; ++i) {
        // Adding 1.5 * 2^23 leaves no fraction bits: the fp32 add rounds half to even, as torch.round.
        const float r = (x[i] * scale + 12582912.0f) - 12582912.0f;
        out[i] = static_cast<int8_t>(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
    }
    *scale_out = 1.0f / scale;
}

template <DType kType>
inline void load_row(float* dst, const void* x, int64_t row, int64_t hidden) {
    using E = Elem<kType>;
    const auto* src = static_cast<const typename E::T*>(x) + row * hidden;
    for (int64_t i = 0; i < hidden; ++i) dst[i] = E::load(src[i]);
}

// The exact fp32 value of every float8 code (NaN codes give a quiet NaN).
struct Fp8Table {
    float value[256];
    Fp8Table(int mant_bits, int bias, bool has_inf) {
        for (int code = 0; code < 256; ++code) {
            const int exponent = (code & 0x7f) >> mant_bits, mant = code & ((1 << mant_bits) - 1);
            const int top = (1 << (7 - mant_bits)) - 1;
            float v;
            if (exponent == 0)
                v = std::ldexp(static_cast<float>(mant), 1 - bias - mant_bits);
            else if (has_inf ? exponent == top : (exponent == top && mant == (1 << mant_bits) - 1))
                v = has_inf && mant == 0 ? std::numeric_limits<float>::infinity()
                                         : std::numeric_limits<float>::quiet_NaN();
            else
                v = std::ldexp(static_cast<float>(mant + (1 << mant_bits)), exponent - bias - mant_bits);
            value[code] = code & 0x80 ? -v : v;
        }
    }
};

const Fp8Table kE4M3Values(3, 7, false);
const Fp8Table kE5M2Values(2, 15, true);

template <DType kType>
inline void dequantize_row(void* out_raw, const uint8_t* q, const uint8_t* scales, int64_t hidden,
                           QuantFormat format, bool ue8m0) {
    using E = Elem<kType>;
    auto* out = static_cast<typename E::T*>(out_raw);
    if (format == QuantFormat::kInt8) {
        float scale;
        std::memcpy(&scale, scales, sizeof(scale));
        for (int64_t i = 0; i < hidden; ++i) out[i] = E::store(static_cast<float>(static_cast<int8_t>(q[i])) * scale);
        return;
    }
    const float* table = format == QuantFormat::kE4M3 ? kE4M3Values.value : kE5M2Values.value;
    for (int64_t g = 0; g < hidden / kGroup; ++g) {
        float scale;
        if (ue8m0)
            scale = from_bits(static_cast<uint32_t>(scales[g]) << 23);
        else
            std::memcpy(&scale, scales + g * sizeof(float), sizeof(scale));
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) out[i] = E::store(table[q[i]] * scale);
    }
}

// One call of quantize_rows (x -> codes, scales) or dequantize_rows (codes, scales -> x).
struct Job {
    bool dequantize;
    uint8_t* codes;
    uint8_t* scales;
    void* x;
    const int64_t* source;
    int64_t hidden, source_div, scale_bytes;
    DType dtype;  // x's
    QuantFormat format;
    bool round_scale, ue8m0;
};

// Rows [begin, end) of the job.
inline void job_range(const Job& job, int64_t begin, int64_t end) {
    const int64_t hidden = job.hidden;
    if (job.dequantize) {
        const int64_t x_bytes = hidden * (job.dtype == DType::kFloat32 ? 4 : 2);
        for (int64_t r = begin; r < end; ++r) {
            void* x = static_cast<uint8_t*>(job.x) + r * x_bytes;
            const uint8_t* q = job.codes + r * hidden;
            const uint8_t* s = job.scales + r * job.scale_bytes;
            if (job.dtype == DType::kBFloat16)
                dequantize_row<DType::kBFloat16>(x, q, s, hidden, job.format, job.ue8m0);
            else if (job.dtype == DType::kFloat16)
                dequantize_row<DType::kFloat16>(x, q, s, hidden, job.format, job.ue8m0);
            else
                dequantize_row<DType::kFloat32>(x, q, s, hidden, job.format, job.ue8m0);
        }
        return;
    }
    const float q_max = job.format == QuantFormat::kE4M3 ? 448.0f : 57344.0f;
    const float q_max_inv = 1.0f / q_max;
    std::vector<float> row(static_cast<size_t>(hidden));
    for (int64_t r = begin; r < end; ++r) {
        const int64_t src = job.source == nullptr ? r : job.source[r];
        if (src < 0)
            std::fill(row.begin(), row.end(), 0.0f);
        else if (job.dtype == DType::kBFloat16)
            load_row<DType::kBFloat16>(row.data(), job.x, src / job.source_div, hidden);
        else if (job.dtype == DType::kFloat16)
            load_row<DType::kFloat16>(row.data(), job.x, src / job.source_div, hidden);
        else
            load_row<DType::kFloat32>(row.data(), job.x, src / job.source_div, hidden);
        uint8_t* o = job.codes + r * hidden;
        uint8_t* s = job.scales + r * job.scale_bytes;
        if (job.format == QuantFormat::kE4M3)
            fp8_row<to_e4m3>(o, s, row.data(), hidden, q_max, q_max_inv, job.round_scale, job.ue8m0);
        else if (job.format == QuantFormat::kE5M2)
            fp8_row<to_e5m2>(o, s, row.data(), hidden, q_max, q_max_inv, job.round_scale, job.ue8m0);
        else
            int8_row(reinterpret_cast<int8_t*>(o), reinterpret_cast<float*>(s), row.data(), hidden);
    }
}

// job_range built for AVX-512, AVX2 and baseline x86-64, with every helper inlined (flatten) so each
// build vectorizes them for its ISA. The same IEEE operations in every build, so the same bits.
#if defined(__x86_64__) && defined(__GNUC__)
#define MC_BUILDS 1
__attribute__((target("avx512f,avx512bw,avx512vl"), flatten))
void range_avx512(const Job& job, int64_t begin, int64_t end) { job_range(job, begin, end); }
__attribute__((target("avx2,f16c"), flatten))
void range_avx2(const Job& job, int64_t begin, int64_t end) { job_range(job, begin, end); }
#endif
__attribute__((flatten))
void range_generic(const Job& job, int64_t begin, int64_t end) { job_range(job, begin, end); }

std::atomic<IsaLevel> isa_cap{IsaLevel::kAvx512};  // the best build tests allow

IsaLevel best_isa() {
    IsaLevel isa = IsaLevel::kGeneric;
#ifdef MC_BUILDS
    static const IsaLevel supported =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
            ? IsaLevel::kAvx512
            : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? IsaLevel::kAvx2 : IsaLevel::kGeneric);
    isa = supported;
#endif
    return std::min(isa, isa_cap.load(std::memory_order_relaxed));
}

void run(const Job& job, int64_t num_rows, int num_threads) {
    const bool fp8 = job.format == QuantFormat::kE4M3 || job.format == QuantFormat::kE5M2;
    const char* op = job.dequantize ? "dequantize_rows" : "quantize_rows";
    MC_CHECK(fp8 || job.format == QuantFormat::kInt8, op << ": unknown format code " << static_cast<int>(job.format));
    MC_CHECK(!fp8 || job.hidden % kGroup == 0, op << ": FP8 needs hidden % " << kGroup << " == 0, got " << job.hidden);
    MC_CHECK(job.source_div > 0, op << ": source_div must be positive, got " << job.source_div);
    MC_CHECK(is_float_row(job.dtype),
             op << ": dtype must be FLOAT32, BFLOAT16 or FLOAT16, got DType code " << static_cast<int>(job.dtype));
    void (*range)(const Job&, int64_t, int64_t) = range_generic;
#ifdef MC_BUILDS
    const IsaLevel isa = best_isa();
    range = isa == IsaLevel::kAvx512 ? range_avx512 : (isa == IsaLevel::kAvx2 ? range_avx2 : range_generic);
#endif
    parallel_for(num_rows, grain_rows(job.hidden * 4), num_threads,
                 [&job, range](int64_t begin, int64_t end) { range(job, begin, end); });
}

int64_t scale_bytes(QuantFormat format, int64_t hidden, bool ue8m0) {
    return format == QuantFormat::kInt8 ? 4 : (hidden / kGroup) * (ue8m0 ? 1 : 4);
}

}  // namespace

void quantize_rows(uint8_t* out, uint8_t* scales,
                   const void* x, const int64_t* source,
                   int64_t num_rows, int64_t x_rows, int64_t hidden, int64_t source_div, DType in_dtype,
                   QuantFormat format, bool round_scale, bool ue8m0, int num_threads) {
    MC_CHECK(num_rows >= 0 && x_rows >= 0 && hidden >= 0,
             "quantize_rows: num_rows, x_rows and hidden must be >= 0, got " << num_rows << ", " << x_rows << ", "
                                                                             << hidden);
    MC_CHECK(source_div > 0, "quantize_rows: source_div must be positive, got " << source_div);
    if (source == nullptr)
        MC_CHECK(num_rows <= x_rows, "quantize_rows: num_rows = " << num_rows << " (without source) is more than the "
                                                                  << x_rows << " rows of x");
    else  // source[r] < x_rows * source_div  <=>  source[r] / source_div < x_rows (for source[r] >= 0)
        check_indices("quantize_rows", "source", source, num_rows, 0, -1, saturating_mul(x_rows, source_div),
                      "source / source_div indexes the " + std::to_string(x_rows) + " rows of x, source_div=" +
                          std::to_string(source_div));
    run({false, out, scales, const_cast<void*>(x), source, hidden, source_div, scale_bytes(format, hidden, ue8m0),
         in_dtype, format, round_scale, ue8m0},
        num_rows, num_threads);
}

void dequantize_rows(void* out, const uint8_t* q, const uint8_t* scales,
                     int64_t num_rows, int64_t hidden, DType out_dtype, QuantFormat format, bool ue8m0,
                     int num_threads) {
    run({true, const_cast<uint8_t*>(q), const_cast<uint8_t*>(scales), out, nullptr, hidden, 1,
         scale_bytes(format, hidden, ue8m0), out_dtype, format, false, ue8m0},
        num_rows, num_threads);
}

const char* quantize_rows_isa() {
    switch (best_isa()) {
        case IsaLevel::kAvx512: return "avx512";
        case IsaLevel::kAvx2: return "avx2";
        case IsaLevel::kGeneric: break;
    }
    return "generic";
}

void set_quantize_rows_isa_cap(IsaLevel cap) {
    MC_CHECK(cap == IsaLevel::kGeneric || cap == IsaLevel::kAvx2 || cap == IsaLevel::kAvx512,
             "set_quantize_rows_isa_cap: unknown ISA level " << static_cast<int>(cap));
    isa_cap.store(cap);
}

}  // namespace moe_comm::cpu
