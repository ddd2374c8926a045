// moe_comm._cuda_host: the host build of the CUDA kernels, for the cuda_host backend. Pointers are
// Python ints (tensor.data_ptr()), sizes plain ints; every launch returns None or its error record as
// (code, kind, rank, peer, channel, observed, expected). The GIL is released while a launch runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "../python/layout_bindings.h"
#include "../python/prepared_low_latency.h"
#include "launches.h"

namespace py = pybind11;
using namespace moe_comm::cuda;
using moe_comm::DType;
using moe_comm::kMaxNodeRanks;
using moe_comm::cuda::host::Peers;

namespace {

using Error = std::optional<std::tuple<int, int, int, int, int, int64_t, int64_t>>;

template <class T>
T* ptr(int64_t p) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

Peers peers(const std::vector<int64_t>& bases, const std::vector<int64_t>& pids, int rank, double timeout_s) {
    Peers p{{}, pids, rank, timeout_s};
    for (int64_t b : bases) p.bases.push_back(ptr<uint8_t>(b));
    return p;
}

Error result(const ErrorRecord& e) {
    if (e.code == 0) return std::nullopt;
    return std::make_tuple(e.code, e.kind, e.rank, e.peer, e.channel, e.observed, e.expected);
}

// One rank's normal-mode buffers: its own and its peers' mappings, the ring geometry.
struct Normal {
    Peers peers;
    int32_t num_channels;
    int64_t chunk;
    NormalLayout layout;

    template <class F>
    Error launch(int64_t epoch, F body) {
        ErrorRecord err{};
        NormalContext k = host::normal_context(peers, num_channels, chunk, layout, epoch, &err);
        {
            py::gil_scoped_release unlocked;
            body(k);
        }
        return result(err);
    }
};

// One rank's normal-mode buffers across nodes: its node's NVL buffers, its rail's RDMA buffers.
struct Internode {
    moe_comm::cuda::host::InternodePeers peers;
    int32_t num_channels;
    int64_t nvl_chunk, rdma_chunk;
    InternodeLayout layout;

    template <class F>
    Error launch(int64_t epoch, F body) {
        ErrorRecord err{};
        InternodeContext k = host::internode_context(peers, num_channels, nvl_chunk, rdma_chunk, layout, epoch, &err);
        {
            py::gil_scoped_release unlocked;
            body(k, peers.rdma.data());
        }
        return result(err);
    }
};

struct LowLatency {
    Peers peers;
    LowLatencyLayout layout;
    std::vector<uint8_t> remote;  // [R] peers on other nodes (sends put to them from staging); empty: none

    template <class F>
    Error launch(int64_t call, int64_t skip, const python::PostArgs& post, F body) {
        if (call < 1 || call >= (int64_t{1} << 31))
            throw py::value_error("call must be in [1, 2^31), got " + std::to_string(call));
        const LowLatencyPost p = python::post_of(post, layout);
        ErrorRecord err{};
        LowLatencyContext k = host::low_latency_context(peers, call, layout, ptr<const uint8_t>(skip), p, &err);
        {
            py::gil_scoped_release unlocked;
            body(k, remote.empty() ? nullptr : remote.data());
        }
        return result(err);
    }
};

// The host build's part of a prepared low-latency call (csrc/cuda/python/prepared_low_latency.h): launches run
// here, on the calling thread (the GIL released), and a received call's statistics are added here.
struct HostPrepared {
    static constexpr bool kStats = true;
    LowLatency ll;
    std::vector<uint8_t> skip;  // [R] zeros: a prepared call leaves no rank out

    explicit HostPrepared(const LowLatency& l) : ll(l), skip(l.peers.bases.size(), 0) {}

    int device() const { return -1; }
    py::object device_object() const { return py::none(); }
    const LowLatencyLayout& layout() const { return ll.layout; }

