// The verdict on one call's headers (moe_comm/protocol/call_header.py; the same checks as
// moe_comm/protocol/handshake.py's, in words: handshake.check): whether every rank's header agrees.
// Shared by the CUDA kernels' receive (csrc/cuda/kernels/low_latency.h, ll_judge) and the CPU's
// (csrc/cpu/headers.cpp: the shm transport's posts), so both find a difference alike; the host then
// reads the headers again for the error message (CallAgreement.judge), the same on every rank.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MC_HEADER __host__ __device__ __forceinline__
#else
#define MC_HEADER inline
#endif

namespace moe_comm::call_header {

// Word w of a header (8-byte words; a header need not be aligned for this).
MC_HEADER int64_t word(const uint8_t* header, int64_t w) {
    int64_t v = 0;
#if defined(__CUDA_ARCH__)
    for (int i = 0; i < 8; ++i) reinterpret_cast<uint8_t*>(&v)[i] = header[8 * w + i];
#else
    std::memcpy(&v, header + 8 * w, 8);
#endif
    return v;
}

// Where headers differ: the rank whose header holds the word, the word, its value, the value wanted.
struct Difference {
    int32_t rank, word;
    int64_t seen, wanted;
};

// Whether the headers agree: rank s's header starts at first + s * stride (masked ranks: skip[s] != 0, or
// skip null for none).
// From word per_rank on, a header holds [4][R]: rows it sends to each rank, rows it expects from each,
// their digests; a pair (s, d) agrees when s's sent and d's expected (rows, then digests) are equal or
// either is unknown (< 0). Then every word w < 64 with bit w of `compare` set must be alike in every
// header (this rank's, `me`, against each), and word `rejected` must be 0 everywhere. On the first
// difference fills *diff (when not null) and returns false.
MC_HEADER bool agree(const uint8_t* first, int64_t stride, const uint8_t* skip, int num_ranks, int me,
                     int64_t per_rank, int rejected, uint64_t compare, Difference* diff) {
    const int64_t R = num_ranks;
    const uint8_t* mine = first + me * stride;
    for (int s = 0; s < num_ranks; ++s) {
        if (skip != nullptr && skip[s]) continue;
        const uint8_t* theirs = first + s * stride;
        for (int d = 0; d < num_ranks; ++d) {  // what s sends d against what d expects from s, where known
            if (skip != nullptr && skip[d]) continue;
            for (int64_t part = 0; part < 2; ++part) {  // row counts, then digests
                const int64_t w = per_rank + 2 * part * R + d;
                const int64_t sent = word(theirs, w);
                const int64_t expected = word(first + d * stride, per_rank + (2 * part + 1) * R + s);
                if (expected >= 0 && sent >= 0 && expected != sent) {
                    if (diff != nullptr) *diff = Difference{s, static_cast<int32_t>(w), sent, expected};
                    return false;
                }
            }
        }
        for (int w = 0; w < 64; ++w) {
            const bool is_rejected = w == rejected;
            if (!is_rejected && !((compare >> w) & 1)) continue;
            const int64_t a = word(mine, w), b = word(theirs, w);
            if (is_rejected ? (a != 0 || b != 0) : a != b) {
                if (diff != nullptr)
                    *diff = Difference{is_rejected && a != 0 ? me : s, w, is_rejected && a != 0 ? a : b,
                                       is_rejected ? 0 : a};
                return false;
            }
        }
    }
    return true;
}

}  // namespace moe_comm::call_header
