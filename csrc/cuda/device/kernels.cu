// The device build of the kernel bodies (kernels/layout.h, intranode.h, internode.h, low_latency.h) on
// DevicePlatform, every peer reached over CUDA IPC: one __global__ wrapper per body (the roles shared
// with the NVSHMEM build in roles.cuh), a block per group (launch.h says which block serves which rank
// and role), and the host functions that launch them.
#include <cuda_runtime.h>

#include "../platform/device.cuh"
#include "../protocol/link.h"
#include "launch.h"

namespace moe_comm::cuda::device {

// This build's links: every peer's buffer is mapped here (CUDA IPC, one host), found by the roles
// (roles.cuh) through argument-dependent lookup on the rank structs of launch.h.
template <class Args>
__device__ __forceinline__ DirectLink<DevicePlatform> rail_of(const InternodeRank<Args>& r) {
    return DirectLink<DevicePlatform>{r.rdma, r.k.node};
}
template <class Args>
__device__ __forceinline__ DirectLink<DevicePlatform> link_of(const LowLatencyRank<Args>& r) {
    return DirectLink<DevicePlatform>{r.k.peers, r.k.rank};
}

}  // namespace moe_comm::cuda::device

#include "roles.cuh"

namespace moe_comm::cuda::device {
namespace {

using P = DevicePlatform;
using G = P::Group;

static_assert(sizeof(LayoutBatch) <= 4096 && sizeof(NotifyBatch) <= 4096 && sizeof(PrologueBatch) <= 4096 &&
                  sizeof(DispatchBatch) <= 4096 && sizeof(CombineBatch) <= 4096 &&
                  sizeof(InternodeNotifyBatch) <= 4096 && sizeof(InternodePrologueBatch) <= 4096 &&
                  sizeof(InternodeDispatchBatch) <= 4096 && sizeof(InternodeCombineBatch) <= 4096 &&
                  sizeof(LowLatencyDispatchBatch) <= 4096 && sizeof(LowLatencyCombineBatch) <= 4096 &&
                  sizeof(LowLatencyRejectBatch) <= 4096,
              "a launch's parameter fits the classic 4 KiB kernel parameter space");

using roles::local_block;
using roles::rank_of;
using roles::started;

// ---------------------------------------------------------------------- layout
__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(const __grid_constant__ LayoutBatch b) {
    const LayoutArgs& a = rank_of(b);
    const int64_t t = static_cast<int64_t>(local_block(b.blocks_per_rank)) * kLayoutThreads + threadIdx.x;
    if (t < a.num_tokens) layout_token<P>(a, t);
}

// ---------------------------------------------------------------------- normal mode
__global__ void __launch_bounds__(kAgentThreads, 1) notify_kernel(const __grid_constant__ NotifyBatch b) {
    const auto& r = rank_of(b);
    const NormalContext k = started(r.k);
    cuda::notify<P>(k, r.a, r.arrive);
}

__global__ void __launch_bounds__(kAgentThreads, 1) prologue_kernel(const __grid_constant__ PrologueBatch b) {
    const auto& r = rank_of(b);
    const NormalContext k = started(r.k);
    cuda::prologue<P>(k, r.arrive);
}

__global__ void __launch_bounds__(kNormalThreads, 1) dispatch_kernel(const __grid_constant__ DispatchBatch b) {
    const auto& r = rank_of(b);
    const NormalContext k = started(r.k);
    const int i = local_block(b.blocks_per_rank), senders = k.num_channels * k.num_ranks;
    const int j = i % senders, c = j / k.num_ranks, peer = j % k.num_ranks;
    if (i < senders)
        dispatch_send<P>(k, r.a, c, peer);
    else
        dispatch_recv<P>(k, r.a, c, peer);
}

__global__ void __launch_bounds__(kNormalThreads, 1) combine_kernel(const __grid_constant__ CombineBatch b) {
    const auto& r = rank_of(b);
    const NormalContext k = started(r.k);
    const int i = local_block(b.blocks_per_rank), senders = k.num_channels * k.num_ranks;
    if (i < senders)
        combine_send<P>(k, r.a, i / k.num_ranks, i % k.num_ranks);
    else
        combine_recv<P>(k, r.a, i - senders);
}

// ---------------------------------------------------------------------- normal mode across nodes
__global__ void __launch_bounds__(kAgentThreads, 1)
    internode_notify_kernel(const __grid_constant__ InternodeNotifyBatch b) { roles::internode_notify(b); }
__global__ void __launch_bounds__(kAgentThreads, 1)
    internode_prologue_kernel(const __grid_constant__ InternodePrologueBatch b) { roles::internode_prologue(b); }
__global__ void __launch_bounds__(kNormalThreads, 1)
    internode_dispatch_kernel(const __grid_constant__ InternodeDispatchBatch b) { roles::internode_dispatch(b); }
__global__ void __launch_bounds__(kNormalThreads, 1)
    internode_combine_kernel(const __grid_constant__ InternodeCombineBatch b) { roles::internode_combine(b); }

// ---------------------------------------------------------------------- low latency
__global__ void __launch_bounds__(kCastThreads, 1)
    ll_cast_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_cast(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_dispatch_send_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_dispatch_send(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_dispatch_recv_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_dispatch_recv(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_combine_send_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_send(b); }
__global__ void __launch_bounds__(kAgentThreads, 1)
    ll_combine_wait_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_wait(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_combine_reduce_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_reduce(b); }

// ---------------------------------------------------------------------- launches
using roles::cooperative;
using roles::plain;

int64_t max_tokens(const LayoutBatch& b) {
    int64_t m = 0;
    for (int i = 0; i < b.num_ranks; ++i) m = b.rank[i].num_tokens > m ? b.rank[i].num_tokens : m;
    return m;
}

int normal_blocks(const NormalContext& k, bool dispatch) {
    return dispatch ? 2 * k.num_channels * k.num_ranks : (k.num_ranks + 1) * k.num_channels;
}

}  // namespace

cudaError_t launch_layout(const LayoutBatch& b, cudaStream_t s) {
    return plain(layout_kernel, b, (max_tokens(b) + kLayoutThreads - 1) / kLayoutThreads, kLayoutThreads, s);
}

cudaError_t launch_notify(const NotifyBatch& b, cudaStream_t s) {
    return cooperative(notify_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_prologue(const PrologueBatch& b, cudaStream_t s) {
    return cooperative(prologue_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_dispatch(const DispatchBatch& b, cudaStream_t s) {
    return cooperative(dispatch_kernel, b, normal_blocks(b.rank[0].k, true), kNormalThreads, s);
}

cudaError_t launch_combine(const CombineBatch& b, cudaStream_t s) {
    return cooperative(combine_kernel, b, normal_blocks(b.rank[0].k, false), kNormalThreads, s);
}

cudaError_t launch_internode_notify(const InternodeNotifyBatch& b, cudaStream_t s) {
    return cooperative(internode_notify_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_internode_prologue(const InternodePrologueBatch& b, cudaStream_t s) {
    return cooperative(internode_prologue_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_internode_dispatch(const InternodeDispatchBatch& b, cudaStream_t s) {
    return cooperative(internode_dispatch_kernel, b, roles::internode_blocks(b.rank[0].k, true), kNormalThreads, s);
}

cudaError_t launch_internode_combine(const InternodeCombineBatch& b, cudaStream_t s) {
    return cooperative(internode_combine_kernel, b, roles::internode_blocks(b.rank[0].k, false), kNormalThreads, s);
}

cudaError_t launch_ll_dispatch_send(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    return roles::launch_ll_dispatch_send(ll_cast_kernel, ll_dispatch_send_kernel, b, s);
}

cudaError_t launch_ll_dispatch_recv(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    return roles::launch_ll_dispatch_recv(ll_dispatch_recv_kernel, b, s);
}

cudaError_t launch_ll_combine_send(const LowLatencyCombineBatch& b, cudaStream_t s) {
    return roles::launch_ll_combine_send(ll_combine_send_kernel, b, s);
}

cudaError_t launch_ll_combine_recv(const LowLatencyCombineBatch& b, cudaStream_t s) {
    return roles::launch_ll_combine_recv(ll_combine_wait_kernel, ll_combine_reduce_kernel, b, s);
}

cudaError_t launch_ll_reject(const LowLatencyRejectBatch& b, cudaStream_t s) {
    return roles::launch_ll_reject(b, s);
}

int64_t cooperative_capacity(NormalKernel kernel) {
    const void* f = reinterpret_cast<const void*>(dispatch_kernel);
    int threads = kNormalThreads;
    switch (kernel) {
        case NormalKernel::kNotify: f = reinterpret_cast<const void*>(notify_kernel); threads = kAgentThreads; break;
        case NormalKernel::kPrologue: f = reinterpret_cast<const void*>(prologue_kernel); threads = kAgentThreads; break;
        case NormalKernel::kDispatch: break;
        case NormalKernel::kCombine: f = reinterpret_cast<const void*>(combine_kernel); break;
        case NormalKernel::kInternodeNotify:
            f = reinterpret_cast<const void*>(internode_notify_kernel);
            threads = kAgentThreads;
            break;
        case NormalKernel::kInternodePrologue:
            f = reinterpret_cast<const void*>(internode_prologue_kernel);
            threads = kAgentThreads;
            break;
        case NormalKernel::kInternodeDispatch: f = reinterpret_cast<const void*>(internode_dispatch_kernel); break;
        case NormalKernel::kInternodeCombine: f = reinterpret_cast<const void*>(internode_combine_kernel); break;
    }
    return roles::co_resident_blocks(f, threads);
}

}  // namespace moe_comm::cuda::device
