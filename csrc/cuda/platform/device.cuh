// The device platform: the flag operations in inline PTX at system scope (peers' buffers are CUDA
// IPC mappings another GPU writes), so the SASS lint (tools/sass_lint/lint.py) can check that every
// publish is a system-scope strong store after a fence and every wait a system-scope strong load.
#pragma once

#include <cstdint>

#include "platform.h"

namespace moe_comm::cuda {

struct DevicePlatform {
    __device__ __forceinline__ static int64_t load_acquire(const int64_t* p) {
        int64_t v;
        asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
    }
    __device__ __forceinline__ static int32_t load_acquire(const int32_t* p) {
        int32_t v;
        asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
    }
    __device__ __forceinline__ static void store_release(int64_t* p, int64_t v) {
        asm volatile("st.release.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    }
    __device__ __forceinline__ static void store_release(int32_t* p, int32_t v) {
        asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
    }
    __device__ __forceinline__ static int64_t load_relaxed(const int64_t* p) {
        int64_t v;
        asm volatile("ld.relaxed.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
        return v;
    }
    __device__ __forceinline__ static int32_t load_relaxed(const int32_t* p) {
        int32_t v;
        asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
        return v;
    }
    __device__ __forceinline__ static void store_relaxed(int64_t* p, int64_t v) {
        asm volatile("st.relaxed.sys.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    }
    __device__ __forceinline__ static void store_relaxed(int32_t* p, int32_t v) {
        asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
    }
    __device__ __forceinline__ static int64_t atomic_add(int64_t* p, int64_t v) {
        return static_cast<int64_t>(atomicAdd_system(reinterpret_cast<unsigned long long*>(p),
                                                     static_cast<unsigned long long>(v)));
    }
    __device__ __forceinline__ static bool cas32(int32_t* p, int32_t expected, int32_t v) {
        return atomicCAS_system(p, expected, v) == expected;
    }
    __device__ __forceinline__ static void fence() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
    __device__ __forceinline__ static int64_t now() { return clock64(); }
    __device__ __forceinline__ static void relax(int64_t) {}
    // Liveness is the host's to check (it polls the error record and the peers); the device waits
    // for its deadline.
    __device__ __forceinline__ static bool peer_exited(const int64_t*, int) { return false; }

    // A group is a whole block (blockDim.x threads); kernels give each protocol role its own block.
    struct Group {
        __device__ __forceinline__ static int lane() { return static_cast<int>(threadIdx.x); }
        __device__ __forceinline__ static int lanes() { return static_cast<int>(blockDim.x); }
        __device__ __forceinline__ static void sync() { __syncthreads(); }
        __device__ __forceinline__ static bool leader() { return threadIdx.x == 0; }
        // The leader's value, to every lane.
        template <class T>
        __device__ __forceinline__ static T broadcast(T v) {
            __shared__ T cell;
            __syncthreads();
            if (threadIdx.x == 0) cell = v;
            __syncthreads();
            return cell;
        }
    };
};

}  // namespace moe_comm::cuda
