// Element types of the CPU kernels: loads to fp32 and rounding stores with the bits torch gives.
// An unnamed namespace gives every file its own copy, so the builds of one file for different
// instruction sets (reduce.cpp: generic and AVX2) never share a definition.
#pragma once

#include <cstdint>
#include <cstring>

#include "api.h"

namespace moe_comm::cpu {
namespace {

inline uint32_t bits_of(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    return bits;
}

inline float from_bits(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

inline float bf16_to_float(uint16_t v) { return from_bits(static_cast<uint32_t>(v) << 16); }

// Round-to-nearest-even, NaN kept quiet: the same rounding torch uses for float -> bfloat16.
inline uint16_t float_to_bf16(float f) {
    const uint32_t bits = bits_of(f);
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

}  // namespace
}  // namespace moe_comm::cpu
