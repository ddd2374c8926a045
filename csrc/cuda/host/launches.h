// The host build of the CUDA kernels: each "launch" runs the kernel bodies of kernels/*.h on the host
// platform, one std::thread per simulated group, and returns the launch's error record. Raw pointers
// and sizes only, as the device build's entry points take. Used by the cuda_host backend
// (moe_comm/backends/cuda_host) through moe_comm._cuda_host, and by the ThreadSanitizer stress.
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/internode.h"
#include "../kernels/intranode.h"
#include "../kernels/layout.h"
#include "../kernels/low_latency.h"
#include "../protocol/wait.h"

namespace moe_comm::cuda::host {

// The peers' buffers as this process maps them, and what every wait shares.
struct Peers {
    std::vector<uint8_t*> bases;   // [R]
    std::vector<int64_t> pids;     // [R], for the peer-exited check
    int32_t rank;
    double timeout_s;
};

NormalContext normal_context(const Peers& p, int32_t num_channels, int64_t chunk, const NormalLayout& layout,
                             int64_t epoch, ErrorRecord* err);
// Across nodes: `nvl` the node's ranks' NVL buffers [NL], `rdma` the rail's RDMA buffers [Rn] (every
// rank's buffer is mapped here: the host build's link is DirectLink), `pids` every rank's [R].
struct InternodePeers {
    std::vector<uint8_t*> nvl, rdma;
    std::vector<int64_t> pids;
    int32_t rank, node_ranks;
    double timeout_s;
};
InternodeContext internode_context(const InternodePeers& p, int32_t num_channels, int64_t nvl_chunk,
                                   int64_t rdma_chunk, const InternodeLayout& layout, int64_t epoch, ErrorRecord* err);
LowLatencyContext low_latency_context(const Peers& p, int64_t call, const LowLatencyLayout& layout,
                                      const uint8_t* skip, const LowLatencyPost& post, ErrorRecord* err);

// The layout kernel, one token after another on the calling thread.
void layout(const LayoutArgs& a);

// Normal mode. `notify` and `prologue` run on the calling thread; dispatch and combine run one sender
// thread per destination and one receiver thread per source (each over the channels in order).
void notify(const NormalContext& k, const NotifyArgs& a);
void prologue(const NormalContext& k);
void dispatch(const NormalContext& k, const DispatchArgs& a);
void combine(const NormalContext& k, const CombineArgs& a);

// Normal mode across nodes (kernels/internode.h), on `rdma` (the rail's RDMA buffers, mapped here).
// `internode_notify` and `internode_prologue` run on the calling thread; dispatch runs one RDMA sender
// thread per node, one forwarder and one NVL receiver per node rank; combine one NVL sender per node
// rank, one forwarder and one receiver (each over the channels in order, then its drains).
void internode_notify(const InternodeContext& k, uint8_t* const* rdma, const InternodeNotifyArgs& a);
void internode_prologue(const InternodeContext& k, uint8_t* const* rdma);
void internode_dispatch(const InternodeContext& k, uint8_t* const* rdma, const InternodeDispatchArgs& a);
void internode_combine(const InternodeContext& k, uint8_t* const* rdma, const InternodeCombineArgs& a);

// Low-latency mode: the send and the receive half of each operation, as separate launches. `remote`
// ([R] or null) marks the peers across the network: the sends put to them from this rank's staging
// (the layout must then be `staged`), as NVSHMEM's puts would.
void ll_dispatch_send(const LowLatencyContext& k, const LowLatencyDispatchArgs& a, const uint8_t* remote = nullptr);
void ll_dispatch_recv(const LowLatencyContext& k, const LowLatencyDispatchArgs& a);
void ll_combine_send(const LowLatencyContext& k, const LowLatencyCombineArgs& a, const uint8_t* remote = nullptr);
void ll_combine_recv(const LowLatencyContext& k, const LowLatencyCombineArgs& a);
// A call this rank rejected on the host: its header (k.post, the rejected bit and message set) goes to
// every rank, no rows, and the half counts as consumed here (this rank receives nothing of the call).
void ll_reject(const LowLatencyContext& k);

}  // namespace moe_comm::cuda::host
