// How a rank reaches its peers' buffers across nodes ("RDMA"). Every rank lays its buffer out alike,
// so protocol code names a place in a peer's buffer by its byte offset, and moves data and signals
// through a link:
//
//   put<G>(peer, off, src, n)          the group copies n bytes of its own memory to peer's buffer at off
//                                      (no ordering by itself)
//   publish<G>(peer, off, v)           the group's puts to peer so far are delivered, then the int64 at
//                                      peer's off becomes v (a signal: what the peer's acquire wait sees)
//   signal(peer, off, v)               one agent's signal, after what it did before (release)
//   settle(off, v)                     after this rank's own int64 at off was seen >= v (a wait), what the
//                                      signal covers is visible (NVSHMEM's consistency step; nothing here)
//   quiet()                            this agent's puts and signals are complete (a launch ends with it)
//   staged(peer)                       whether puts to peer must come from this rank's own buffer (the
//                                      registered memory an RDMA NIC reads), not from any address
//
// DirectLink (here, both targets): every peer's buffer is mapped in this process (the host's shared
// memory; CUDA IPC or an nvshmem_ptr on the GPU): a put is the group's copy and a signal a release store
// after the group's sync, so the host build runs the RDMA protocol as copies plus signals into the peer's
// memory. NvshmemLink (platform/nvshmem_link.cuh, device only) is the same contract over NVSHMEM's puts
// with signal. Waits are always on the waiter's own memory (wait.h), so a link has no remote loads.
#pragma once

#include <cstdint>

#include "../kernels/copy.h"
#include "../platform/platform.h"

namespace moe_comm::cuda {

template <class P>
struct DirectLink {
    uint8_t* const* bases;  // [peers] every peer's buffer, mapped here
    int32_t me;             // this rank's index among the peers
    // [peers] 1 for a peer the host build treats as across the network (puts go through staging, as
    // NVSHMEM's would), or null: every peer is direct
    const uint8_t* remote = nullptr;

    MC_HD bool staged(int peer) const { return remote != nullptr && remote[peer] != 0; }
    MC_HD uint8_t* local(int64_t off) const { return bases[me] + off; }
    MC_HD int64_t* local_flag(int64_t off) const { return reinterpret_cast<int64_t*>(bases[me] + off); }

    template <class G>
    MC_HD void put(int peer, int64_t off, const void* src, int64_t n) const {
        copy_bytes<G>(bases[peer] + off, src, n);
    }
    // The release after the group's sync is cumulative: it covers every lane's copy before it.
    template <class G>
    MC_HD void publish(int peer, int64_t off, int64_t v) const {
        G::sync();
        if (G::leader()) signal(peer, off, v);
    }
    MC_HD void signal(int peer, int64_t off, int64_t v) const {
        P::store_release(reinterpret_cast<int64_t*>(bases[peer] + off), v);
    }
    MC_HD void settle(int64_t, int64_t) const {}
    MC_HD void quiet() const {}
};

// The data of a link over NVSHMEM's symmetric memory (platform/nvshmem_link.cuh holds its device code),
// in plain C++ so host code can put it into a launch's parameters.
struct SymmetricPeers {
    uint8_t* base;        // this rank's symmetric buffer (the same offsets on every PE)
    uint8_t* const* p2p;  // [peers] nvshmem_ptr(base, pe): the peer's buffer mapped here, or null
    const int32_t* pes;   // [peers] each peer's PE
    int32_t me;           // this rank's index among the peers
};

}  // namespace moe_comm::cuda
