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

#include "../../python/tensor_args.h"
#include "../python/layout_bindings.h"
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

// A low-latency operation prepared for one signature (moe_comm/backends/cuda/prepared.py): its launch
// object, its call header's template, the outputs of both buffer halves (a dispatch's). Each call reads
// and checks its Python arguments here against the signature (moe_comm/python/tensor_args.h: anything
// else is "not taken", for the checked path), then launches: one crossing per op half. The kernels check
// the top-k ids and the handle themselves, as on the checked path.
class PreparedLowLatency {
  public:
    struct Outputs {
        int64_t recv_x, recv_scales, src_info, layout_range, recv_count;  // recv_scales: the [E_loc, S, R * M] storage
    };

    PreparedLowLatency(const LowLatency& ll, const std::vector<uint8_t>& header, int call_word, const python::PostArgs& post,
                       int64_t num_experts, int num_topk, const CastFormat& format, const std::vector<Outputs>& halves,
                       py::object key, const py::module_& torch)
        : ll_(ll), torch_(torch), key_(std::move(key)), header_(header), call_word_(call_word), num_topk_(num_topk),
          format_(format), skip_(ll.peers.bases.size(), 0) {
        if (call_word < 0 || 8 * (call_word + 1) > static_cast<int64_t>(header_.size()))
            throw py::value_error("PreparedLowLatency: call word " + std::to_string(call_word) + " outside the " +
                                  std::to_string(header_.size()) + "-byte header");
        post_ = {reinterpret_cast<int64_t>(header_.data()), static_cast<int64_t>(header_.size()), std::get<2>(post),
                 std::get<3>(post), std::get<4>(post)};
        python::post_of(post_, ll_.layout);  // the header fits the cells
        const int R = ll_.layout.num_ranks;
        local_ = ll_.layout.experts_per_rank;
        if (num_experts != int64_t{local_} * R)
            throw py::value_error("PreparedLowLatency: num_experts " + std::to_string(num_experts) + " for " +
                                  std::to_string(local_) + " local experts on " + std::to_string(R) + " ranks");
        if (!halves.empty() && halves.size() != 2) throw py::value_error("PreparedLowLatency: need both halves' outputs");
        for (size_t h = 0; h < halves.size(); ++h) outputs_[h] = halves[h];
        scale_bytes_ = format.fp8 ? 4 * (ll_.layout.hidden / moe_comm::kFp8Group / (format.ue8m0 ? 4 : 1)) : 0;
    }

    // (taken, the record of the launches that ran: the send's if it failed, else with `receive` the receive's)
    std::tuple<bool, Error> dispatch(py::handle key, py::handle x, py::handle topk_idx, py::handle recv_stats,
                                     py::handle wait_stats, int64_t number, int64_t call, bool receive) {
        const auto& t = torch_;
        const int64_t M = ll_.layout.max_tokens, H = ll_.layout.hidden;
        moe_comm::python::TensorArg xa, ta;
        Pending p;
        if (!moe_comm::python::same_key(key, key_) || !moe_comm::python::read_tensor(x, t, t.bfloat16, 2, &xa) ||
            xa.shape[1] != H || xa.shape[0] > M || !xa.contiguous() ||
            !moe_comm::python::read_tensor(topk_idx, t, t.int64, 2, &ta) || ta.shape[0] != xa.shape[0] ||
            ta.shape[1] != num_topk_ || !ta.contiguous() || !stats(recv_stats, t.int32, local_, &p.recv_stats) ||
            !stats(wait_stats, t.int64, ll_.layout.num_ranks, &p.wait_stats) || outputs_[0].recv_x == 0)
            return {false, std::nullopt};
        const Outputs& o = outputs_[(call - 1) & 1];
        p.dispatch = {xa.shape[0], scale_bytes_, num_topk_, format_, reinterpret_cast<const uint16_t*>(xa.data),
                      reinterpret_cast<const int64_t*>(ta.data), ptr<uint8_t>(o.recv_x), ptr<uint8_t>(o.recv_scales),
                      ptr<int32_t>(o.src_info), ptr<int64_t>(o.layout_range), ptr<int32_t>(o.recv_count)};
        p.is_dispatch = true;
        p.held = py::make_tuple(x, topk_idx, recv_stats, wait_stats);
        return {true, launch(std::move(p), number, call, receive)};
    }

