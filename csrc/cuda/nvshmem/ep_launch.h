// The expert-parallel launches of moe_comm._cuda_nvshmem (ep_kernels.cu), as its bindings (bind_ep.cpp,
// a host compiler) call them: normal mode across nodes (kernels/internode.h) with the rail reached over
// NVSHMEM, and low latency (kernels/low_latency.h) with every rank reached over NVSHMEM, each with a
// link's data (protocol/link.h's SymmetricPeers) beside the context. Launch geometry, threads per
// block, batches and deadlines as the IPC build's (../device/launch.h); a real rank per launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../device/launch.h"
#include "../protocol/link.h"

namespace moe_comm::cuda::nvshmem {

template <class Args>
struct InternodeRank {
    InternodeContext k;   // its NVL peers (CUDA IPC) in the context
    SymmetricPeers rdma;  // its rail, over NVSHMEM: [Rn] rail peers' PEs and nvshmem_ptr mappings
    Args a;
};

template <class Args>
struct LowLatencyRank {
    LowLatencyContext k;  // k.peers is unused: every peer is reached through `link`
    SymmetricPeers link;  // [R] every rank's PE and nvshmem_ptr mapping
    Args a;
};

using device::Batch;
using device::NoArgs;
using InternodeNotifyBatch = Batch<InternodeRank<InternodeNotifyArgs>>;
using InternodePrologueBatch = Batch<InternodeRank<NoArgs>>;
using InternodeDispatchBatch = Batch<InternodeRank<InternodeDispatchArgs>>;
using InternodeCombineBatch = Batch<InternodeRank<InternodeCombineArgs>>;
using LowLatencyDispatchBatch = Batch<LowLatencyRank<LowLatencyDispatchArgs>>;
using LowLatencyCombineBatch = Batch<LowLatencyRank<LowLatencyCombineArgs>>;
using LowLatencyRejectBatch = Batch<LowLatencyRank<NoArgs>>;

// As device::launch_internode_* (cooperative: a grid that cannot be co-resident fails to launch).
cudaError_t launch_internode_notify(const InternodeNotifyBatch& b, cudaStream_t s);
cudaError_t launch_internode_prologue(const InternodePrologueBatch& b, cudaStream_t s);
cudaError_t launch_internode_dispatch(const InternodeDispatchBatch& b, cudaStream_t s);
cudaError_t launch_internode_combine(const InternodeCombineBatch& b, cudaStream_t s);
// As device::launch_ll_* (plain launches in stream order, no host synchronisation: capturable).
cudaError_t launch_ll_dispatch_send(const LowLatencyDispatchBatch& b, cudaStream_t s);
cudaError_t launch_ll_dispatch_recv(const LowLatencyDispatchBatch& b, cudaStream_t s);
cudaError_t launch_ll_combine_send(const LowLatencyCombineBatch& b, cudaStream_t s);
cudaError_t launch_ll_combine_recv(const LowLatencyCombineBatch& b, cudaStream_t s);
cudaError_t launch_ll_reject(const LowLatencyRejectBatch& b, cudaStream_t s);

// The blocks of an internode launch this GPU holds co-resident (-1 when the query fails).
int64_t cooperative_capacity(device::NormalKernel kernel);

}  // namespace moe_comm::cuda::nvshmem
