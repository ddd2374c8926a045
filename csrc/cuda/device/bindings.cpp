// moe_comm._cuda: the device build of the CUDA kernels. The interface of moe_comm._cuda_host (classes
// Normal and LowLatency, the same methods and argument order, the layout functions and enums) plus a
// trailing `stream` (a cudaStream_t as an int, 0: the legacy default stream) on every launch, CUDA IPC
// and buffer helpers, and emulated ranks: Normal.emulated / LowLatency.emulated serve R ranks of one
// GPU in each launch (every pointer or size argument then takes one int for all ranks or a sequence
// of R, and results come as a list of R).
//
// Normal-mode launches synchronise the stream (as DeepEP's normal mode waits on the host) and return
// None or the error record (code, kind, rank, peer, channel, observed, expected). Low-latency
// launches return at once (no host synchronisation: they can be captured in a CUDA graph); check()
// reads the record later, after the caller has synchronised. Pointers are Python ints; no libtorch.
// Importing the module makes no CUDA call (static cudart), so it imports without a GPU.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../python/layout_bindings.h"
#include "launch_bindings.h"

namespace py = pybind11;
using namespace moe_comm::cuda;
using moe_comm::DType;
using moe_comm::kMaxNodeRanks;
using namespace moe_comm::cuda::device;
using namespace moe_comm::cuda::device::bind;

void bind_internode(py::module_& m);  // bind_internode.cpp

namespace {

struct Normal {
    Ranks r;
    int32_t num_channels;
    int64_t chunk;
    NormalLayout layout;
    DeviceTable<int64_t*> arrive;

    Normal(const std::vector<int64_t>& bases, std::vector<int32_t> served, bool emulate, double timeout_s, int C,
           int64_t chunk_tokens, int L, int64_t slots, int64_t slot_bytes)
        : r(bases, std::move(served), emulate, timeout_s), num_channels(C), chunk(chunk_tokens),
          layout(static_cast<int32_t>(bases.size()), C, L, slots, slot_bytes) {
        std::vector<int64_t*> table;
        for (int64_t b : bases) table.push_back(layout.arrive_of(ptr<uint8_t>(b)));
        arrive = DeviceTable<int64_t*>(table);
    }

    NormalContext context(size_t i, int64_t epoch) const {
        return NormalContext{r.ranks[i], r.num_ranks, num_channels, chunk, layout, r.peers.get(), r.watch(i), epoch};
    }

    int64_t blocks(NormalKernel k) const {
        const int64_t R = r.num_ranks, C = num_channels;
        const int64_t per_rank =
            k == NormalKernel::kDispatch ? 2 * C * R : k == NormalKernel::kCombine ? (R + 1) * C : 1;
        return per_rank * static_cast<int64_t>(r.size());
    }

    // Fills one rank's arguments per served rank, launches, waits for the stream, reads the records.
    template <class Args, class Make>
    py::object launch(NormalKernel kernel, int64_t epoch, int64_t stream, Make make,
                      cudaError_t (*fn)(const Batch<NormalRank<Args>>&, cudaStream_t)) {
        Batch<NormalRank<Args>> b{};
        b.num_ranks = static_cast<int32_t>(r.size());
        for (size_t i = 0; i < r.size(); ++i) b.rank[i] = NormalRank<Args>{context(i, epoch), arrive.get(), make(i)};
        return launch_cooperative(r, kernel, blocks(kernel), stream, b, fn);
    }
};

// ---------------------------------------------------------------------- low latency
struct LowLatency {
    static constexpr auto dispatch_send = &launch_ll_dispatch_send;
    static constexpr auto dispatch_recv = &launch_ll_dispatch_recv;
    static constexpr auto combine_send = &launch_ll_combine_send;
    static constexpr auto combine_recv = &launch_ll_combine_recv;
    static constexpr auto reject = &launch_ll_reject;
    Ranks r;
    LowLatencyLayout layout;
    HeaderCells headers;

    LowLatency(const std::vector<int64_t>& bases, std::vector<int32_t> served, bool emulate, double timeout_s, int L,
               int64_t M, int64_t H)
        : r(bases, std::move(served), emulate, timeout_s), layout(static_cast<int32_t>(bases.size()), L, M, H) {}

