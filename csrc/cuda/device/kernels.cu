// The device build of the kernel bodies (kernels/layout.h, intranode.h, low_latency.h) on
// DevicePlatform: one __global__ wrapper per body, a block per group (launch.h says which block
// serves which rank and role), and the host functions that launch them.
#include <cuda_runtime.h>

#include "../platform/device.cuh"
#include "launch.h"

namespace moe_comm::cuda::device {
namespace {

using P = DevicePlatform;
using G = P::Group;

static_assert(sizeof(LayoutBatch) <= 4096 && sizeof(NotifyBatch) <= 4096 && sizeof(PrologueBatch) <= 4096 &&
                  sizeof(DispatchBatch) <= 4096 && sizeof(CombineBatch) <= 4096 &&
                  sizeof(LowLatencyDispatchBatch) <= 4096 && sizeof(LowLatencyCombineBatch) <= 4096,
              "a launch's parameter fits the classic 4 KiB kernel parameter space");

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

// ---------------------------------------------------------------------- low latency
__global__ void __launch_bounds__(kCastThreads, 1) ll_cast_kernel(const __grid_constant__ LowLatencyDispatchBatch b) {
    const auto& r = rank_of(b);
    const int64_t t = local_block(b.blocks_per_rank);
    if (t < r.a.num_tokens) ll_cast<P>(r.k, r.a, t);
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_dispatch_send_kernel(const __grid_constant__ LowLatencyDispatchBatch b) {
    const auto& r = rank_of(b);
    ll_dispatch_send<P>(r.k, r.a, local_block(b.blocks_per_rank));
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_dispatch_recv_kernel(const __grid_constant__ LowLatencyDispatchBatch b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = started(r.k);
    ll_dispatch_recv<P>(k, r.a, local_block(b.blocks_per_rank));
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_combine_send_kernel(const __grid_constant__ LowLatencyCombineBatch b) {
    const auto& r = rank_of(b);
    ll_combine_send<P>(r.k, r.a, local_block(b.blocks_per_rank));
}

__global__ void __launch_bounds__(kAgentThreads, 1)
    ll_combine_wait_kernel(const __grid_constant__ LowLatencyCombineBatch b) {
    const auto& r = rank_of(b);
    const LowLatencyContext k = started(r.k);
    ll_combine_wait<P>(k, local_block(b.blocks_per_rank));
}

__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_combine_reduce_kernel(const __grid_constant__ LowLatencyCombineBatch b) {
    const auto& r = rank_of(b);
    const int64_t t = local_block(b.blocks_per_rank);
    if (t >= r.a.num_tokens) return;
    int gave_up = 0;
    if (G::leader()) gave_up = failed<P>(r.k.watch);
    if (G::broadcast(gave_up)) return;  // a wait of this rank's combine failed: no sum, as on the host
    ll_combine_reduce<P>(r.k, r.a, t);
}

// ---------------------------------------------------------------------- launches
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

template <class B>
int64_t max_tokens(const B& b) {
    int64_t m = 0;
    for (int i = 0; i < b.num_ranks; ++i) m = b.rank[i].a.num_tokens > m ? b.rank[i].a.num_tokens : m;
    return m;
}

int64_t max_tokens(const LayoutBatch& b) {
    int64_t m = 0;
    for (int i = 0; i < b.num_ranks; ++i) m = b.rank[i].num_tokens > m ? b.rank[i].num_tokens : m;
    return m;
}

int normal_blocks(const NormalContext& k, bool dispatch) {
    return dispatch ? 2 * k.num_channels * k.num_ranks : (k.num_ranks + 1) * k.num_channels;
}

int experts(const LowLatencyContext& k) { return k.num_ranks * k.layout.experts_per_rank; }

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

cudaError_t launch_ll_dispatch_send(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    const cudaError_t e = plain(ll_cast_kernel, b, max_tokens(b), kCastThreads, s);
    if (e != cudaSuccess) return e;
    return plain(ll_dispatch_send_kernel, b, experts(b.rank[0].k), kLowLatencyThreads, s);
}

cudaError_t launch_ll_dispatch_recv(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    return plain(ll_dispatch_recv_kernel, b, b.rank[0].k.layout.experts_per_rank, kLowLatencyThreads, s);
}

cudaError_t launch_ll_combine_send(const LowLatencyCombineBatch& b, cudaStream_t s) {
    return plain(ll_combine_send_kernel, b, b.rank[0].k.layout.experts_per_rank, kLowLatencyThreads, s);
}

cudaError_t launch_ll_combine_recv(const LowLatencyCombineBatch& b, cudaStream_t s) {
    const cudaError_t e = plain(ll_combine_wait_kernel, b, experts(b.rank[0].k), kAgentThreads, s);
    if (e != cudaSuccess) return e;
    return plain(ll_combine_reduce_kernel, b, max_tokens(b), kLowLatencyThreads, s);
}

int64_t cooperative_capacity(NormalKernel kernel) {
    const void* f = reinterpret_cast<const void*>(dispatch_kernel);
    int threads = kNormalThreads;
    if (kernel == NormalKernel::kNotify || kernel == NormalKernel::kPrologue) threads = kAgentThreads;
    if (kernel == NormalKernel::kNotify) f = reinterpret_cast<const void*>(notify_kernel);
    if (kernel == NormalKernel::kPrologue) f = reinterpret_cast<const void*>(prologue_kernel);
    if (kernel == NormalKernel::kCombine) f = reinterpret_cast<const void*>(combine_kernel);
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, threads, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return static_cast<int64_t>(sms) * per_sm;
}

}  // namespace moe_comm::cuda::device
