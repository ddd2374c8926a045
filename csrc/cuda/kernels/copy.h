// Payload copies: the only code that differs by target besides the platform. On the device a group's
// lanes copy 16-byte words (rows are 16-byte aligned in every ring slot and buffer); the host twin is
// memcpy. Neither synchronises: the protocol's publish after the copy does.
#pragma once

#include <cstdint>
#include <cstring>

#include "../platform/platform.h"

namespace moe_comm::cuda {

template <class G>
MC_HD void copy_bytes(void* dst, const void* src, int64_t n) {
#if defined(__CUDA_ARCH__)
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const bool aligned = ((reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s)) & 15) == 0;
    int64_t done = 0;
    if (aligned) {
        const int64_t words = n / 16;
        for (int64_t i = G::lane(); i < words; i += G::lanes())
            reinterpret_cast<int4*>(d)[i] = reinterpret_cast<const int4*>(s)[i];
        done = words * 16;
    }
    for (int64_t i = done + G::lane(); i < n; i += G::lanes()) d[i] = s[i];
#else
    if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
#endif
}

// n zero bytes by a group (an output's padding).
template <class G>
MC_HD void zero_bytes(void* dst, int64_t n) {
#if defined(__CUDA_ARCH__)
    auto* d = static_cast<uint8_t*>(dst);
    int64_t done = 0;
    if ((reinterpret_cast<uintptr_t>(d) & 15) == 0) {
        const int64_t words = n / 16;
        for (int64_t i = G::lane(); i < words; i += G::lanes()) reinterpret_cast<int4*>(d)[i] = make_int4(0, 0, 0, 0);
        done = words * 16;
    }
    for (int64_t i = done + G::lane(); i < n; i += G::lanes()) d[i] = 0;
#else
    if (n > 0) std::memset(dst, 0, static_cast<size_t>(n));
#endif
}

// A few bytes by one agent (a leader's metadata, a misaligned scalar).
MC_HD void copy_one(void* dst, const void* src, int64_t n) {
#if defined(__CUDA_ARCH__)
    for (int64_t i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = static_cast<const uint8_t*>(src)[i];
#else
    std::memcpy(dst, src, static_cast<size_t>(n));
#endif
}

}  // namespace moe_comm::cuda
