// The roles of the launches across nodes and of low latency, written once for every device build:
// kernels.cu (links over CUDA IPC) and ../nvshmem/ep_kernels.cu (links over NVSHMEM) each give every role
// a one-line __global__ wrapper. A build's rank structs come with, found by argument-dependent lookup,
// rail_of(rank) (an internode rank's link to its rail) and link_of(rank) (a low-latency rank's link to
// every rank). Block b of a launch serves rank b / blocks_per_rank (launch.h).
#pragma once

#include <cuda_runtime.h>

#include "../platform/device.cuh"
#include "launch.h"

namespace moe_comm::cuda::device::roles {

using P = DevicePlatform;
using G = P::Group;

// This block's rank and its index among the rank's blocks.
template <class B>
__device__ __forceinline__ const auto& rank_of(const B& b) {
    return b.rank[blockIdx.x / static_cast<unsigned>(b.blocks_per_rank)];
}

__device__ __forceinline__ int local_block(int blocks_per_rank) {
    return static_cast<int>(blockIdx.x % static_cast<unsigned>(blocks_per_rank));
}

// The context with its wait budget made a deadline on this block's clock.
template <class Ctx>
__device__ __forceinline__ Ctx started(const Ctx& k) {
    Ctx c = k;
    c.watch.deadline = P::now() + k.watch.deadline;
    return c;
}

// ---------------------------------------------------------------------- normal mode across nodes
template <class B>
__device__ __forceinline__ void internode_notify(const B& b) {
    const auto& r = rank_of(b);
    cuda::internode_notify<P>(started(r.k), rail_of(r), r.a);
}

template <class B>
__device__ __forceinline__ void internode_prologue(const B& b) {
    const auto& r = rank_of(b);
    cuda::internode_prologue<P>(started(r.k), rail_of(r));
}

// Blocks of a rank: C * Rn RDMA senders (then each one's drain), C forwarders, C * NL NVL receivers.
template <class B>
__device__ __forceinline__ void internode_dispatch(const B& b) {
    const auto& r = rank_of(b);
    const InternodeContext k = started(r.k);
    const auto link = rail_of(r);
    const int i = local_block(b.blocks_per_rank), C = k.num_channels, senders = C * k.num_nodes;
    if (i < senders) {
        const int c = i / k.num_nodes, n = i % k.num_nodes;
        if (internode_rdma_send<P>(k, link, r.a, c, n) && G::leader())
            internode_rdma_drain<P>(k, link, r.a.rdma_channel_prefix, c, n);
    } else if (i < senders + C) {
        internode_forward<P>(k, link, r.a, i - senders);
    } else {
        const int j = i - senders - C;
        internode_nvl_recv<P>(k, r.a, j / k.node_ranks, j % k.node_ranks);
    }
}

// Blocks of a rank: C * NL NVL senders, C forwarders (then their drains), C receivers.
template <class B>
__device__ __forceinline__ void internode_combine(const B& b) {
    const auto& r = rank_of(b);
    const InternodeContext k = started(r.k);
    const auto link = rail_of(r);
    const int i = local_block(b.blocks_per_rank), C = k.num_channels, senders = C * k.node_ranks;
    if (i < senders) {
        internode_combine_send<P>(k, r.a, i / k.node_ranks, i % k.node_ranks);
    } else if (i < senders + C) {
        const int c = i - senders;
        if (internode_combine_forward<P>(k, link, r.a, c) && G::leader())
            for (int n = 0; n < k.num_nodes; ++n)
                if (!internode_rdma_drain<P>(k, link, r.a.recv_rdma_channel_prefix, c, n)) break;
    } else {
        internode_combine_recv<P>(k, link, r.a, i - senders - C);
    }
}

// ---------------------------------------------------------------------- low latency
// With a call header (k.post.header: the agreement in the data path, kernels/low_latency.h) a send runs
// its stage first (one agent per rank: the call counted in the buffer, the header staged, the send's
// checks), then its posts (a block per destination: flow control, the header, its sequence word), then
// its rows; a receive runs its judge (one agent per rank), then its rows, then tells every source the
// half is consumed (one agent per rank). Every launch of the call reads its number from the buffer
// (ll_counted), so a CUDA graph's replays advance it; blocks that move rows stop once the call was
// rejected here or a wait of the rank failed (a post's flow control, the judge's verdict).

template <class B>
__device__ __forceinline__ LowLatencyContext counted(const B& b, bool count = false) {
    const auto& r = rank_of(b);
    return ll_counted(r.k, link_of(r), count);
}

// Whether this block of a call with a header does nothing (the call rejected here, or a wait failed).
template <class L>
__device__ __forceinline__ bool ll_stops(const LowLatencyContext& k, const L& link) {
    if (!k.post.header) return false;
    int stop = 0;
    if (G::leader()) stop = failed<P>(k.watch) || ll_rejected(k, link);
    return G::broadcast(stop) != 0;
}

template <class L>
__device__ __forceinline__ void ll_stage_of(const LowLatencyContext& k, const L& link,
                                            const LowLatencyDispatchArgs& a) {
    cuda::ll_stage_dispatch(k, link, a);
}
template <class L>
__device__ __forceinline__ void ll_stage_of(const LowLatencyContext& k, const L& link,
                                            const LowLatencyCombineArgs& a) {
    cuda::ll_stage_combine(k, link, a);
}
template <class L>
__device__ __forceinline__ void ll_stage_of(const LowLatencyContext& k, const L& link, const NoArgs&) {
    ll_stage_header(k, link);  // a rejection: its header says so
}

// One agent per rank: counts the call, stages the header, runs the send's checks.
template <class B>
__device__ __forceinline__ void ll_stage(const B& b) {
    const auto& r = rank_of(b);
    ll_stage_of(ll_counted(r.k, link_of(r), true), link_of(r), r.a);
}

// A block per destination: the staged header to it, after it consumed call n - 2 of the half.
template <class B>
__device__ __forceinline__ void ll_post(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = started(counted(b));
    int gave_up = 0;
    if (G::leader()) gave_up = failed<P>(k.watch);
    if (G::broadcast(gave_up)) return;
    ll_post_header<P>(k, link_of(r), local_block(b.blocks_per_rank));
}

// One agent per rank: every rank's header of the call awaited and compared (MISMATCH in the record).
template <class B>
__device__ __forceinline__ void ll_judge(const B& b) {
    cuda::ll_judge<P>(started(counted(b)), link_of(rank_of(b)));
}

// One agent per rank, after the call's reads: every source may reuse the half (also after a verdict
// against the call, which leaves the buffer usable).
template <class B>
__device__ __forceinline__ void ll_consumed(const B& b) {
    cuda::ll_consumed<P>(counted(b), link_of(rank_of(b)));
}

template <class B>
__device__ __forceinline__ void ll_cast(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = counted(b);
    const int64_t t = local_block(b.blocks_per_rank);
    if (ll_stops(k, link_of(r))) return;
    if (t < r.a.num_tokens) cuda::ll_cast<P>(k, link_of(r), r.a, t);
}

template <class B>
__device__ __forceinline__ void ll_dispatch_send(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = counted(b);
    if (ll_stops(k, link_of(r))) return;
    cuda::ll_dispatch_send<P>(k, link_of(r), r.a, local_block(b.blocks_per_rank));
}

template <class B>
__device__ __forceinline__ void ll_dispatch_recv(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = started(counted(b));
    if (ll_stops(k, link_of(r))) return;
    cuda::ll_dispatch_recv<P>(k, link_of(r), r.a, local_block(b.blocks_per_rank));
}

template <class B>
__device__ __forceinline__ void ll_combine_send(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = counted(b);
    if (ll_stops(k, link_of(r))) return;
    cuda::ll_combine_send<P>(k, link_of(r), r.a, local_block(b.blocks_per_rank));
}

template <class B>
__device__ __forceinline__ void ll_combine_wait(const B& b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = started(counted(b));
    if (ll_stops(k, link_of(r))) return;
    cuda::ll_combine_wait<P>(k, link_of(r), local_block(b.blocks_per_rank));
}

template <class B>
__device__ __forceinline__ void ll_combine_reduce(const B& b) {
    const auto& r = rank_of(b);
    const int64_t t = local_block(b.blocks_per_rank);
    if (t >= r.a.num_tokens) return;
    int gave_up = 0;
    if (G::leader()) gave_up = failed<P>(r.k.watch);
    if (G::broadcast(gave_up)) return;  // a wait of this rank's combine failed: no sum, as on the host
    cuda::ll_combine_reduce<P>(counted(b), link_of(r), r.a, t);
}

// ---------------------------------------------------------------------- launching them
// A grid of every served rank's blocks that wait on each other: all co-resident, or no launch at all.
template <class B>
cudaError_t cooperative(void (*kernel)(B), B b, int blocks_per_rank, int threads, cudaStream_t s) {
    b.blocks_per_rank = blocks_per_rank;
    void* args[] = {&b};
    return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel),
                                       dim3(static_cast<unsigned>(b.num_ranks * blocks_per_rank)),
                                       dim3(static_cast<unsigned>(threads)), args, 0, s);
}

