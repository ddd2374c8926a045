// moe_comm._cuda_nvshmem's expert-parallel launchers (ep_launch.h), with moe_comm._cuda's interface
// (device/launch_bindings.h: the same methods, arguments and results) and its codes and layouts, so the
// cuda backend drives them through the same adapter (moe_comm/backends/cuda/device_kernels.py):
//
//   Internode(nvl_bases, rail, pids, rank, timeout_s, C, nvl_chunk, rdma_chunk, L, nvl_slots,
//             nvl_slot_bytes, rdma_slots, rdma_slot_bytes)   normal mode across nodes: nvl_bases the node's
//             NVL buffers (CUDA IPC), rail = (this rank's symmetric RDMA buffer, [Rn] each rail peer's
//             buffer mapped here or 0, [Rn] each one's PE)
//   LowLatency(peers, pids, rank, timeout_s, L, M, H, node_ranks)   peers = (this rank's symmetric
//             low-latency buffer, [R] mappings or 0, [R] PEs); node_ranks: unused (the layout stages rows for every peer)
//
// Every launch needs NVSHMEM initialized in this process (init()); one real rank per launch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../device/launch_bindings.h"
#include "../python/layout_bindings.h"
#include "ep_launch.h"
#include "runtime.h"

namespace py = pybind11;
using namespace moe_comm::cuda;
using moe_comm::DType;
using moe_comm::kMaxNodeRanks;
using namespace moe_comm::cuda::device::bind;
namespace nv = moe_comm::cuda::nvshmem;

namespace {

// (base, mappings, PEs) as given from Python: every list as long as the other, PEs in [0, n_pes).
using Symmetric = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>>;

// The device tables of one symmetric link (they live as long as its launcher).
struct SymmetricTables {
    uint8_t* base = nullptr;
    device::DeviceTable<uint8_t*> p2p;
    device::DeviceTable<int32_t> pes;
    int32_t me = 0;

    SymmetricTables(const Symmetric& s, int32_t index, const char* what) {
        const auto& [b, maps, pe_list] = s;
        if (maps.size() != pe_list.size() || index < 0 || static_cast<size_t>(index) >= maps.size())
            throw py::value_error(std::string("moe_comm._cuda_nvshmem: ") + what + ": " +
                                  std::to_string(maps.size()) + " mappings and " + std::to_string(pe_list.size()) +
                                  " PEs for peer " + std::to_string(index));
        std::vector<int32_t> p;
        for (int64_t v : pe_list) p.push_back(static_cast<int32_t>(v));
        base = ptr<uint8_t>(b);
        p2p = device::DeviceTable<uint8_t*>(pointers(maps));
        pes = device::DeviceTable<int32_t>(p);
        me = index;
    }
    SymmetricPeers peers() const { return SymmetricPeers{base, p2p.get(), pes.get(), me}; }
};

void require_initialized(const char* what) {
    if (!nv::initialized())
        throw std::runtime_error(std::string("moe_comm._cuda_nvshmem: ") + what +
                                 ": NVSHMEM is not initialized in this process (init(uid, rank, num_ranks) first)");
}

struct Internode {
    static constexpr auto notify = &nv::launch_internode_notify;
    static constexpr auto prologue = &nv::launch_internode_prologue;
    static constexpr auto dispatch = &nv::launch_internode_dispatch;
    static constexpr auto combine = &nv::launch_internode_combine;
    Ranks r;
    int32_t num_nodes, node_ranks, num_channels;
    int64_t nvl_chunk, rdma_chunk;
    InternodeLayout layout;
    device::DeviceTable<uint8_t*> nvl;  // [NL] the node's NVL buffers (CUDA IPC)
    SymmetricTables rail;               // [Rn]

    Internode(const std::vector<int64_t>& nvl_bases, const Symmetric& rail_peers, int rank, double timeout_s, int C,
              int64_t nvl_chunk_tokens, int64_t rdma_chunk_tokens, int L, int64_t nvl_slots, int64_t nvl_slot_bytes,
              int64_t rdma_slots, int64_t rdma_slot_bytes)
        : r(static_cast<int32_t>(nvl_bases.size() * std::get<1>(rail_peers).size()), {static_cast<int32_t>(rank)},
            false, timeout_s),
          num_nodes(static_cast<int32_t>(std::get<1>(rail_peers).size())),
          node_ranks(static_cast<int32_t>(nvl_bases.size())), num_channels(C), nvl_chunk(nvl_chunk_tokens),
          rdma_chunk(rdma_chunk_tokens),
          layout(num_nodes, node_ranks, C, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes),
          nvl(pointers(nvl_bases)), rail(rail_peers, rank / std::max(node_ranks, 1), "Internode") {
        if (node_ranks < 1 || node_ranks > kMaxNodeRanks || num_nodes > kMaxNodes)
            throw py::value_error("moe_comm._cuda_nvshmem: Internode: " + std::to_string(num_nodes) + " nodes of " +
                                  std::to_string(node_ranks) + " ranks (at most " + std::to_string(kMaxNodes) +
                                  " of " + std::to_string(kMaxNodeRanks) + ")");
    }