    Error run(python::PreparedPending& p, const python::PostArgs& post, bool receive) {
        const auto begin = std::chrono::steady_clock::now();
        const auto at = reinterpret_cast<int64_t>(skip.data());
        Error record = p.is_dispatch
            ? ll.launch(p.call, at, post, [&](const LowLatencyContext& k, const uint8_t* remote) {
                  receive ? host::ll_dispatch_recv(k, p.dispatch) : host::ll_dispatch_send(k, p.dispatch, remote);
              })
            : ll.launch(p.call, at, post, [&](const LowLatencyContext& k, const uint8_t* remote) {
                  receive ? host::ll_combine_recv(k, p.combine) : host::ll_combine_send(k, p.combine, remote);
              });
        if (receive && !record) {  // the stats of a received call, as the checked path adds them
            const int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - begin).count();
            if (p.recv_stats != nullptr)
                for (int e = 0; e < ll.layout.experts_per_rank; ++e) p.recv_stats[e] += p.dispatch.recv_count[e];
            if (p.wait_stats != nullptr)
                for (int r = 0; r < ll.layout.num_ranks; ++r) p.wait_stats[r] += waited;
        }
        return record;
    }
};

// Node n's ranks are [n * node_ranks, (n + 1) * node_ranks); 0: one node.
std::vector<uint8_t> remote_peers(int num_ranks, int rank, int node_ranks) {
    std::vector<uint8_t> remote;
    if (node_ranks > 0)
        for (int r = 0; r < num_ranks; ++r) remote.push_back(r / node_ranks != rank / node_ranks);
    return remote;
}

}  // namespace

