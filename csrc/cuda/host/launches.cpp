// Host launches of the CUDA kernel bodies (launches.h).
#include "launches.h"

#include <thread>

#include "../platform/host.h"
#include "../protocol/link.h"

namespace moe_comm::cuda::host {
namespace {

using P = HostPlatform;

Watch watch(const Peers& p, ErrorRecord* err) {
    return Watch{err, P::now() + static_cast<int64_t>(p.timeout_s * 1e9), p.rank, p.pids.data()};
}

// Runs fn(i) for i in [0, n) on n threads (the groups of one launch wait on each other).
template <class F>
void run_threads(int n, F fn) {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) threads.emplace_back(fn, i);
    for (auto& t : threads) t.join();
}

std::vector<int64_t*> arrive_table(const NormalContext& k) {
    std::vector<int64_t*> arrive(static_cast<size_t>(k.num_ranks));
    for (int i = 0; i < k.num_ranks; ++i) arrive[static_cast<size_t>(i)] = k.layout.arrive_of(k.peers[i]);
    return arrive;
}

}  // namespace

NormalContext normal_context(const Peers& p, int32_t num_channels, int64_t chunk, const NormalLayout& layout,
                             int64_t epoch, ErrorRecord* err) {
    return NormalContext{p.rank, static_cast<int32_t>(p.bases.size()), num_channels, chunk, layout, p.bases.data(),
                         watch(p, err), epoch};
}

InternodeContext internode_context(const InternodePeers& p, int32_t num_channels, int64_t nvl_chunk,
                                   int64_t rdma_chunk, const InternodeLayout& layout, int64_t epoch, ErrorRecord* err) {
    const int32_t node = p.rank / p.node_ranks, local = p.rank % p.node_ranks;
    const Watch w{err, P::now() + static_cast<int64_t>(p.timeout_s * 1e9), p.rank, p.pids.data()};
    return InternodeContext{p.rank, node, local, static_cast<int32_t>(p.rdma.size()), p.node_ranks, num_channels,
                            nvl_chunk, rdma_chunk, layout, p.nvl.data(), w, epoch};
}

LowLatencyContext low_latency_context(const Peers& p, int64_t call, const LowLatencyLayout& layout,
                                      const uint8_t* skip, const LowLatencyPost& post, ErrorRecord* err) {
    return LowLatencyContext{p.rank, static_cast<int32_t>(p.bases.size()), static_cast<int32_t>((call - 1) & 1),
                             layout, p.bases.data(), skip, watch(p, err), call, post};
}

void layout(const LayoutArgs& a) {
    for (int64_t t = 0; t < a.num_tokens; ++t) layout_token<P>(a, t);
}

void notify(const NormalContext& k, const NotifyArgs& a) { cuda::notify<P>(k, a, arrive_table(k).data()); }

void prologue(const NormalContext& k) { cuda::prologue<P>(k, arrive_table(k).data()); }

void dispatch(const NormalContext& k, const DispatchArgs& a) {
    const int R = k.num_ranks;
    run_threads(2 * R, [&](int i) {
        for (int c = 0; c < k.num_channels; ++c)
            if (!(i < R ? dispatch_send<P>(k, a, c, i) : dispatch_recv<P>(k, a, c, i - R))) return;
    });
}

void combine(const NormalContext& k, const CombineArgs& a) {
    const int R = k.num_ranks;
    run_threads(R + 1, [&](int i) {
        for (int c = 0; c < k.num_channels; ++c)
            if (!(i < R ? combine_send<P>(k, a, c, i) : combine_recv<P>(k, a, c))) return;
    });
}

namespace {
DirectLink<P> rail(const InternodeContext& k, uint8_t* const* rdma) { return DirectLink<P>{rdma, k.node}; }
}  // namespace

void internode_notify(const InternodeContext& k, uint8_t* const* rdma, const InternodeNotifyArgs& a) {
    cuda::internode_notify<P>(k, rail(k, rdma), a);
}

void internode_prologue(const InternodeContext& k, uint8_t* const* rdma) {
    cuda::internode_prologue<P>(k, rail(k, rdma));
}

void internode_dispatch(const InternodeContext& k, uint8_t* const* rdma, const InternodeDispatchArgs& a) {
    const auto link = rail(k, rdma);
    const int Rn = k.num_nodes, NL = k.node_ranks, C = k.num_channels;
    run_threads(Rn + 1 + NL, [&](int i) {
        if (i < Rn) {  // RDMA sender to node i, then its drain
            for (int c = 0; c < C; ++c)
                if (!internode_rdma_send<P>(k, link, a, c, i)) return;
            for (int c = 0; c < C; ++c)
                if (!internode_rdma_drain<P>(k, link, a.rdma_channel_prefix, c, i)) return;
        } else if (i == Rn) {
            for (int c = 0; c < C; ++c)
                if (!internode_forward<P>(k, link, a, c)) return;
        } else {
            for (int c = 0; c < C; ++c)
                if (!internode_nvl_recv<P>(k, a, c, i - Rn - 1)) return;
        }
    });
}

