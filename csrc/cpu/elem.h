// Element types of the CPU kernels: loads to fp32 and rounding stores with the bits torch gives
// (the scalar formats are csrc/common/numeric.h, shared with the CUDA kernels).
// An unnamed namespace gives every file its own copy, so the builds of one file for different
// instruction sets (reduce.cpp: generic and AVX2) never share a definition.
#pragma once

#include <cstdint>
#include <cstring>

#include "api.h"
#include "../common/numeric.h"

namespace moe_comm::cpu {
namespace {

using numeric::bf16_to_float;
using numeric::bits_of;
using numeric::float_to_bf16;
using numeric::from_bits;

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
