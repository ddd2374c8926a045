// The launch methods every device build's launchers share (moe_comm._cuda over CUDA IPC, moe_comm._cuda_nvshmem
// over NVSHMEM): the same Python names, arguments and results as moe_comm._cuda_host's, so the backend
// drives every build through one adapter (moe_comm/backends/cuda/device_kernels.py).
//
// A low-latency launcher LL has `r` (Ranks), `launch<Args>(op, half, skip, stream, make, fn)` enqueueing
// one launch, and the launch functions LL::dispatch_send, dispatch_recv, combine_send, combine_recv. An
// internode launcher IN has `launch<Args>(kernel, epoch, stream, make, fn)` (cooperative, synchronised)
// and IN::notify, prologue, dispatch, combine.
#pragma once

#include <memory>

#include "../python/layout_bindings.h"
#include "../python/prepared_low_latency.h"
#include "binding_support.h"

namespace moe_comm::cuda::device::bind {

using python::PostArgs;

// A launch's header as its kernels read it (HeaderCells), checked against the layout's cells (the
// launch checks `call`).
template <class LL>
LowLatencyPost placed(LL& l, const PostArgs& post, int64_t call, HeaderKind kind) {
    return l.headers.place(python::post_of(post, l.layout), l.layout, call, kind, l.r.device);
}

template <class LL>
void def_low_latency_launches(py::class_<LL>& cls) {
    cls
        .def("dispatch", [](LL& l, bool receive, int64_t call, const PerRank& skip, const PerRank& num_tokens,
                            int64_t scale_bytes, int num_topk, bool fp8, bool round_scale, bool ue8m0,
                            const PerRank& x, const PerRank& topk_idx, const PerRank& recv_x,
                            const PerRank& recv_scales, const PerRank& src_info, const PerRank& layout_range,
                            const PerRank& recv_count, const PostArgs& post, int64_t stream) {
            const LowLatencyPost p = placed(l, post, call, HeaderKind::kDispatch);
            auto make = [&](size_t i) {
                return LowLatencyDispatchArgs{num_tokens.at(i), scale_bytes, num_topk,
                                              CastFormat{fp8, round_scale, ue8m0}, x.ptr<const uint16_t>(i),
                                              topk_idx.ptr<const int64_t>(i), recv_x.ptr<uint8_t>(i),
                                              recv_scales.ptr<uint8_t>(i), src_info.ptr<int32_t>(i),
                                              layout_range.ptr<int64_t>(i), recv_count.ptr<int32_t>(i)};
            };
            if (receive)
                l.template launch<LowLatencyDispatchArgs>("low-latency dispatch (receive)", call, skip, p, stream, make,
                                                 LL::dispatch_recv);
            else
                l.template launch<LowLatencyDispatchArgs>("low-latency dispatch (send)", call, skip, p, stream, make,
                                                 LL::dispatch_send);
        }, py::arg("receive"), py::arg("call"), py::arg("skip"), py::arg("num_tokens"), py::arg("scale_bytes"),
           py::arg("num_topk"), py::arg("fp8"), py::arg("round_scale"), py::arg("ue8m0"), py::arg("x"),
           py::arg("topk_idx"), py::arg("recv_x"), py::arg("recv_scales"), py::arg("src_info"),
           py::arg("layout_range"), py::arg("recv_count"), py::arg("post") = PostArgs{0, 0, 0, 0, 0},
           py::arg("stream") = 0,
           "Enqueues the send half (receive=False) or the receive half of a low-latency dispatch; returns None "
           "at once (check() reads the error record). post: the call header, as moe_comm._cuda_host's (header "
           "0: none, the host agreed first); with one, the call number is counted in the buffer.")
        .def("combine", [](LL& l, bool receive, int64_t call, const PerRank& skip, const PerRank& num_tokens,
                           int num_topk, const PerRank& x, const PerRank& src_info, const PerRank& layout_range,
                           const PerRank& topk_idx, const PerRank& topk_weights, const PerRank& out, bool logfmt,
                           const PostArgs& post, int64_t stream) {
            const LowLatencyPost p = placed(l, post, call, HeaderKind::kCombine);
            auto make = [&](size_t i) {
                return LowLatencyCombineArgs{num_tokens.at(i), num_topk, x.ptr<const uint16_t>(i),
                                             src_info.ptr<const int32_t>(i), layout_range.ptr<const int64_t>(i),
                                             topk_idx.ptr<const int64_t>(i), topk_weights.ptr<const float>(i),
                                             out.ptr<uint16_t>(i), logfmt};
            };
            if (receive)
                l.template launch<LowLatencyCombineArgs>("low-latency combine (receive)", call, skip, p, stream, make,
                                                LL::combine_recv);
            else
                l.template launch<LowLatencyCombineArgs>("low-latency combine (send)", call, skip, p, stream, make,
                                                LL::combine_send);
        }, py::arg("receive"), py::arg("call"), py::arg("skip"), py::arg("num_tokens"), py::arg("num_topk"),
           py::arg("x"), py::arg("src_info"), py::arg("layout_range"), py::arg("topk_idx"), py::arg("topk_weights"),
           py::arg("out"), py::arg("logfmt") = false, py::arg("post") = PostArgs{0, 0, 0, 0, 0}, py::arg("stream") = 0,
           "Enqueues the send half (receive=False) or the receive half of a low-latency combine (logfmt: rows "
           "travel LogFMT-10 encoded); returns None at "
           "once (check() reads the error record).")
        .def("reject", [](LL& l, int64_t call, const PerRank& skip, const PostArgs& post, int64_t stream) {
            const LowLatencyPost p = placed(l, post, call, HeaderKind::kReject);
            if (!p.header) throw py::value_error("reject: post must hold the rejected call's header (header 0)");
            l.template launch<NoArgs>("low-latency rejection", call, skip, p, stream, [](size_t) { return NoArgs{}; },
                                      LL::reject);
        }, py::arg("call"), py::arg("skip"), py::arg("post"), py::arg("stream") = 0,
           "Enqueues call `call`, rejected here on the host: its header (post, the rejected bit set) to every "
           "rank, no rows, and this rank's half of it consumed; returns None at once.")
        .def_property_readonly("header_offsets", [](const LL& l) { return python::header_offsets(l.layout); },
                               "Where each header cell of this rank's buffer starts: [half * R + source].")
        .def("check", [](const LL& l) { return l.r.results(); },
             "None or the error record of this object's launches so far (a list per rank, emulated); read it "
             "after synchronising the stream. A record stays set, and stops this object's later launches of a "
             "call with a header, until clear() (a failed wait breaks the buffer; a MISMATCH is a verdict, "
             "which the caller clears once it has read it).")
        .def("clear", [](const LL& l) { l.r.clear(); },
             "Zeroes the error records; only while no launch of this object is in flight.");;
}

template <class IN>
void def_internode_launches(py::class_<IN>& cls) {
    cls
        .def("notify", [](IN& n, int64_t epoch, const PerRank& rows_to_rank, const PerRank& tokens_per_expert,
                          const PerRank& channel_prefix, const PerRank& rdma_channel_prefix, int64_t alignment,
                          const PerRank& recv_gbl_rank_prefix, const PerRank& recv_offset,
                          const PerRank& recv_channel_offset, const PerRank& recv_channel_count,
                          const PerRank& recv_rdma_channel_prefix, const PerRank& recv_per_expert,
                          const PerRank& num_recv, int64_t stream) {
            return n.template launch<InternodeNotifyArgs>(NormalKernel::kInternodeNotify, epoch, stream, [&](size_t i) {
                return InternodeNotifyArgs{
                    rows_to_rank.ptr<const int64_t>(i), tokens_per_expert.ptr<const int64_t>(i),
                    channel_prefix.ptr<const int64_t>(i), rdma_channel_prefix.ptr<const int64_t>(i), alignment,
                    recv_gbl_rank_prefix.ptr<int32_t>(i), recv_offset.ptr<int64_t>(i),
                    recv_channel_offset.ptr<int64_t>(i), recv_channel_count.ptr<int64_t>(i),
                    recv_rdma_channel_prefix.ptr<int64_t>(i), recv_per_expert.ptr<int64_t>(i), num_recv.ptr<int64_t>(i)};
            }, IN::notify);
        }, py::arg("epoch"), py::arg("rows_to_rank"), py::arg("tokens_per_expert"), py::arg("channel_prefix"),
           py::arg("rdma_channel_prefix"), py::arg("alignment"), py::arg("recv_gbl_rank_prefix"), py::arg("recv_offset"),
           py::arg("recv_channel_offset"), py::arg("recv_channel_count"), py::arg("recv_rdma_channel_prefix"),
           py::arg("recv_per_expert"), py::arg("num_recv"), py::arg("stream") = 0,
           "The notify kernel; its outputs in memory the host reads after it (pinned host memory).")
        .def("prologue", [](IN& n, int64_t epoch, int64_t stream) {
            return n.template launch<NoArgs>(NormalKernel::kInternodePrologue, epoch, stream, [](size_t) { return NoArgs{}; },
                                    IN::prologue);
        }, py::arg("epoch"), py::arg("stream") = 0)
        .def("dispatch", [](IN& n, const PerRank& num_tokens, const PerRank& x_bytes,
                            const PerRank& scale_bytes, int num_topk, const PerRank& x, const PerRank& scales,
                            const PerRank& topk_idx, const PerRank& topk_weights, const PerRank& is_token_in_rank,
                            const PerRank& rdma_channel_prefix, const PerRank& recv_rdma_channel_prefix,
                            const PerRank& recv_offset, const PerRank& recv_channel_offset,
                            const PerRank& recv_channel_count, const PerRank& recv_x, const PerRank& recv_scales,
                            const PerRank& recv_topk_idx, const PerRank& recv_topk_weights,
                            const PerRank& recv_src_idx, int64_t stream) {
            return n.template launch<InternodeDispatchArgs>(NormalKernel::kInternodeDispatch, 0, stream, [&](size_t i) {
                return InternodeDispatchArgs{
                    DispatchArgs{num_tokens.at(i), x_bytes.at(i), scale_bytes.at(i), num_topk, x.ptr<const uint8_t>(i),
                                 scales.ptr<const uint8_t>(i), topk_idx.ptr<const int64_t>(i),
                                 topk_weights.ptr<const float>(i), is_token_in_rank.ptr<const uint8_t>(i), nullptr,
                                 recv_offset.ptr<const int64_t>(i), recv_channel_offset.ptr<const int64_t>(i),
                                 recv_channel_count.ptr<const int64_t>(i), recv_x.ptr<uint8_t>(i),
                                 recv_scales.ptr<uint8_t>(i), recv_topk_idx.ptr<int64_t>(i),
                                 recv_topk_weights.ptr<float>(i), recv_src_idx.ptr<int32_t>(i)},
                    rdma_channel_prefix.ptr<const int64_t>(i), recv_rdma_channel_prefix.ptr<const int64_t>(i)};
            }, IN::dispatch);
        }, py::arg("num_tokens"), py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("num_topk"), py::arg("x"),
           py::arg("scales"), py::arg("topk_idx"), py::arg("topk_weights"), py::arg("is_token_in_rank"),
           py::arg("rdma_channel_prefix"), py::arg("recv_rdma_channel_prefix"), py::arg("recv_offset"),
           py::arg("recv_channel_offset"), py::arg("recv_channel_count"), py::arg("recv_x"), py::arg("recv_scales"),
           py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"), py::arg("stream") = 0)
        .def("combine", [](IN& n, const PerRank& num_tokens, int64_t hidden, int64_t x_bytes, int num_topk,
                           DType type, const PerRank& x, const PerRank& topk_weights, const PerRank& recv_offset,
                           const PerRank& recv_channel_offset, const PerRank& recv_channel_count,
                           const PerRank& recv_rdma_channel_prefix, const PerRank& forward_bits,
                           const PerRank& send_rdma_head, const PerRank& bias0, const PerRank& bias1,
                           const PerRank& out, const PerRank& out_weights, int64_t stream) {
            return n.template launch<InternodeCombineArgs>(NormalKernel::kInternodeCombine, 0, stream, [&](size_t i) {
                return InternodeCombineArgs{
                    CombineArgs{num_tokens.at(i), hidden, x_bytes, num_topk, moe_comm::cuda::python::combine_row_type(type, hidden, x_bytes), x.ptr<const uint8_t>(i),
                                topk_weights.ptr<const float>(i), recv_offset.ptr<const int64_t>(i),
                                recv_channel_offset.ptr<const int64_t>(i), recv_channel_count.ptr<const int64_t>(i),
                                nullptr, nullptr, nullptr, bias0.ptr<const uint8_t>(i), bias1.ptr<const uint8_t>(i),
                                out.ptr<uint8_t>(i), out_weights.ptr<float>(i)},
                    recv_rdma_channel_prefix.ptr<const int64_t>(i), forward_bits.ptr<const int32_t>(i),
                    send_rdma_head.ptr<const int32_t>(i)};
            }, IN::combine);
        }, py::arg("num_tokens"), py::arg("hidden"), py::arg("x_bytes"), py::arg("num_topk"), py::arg("type"),
           py::arg("x"), py::arg("topk_weights"), py::arg("recv_offset"), py::arg("recv_channel_offset"),
           py::arg("recv_channel_count"), py::arg("recv_rdma_channel_prefix"), py::arg("forward_bits"),
           py::arg("send_rdma_head"), py::arg("bias0"), py::arg("bias1"), py::arg("out"), py::arg("out_weights"),
           py::arg("stream") = 0);;
}

// A device build's part of a prepared low-latency call (csrc/cuda/python/prepared_low_latency.h) on launch object
// LL, doing natively what the Python adapter does around a launch (moe_comm/backends/cuda/device_kernels.py,
// _LowLatencyLaunches): each launch on the comm stream after the work queued so far on the caller's current
// stream; a send (or a receive while a graph is captured) returns at once, the caller's stream ordered after
// it; a receive waits for the comm stream on the host and returns the launches' record, clearing a MISMATCH
// (a verdict against the call, which the caller raises). Calls with statistics tensors are not taken: adding
// them would be kernels of their own, which the checked path runs.
template <class LL>
struct DevicePrepared {
    static constexpr bool kStats = false;
    py::object owner;  // the launch object, alive while this is
    LL* ll;
    py::object device_object_;  // the torch.device of the outputs
    cudaStream_t comm;
    int mismatch;
    py::object current_stream;  // torch._C._cuda_getCurrentRawStream: a builtin (no Python frame)
    std::shared_ptr<DeviceMemory> skip;  // [R] zeros: a prepared call leaves no rank out
    std::shared_ptr<StreamEvent> event;

    // extra: (torch.device of the outputs, the comm stream as an int, WaitOutcome.MISMATCH as an int)
    DevicePrepared(py::object kernel, const py::tuple& extra, const py::module_& torch)
        : owner(kernel), ll(kernel.cast<LL*>()) {
        if (ll->r.emulated)
            throw py::value_error("PreparedLowLatency: an emulated launch object takes no prepared calls");
        if (extra.size() != 3)
            throw py::value_error("PreparedLowLatency: extra must be (device, comm stream, MISMATCH), got " +
                                  std::to_string(extra.size()) + " values");
        device_object_ = extra[0];
        comm = stream_of(extra[1].cast<int64_t>());
        mismatch = extra[2].cast<int>();
        current_stream = torch.attr("_C").attr("_cuda_getCurrentRawStream");
        DeviceGuard on(ll->r.device);
        skip = std::make_shared<DeviceMemory>(static_cast<size_t>(ll->r.num_ranks));
        event = std::make_shared<StreamEvent>(ll->r.device);
    }

    int device() const { return ll->r.device; }
    py::object device_object() const { return device_object_; }
    const LowLatencyLayout& layout() const { return ll->layout; }

    python::PreparedError run(python::PreparedPending& p, const PostArgs& post, bool receive) {
        const cudaStream_t caller = stream_of(current_stream(device()).template cast<int64_t>());
        const LowLatencyPost placed_post =
            placed(*ll, post, p.call, p.is_dispatch ? HeaderKind::kDispatch : HeaderKind::kCombine);
        PerRank no_skip;
        no_skip.values = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(skip->get()))};
        const auto on_comm = static_cast<int64_t>(reinterpret_cast<uintptr_t>(comm));
        {
            DeviceGuard on(device());
            event->order(comm, caller);
        }
        if (p.is_dispatch)
            ll->template launch<LowLatencyDispatchArgs>(
                receive ? "low-latency dispatch (receive)" : "low-latency dispatch (send)", p.call, no_skip,
                placed_post, on_comm, [&](size_t) { return p.dispatch; },
                receive ? LL::dispatch_recv : LL::dispatch_send);
        else
            ll->template launch<LowLatencyCombineArgs>(
                receive ? "low-latency combine (receive)" : "low-latency combine (send)", p.call, no_skip, placed_post,
                on_comm, [&](size_t) { return p.combine; }, receive ? LL::combine_recv : LL::combine_send);
        if (!receive || capturing(caller)) {
            DeviceGuard on(device());
            event->order(caller, comm);
            return std::nullopt;
        }
        {
            py::gil_scoped_release unlocked;
            check(cudaStreamSynchronize(comm), "moe_comm: prepared low-latency receive");
        }
        auto record = ll->r.results().template cast<python::PreparedError>();
        if (record && std::get<0>(*record) == mismatch) ll->r.clear();
        return record;
    }
};

// Binds `PreparedLowLatency` of a device build whose launch objects are LL.
template <class LL>
void def_prepared_low_latency(py::module_& m) {
    python::def_prepared_low_latency<DevicePrepared<LL>>(
        m,
        [](py::object kernel, const py::tuple& extra, const py::module_& torch) {
            return DevicePrepared<LL>(kernel, extra, torch);
        },
        "(the outputs' torch.device, the comm stream as an int, WaitOutcome.MISMATCH as an int).");
}

}  // namespace moe_comm::cuda::device::bind