    template <class Args, class Make>
    py::object launch(device::NormalKernel kernel, int64_t epoch, int64_t stream, Make make,
                      cudaError_t (*fn)(const device::Batch<nv::InternodeRank<Args>>&, cudaStream_t)) {
        require_initialized("Internode");
        const int32_t rank = r.ranks[0];
        device::Batch<nv::InternodeRank<Args>> b{};
        b.num_ranks = 1;
        b.rank[0] = nv::InternodeRank<Args>{
            InternodeContext{rank, rank / node_ranks, rank % node_ranks, num_nodes, node_ranks, num_channels,
                             nvl_chunk, rdma_chunk, layout, nvl.get(), r.watch(0), epoch},
            rail.peers(), make(0)};
        const int64_t C = num_channels;
        const int64_t blocks = kernel == device::NormalKernel::kInternodeDispatch ? C * (num_nodes + 1 + node_ranks)
                               : kernel == device::NormalKernel::kInternodeCombine ? C * (node_ranks + 2) : 1;
        return launch_cooperative(r, kernel, blocks, stream, b, fn, &nv::cooperative_capacity);
    }
};

struct LowLatency {
    static constexpr auto dispatch_send = &nv::launch_ll_dispatch_send;
    static constexpr auto dispatch_recv = &nv::launch_ll_dispatch_recv;
    static constexpr auto combine_send = &nv::launch_ll_combine_send;
    static constexpr auto combine_recv = &nv::launch_ll_combine_recv;
    static constexpr auto reject = &nv::launch_ll_reject;
    Ranks r;
    LowLatencyLayout layout;
    SymmetricTables peers;  // [R]
    HeaderCells headers;

    LowLatency(const Symmetric& all, int rank, double timeout_s, int L, int64_t M, int64_t H,
               int /*node_ranks: the host build's interface; every layout has the staging rows now*/)
        : r(static_cast<int32_t>(std::get<1>(all).size()), {static_cast<int32_t>(rank)}, false, timeout_s),
          layout(static_cast<int32_t>(std::get<1>(all).size()), L, M, H),
          peers(all, rank, "LowLatency") {}

    template <class Args, class Make>
    void launch(const char* op, int64_t call, const PerRank& skip, const LowLatencyPost& post, int64_t stream,
                Make make, cudaError_t (*fn)(const device::Batch<nv::LowLatencyRank<Args>>&, cudaStream_t)) {
        require_initialized(op);
        check_call(call);
        device::Batch<nv::LowLatencyRank<Args>> b{};
        b.num_ranks = 1;
        b.rank[0] = nv::LowLatencyRank<Args>{
            LowLatencyContext{r.ranks[0], r.num_ranks, static_cast<int32_t>((call - 1) & 1), layout, nullptr,
                              skip.ptr<const uint8_t>(0), r.watch(0), call, post},
            peers.peers(), make(0)};
        py::gil_scoped_release unlocked;
        DeviceGuard on(r.device);
        check(fn(b, stream_of(stream)), std::string("moe_comm._cuda_nvshmem: ") + op + " (launch)");
    }
};

}  // namespace

void bind_ep(py::module_& m) {
    moe_comm::cuda::python::def_layouts(m);

    py::class_<Internode> internode(m, "Internode");
    internode
        .def(py::init([](const std::vector<int64_t>& nvl_bases, const Symmetric& rail, const std::vector<int64_t>&,
                         int rank, double timeout_s, int C, int64_t nvl_chunk, int64_t rdma_chunk, int L,
                         int64_t nvl_slots, int64_t nvl_slot_bytes, int64_t rdma_slots, int64_t rdma_slot_bytes) {
                 return new Internode(nvl_bases, rail, rank, timeout_s, C, nvl_chunk, rdma_chunk, L, nvl_slots,
                                      nvl_slot_bytes, rdma_slots, rdma_slot_bytes);
             }),
             py::arg("nvl_bases"), py::arg("rail"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"),
             py::arg("C"), py::arg("nvl_chunk"), py::arg("rdma_chunk"), py::arg("L"), py::arg("nvl_slots"),
             py::arg("nvl_slot_bytes"), py::arg("rdma_slots"), py::arg("rdma_slot_bytes"),
             "One rank's launches across nodes: its node's NVL buffers (CUDA IPC) and its rail over NVSHMEM.")
        .def_property_readonly("ranks", [](const Internode& n) { return n.r.ranks; });
    def_internode_launches(internode);

    py::class_<LowLatency> low_latency(m, "LowLatency");
    low_latency
        .def(py::init([](const Symmetric& peers, const std::vector<int64_t>&, int rank, double timeout_s, int L,
                         int64_t M, int64_t H, int node_ranks) {
                 return new LowLatency(peers, rank, timeout_s, L, M, H, node_ranks);
             }),
             py::arg("peers"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"), py::arg("L"), py::arg("M"),
             py::arg("H"), py::arg("node_ranks") = 0,
             "One rank's low-latency launches over NVSHMEM (NVLink stores where a peer is mapped).")
        .def_property_readonly("ranks", [](const LowLatency& l) { return l.r.ranks; });
    def_low_latency_launches(low_latency);
    def_prepared_low_latency<LowLatency>(m);
}