    // (taken, record as dispatch's, out: the given or a new [T, hidden] bf16 tensor)
    std::tuple<bool, Error, py::object> combine(py::handle key, py::handle x, py::handle topk_idx,
                                                py::handle topk_weights, py::handle handle, py::handle out,
                                                py::handle wait_stats, int64_t number, int64_t call, bool receive) {
        const auto& t = torch_;
        const int64_t R = ll_.layout.num_ranks, M = ll_.layout.max_tokens, H = ll_.layout.hidden;
        const std::tuple<bool, Error, py::object> not_taken{false, std::nullopt, py::none()};
        moe_comm::python::TensorArg xa, src, range, ta, wa, oa;
        Pending p;
        if (!moe_comm::python::same_key(key, key_) || !PyTuple_CheckExact(handle.ptr()) ||
            PyTuple_GET_SIZE(handle.ptr()) != 5 || !moe_comm::python::read_tensor(x, t, t.bfloat16, 3, &xa) ||
            xa.shape[0] != local_ || xa.shape[1] != R * M || xa.shape[2] != H || !xa.contiguous() ||
            !moe_comm::python::read_tensor(PyTuple_GET_ITEM(handle.ptr(), 0), t, t.int32, 2, &src) ||
            src.shape[0] != local_ || src.shape[1] != R * M || !src.contiguous() ||
            !moe_comm::python::read_tensor(PyTuple_GET_ITEM(handle.ptr(), 1), t, t.int64, 2, &range) ||
            range.shape[0] != local_ || range.shape[1] != R || !range.contiguous() ||
            !moe_comm::python::read_tensor(topk_idx, t, t.int64, 2, &ta) || ta.shape[1] != num_topk_ ||
            ta.shape[0] > M || !ta.contiguous() || !moe_comm::python::read_tensor(topk_weights, t, t.float32, 2, &wa) ||
            wa.shape[0] != ta.shape[0] || wa.shape[1] != num_topk_ || !wa.contiguous() ||
            !stats(wait_stats, t.int64, R, &p.wait_stats))
            return not_taken;
        py::object result = py::reinterpret_borrow<py::object>(out);
        if (out.is_none()) result = t.empty(py::make_tuple(ta.shape[0], H), py::arg("dtype") = t.bfloat16);
        if (!moe_comm::python::read_tensor(result, t, t.bfloat16, 2, &oa) || oa.shape[0] != ta.shape[0] ||
            oa.shape[1] != H || !oa.contiguous())
            return not_taken;
        p.combine = {ta.shape[0], num_topk_, reinterpret_cast<const uint16_t*>(xa.data),
                     reinterpret_cast<const int32_t*>(src.data), reinterpret_cast<const int64_t*>(range.data),
                     reinterpret_cast<const int64_t*>(ta.data), reinterpret_cast<const float*>(wa.data),
                     reinterpret_cast<uint16_t*>(oa.data), false};
        p.held = py::make_tuple(x, handle, topk_idx, topk_weights, result, wait_stats);
        return {true, launch(std::move(p), number, call, receive), result};
    }

    // The receive launch of the call last sent on `half` (its record), then its stats.
    Error receive(int half) {
        if (half != 0 && half != 1) throw py::value_error("PreparedLowLatency: half must be 0 or 1");
        Pending& p = pending_[half];
        Error record = run(p, true);
        if (!record) p.held = py::object();
        return record;
    }

  private:
    struct Pending {
        bool is_dispatch = false;
        LowLatencyDispatchArgs dispatch{};
        LowLatencyCombineArgs combine{};
        int64_t call = 0;
        int32_t* recv_stats = nullptr;
        int64_t* wait_stats = nullptr;
        py::object held;  // the tensors the launches read, alive until the receive
    };

    template <class T>
    bool stats(py::handle h, const py::object& dtype, int64_t size, T** out) const {
        *out = nullptr;
        if (h.is_none()) return true;
        moe_comm::python::TensorArg a;
        if (!moe_comm::python::read_tensor(h, torch_, dtype, 1, &a) || a.shape[0] != size || !a.contiguous())
            return false;
        *out = reinterpret_cast<T*>(a.data);
        return true;
    }

    Error launch(Pending p, int64_t number, int64_t call, bool receive) {
        std::memcpy(header_.data() + 8 * call_word_, &number, 8);
        p.call = call;
        Pending& slot = pending_[(call - 1) & 1];
        slot = std::move(p);
        Error record = run(slot, false);
        if (!record && receive) record = run(slot, true);
        if (receive && !record) slot.held = py::object();
        return record;
    }

