// moe_comm._cuda.Internode: normal mode across nodes (kernels/internode.h) on buffers mapped in this
// process, the RDMA link being DirectLink: the ranks of one host split into nodes (LOCAL_WORLD_SIZE),
// and emulated ranks of one GPU (Internode.emulated: every rank's blocks in each launch, nodes of
// `node_ranks` consecutive ranks). Across real nodes the RDMA buffers are NVSHMEM's: moe_comm._cuda_nvshmem.
// The interface is moe_comm._cuda_host.Internode's plus a trailing `stream`; every launch is cooperative
// and synchronised, and returns None or the error record (a list of them, emulated).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "launch_bindings.h"

namespace py = pybind11;
using namespace moe_comm::cuda;
using moe_comm::kMaxNodeRanks;
using namespace moe_comm::cuda::device;
using namespace moe_comm::cuda::device::bind;

namespace {

struct Internode {
    static constexpr auto notify = &launch_internode_notify;
    static constexpr auto prologue = &launch_internode_prologue;
    static constexpr auto dispatch = &launch_internode_dispatch;
    static constexpr auto combine = &launch_internode_combine;
    Ranks r;
    int32_t num_nodes, node_ranks, num_channels;
    int64_t nvl_chunk, rdma_chunk;
    InternodeLayout layout;
    DeviceTable<uint8_t*> nvl;    // the node's NVL buffers [NL]; emulated: every rank's [R]
    DeviceTable<uint8_t*> rails;  // [served][Rn] each served rank's rail of RDMA buffers

    // nvl_bases / rdma_bases: [NL] / [Rn] for a real rank; [R] / [R] emulated.
    Internode(const std::vector<int64_t>& nvl_bases, const std::vector<int64_t>& rdma_bases,
              std::vector<int32_t> served, bool emulate, int NL, double timeout_s, int C, int64_t nvl_chunk_tokens,
              int64_t rdma_chunk_tokens, int L, int64_t nvl_slots, int64_t nvl_slot_bytes, int64_t rdma_slots,
              int64_t rdma_slot_bytes)
        : r(geometry(nvl_bases, rdma_bases, emulate, NL), std::move(served), emulate, timeout_s),
          num_nodes(r.num_ranks / NL), node_ranks(NL), num_channels(C), nvl_chunk(nvl_chunk_tokens),
          rdma_chunk(rdma_chunk_tokens),
          layout(num_nodes, NL, C, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes) {
        nvl = DeviceTable<uint8_t*>(pointers(nvl_bases));
        std::vector<int64_t> rail;
        for (int32_t rank : r.ranks)
            for (int n = 0; n < num_nodes; ++n)
                rail.push_back(emulate ? rdma_bases[static_cast<size_t>(n * NL + rank % NL)]
                                       : rdma_bases[static_cast<size_t>(n)]);
        rails = DeviceTable<uint8_t*>(pointers(rail));
    }

    // The group's size, after checking the tables' sizes against it.
    static int32_t geometry(const std::vector<int64_t>& nvl_bases, const std::vector<int64_t>& rdma_bases, bool emulate,
                            int NL) {
        if (NL < 1 || NL > kMaxNodeRanks)
            throw py::value_error("Internode: nodes of " + std::to_string(NL) + " ranks (1 to " +
                                  std::to_string(kMaxNodeRanks) + ")");
        const int64_t R = emulate ? static_cast<int64_t>(nvl_bases.size())
                                  : static_cast<int64_t>(rdma_bases.size()) * NL;
        const bool ok = emulate ? rdma_bases.size() == nvl_bases.size() && R % NL == 0
                                : nvl_bases.size() == static_cast<size_t>(NL);
        if (!ok || R < NL || R / NL > kMaxNodes)
            throw py::value_error("Internode: " + std::to_string(nvl_bases.size()) + " NVL and " +
                                  std::to_string(rdma_bases.size()) + " RDMA buffers for nodes of " +
                                  std::to_string(NL) + " ranks (at most " + std::to_string(kMaxNodes) + " nodes)");
        return static_cast<int32_t>(R);
    }