    LowLatencyContext context(size_t i, int64_t call, const PerRank& skip, const LowLatencyPost& post) const {
        return LowLatencyContext{r.ranks[i], r.num_ranks, static_cast<int32_t>((call - 1) & 1), layout,
                                 r.peers.get(), skip.ptr<const uint8_t>(i), r.watch(i), call, post};
    }

    // Enqueues the launch and returns: the caller synchronises, then check().
    template <class Args, class Make>
    void launch(const char* op, int64_t call, const PerRank& skip, const LowLatencyPost& post, int64_t stream,
                Make make, cudaError_t (*fn)(const Batch<LowLatencyRank<Args>>&, cudaStream_t)) {
        check_call(call);
        Batch<LowLatencyRank<Args>> b{};
        b.num_ranks = static_cast<int32_t>(r.size());
        for (size_t i = 0; i < r.size(); ++i) b.rank[i] = LowLatencyRank<Args>{context(i, call, skip, post), make(i)};
        py::gil_scoped_release unlocked;
        DeviceGuard on(r.device);
        check(fn(b, stream_of(stream)), std::string("moe_comm._cuda: ") + op + " (launch)");
    }
};

}  // namespace

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "Device build of moe-comm's CUDA kernels (csrc/cuda), for the cuda backend";

    moe_comm::cuda::python::def_layouts(m);
    m.attr("MAX_EMULATED_RANKS") = kMaxLaunchRanks;
    m.attr("IPC_HANDLE_BYTES") = static_cast<int>(kIpcHandleBytes);

    m.def("layout", [](const PerRank& num_tokens, int num_topk, int num_ranks, int num_experts,
                       const PerRank& topk_idx, const PerRank& per_rank, const PerRank& per_expert,
                       const PerRank& in_rank, const PerRank& bad, int64_t stream) {
        LayoutBatch b{};
        size_t n = 1;
        for (const PerRank* p : {&num_tokens, &topk_idx, &per_rank, &per_expert, &in_rank, &bad})
            if (p->per_rank) n = p->values.size() > n ? p->values.size() : n;
        if (n > static_cast<size_t>(kMaxLaunchRanks))
            throw py::value_error(std::to_string(n) + " emulated ranks: a launch serves at most " +
                                  std::to_string(kMaxLaunchRanks));
        b.num_ranks = static_cast<int32_t>(n);
        for (size_t i = 0; i < n; ++i)
            b.rank[i] = LayoutArgs{num_tokens.at(i), num_topk, num_ranks, num_experts, topk_idx.ptr<const int64_t>(i),
                                   per_rank.ptr<int64_t>(i), per_expert.ptr<int64_t>(i), in_rank.ptr<uint8_t>(i),
                                   bad.ptr<int64_t>(i)};
        py::gil_scoped_release unlocked;
        check(launch_layout(b, stream_of(stream)), "moe_comm._cuda: layout (launch)");
    }, py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_ranks"), py::arg("num_experts"), py::arg("topk_idx"),
       py::arg("per_rank"), py::arg("per_expert"), py::arg("in_rank"), py::arg("bad"), py::arg("stream") = 0,
       "Enqueues the layout kernel: counts (int64, zeroed by the caller) and is_token_in_rank of topk_idx; "
       "bad[0] = 1 when an id is outside [-1, num_experts). Returns at once (no host synchronisation). "
       "Sequences of pointers (one per emulated rank) run several ranks' layouts in one launch.");

    // ------------------------------------------------------------------ runtime
    m.def("device_count", &device_count, "Visible CUDA devices (0 without a driver or a GPU).");
    m.def("synchronize", [](int64_t stream) {
        py::gil_scoped_release unlocked;
        check(cudaStreamSynchronize(stream_of(stream)), "cudaStreamSynchronize");
    }, py::arg("stream") = 0, "Waits for every launch enqueued on `stream`.");
    m.def("memset", [](int64_t p, int value, int64_t bytes, int64_t stream) {
        check(cudaMemsetAsync(ptr<void>(p), value, static_cast<size_t>(bytes), stream_of(stream)), "cudaMemsetAsync");
    }, py::arg("ptr"), py::arg("value"), py::arg("bytes"), py::arg("stream") = 0,
       "Sets `bytes` bytes of device memory at `ptr` to `value`, in stream order.");
    m.def("memcpy", [](int64_t dst, int64_t src, int64_t bytes, int64_t stream) {
        py::gil_scoped_release unlocked;
        check(cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), static_cast<size_t>(bytes), cudaMemcpyDefault,
                              stream_of(stream)), "cudaMemcpyAsync");
        check(cudaStreamSynchronize(stream_of(stream)), "cudaStreamSynchronize");
    }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream") = 0,
       "Copies `bytes` bytes from `src` to `dst` (host or device memory), in stream order, and waits for it.");
    m.def("ipc_get_handle", [](int64_t base) { return py::bytes(ipc_get_handle(ptr<void>(base))); },
          py::arg("base"), "The CUDA IPC handle (bytes) of the cudaMalloc'd allocation at `base`.");
    m.def("ipc_open_handle", [](const py::bytes& handle) {
        return static_cast<int64_t>(reinterpret_cast<uintptr_t>(ipc_open_handle(std::string(handle))));
    }, py::arg("handle"), "Maps a peer's allocation (its ipc_get_handle bytes) here; returns its base.");
    m.def("ipc_close_handle", [](int64_t base) { ipc_close_handle(ptr<void>(base)); }, py::arg("base"),
          "Unmaps a peer's allocation opened with ipc_open_handle.");

    py::class_<SharedBuffer>(m, "SharedBuffer",
                             "One rank's buffer (cudaMalloc'd on the current device, zeroed) and its peers' "
                             "mappings. Teardown is collective: close_peers() on every rank, a barrier, close().")
        .def(py::init<size_t>(), py::arg("bytes"))
        .def_property_readonly("ptr", [](const SharedBuffer& b) {
            return static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.ptr()));
        })
        .def_property_readonly("bytes", &SharedBuffer::bytes)
        .def_property_readonly("device", &SharedBuffer::device)
        .def("handle", [](const SharedBuffer& b) { return py::bytes(b.handle()); },
             "This allocation's CUDA IPC handle, for the peers.")
        .def("open", [](SharedBuffer& b, const std::vector<py::bytes>& handles, int rank) {
            std::vector<std::string> hs(handles.begin(), handles.end());
            std::vector<int64_t> out;
            for (void* p : b.open(hs, rank)) out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
            return out;
        }, py::arg("handles"), py::arg("rank"),
             "Opens every peer's handle (handles[rank] is this buffer's); returns every rank's base here.")
        .def_property_readonly("bases", [](const SharedBuffer& b) {
            std::vector<int64_t> out;
            for (void* p : b.bases()) out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
            return out;
        })
        .def("close_peers", &SharedBuffer::close_peers, "Unmaps the peers' buffers.")
        .def("close", &SharedBuffer::close, "Unmaps the peers' buffers and frees this one.");

    py::class_<MappedMemory>(m, "MappedBuffer",
                             "Pinned host memory mapped into the device (cudaHostAllocMapped), zeroed: for what "
                             "a kernel writes and the host reads after it (notify's outputs).")
        .def(py::init<size_t>(), py::arg("bytes"))
        .def_property_readonly("ptr", [](const MappedMemory& b) {
            return static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.device()));
        }, "The device's address of the bytes (for launches).")
        .def_property_readonly("host_ptr", [](const MappedMemory& b) {
            return static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.host()));
        }, "The host's address of the bytes (equal to ptr under unified addressing).")
        .def_property_readonly("bytes", &MappedMemory::bytes)
        .def("close", &MappedMemory::reset, "Frees the bytes now.");

    // ------------------------------------------------------------------ normal mode
    bind_internode(m);
    py::class_<Normal>(m, "Normal")
        .def(py::init([](const std::vector<int64_t>& bases, const std::vector<int64_t>&, int rank, double timeout_s,
                         int C, int64_t chunk, int L, int64_t slots, int64_t slot_bytes) {
                 return new Normal(bases, {static_cast<int32_t>(rank)}, false, timeout_s, C, chunk, L, slots,
                                   slot_bytes);
             }),
             py::arg("bases"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"), py::arg("C"),
             py::arg("chunk"), py::arg("L"), py::arg("slots"), py::arg("slot_bytes"),
             "One rank's launches. bases: every rank's buffer as mapped here (device pointers); pids are "
             "accepted for _cuda_host's signature (the device relies on its deadlines).")
        .def_static("emulated", [](const std::vector<int64_t>& bases, double timeout_s, int C, int64_t chunk, int L,
                                   int64_t slots, int64_t slot_bytes) {
            return new Normal(bases, all_ranks(bases.size()), true, timeout_s, C, chunk, L, slots, slot_bytes);
        }, py::arg("bases"), py::arg("timeout_s"), py::arg("C"), py::arg("chunk"), py::arg("L"), py::arg("slots"),
           py::arg("slot_bytes"),
           "Every rank of `bases` (buffers of this GPU) in each launch, as emulated ranks 0..R-1.")
        .def_property_readonly("ranks", [](const Normal& n) { return n.r.ranks; })
        .def_property_readonly("device", [](const Normal& n) { return n.r.device; })
        .def_property_readonly("budget_cycles", [](const Normal& n) { return n.r.budget; })
        .def("notify", [](Normal& n, int64_t epoch, const PerRank& rows_to_rank, const PerRank& tokens_per_expert,
                          const PerRank& channel_prefix, int64_t alignment, const PerRank& rank_prefix,
                          const PerRank& recv_offset, const PerRank& recv_channel_offset,
                          const PerRank& recv_channel_count, const PerRank& recv_per_expert, const PerRank& num_recv,
                          int64_t stream) {
            return n.launch<NotifyArgs>(NormalKernel::kNotify, epoch, stream, [&](size_t i) {
                return NotifyArgs{rows_to_rank.ptr<const int64_t>(i), tokens_per_expert.ptr<const int64_t>(i),
                                  channel_prefix.ptr<const int64_t>(i), alignment, rank_prefix.ptr<int32_t>(i),
                                  recv_offset.ptr<int64_t>(i), recv_channel_offset.ptr<int64_t>(i),
                                  recv_channel_count.ptr<int64_t>(i), recv_per_expert.ptr<int64_t>(i),
                                  num_recv.ptr<int64_t>(i)};
            }, &launch_notify);
        }, py::arg("epoch"), py::arg("rows_to_rank"), py::arg("tokens_per_expert"), py::arg("channel_prefix"),
           py::arg("alignment"), py::arg("rank_prefix"), py::arg("recv_offset"), py::arg("recv_channel_offset"),
           py::arg("recv_channel_count"), py::arg("recv_per_expert"), py::arg("num_recv"), py::arg("stream") = 0,
           "The notify kernel; its outputs in memory the host reads after it (pinned host memory).")
        .def("prologue", [](Normal& n, int64_t epoch, int64_t stream) {
            return n.launch<NoArgs>(NormalKernel::kPrologue, epoch, stream, [](size_t) { return NoArgs{}; },
                                    &launch_prologue);
        }, py::arg("epoch"), py::arg("stream") = 0)
        .def("dispatch", [](Normal& n, const PerRank& num_tokens, const PerRank& x_bytes, const PerRank& scale_bytes,
                            int num_topk, const PerRank& x, const PerRank& scales, const PerRank& topk_idx,
                            const PerRank& topk_weights, const PerRank& is_token_in_rank,
                            const PerRank& channel_prefix, const PerRank& recv_offset,
                            const PerRank& recv_channel_offset, const PerRank& recv_channel_count,
                            const PerRank& recv_x, const PerRank& recv_scales, const PerRank& recv_topk_idx,
                            const PerRank& recv_topk_weights, const PerRank& recv_src_idx, int64_t stream) {
            return n.launch<DispatchArgs>(NormalKernel::kDispatch, 0, stream, [&](size_t i) {
                return DispatchArgs{num_tokens.at(i), x_bytes.at(i), scale_bytes.at(i), num_topk,
                                    x.ptr<const uint8_t>(i), scales.ptr<const uint8_t>(i),
                                    topk_idx.ptr<const int64_t>(i), topk_weights.ptr<const float>(i),
                                    is_token_in_rank.ptr<const uint8_t>(i), channel_prefix.ptr<const int64_t>(i),
                                    recv_offset.ptr<const int64_t>(i), recv_channel_offset.ptr<const int64_t>(i),
                                    recv_channel_count.ptr<const int64_t>(i), recv_x.ptr<uint8_t>(i),
                                    recv_scales.ptr<uint8_t>(i), recv_topk_idx.ptr<int64_t>(i),
                                    recv_topk_weights.ptr<float>(i), recv_src_idx.ptr<int32_t>(i)};
            }, &launch_dispatch);
        }, py::arg("num_tokens"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"), py::arg("x"),
           py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"),
           py::arg("channel_prefix"), py::arg("recv_offset"), py::arg("recv_channel_offset"),
           py::arg("recv_channel_count"), py::arg("recv_x"), py::arg("recv_scales"), py::arg("recv_topk_idx"),
           py::arg("recv_topk_weights"), py::arg("recv_src_idx"), py::arg("stream") = 0)
        .def("combine", [](Normal& n, const PerRank& num_tokens, int64_t hidden, int64_t x_bytes, int num_topk,
                           DType type, const PerRank& x, const PerRank& topk_weights, const PerRank& recv_offset,
                           const PerRank& recv_channel_offset, const PerRank& recv_channel_count,
                           const PerRank& is_token_in_rank, const PerRank& channel_prefix, const PerRank& send_pos,
                           const PerRank& bias0, const PerRank& bias1, const PerRank& out,
                           const PerRank& out_weights, int64_t stream) {
            return n.launch<CombineArgs>(NormalKernel::kCombine, 0, stream, [&](size_t i) {
                return CombineArgs{num_tokens.at(i), hidden, x_bytes, num_topk, moe_comm::cuda::python::combine_row_type(type, hidden, x_bytes), x.ptr<const uint8_t>(i),
                                   topk_weights.ptr<const float>(i), recv_offset.ptr<const int64_t>(i),
                                   recv_channel_offset.ptr<const int64_t>(i),
                                   recv_channel_count.ptr<const int64_t>(i), is_token_in_rank.ptr<const uint8_t>(i),
                                   channel_prefix.ptr<const int64_t>(i), send_pos.ptr<const int32_t>(i),
                                   bias0.ptr<const uint8_t>(i), bias1.ptr<const uint8_t>(i), out.ptr<uint8_t>(i),
                                   out_weights.ptr<float>(i)};
            }, &launch_combine);
        }, py::arg("num_tokens"), py::arg("hidden"), py::arg("x_bytes"), py::arg("num_topk"), py::arg("type"),
           py::arg("x"), py::arg("topk_weights"), py::arg("recv_offset"), py::arg("recv_channel_offset"),
           py::arg("recv_channel_count"), py::arg("is_token_in_rank"), py::arg("channel_prefix"), py::arg("send_pos"),
           py::arg("bias0"), py::arg("bias1"), py::arg("out"), py::arg("out_weights"), py::arg("stream") = 0);

    // ------------------------------------------------------------------ low latency
    py::class_<LowLatency> low_latency(m, "LowLatency");
    low_latency
        .def(py::init([](const std::vector<int64_t>& bases, const std::vector<int64_t>&, int rank, double timeout_s,
                         int L, int64_t M, int64_t H, int node_ranks) {
                 if (node_ranks != 0)  // over CUDA IPC every rank's buffer is mapped: nothing goes through staging
                     throw py::value_error("moe_comm._cuda.LowLatency reaches every rank directly (CUDA IPC): "
                                           "node_ranks must be 0, got " + std::to_string(node_ranks));
                 return new LowLatency(bases, {static_cast<int32_t>(rank)}, false, timeout_s, L, M, H);
             }),
             py::arg("bases"), py::arg("pids"), py::arg("rank"), py::arg("timeout_s"), py::arg("L"), py::arg("M"),
             py::arg("H"), py::arg("node_ranks") = 0)
        .def_static("emulated", [](const std::vector<int64_t>& bases, double timeout_s, int L, int64_t M, int64_t H) {
            return new LowLatency(bases, all_ranks(bases.size()), true, timeout_s, L, M, H);
        }, py::arg("bases"), py::arg("timeout_s"), py::arg("L"), py::arg("M"), py::arg("H"),
           "Every rank of `bases` (buffers of this GPU) in each launch, as emulated ranks 0..R-1.")
        .def_property_readonly("ranks", [](const LowLatency& l) { return l.r.ranks; })
        .def_property_readonly("device", [](const LowLatency& l) { return l.r.device; })
        .def_property_readonly("budget_cycles", [](const LowLatency& l) { return l.r.budget; });
    def_low_latency_launches(low_latency);
    def_prepared_low_latency<LowLatency>(m);
}