template <class B>
cudaError_t plain(void (*kernel)(B), B b, int64_t blocks_per_rank, int threads, cudaStream_t s) {
    if (blocks_per_rank <= 0) return cudaSuccess;  // nothing to do (no tokens)
    b.blocks_per_rank = static_cast<int32_t>(blocks_per_rank);
    kernel<<<dim3(static_cast<unsigned>(b.num_ranks * blocks_per_rank)), dim3(static_cast<unsigned>(threads)), 0,
             s>>>(b);
    return cudaGetLastError();
}

// The blocks of `kernel` at `threads` per block this GPU holds co-resident (-1 when the query fails):
// what a cooperative launch may have.
inline int64_t co_resident_blocks(const void* kernel, int threads) {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return static_cast<int64_t>(sms) * per_sm;
}

template <class B>
int64_t max_tokens(const B& b) {
    int64_t m = 0;
    for (int i = 0; i < b.num_ranks; ++i) m = b.rank[i].a.num_tokens > m ? b.rank[i].a.num_tokens : m;
    return m;
}

inline int internode_blocks(const InternodeContext& k, bool dispatch) {
    return dispatch ? k.num_channels * (k.num_nodes + 1 + k.node_ranks) : k.num_channels * (k.node_ranks + 2);
}

inline int experts(const LowLatencyContext& k) { return k.num_ranks * k.layout.experts_per_rank; }

