// Probe kernels for the SASS lint (lint.py): one extern "C" kernel per protocol operation, each
// calling the real protocol function with the real DevicePlatform, so the machine code ptxas emits
// for the flag operations the kernels inline can be read back by name and checked. Nothing here is
// launched; it is compiled to a cubin and disassembled.
//
//   probe_<op>    a publish (release store) or a wait (acquire-load spin loop) or both (barrier)
//
// Built with -I csrc. -DMOE_COMM_PLANT_RELAXED_TAIL turns the ring tail publish into a relaxed store
// (protocol/ring.h): the lint must then fail probe_ring_publish_tail and only it.
#include <cstdint>

#include "cuda/platform/device.cuh"
#include "cuda/protocol/barrier.h"
#include "cuda/protocol/ring.h"
#include "cuda/protocol/wait.h"
#include "cuda/kernels/internode.h"
#include "cuda/kernels/low_latency.h"
#include "cuda/protocol/link.h"
#include "cuda/protocol/rdma_ring.h"

using moe_comm::cuda::DevicePlatform;
namespace mc = moe_comm::cuda;

// ---- ring (normal mode) ----------------------------------------------------------------------------

extern "C" __global__ void probe_ring_publish_tail(mc::Ring ring, int64_t tail) {
    mc::ring_publish_tail<DevicePlatform>(ring, tail);
}

extern "C" __global__ void probe_ring_publish_head(mc::Ring ring, int64_t head) {
    mc::ring_publish_head<DevicePlatform>(ring, head);
}

extern "C" __global__ void probe_ring_wait_data(mc::Watch w, mc::Ring ring, int64_t consumed, int peer,
                                                int channel, int64_t* out) {
    *out = mc::ring_wait_data<DevicePlatform>(w, ring, consumed, peer, channel);
}

extern "C" __global__ void probe_ring_wait_space(mc::Watch w, mc::Ring ring, int64_t sent, int64_t n, int peer,
                                                 int channel, int* out) {
    *out = mc::ring_wait_space<DevicePlatform>(w, ring, sent, n, peer, channel) ? 1 : 0;
}

// ---- barrier and the bare wait ---------------------------------------------------------------------

extern "C" __global__ void probe_barrier(mc::Watch w, int64_t* const* arrive, int rank, int num_ranks,
                                         int64_t epoch, int* out) {
    *out = mc::barrier<DevicePlatform>(w, arrive, rank, num_ranks, epoch) ? 1 : 0;
}

extern "C" __global__ void probe_wait_at_least(mc::Watch w, const int64_t* flag, int64_t target, int peer,
                                               int channel, int64_t* out) {
    *out = mc::wait_at_least<DevicePlatform>(w, flag, target, mc::WaitKind::kBarrier, peer, channel);
}

// ---- low latency: the count signal and the combine flag, publish and wait ----------------------------

using Link = mc::DirectLink<DevicePlatform>;  // the IPC build's link (kernels.cu)

extern "C" __global__ void probe_ll_dispatch_send(mc::LowLatencyContext k, mc::LowLatencyDispatchArgs a,
                                                  int expert) {
    mc::ll_dispatch_send<DevicePlatform>(k, Link{k.peers, k.rank}, a, expert);
}

extern "C" __global__ void probe_ll_dispatch_recv(mc::LowLatencyContext k, mc::LowLatencyDispatchArgs a,
                                                  int e_loc, int* out) {
    const bool ok = mc::ll_dispatch_recv<DevicePlatform>(k, Link{k.peers, k.rank}, a, e_loc);
    if (threadIdx.x == 0) *out = ok ? 1 : 0;
}

extern "C" __global__ void probe_ll_combine_send(mc::LowLatencyContext k, mc::LowLatencyCombineArgs a,
                                                 int e_loc) {
    mc::ll_combine_send<DevicePlatform>(k, Link{k.peers, k.rank}, a, e_loc);
}

extern "C" __global__ void probe_ll_combine_wait(mc::LowLatencyContext k, int expert, int* out) {
    *out = mc::ll_combine_wait<DevicePlatform>(k, Link{k.peers, k.rank}, expert) ? 1 : 0;
}

// The call header protocol of a low-latency launch (kernels/low_latency.h): the flow-control wait and
// the header's sequence word, the receive's wait for every header, the "consumed" signals.
extern "C" __global__ void probe_ll_post_header(mc::LowLatencyContext k, int dest, int* out) {
    const bool ok = mc::ll_post_header<DevicePlatform>(k, Link{k.peers, k.rank}, dest);
    if (threadIdx.x == 0) *out = ok ? 1 : 0;
}

extern "C" __global__ void probe_ll_judge(mc::LowLatencyContext k, int* out) {
    *out = mc::ll_judge<DevicePlatform>(k, Link{k.peers, k.rank}) ? 1 : 0;
}

extern "C" __global__ void probe_ll_consumed(mc::LowLatencyContext k) {
    mc::ll_consumed<DevicePlatform>(k, Link{k.peers, k.rank});
}

// ---- across nodes: the RDMA ring over the IPC build's link, and the rail and node barriers ----------------

extern "C" __global__ void probe_rdma_put(Link link, mc::RdmaRing ring, int peer, int64_t sent, int64_t n) {
    mc::rdma_put<DevicePlatform, DevicePlatform::Group>(link, peer, ring, sent, n);
}

extern "C" __global__ void probe_rdma_release(Link link, mc::RdmaRing ring, int peer, int64_t head) {
    if (threadIdx.x == 0) mc::rdma_release(link, peer, ring, head);
}

extern "C" __global__ void probe_rdma_wait_data(mc::Watch w, Link link, mc::RdmaRing ring, int64_t consumed, int peer,
                                                int channel, int64_t* out) {
    *out = mc::rdma_wait_data<DevicePlatform>(w, link, ring, consumed, peer, channel);
}

extern "C" __global__ void probe_rdma_wait_space(mc::Watch w, Link link, mc::RdmaRing ring, int64_t sent, int64_t n,
                                                 int peer, int channel, int* out) {
    *out = mc::rdma_wait_space<DevicePlatform>(w, link, ring, sent, n, peer, channel) ? 1 : 0;
}

extern "C" __global__ void probe_rail_barrier(mc::InternodeContext k, Link link, int64_t epoch, int* out) {
    *out = mc::rail_barrier<DevicePlatform>(k, link, epoch) ? 1 : 0;
}

extern "C" __global__ void probe_node_barrier(mc::InternodeContext k, int64_t epoch, int* out) {
    *out = mc::node_barrier<DevicePlatform>(k, epoch) ? 1 : 0;
}