    InternodeContext context(size_t i, int64_t epoch) const {
        const int32_t rank = r.ranks[i], node = rank / node_ranks;
        uint8_t* const* peers = r.emulated ? nvl.get() + static_cast<int64_t>(node) * node_ranks : nvl.get();
        return InternodeContext{rank, node, rank % node_ranks, num_nodes, node_ranks, num_channels, nvl_chunk,
                                rdma_chunk, layout, peers, r.watch(i), epoch};
    }

    int64_t blocks(NormalKernel k) const {
        const int64_t C = num_channels;
        const int64_t per_rank = k == NormalKernel::kInternodeDispatch ? C * (num_nodes + 1 + node_ranks)
                                 : k == NormalKernel::kInternodeCombine ? C * (node_ranks + 2) : 1;
        return per_rank * static_cast<int64_t>(r.size());
    }

    template <class Args, class Make>
    py::object launch(NormalKernel kernel, int64_t epoch, int64_t stream, Make make,
                      cudaError_t (*fn)(const Batch<InternodeRank<Args>>&, cudaStream_t)) {
        Batch<InternodeRank<Args>> b{};
        b.num_ranks = static_cast<int32_t>(r.size());
        for (size_t i = 0; i < r.size(); ++i)
            b.rank[i] = InternodeRank<Args>{context(i, epoch), rails.get() + i * num_nodes, make(i)};
        return launch_cooperative(r, kernel, blocks(kernel), stream, b, fn);
    }
};

}  // namespace

void bind_internode(py::module_& m) {
    py::class_<Internode> internode(m, "Internode");
    internode
        .def(py::init([](const std::vector<int64_t>& nvl_bases, const std::vector<int64_t>& rdma_bases,
                         const std::vector<int64_t>&, int rank, double timeout_s, int C, int64_t nvl_chunk,
                         int64_t rdma_chunk, int L, int64_t nvl_slots, int64_t nvl_slot_bytes, int64_t rdma_slots,
                         int64_t rdma_slot_bytes) {
                 return new Internode(nvl_bases, rdma_bases, {static_cast<int32_t>(rank)}, false,
                                      static_cast<int>(nvl_bases.size()), timeout_s, C, nvl_chunk, rdma_chunk, L,
                                      nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes);
             }),
             py::arg("nvl_bases"), py::arg("rdma_bases"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"),
             py::arg("C"), py::arg("nvl_chunk"), py::arg("rdma_chunk"), py::arg("L"), py::arg("nvl_slots"),
             py::arg("nvl_slot_bytes"), py::arg("rdma_slots"), py::arg("rdma_slot_bytes"),
             "One rank's launches: nvl_bases its node's NVL buffers, rdma_bases its rail's RDMA buffers, all mapped "
             "here (device pointers); pids as _cuda_host's signature (the device relies on its deadlines).")
        .def_static("emulated", [](const std::vector<int64_t>& nvl_bases, const std::vector<int64_t>& rdma_bases,
                                   int node_ranks, double timeout_s, int C, int64_t nvl_chunk, int64_t rdma_chunk,
                                   int L, int64_t nvl_slots, int64_t nvl_slot_bytes, int64_t rdma_slots,
                                   int64_t rdma_slot_bytes) {
            return new Internode(nvl_bases, rdma_bases, all_ranks(nvl_bases.size()), true, node_ranks, timeout_s, C,
                                 nvl_chunk, rdma_chunk, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes);
        }, py::arg("nvl_bases"), py::arg("rdma_bases"), py::arg("node_ranks"), py::arg("timeout_s"), py::arg("C"),
           py::arg("nvl_chunk"), py::arg("rdma_chunk"), py::arg("L"), py::arg("nvl_slots"), py::arg("nvl_slot_bytes"),
           py::arg("rdma_slots"), py::arg("rdma_slot_bytes"),
           "Every rank of this GPU's buffers (R of each) in each launch, as emulated ranks 0..R-1 in nodes of "
           "node_ranks.")
        .def_property_readonly("ranks", [](const Internode& n) { return n.r.ranks; });
    def_internode_launches(internode);

}
