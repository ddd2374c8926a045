// Non-temporal (streaming) copies: for large outputs that will not be read again before they
// leave the cache, skipping the read-for-ownership saves a third of the memory traffic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace moe_comm::cpu {

// Copies larger than this (in total) stream (1.3x on 58 MB of 14 KB rows, bench/RESULTS.md).
constexpr int64_t kStreamBytes = 8 << 20;
// Runs shorter than this use memcpy even when streaming.
constexpr size_t kStreamRun = 256;

// memcpy with non-temporal stores where the CPU has them; the caller fences (stream_fence).
inline void stream_copy(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
    const size_t head = std::min(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
    std::memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
#endif
    std::memcpy(dst, src, n);
}

// memset(dst, 0, n) with non-temporal stores where the CPU has them (no read for ownership of lines
// that will not be read soon: the padding of an output); the caller fences (stream_fence).
inline void stream_zero(uint8_t* dst, size_t n) {
#if defined(__SSE2__)
    const size_t head = std::min(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
    std::memset(dst, 0, head);
    dst += head, n -= head;
    const __m128i zero = _mm_setzero_si128();
    for (; n >= 64; n -= 64, dst += 64) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), zero);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), zero);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), zero);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), zero);
    }
#endif
    std::memset(dst, 0, n);
}

// Orders this thread's non-temporal stores before its later stores (a published flag, a join).
inline void stream_fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

}  // namespace moe_comm::cpu