PYBIND11_MODULE(_cuda_host, m) {
    m.doc() = "Host build of moe-comm's CUDA kernels (csrc/cuda), for the cuda_host backend";

    moe_comm::cuda::python::def_layouts(m);

    m.def("layout", [](int64_t num_tokens, int num_topk, int num_ranks, int num_experts, int64_t topk_idx,
                       int64_t per_rank, int64_t per_expert, int64_t in_rank, int64_t bad) {
        LayoutArgs a{num_tokens, num_topk, num_ranks, num_experts, ptr<const int64_t>(topk_idx), ptr<int64_t>(per_rank),
                     ptr<int64_t>(per_expert), ptr<uint8_t>(in_rank), ptr<int64_t>(bad)};
        py::gil_scoped_release unlocked;
        host::layout(a);
    }, "The layout kernel: counts (int64, zeroed by the caller) and is_token_in_rank of topk_idx; bad[0] = 1 "
       "when an id is outside [-1, num_experts).");

    py::class_<Normal>(m, "Normal")
        .def(py::init([](const std::vector<int64_t>& bases, const std::vector<int64_t>& pids, int rank,
                         double timeout_s, int C, int64_t chunk, int L, int64_t slots, int64_t slot_bytes) {
                 return Normal{peers(bases, pids, rank, timeout_s), C, chunk,
                               NormalLayout(static_cast<int>(bases.size()), C, L, slots, slot_bytes)};
             }))
        .def("notify", [](Normal& n, int64_t epoch, int64_t rows_to_rank, int64_t tokens_per_expert,
                          int64_t channel_prefix, int64_t alignment, int64_t rank_prefix, int64_t recv_offset,
                          int64_t recv_channel_offset, int64_t recv_channel_count, int64_t recv_per_expert,
                          int64_t num_recv) {
            NotifyArgs a{ptr<const int64_t>(rows_to_rank), ptr<const int64_t>(tokens_per_expert),
                         ptr<const int64_t>(channel_prefix), alignment, ptr<int32_t>(rank_prefix),
                         ptr<int64_t>(recv_offset), ptr<int64_t>(recv_channel_offset),
                         ptr<int64_t>(recv_channel_count), ptr<int64_t>(recv_per_expert), ptr<int64_t>(num_recv)};
            return n.launch(epoch, [&](const NormalContext& k) { host::notify(k, a); });
        })
        .def("prologue", [](Normal& n, int64_t epoch) {
            return n.launch(epoch, [&](const NormalContext& k) { host::prologue(k); });
        })
        .def("dispatch", [](Normal& n, int64_t num_tokens, int64_t x_bytes, int64_t scale_bytes, int num_topk,
                            int64_t x, int64_t scales, int64_t topk_idx, int64_t topk_weights,
                            int64_t is_token_in_rank, int64_t channel_prefix, int64_t recv_offset,
                            int64_t recv_channel_offset, int64_t recv_channel_count, int64_t recv_x,
                            int64_t recv_scales, int64_t recv_topk_idx, int64_t recv_topk_weights,
                            int64_t recv_src_idx) {
            DispatchArgs a{num_tokens, x_bytes, scale_bytes, num_topk, ptr<const uint8_t>(x),
                           ptr<const uint8_t>(scales), ptr<const int64_t>(topk_idx), ptr<const float>(topk_weights),
                           ptr<const uint8_t>(is_token_in_rank), ptr<const int64_t>(channel_prefix),
                           ptr<const int64_t>(recv_offset), ptr<const int64_t>(recv_channel_offset),
                           ptr<const int64_t>(recv_channel_count), ptr<uint8_t>(recv_x), ptr<uint8_t>(recv_scales),
                           ptr<int64_t>(recv_topk_idx), ptr<float>(recv_topk_weights), ptr<int32_t>(recv_src_idx)};
            return n.launch(0, [&](const NormalContext& k) { host::dispatch(k, a); });
        })
        .def("combine", [](Normal& n, int64_t num_tokens, int64_t hidden, int64_t x_bytes, int num_topk, DType type,
                           int64_t x, int64_t topk_weights, int64_t recv_offset, int64_t recv_channel_offset,
                           int64_t recv_channel_count, int64_t is_token_in_rank, int64_t channel_prefix,
                           int64_t send_pos, int64_t bias0, int64_t bias1, int64_t out, int64_t out_weights) {
            CombineArgs a{num_tokens, hidden, x_bytes, num_topk, type, ptr<const uint8_t>(x),
                          ptr<const float>(topk_weights), ptr<const int64_t>(recv_offset),
                          ptr<const int64_t>(recv_channel_offset), ptr<const int64_t>(recv_channel_count),
                          ptr<const uint8_t>(is_token_in_rank), ptr<const int64_t>(channel_prefix),
                          ptr<const int32_t>(send_pos), ptr<const uint8_t>(bias0), ptr<const uint8_t>(bias1),
                          ptr<uint8_t>(out), ptr<float>(out_weights)};
            return n.launch(0, [&](const NormalContext& k) { host::combine(k, a); });
        });

    py::class_<Internode>(m, "Internode")
        .def(py::init([](const std::vector<int64_t>& nvl_bases, const std::vector<int64_t>& rdma_bases,
                         const std::vector<int64_t>& pids, int rank, double timeout_s, int C, int64_t nvl_chunk,
                         int64_t rdma_chunk, int L, int64_t nvl_slots, int64_t nvl_slot_bytes, int64_t rdma_slots,
                         int64_t rdma_slot_bytes) {
                 const int NL = static_cast<int>(nvl_bases.size()), Rn = static_cast<int>(rdma_bases.size());
                 if (NL < 1 || NL > kMaxNodeRanks || Rn < 1 || Rn > kMaxNodes ||
                     pids.size() != static_cast<size_t>(NL) * static_cast<size_t>(Rn) || rank < 0 || rank >= NL * Rn)
                     throw py::value_error("Internode: " + std::to_string(Rn) + " nodes of " + std::to_string(NL) +
                                           " ranks (at most " + std::to_string(kMaxNodes) + " of " +
                                           std::to_string(kMaxNodeRanks) + "), " + std::to_string(pids.size()) +
                                           " pids, rank " + std::to_string(rank));
                 moe_comm::cuda::host::InternodePeers p{{}, {}, pids, rank, NL, timeout_s};
                 for (int64_t b : nvl_bases) p.nvl.push_back(ptr<uint8_t>(b));
                 for (int64_t b : rdma_bases) p.rdma.push_back(ptr<uint8_t>(b));
                 return Internode{p, C, nvl_chunk, rdma_chunk,
                                  InternodeLayout(Rn, NL, C, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes)};
             }))
        .def("notify", [](Internode& n, int64_t epoch, int64_t rows_to_rank, int64_t tokens_per_expert,
                          int64_t channel_prefix, int64_t rdma_channel_prefix, int64_t alignment,
                          int64_t recv_gbl_rank_prefix, int64_t recv_offset, int64_t recv_channel_offset,
                          int64_t recv_channel_count, int64_t recv_rdma_channel_prefix, int64_t recv_per_expert,
                          int64_t num_recv) {
            InternodeNotifyArgs a{ptr<const int64_t>(rows_to_rank), ptr<const int64_t>(tokens_per_expert),
                                  ptr<const int64_t>(channel_prefix), ptr<const int64_t>(rdma_channel_prefix), alignment,
                                  ptr<int32_t>(recv_gbl_rank_prefix), ptr<int64_t>(recv_offset),
                                  ptr<int64_t>(recv_channel_offset), ptr<int64_t>(recv_channel_count),
                                  ptr<int64_t>(recv_rdma_channel_prefix), ptr<int64_t>(recv_per_expert),
                                  ptr<int64_t>(num_recv)};
            return n.launch(epoch, [&](const InternodeContext& k, uint8_t* const* rdma) {
                host::internode_notify(k, rdma, a);
            });
        })
        .def("prologue", [](Internode& n, int64_t epoch) {
            return n.launch(epoch, [&](const InternodeContext& k, uint8_t* const* rdma) {
                host::internode_prologue(k, rdma);
            });
        })
        .def("dispatch", [](Internode& n, int64_t num_tokens, int64_t x_bytes, int64_t scale_bytes, int num_topk,
                            int64_t x, int64_t scales, int64_t topk_idx, int64_t topk_weights,
                            int64_t is_token_in_rank, int64_t rdma_channel_prefix, int64_t recv_rdma_channel_prefix,
                            int64_t recv_offset, int64_t recv_channel_offset, int64_t recv_channel_count,
                            int64_t recv_x, int64_t recv_scales, int64_t recv_topk_idx, int64_t recv_topk_weights,
                            int64_t recv_src_idx) {
            InternodeDispatchArgs a{
                DispatchArgs{num_tokens, x_bytes, scale_bytes, num_topk, ptr<const uint8_t>(x),
                             ptr<const uint8_t>(scales), ptr<const int64_t>(topk_idx), ptr<const float>(topk_weights),
                             ptr<const uint8_t>(is_token_in_rank), nullptr, ptr<const int64_t>(recv_offset),
                             ptr<const int64_t>(recv_channel_offset), ptr<const int64_t>(recv_channel_count),
                             ptr<uint8_t>(recv_x), ptr<uint8_t>(recv_scales), ptr<int64_t>(recv_topk_idx),
                             ptr<float>(recv_topk_weights), ptr<int32_t>(recv_src_idx)},
                ptr<const int64_t>(rdma_channel_prefix), ptr<const int64_t>(recv_rdma_channel_prefix)};
            return n.launch(0, [&](const InternodeContext& k, uint8_t* const* rdma) {
                host::internode_dispatch(k, rdma, a);
            });
        })
        .def("combine", [](Internode& n, int64_t num_tokens, int64_t hidden, int64_t x_bytes, int num_topk,
                           DType type, int64_t x, int64_t topk_weights, int64_t recv_offset,
                           int64_t recv_channel_offset, int64_t recv_channel_count, int64_t recv_rdma_channel_prefix,
                           int64_t forward_bits, int64_t send_rdma_head, int64_t bias0, int64_t bias1, int64_t out,
                           int64_t out_weights) {
            InternodeCombineArgs a{
                CombineArgs{num_tokens, hidden, x_bytes, num_topk, moe_comm::cuda::python::combine_row_type(type, hidden, x_bytes), ptr<const uint8_t>(x),
                            ptr<const float>(topk_weights), ptr<const int64_t>(recv_offset),
                            ptr<const int64_t>(recv_channel_offset), ptr<const int64_t>(recv_channel_count), nullptr,
                            nullptr, nullptr, ptr<const uint8_t>(bias0), ptr<const uint8_t>(bias1), ptr<uint8_t>(out),
                            ptr<float>(out_weights)},
                ptr<const int64_t>(recv_rdma_channel_prefix), ptr<const int32_t>(forward_bits),
                ptr<const int32_t>(send_rdma_head)};
            return n.launch(0, [&](const InternodeContext& k, uint8_t* const* rdma) {
                host::internode_combine(k, rdma, a);
            });
        });

    py::class_<LowLatency>(m, "LowLatency")
        .def(py::init([](const std::vector<int64_t>& bases, const std::vector<int64_t>& pids, int rank,
                         double timeout_s, int L, int64_t M, int64_t H, int node_ranks) {
                 const int R = static_cast<int>(bases.size());
                 return LowLatency{peers(bases, pids, rank, timeout_s), LowLatencyLayout(R, L, M, H),
                                   remote_peers(R, rank, node_ranks)};
             }), py::arg("bases"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"), py::arg("L"), py::arg("M"),
             py::arg("H"), py::arg("node_ranks") = 0,
             "node_ranks > 0: ranks form nodes of that many; sends to other nodes put from this rank's staging "
             "(the RDMA path).")
        .def("dispatch", [](LowLatency& l, bool receive, int64_t call, int64_t skip, int64_t num_tokens,
                            int64_t scale_bytes, int num_topk, bool fp8, bool round_scale, bool ue8m0, int64_t x,
                            int64_t topk_idx, int64_t recv_x, int64_t recv_scales, int64_t src_info,
                            int64_t layout_range, int64_t recv_count, const python::PostArgs& post) {
            LowLatencyDispatchArgs a{num_tokens, scale_bytes, num_topk, CastFormat{fp8, round_scale, ue8m0},
                                     ptr<const uint16_t>(x), ptr<const int64_t>(topk_idx), ptr<uint8_t>(recv_x),
                                     ptr<uint8_t>(recv_scales), ptr<int32_t>(src_info), ptr<int64_t>(layout_range),
                                     ptr<int32_t>(recv_count)};
            return l.launch(call, skip, post, [&](const LowLatencyContext& k, const uint8_t* remote) {
                receive ? host::ll_dispatch_recv(k, a) : host::ll_dispatch_send(k, a, remote);
            });
        }, py::arg("receive"), py::arg("call"), py::arg("skip"), py::arg("num_tokens"), py::arg("scale_bytes"),
           py::arg("num_topk"), py::arg("fp8"), py::arg("round_scale"), py::arg("ue8m0"), py::arg("x"),
           py::arg("topk_idx"), py::arg("recv_x"), py::arg("recv_scales"), py::arg("src_info"),
           py::arg("layout_range"), py::arg("recv_count"), py::arg("post") = python::PostArgs{0, 0, 0, 0, 0},
           "The send half (receive=False) or the receive half of low-latency call `call` (1, 2, ...; half "
           "(call - 1) % 2). post = (header, bytes, rejected word, message offset, compared words): the call "
           "header it posts and judges (kernels/low_latency.h); header 0: none, the host agreed first.")
        .def("combine", [](LowLatency& l, bool receive, int64_t call, int64_t skip, int64_t num_tokens, int num_topk,
                           int64_t x, int64_t src_info, int64_t layout_range, int64_t topk_idx, int64_t topk_weights,
                           int64_t out, bool logfmt, const python::PostArgs& post) {
            LowLatencyCombineArgs a{num_tokens, num_topk, ptr<const uint16_t>(x), ptr<const int32_t>(src_info),
                                    ptr<const int64_t>(layout_range), ptr<const int64_t>(topk_idx),
                                    ptr<const float>(topk_weights), ptr<uint16_t>(out), logfmt};
            return l.launch(call, skip, post, [&](const LowLatencyContext& k, const uint8_t* remote) {
                receive ? host::ll_combine_recv(k, a) : host::ll_combine_send(k, a, remote);
            });
        }, py::arg("receive"), py::arg("call"), py::arg("skip"), py::arg("num_tokens"), py::arg("num_topk"),
           py::arg("x"), py::arg("src_info"), py::arg("layout_range"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("out"), py::arg("logfmt") = false, py::arg("post") = python::PostArgs{0, 0, 0, 0, 0},
           "The send half (receive=False) or the receive half of a low-latency combine (logfmt: rows travel "
           "LogFMT-10 encoded; call and post as dispatch's).")
        .def("reject", [](LowLatency& l, int64_t call, int64_t skip, const python::PostArgs& post) {
            return l.launch(call, skip, post, [&](const LowLatencyContext& k, const uint8_t*) { host::ll_reject(k); });
        }, py::arg("call"), py::arg("skip"), py::arg("post"),
           "Call `call`, rejected here on the host: posts its header (post, the rejected bit set) to every rank "
           "and no rows, and frees this rank's half of it.")
        .def_property_readonly("header_offsets", [](const LowLatency& l) { return python::header_offsets(l.layout); },
                               "Where each header cell of this rank's buffer starts: [half * R + source].");

    python::def_prepared_low_latency<HostPrepared>(
        m,
        [](py::object kernel, const py::tuple&, const py::module_&) {
            return HostPrepared(kernel.cast<const LowLatency&>());
        },
        "unused.");
}