// The header steps of a launch of a call with a header (none without): a send's stage and posts, a
// receive's judge and its consumed signals. Every rank of a launch has a header, or none.
template <class B>
bool has_header(const B& b) {
    return b.rank[0].k.post.header != nullptr;
}

// The header steps' kernels, one per step and batch type (each build instantiates them with its links).
template <class B>
__global__ void __launch_bounds__(kAgentThreads, 1) ll_stage_kernel(const __grid_constant__ B b) { ll_stage(b); }
template <class B>
__global__ void __launch_bounds__(kLowLatencyThreads, 1) ll_post_kernel(const __grid_constant__ B b) { ll_post(b); }
template <class B>
__global__ void __launch_bounds__(kAgentThreads, 1) ll_judge_kernel(const __grid_constant__ B b) { ll_judge(b); }
template <class B>
__global__ void __launch_bounds__(kAgentThreads, 1) ll_consumed_kernel(const __grid_constant__ B b) {
    ll_consumed(b);
}

template <class B>
cudaError_t before_send(const B& b, cudaStream_t s) {
    if (!has_header(b)) return cudaSuccess;
    const cudaError_t e = plain(ll_stage_kernel<B>, b, 1, kAgentThreads, s);
    return e != cudaSuccess ? e : plain(ll_post_kernel<B>, b, b.rank[0].k.num_ranks, kLowLatencyThreads, s);
}
template <class B>
cudaError_t before_receive(const B& b, cudaStream_t s) {
    return has_header(b) ? plain(ll_judge_kernel<B>, b, 1, kAgentThreads, s) : cudaSuccess;
}
template <class B>
cudaError_t after_receive(const B& b, cudaStream_t s) {
    return has_header(b) ? plain(ll_consumed_kernel<B>, b, 1, kAgentThreads, s) : cudaSuccess;
}

// Low latency: the send half is the cast (a block per token) then the sends (a block per expert); the
// receive half of a combine its waits (a block per expert) then its sums (a block per token); each with
// its header steps first (and, for a receive, last).
template <class B>
cudaError_t launch_ll_dispatch_send(void (*cast)(B), void (*send)(B), const B& b, cudaStream_t s) {
    cudaError_t e = before_send(b, s);
    if (e == cudaSuccess) e = plain(cast, b, max_tokens(b), kCastThreads, s);
    return e != cudaSuccess ? e : plain(send, b, experts(b.rank[0].k), kLowLatencyThreads, s);
}

template <class B>
cudaError_t launch_ll_dispatch_recv(void (*recv)(B), const B& b, cudaStream_t s) {
    cudaError_t e = before_receive(b, s);
    if (e == cudaSuccess) e = plain(recv, b, b.rank[0].k.layout.experts_per_rank, kLowLatencyThreads, s);
    return e != cudaSuccess ? e : after_receive(b, s);
}

template <class B>
cudaError_t launch_ll_combine_send(void (*send)(B), const B& b, cudaStream_t s) {
    const cudaError_t e = before_send(b, s);
    return e != cudaSuccess ? e : plain(send, b, b.rank[0].k.layout.experts_per_rank, kLowLatencyThreads, s);
}

template <class B>
cudaError_t launch_ll_combine_recv(void (*wait)(B), void (*reduce)(B), const B& b, cudaStream_t s) {
    cudaError_t e = before_receive(b, s);
    if (e == cudaSuccess) e = plain(wait, b, experts(b.rank[0].k), kAgentThreads, s);
    if (e == cudaSuccess) e = plain(reduce, b, max_tokens(b), kLowLatencyThreads, s);
    return e != cudaSuccess ? e : after_receive(b, s);
}

// A call rejected on the host: its header (the rejected bit set) to every rank, no rows, and its half
// consumed here (this rank receives nothing of it).
template <class B>
cudaError_t launch_ll_reject(const B& b, cudaStream_t s) {
    if (!has_header(b)) return cudaErrorInvalidValue;  // a rejection is its header
    const cudaError_t e = before_send(b, s);
    return e != cudaSuccess ? e : after_receive(b, s);
}

}  // namespace moe_comm::cuda::device::roles
