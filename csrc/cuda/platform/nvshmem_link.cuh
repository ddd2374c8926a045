// NVSHMEM as a link (protocol/link.h's contract), on the device only: one PE per rank, every place an
// offset into the rank's symmetric buffer (nvshmem_malloc: one offset names the same place on every PE).
// A peer whose memory this GPU can load and store (nvshmem_ptr non-null: NVLink inside a node) gets the
// group's plain copies and a release store, exactly DirectLink's code; any other peer goes through
// NVSHMEM's block-wide non-blocking puts, a fence, and a signal operation (IBGDA or IBRC: the RDMA path).
//
// Ordering across the network: nvshmem_fence orders this PE's earlier puts to a peer before its later
// puts and signals to that peer, so a signal (publish, signal) is always preceded by a fence and lands
// after the data it covers. Waits stay on the waiter's own memory (protocol/wait.h: acquire loads of a
// word a remote signal writes). Source buffers of remote puts are symmetric (the kernels stage into
// their own buffer first: staged(peer)), as the RDMA transports read registered memory.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "../kernels/copy.h"
#include "../protocol/link.h"
#include "device.cuh"

namespace moe_comm::cuda {

struct NvshmemLink : SymmetricPeers {
    __device__ __forceinline__ bool staged(int peer) const { return p2p[peer] == nullptr; }
    __device__ __forceinline__ uint8_t* local(int64_t off) const { return base + off; }
    __device__ __forceinline__ int64_t* local_flag(int64_t off) const {
        return reinterpret_cast<int64_t*>(base + off);
    }

    // Every thread of the block calls it (NVSHMEM's block-wide put is collective over the block).
    template <class G>
    __device__ __forceinline__ void put(int peer, int64_t off, const void* src, int64_t n) const {
        if (n <= 0) return;
        if (p2p[peer] != nullptr)
            copy_bytes<G>(p2p[peer] + off, src, n);
        else
            nvshmemx_putmem_nbi_block(base + off, src, static_cast<size_t>(n), pes[peer]);
    }
    template <class G>
    __device__ __forceinline__ void publish(int peer, int64_t off, int64_t v) const {
        G::sync();
        if (G::leader()) signal(peer, off, v);
    }
    __device__ __forceinline__ void signal(int peer, int64_t off, int64_t v) const {
        if (p2p[peer] != nullptr) {
            DevicePlatform::store_release(reinterpret_cast<int64_t*>(p2p[peer] + off), v);
            return;
        }
        nvshmem_fence();
        nvshmemx_signal_op(reinterpret_cast<uint64_t*>(base + off), static_cast<uint64_t>(v), NVSHMEM_SIGNAL_SET,
                           pes[peer]);
    }
    // What nvshmem_signal_wait_until does once the signal holds (for proxy transports, the step that makes
    // the data the signal covers visible here): one nvshmem_uint64_test, whose answer is already known.
    __device__ __forceinline__ void settle(int64_t off, int64_t v) const {
        (void)nvshmem_uint64_test(reinterpret_cast<uint64_t*>(base + off), NVSHMEM_CMP_GE, static_cast<uint64_t>(v));
    }
    __device__ __forceinline__ void quiet() const { nvshmem_quiet(); }
};

}  // namespace moe_comm::cuda
