// Scalar number formats shared by the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda, both
// targets), so every backend rounds with the same bits: bfloat16 and float16 <-> fp32 as torch
// rounds (nearest even), and the float8 casts of DeepEP's low-latency FP8 path. An unnamed namespace
// gives every translation unit its own copy, so the builds of one file for different instruction sets
// (csrc/cpu/reduce.cpp: generic and AVX2) never share a definition.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define MC_NUM __host__ __device__ __forceinline__
#else
#define MC_NUM inline
#endif

namespace moe_comm::numeric {
namespace {

MC_NUM uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    return bits;
#endif
}

MC_NUM float from_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
#endif
}

MC_NUM float bf16_to_float(uint16_t v) { return from_bits(static_cast<uint32_t>(v) << 16); }

// Round-to-nearest-even, NaN kept quiet: the same rounding torch uses for float -> bfloat16.
MC_NUM uint16_t float_to_bf16(float f) {
    const uint32_t bits = bits_of(f);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    // A select, not a branch, so the store loop vectorizes.
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// Rounds |f| (sign cleared in `bits`) to a float8 with `kMant` mantissa bits and exponent bias `kBias`:
// nearest even for normals; subnormals by an fp32 add that leaves the wanted bits at the bottom.
template <int kMant, int kBias>
MC_NUM uint32_t fp8_magnitude(uint32_t bits) {
    constexpr int kDrop = 23 - kMant;
    constexpr uint32_t kDenormMagic = static_cast<uint32_t>(127 - kBias + kDrop + 1) << 23;
    constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 - kBias + 1) << 23;
    const uint32_t odd = (bits >> kDrop) & 1u;
    const uint32_t normal =
        (bits + (static_cast<uint32_t>(kBias - 127) << 23) + ((1u << (kDrop - 1)) - 1) + odd) >> kDrop;
    const uint32_t denormal = bits_of(from_bits(bits) + from_bits(kDenormMagic)) - kDenormMagic;
    return bits < kMinNormal ? denormal : normal;
}

// E4M3 (fn: no Inf) saturates to +-448 from above, Inf included, as torch's cast does; NaN stays NaN.
MC_NUM uint8_t to_e4m3(float f) {
    const uint32_t all = bits_of(f), sign = all & 0x80000000u, bits = all ^ sign;
    const uint32_t rounded = fp8_magnitude<3, 7>(bits);
    const uint32_t mag = bits > 0x7f800000u ? 0x7fu : (rounded > 0x7eu ? 0x7eu : rounded);
    return static_cast<uint8_t>(mag | (sign >> 24));
}

// E5M2 overflows to +-Inf from 61440 up, as torch's cast does; NaN stays NaN.
MC_NUM uint8_t to_e5m2(float f) {
    const uint32_t all = bits_of(f), sign = all & 0x80000000u, bits = all ^ sign;
    const uint32_t big = bits > 0x7f800000u ? 0x7fu : 0x7cu;  // NaN stays NaN, the rest overflows to Inf
    const uint32_t mag = bits >= (143u << 23) ? big : fp8_magnitude<2, 15>(bits);
    return static_cast<uint8_t>(mag | (sign >> 24));
}

// float16 <-> fp32 with torch's rounding (nearest even): the hardware conversions on either target.
MC_NUM float half_to_float(uint16_t v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(v));
#else
    _Float16 h;
    std::memcpy(&h, &v, sizeof(h));
    return static_cast<float>(h);
#endif
}

MC_NUM uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(f));
#else
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t v;
    std::memcpy(&v, &h, sizeof(v));
    return v;
#endif
}

// fp32 multiply and add, each rounded once: never contracted into an FMA, on either target, so sums
// round as the torch references do.
MC_NUM float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;  // the files that include this build with -ffp-contract=off
#endif
}

MC_NUM float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

}  // namespace
}  // namespace moe_comm::numeric