    Error run(Pending& p, bool receive) {
        const auto begin = std::chrono::steady_clock::now();
        const auto skip = reinterpret_cast<int64_t>(skip_.data());
        Error record = p.is_dispatch
            ? ll_.launch(p.call, skip, post_, [&](const LowLatencyContext& k, const uint8_t* remote) {
                  receive ? host::ll_dispatch_recv(k, p.dispatch) : host::ll_dispatch_send(k, p.dispatch, remote);
              })
            : ll_.launch(p.call, skip, post_, [&](const LowLatencyContext& k, const uint8_t* remote) {
                  receive ? host::ll_combine_recv(k, p.combine) : host::ll_combine_send(k, p.combine, remote);
              });
        if (receive && !record) {  // the stats of a received call, as the checked path adds them
            const int64_t waited = std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - begin).count();
            if (p.recv_stats != nullptr)
                for (int e = 0; e < local_; ++e) p.recv_stats[e] += p.dispatch.recv_count[e];
            if (p.wait_stats != nullptr)
                for (int r = 0; r < ll_.layout.num_ranks; ++r) p.wait_stats[r] += waited;
        }
        return record;
    }

    LowLatency ll_;
    moe_comm::python::TorchObjects torch_;
    py::object key_;
    std::vector<uint8_t> header_;
    int call_word_;
    python::PostArgs post_;
    int32_t num_topk_;
    CastFormat format_;
    int32_t local_ = 0;
    int64_t scale_bytes_ = 0;
    std::vector<uint8_t> skip_;
    Outputs outputs_[2] = {};
    Pending pending_[2];
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

    py::class_<PreparedLowLatency>(m, "PreparedLowLatency",
                                   "A low-latency dispatch or combine prepared for one signature.")
        .def(py::init([](const LowLatency& ll, int64_t header, int64_t header_bytes, int call_word, const python::PostArgs& post,
                         int64_t num_experts, int num_topk, bool fp8, bool round_scale, bool ue8m0,
                         const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>& halves,
                         py::object key, const py::module_& torch) {
                 std::vector<PreparedLowLatency::Outputs> outputs;
                 for (const auto& [x, scales, src, range, count] : halves) outputs.push_back({x, scales, src, range, count});
                 if (header_bytes < 0) throw py::value_error("PreparedLowLatency: header_bytes must be >= 0");
                 const auto* bytes = ptr<const uint8_t>(header);
                 return PreparedLowLatency(ll, std::vector<uint8_t>(bytes, bytes + header_bytes), call_word, post,
                                           num_experts, num_topk,
                                           CastFormat{fp8, round_scale, ue8m0}, outputs, std::move(key), torch);
             }),
             py::arg("kernel"), py::arg("header"), py::arg("header_bytes"), py::arg("call_word"), py::arg("post"),
             py::arg("num_experts"),
             py::arg("num_topk"), py::arg("fp8"), py::arg("round_scale"), py::arg("ue8m0"), py::arg("halves"),
             py::arg("key"), py::arg("torch"),
             "kernel: the launch object; header, header_bytes: the call header with call number 0, copied (the "
             "call's number is written into word call_word); post: as a launch's, its address unused; halves: a dispatch's outputs per buffer "
             "half (recv_x, the scales' [E_loc, S, R * M] storage or 0, src_info, layout_range, recv_count "
             "addresses), none for a combine; key: the signature every call must carry exactly.")
        .def("dispatch", &PreparedLowLatency::dispatch, py::arg("key"), py::arg("x"), py::arg("topk_idx"),
             py::arg("recv_stats"), py::arg("wait_stats"), py::arg("number"), py::arg("call"), py::arg("receive"),
             "(taken, error record or None) of low-latency call `call` (the Buffer's call `number`).")
        .def("combine", &PreparedLowLatency::combine, py::arg("key"), py::arg("x"), py::arg("topk_idx"),
             py::arg("topk_weights"), py::arg("handle"), py::arg("out"), py::arg("wait_stats"), py::arg("number"),
             py::arg("call"), py::arg("receive"), "(taken, error record or None, out).")
        .def("receive", &PreparedLowLatency::receive, py::arg("half"),
             "The receive launch of the call last sent on `half`: its error record or None.");
}
