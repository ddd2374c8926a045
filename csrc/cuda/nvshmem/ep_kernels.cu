// moe_comm._cuda_nvshmem's expert-parallel kernels (ep_launch.h): the roles of the IPC build
// (../device/roles.cuh) with NVSHMEM links: an internode rank's rail and a low-latency rank's peers are
// reached through NvshmemLink (NVLink stores where nvshmem_ptr maps the peer, puts with signals
// elsewhere). Relocatable device code, linked against libnvshmem_device.a (CMakeLists.txt).
#include <cuda_runtime.h>

#include "../platform/nvshmem_link.cuh"
#include "ep_launch.h"

namespace moe_comm::cuda::nvshmem {

// This build's links, found by the roles through argument-dependent lookup on the rank structs.
template <class Args>
__device__ __forceinline__ NvshmemLink rail_of(const InternodeRank<Args>& r) {
    return NvshmemLink{r.rdma};
}
template <class Args>
__device__ __forceinline__ NvshmemLink link_of(const LowLatencyRank<Args>& r) {
    return NvshmemLink{r.link};
}

}  // namespace moe_comm::cuda::nvshmem

#include "../device/roles.cuh"

namespace moe_comm::cuda::nvshmem {
namespace {

namespace roles = device::roles;
using device::kAgentThreads;
using device::kCastThreads;
using device::kLowLatencyThreads;
using device::kNormalThreads;

static_assert(sizeof(InternodeNotifyBatch) <= 4096 && sizeof(InternodePrologueBatch) <= 4096 &&
                  sizeof(InternodeDispatchBatch) <= 4096 && sizeof(InternodeCombineBatch) <= 4096 &&
                  sizeof(LowLatencyDispatchBatch) <= 4096 && sizeof(LowLatencyCombineBatch) <= 4096 &&
                  sizeof(LowLatencyRejectBatch) <= 4096,
              "a launch's parameter fits the classic 4 KiB kernel parameter space");

__global__ void __launch_bounds__(kAgentThreads, 1)
    nv_internode_notify_kernel(const __grid_constant__ InternodeNotifyBatch b) { roles::internode_notify(b); }
__global__ void __launch_bounds__(kAgentThreads, 1)
    nv_internode_prologue_kernel(const __grid_constant__ InternodePrologueBatch b) { roles::internode_prologue(b); }
__global__ void __launch_bounds__(kNormalThreads, 1)
    nv_internode_dispatch_kernel(const __grid_constant__ InternodeDispatchBatch b) { roles::internode_dispatch(b); }
__global__ void __launch_bounds__(kNormalThreads, 1)
    nv_internode_combine_kernel(const __grid_constant__ InternodeCombineBatch b) { roles::internode_combine(b); }

__global__ void __launch_bounds__(kCastThreads, 1)
    nv_ll_cast_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_cast(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    nv_ll_dispatch_send_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_dispatch_send(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    nv_ll_dispatch_recv_kernel(const __grid_constant__ LowLatencyDispatchBatch b) { roles::ll_dispatch_recv(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    nv_ll_combine_send_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_send(b); }
__global__ void __launch_bounds__(kAgentThreads, 1)
    nv_ll_combine_wait_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_wait(b); }
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    nv_ll_combine_reduce_kernel(const __grid_constant__ LowLatencyCombineBatch b) { roles::ll_combine_reduce(b); }

}  // namespace

cudaError_t launch_internode_notify(const InternodeNotifyBatch& b, cudaStream_t s) {
    return roles::cooperative(nv_internode_notify_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_internode_prologue(const InternodePrologueBatch& b, cudaStream_t s) {
    return roles::cooperative(nv_internode_prologue_kernel, b, 1, kAgentThreads, s);
}

cudaError_t launch_internode_dispatch(const InternodeDispatchBatch& b, cudaStream_t s) {
    return roles::cooperative(nv_internode_dispatch_kernel, b, roles::internode_blocks(b.rank[0].k, true),
                              kNormalThreads, s);
}

cudaError_t launch_internode_combine(const InternodeCombineBatch& b, cudaStream_t s) {
    return roles::cooperative(nv_internode_combine_kernel, b, roles::internode_blocks(b.rank[0].k, false),
                              kNormalThreads, s);
}

cudaError_t launch_ll_dispatch_send(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    return roles::launch_ll_dispatch_send(nv_ll_cast_kernel, nv_ll_dispatch_send_kernel, b, s);
}

cudaError_t launch_ll_dispatch_recv(const LowLatencyDispatchBatch& b, cudaStream_t s) {
    return roles::launch_ll_dispatch_recv(nv_ll_dispatch_recv_kernel, b, s);
}

cudaError_t launch_ll_combine_send(const LowLatencyCombineBatch& b, cudaStream_t s) {
    return roles::launch_ll_combine_send(nv_ll_combine_send_kernel, b, s);
}

cudaError_t launch_ll_combine_recv(const LowLatencyCombineBatch& b, cudaStream_t s) {
    return roles::launch_ll_combine_recv(nv_ll_combine_wait_kernel, nv_ll_combine_reduce_kernel, b, s);
}

cudaError_t launch_ll_reject(const LowLatencyRejectBatch& b, cudaStream_t s) {
    return roles::launch_ll_reject(b, s);
}

int64_t cooperative_capacity(device::NormalKernel kernel) {
    const void* f = reinterpret_cast<const void*>(nv_internode_dispatch_kernel);
    int threads = kNormalThreads;
    switch (kernel) {
        case device::NormalKernel::kInternodeNotify:
            f = reinterpret_cast<const void*>(nv_internode_notify_kernel);
            threads = kAgentThreads;
            break;
        case device::NormalKernel::kInternodePrologue:
            f = reinterpret_cast<const void*>(nv_internode_prologue_kernel);
            threads = kAgentThreads;
            break;
        case device::NormalKernel::kInternodeCombine: f = reinterpret_cast<const void*>(nv_internode_combine_kernel); break;
        default: break;
    }
    return roles::co_resident_blocks(f, threads);
}

}  // namespace moe_comm::cuda::nvshmem
