// The device build's launches (kernels.cu), as the bindings (bindings.cpp, a host compiler) call them:
// what one launch carries for each rank it serves, and one entry point per launch.
//
// A launch serves one rank (a real process) or several emulated ranks of one GPU (tests): its grid is
// num_ranks * blocks_per_rank blocks, block b serving rank b / blocks_per_rank as its block
// b % blocks_per_rank. Per-rank contexts and arguments travel as the kernel's parameter (a
// __grid_constant__ struct: device constant memory, no per-call allocation or copy, captured by value
// into a CUDA graph), up to kMaxLaunchRanks of them.
//
// Deadlines: a context's watch.deadline holds a budget in clock64 cycles (the host cannot know a
// block's clock at its start); every kernel that waits turns it into clock64() + budget first.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../kernels/internode.h"
#include "../kernels/intranode.h"
#include "../kernels/layout.h"
#include "../kernels/low_latency.h"

namespace moe_comm::cuda::device {

constexpr int kMaxLaunchRanks = 8;  // emulated ranks of one launch (a node's NVLink domain)

// Threads per block (each kernel's __launch_bounds__). notify, prologue and ll_combine_wait are
// bodies of one agent (no lane split: every thread would run the whole body), so one thread each.
constexpr int kAgentThreads = 1;
constexpr int kNormalThreads = 256;      // dispatch and combine: one block per (role, channel, peer)
constexpr int kCastThreads = 128;        // ll_cast: one block per token (lanes: 128-channel groups)
constexpr int kLowLatencyThreads = 256;  // the other low-latency bodies
constexpr int kLayoutThreads = 256;      // layout_token: one thread (agent) per token

struct NoArgs {};

template <class Args>
struct NormalRank {
    NormalContext k;
    int64_t* const* arrive;  // [R] every rank's barrier counters (device memory)
    Args a;
};

template <class Args>
struct LowLatencyRank {
    LowLatencyContext k;
    Args a;
};

template <class Rank>
struct Batch {
    int32_t num_ranks;        // ranks served (1: a real rank)
    int32_t blocks_per_rank;  // set by the launch
    Rank rank[kMaxLaunchRanks];
};

// Across nodes: the rank's context (its NVL peers in the context) and its rail's RDMA buffers, every
// one mapped here (the IPC build's link is DirectLink: one host, emulated nodes).
template <class Args>
struct InternodeRank {
    InternodeContext k;
    uint8_t* const* rdma;  // [Rn] the rail's RDMA buffers (device memory)
    Args a;
};

using LayoutBatch = Batch<LayoutArgs>;
using NotifyBatch = Batch<NormalRank<NotifyArgs>>;
using PrologueBatch = Batch<NormalRank<NoArgs>>;
using DispatchBatch = Batch<NormalRank<DispatchArgs>>;
using CombineBatch = Batch<NormalRank<CombineArgs>>;
using InternodeNotifyBatch = Batch<InternodeRank<InternodeNotifyArgs>>;
using InternodePrologueBatch = Batch<InternodeRank<NoArgs>>;
using InternodeDispatchBatch = Batch<InternodeRank<InternodeDispatchArgs>>;
using InternodeCombineBatch = Batch<InternodeRank<InternodeCombineArgs>>;
using LowLatencyDispatchBatch = Batch<LowLatencyRank<LowLatencyDispatchArgs>>;
using LowLatencyCombineBatch = Batch<LowLatencyRank<LowLatencyCombineArgs>>;
using LowLatencyRejectBatch = Batch<LowLatencyRank<NoArgs>>;

// The layout kernel (get_dispatch_layout): a thread per token, ceil(T / kLayoutThreads) blocks per
// rank; no waits, no host synchronisation.
cudaError_t launch_layout(const LayoutBatch& b, cudaStream_t s);

// Normal mode: notify and prologue one block per rank; dispatch 2 * C * R blocks per rank (senders
// (c, d), then receivers (c, s)); combine C * R senders (c, d) then C receivers. All cooperative
// launches: their blocks wait on each other, so a grid that cannot be co-resident fails to launch
// (cudaErrorCooperativeLaunchTooLarge) instead of hanging.
cudaError_t launch_notify(const NotifyBatch& b, cudaStream_t s);
cudaError_t launch_prologue(const PrologueBatch& b, cudaStream_t s);
cudaError_t launch_dispatch(const DispatchBatch& b, cudaStream_t s);
cudaError_t launch_combine(const CombineBatch& b, cudaStream_t s);

// Normal mode across nodes, cooperative as above: notify and prologue one block per rank; dispatch
// C * Rn RDMA senders (c, n), C forwarders, C * NL NVL receivers (c, l) per rank; combine C * NL NVL
// senders (c, l), C forwarders, C receivers per rank.
cudaError_t launch_internode_notify(const InternodeNotifyBatch& b, cudaStream_t s);
cudaError_t launch_internode_prologue(const InternodePrologueBatch& b, cudaStream_t s);
cudaError_t launch_internode_dispatch(const InternodeDispatchBatch& b, cudaStream_t s);
cudaError_t launch_internode_combine(const InternodeCombineBatch& b, cudaStream_t s);

// Low latency: no host synchronisation, plain launches in stream order.
//   dispatch send: ll_cast (a block per token), then ll_dispatch_send (a block per expert)
//   dispatch recv: ll_dispatch_recv (a block per local expert)
//   combine send:  ll_combine_send (a block per local expert)
//   combine recv:  ll_combine_wait (a block per expert), then ll_combine_reduce (a block per token,
//                  skipped once the rank's error record is set, as the host build returns)
// With a call header, a send first stages it (one block per rank) and posts it (a block per
// destination); a receive first judges the call's headers and last signals its half consumed (one block
// per rank each); a reject is a send of its header alone, then the consumed signals (roles.cuh).
cudaError_t launch_ll_dispatch_send(const LowLatencyDispatchBatch& b, cudaStream_t s);
cudaError_t launch_ll_dispatch_recv(const LowLatencyDispatchBatch& b, cudaStream_t s);
cudaError_t launch_ll_combine_send(const LowLatencyCombineBatch& b, cudaStream_t s);
cudaError_t launch_ll_combine_recv(const LowLatencyCombineBatch& b, cudaStream_t s);
cudaError_t launch_ll_reject(const LowLatencyRejectBatch& b, cudaStream_t s);

// The blocks a normal-mode launch can hold co-resident on the current device (for the message of a
// grid that is too large); -1 when the query fails.
enum class NormalKernel {
    kNotify, kPrologue, kDispatch, kCombine,
    kInternodeNotify, kInternodePrologue, kInternodeDispatch, kInternodeCombine
};
int64_t cooperative_capacity(NormalKernel kernel);

}  // namespace moe_comm::cuda::device