void internode_combine(const InternodeContext& k, uint8_t* const* rdma, const InternodeCombineArgs& a) {
    const auto link = rail(k, rdma);
    const int Rn = k.num_nodes, NL = k.node_ranks, C = k.num_channels;
    run_threads(NL + 2, [&](int i) {
        if (i < NL) {  // NVL sender to forwarder i
            for (int c = 0; c < C; ++c)
                if (!internode_combine_send<P>(k, a, c, i)) return;
        } else if (i == NL) {  // the forwarder, then its drains
            for (int c = 0; c < C; ++c)
                if (!internode_combine_forward<P>(k, link, a, c)) return;
            for (int c = 0; c < C; ++c)
                for (int n = 0; n < Rn; ++n)
                    if (!internode_rdma_drain<P>(k, link, a.recv_rdma_channel_prefix, c, n)) return;
        } else {
            for (int c = 0; c < C; ++c)
                if (!internode_combine_recv<P>(k, link, a, c)) return;
        }
    });
}

namespace {
// The posts of a send with a header (flow control first), after its stage (`clean`: its checks
// passed). Returns whether rows go out: clean, and every post's wait held.
bool ll_post_all(const LowLatencyContext& k, const DirectLink<P>& link, bool clean) {
    for (int d = 0; d < k.num_ranks; ++d)
        if (!ll_post_header<P>(k, link, d)) return false;
    return clean;
}
}  // namespace

void ll_dispatch_send(const LowLatencyContext& call, const LowLatencyDispatchArgs& a, const uint8_t* remote) {
    const DirectLink<P> link{call.peers, call.rank, remote};
    const LowLatencyContext k = ll_counted(call, link, true);
    if (k.post.header && !ll_post_all(k, link, ll_stage_dispatch(k, link, a))) return;
    for (int64_t t = 0; t < a.num_tokens; ++t) ll_cast<P>(k, link, a, t);
    const int experts = k.num_ranks * k.layout.experts_per_rank;
    for (int e = 0; e < experts; ++e) cuda::ll_dispatch_send<P>(k, link, a, e);
}

void ll_dispatch_recv(const LowLatencyContext& call, const LowLatencyDispatchArgs& a) {
    const DirectLink<P> link{call.peers, call.rank};
    const LowLatencyContext k = ll_counted(call, link, false);
    if (!k.post.header || ll_judge<P>(k, link))
        for (int e = 0; e < k.layout.experts_per_rank; ++e)
            if (!cuda::ll_dispatch_recv<P>(k, link, a, e)) break;
    if (k.post.header) ll_consumed<P>(k, link);
}

void ll_combine_send(const LowLatencyContext& call, const LowLatencyCombineArgs& a, const uint8_t* remote) {
    const DirectLink<P> link{call.peers, call.rank, remote};
    const LowLatencyContext k = ll_counted(call, link, true);
    if (k.post.header && !ll_post_all(k, link, ll_stage_combine(k, link, a))) return;
    for (int e = 0; e < k.layout.experts_per_rank; ++e) cuda::ll_combine_send<P>(k, link, a, e);
}

void ll_combine_recv(const LowLatencyContext& call, const LowLatencyCombineArgs& a) {
    const DirectLink<P> link{call.peers, call.rank};
    const LowLatencyContext k = ll_counted(call, link, false);
    const int experts = k.num_ranks * k.layout.experts_per_rank;
    bool ok = !k.post.header || ll_judge<P>(k, link);
    for (int e = 0; ok && e < experts; ++e) ok = ll_combine_wait<P>(k, link, e);
    if (ok)
        for (int64_t t = 0; t < a.num_tokens; ++t) ll_combine_reduce<P>(k, link, a, t);
    if (k.post.header) ll_consumed<P>(k, link);
}

void ll_reject(const LowLatencyContext& call) {
    const DirectLink<P> link{call.peers, call.rank};
    const LowLatencyContext k = ll_counted(call, link, true);
    ll_stage_header(k, link);
    ll_post_all(k, link, true);
    ll_consumed<P>(k, link);  // as the device builds' (a failed post has set the record: the buffer breaks)
}

}  // namespace moe_comm::cuda::host
