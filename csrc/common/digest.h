// The arithmetic of routing digests (moe_comm/protocol/digest.py gives the formula): a block of token
// keys k_0, k_1, ... digests to (sum of mix(mix(k_j) + j) mod 2^64) >> 2. Shared by the CPU kernels
// (csrc/cpu/digest.cpp: the handshake's digests) and the CUDA kernels (csrc/cuda/kernels/low_latency.h:
// a low-latency combine's call header), so both sides of a comparison compute the same bits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MC_DIGEST __host__ __device__ __forceinline__
#else
#define MC_DIGEST inline
#endif

namespace moe_comm::digest {

// splitmix64's finalizer (wrapping uint64 arithmetic).
MC_DIGEST uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Key j of a block, as it adds to the block's sum.
MC_DIGEST uint64_t term(uint64_t key, int64_t j) { return mix(mix(key) + static_cast<uint64_t>(j)); }

// A block's digest from its sum: 62 bits, never negative (UNKNOWN, -1, stays apart).
MC_DIGEST int64_t finish(uint64_t sum) { return static_cast<int64_t>(sum >> 2); }

}  // namespace moe_comm::digest
