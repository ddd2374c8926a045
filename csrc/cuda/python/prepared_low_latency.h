// A low-latency operation of the kernels prepared for one signature (moe_comm/backends/cuda/prepared.py), shared
// by the host build (moe_comm._cuda_host) and the device builds (moe_comm._cuda, moe_comm._cuda_nvshmem): its
// launch object, its call header's template, the outputs of both buffer halves (a dispatch's). Each call reads
// and checks its Python arguments here against the signature (csrc/python/tensor_args.h: anything else is "not
// taken", for the checked path), then launches: one crossing per op half. The kernels check the top-k ids and
// the handle themselves, as on the checked path.
//
// What differs between the builds is `Build`:
//   Error run(PreparedPending& p, const PostArgs& post, bool receive)   the send or receive launch of p, its record
//   int device() const              where the tensors must live: -1 the CPU, else that CUDA device
//   py::object device_object() const   the `device=` of a new output (None: the CPU)
//   const LowLatencyLayout& layout() const
//   static constexpr bool kStats    whether it adds the statistics tensors (else a call with them is not taken)
// Included by binding files only (it needs pybind11).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../../python/tensor_args.h"
#include "layout_bindings.h"

namespace moe_comm::cuda::python {

namespace py = pybind11;

using PreparedError = std::optional<std::tuple<int, int, int, int, int, int64_t, int64_t>>;

// A dispatch's outputs on one buffer half, as addresses (recv_scales: the [E_loc, S, R * M] storage, or 0).
struct PreparedOutputs {
    int64_t recv_x, recv_scales, src_info, layout_range, recv_count;
};

// One call's launch arguments, held from its send to its receive.
struct PreparedPending {
    bool is_dispatch = false;
    LowLatencyDispatchArgs dispatch{};
    LowLatencyCombineArgs combine{};
    int64_t call = 0;
    int32_t* recv_stats = nullptr;
    int64_t* wait_stats = nullptr;
    py::object held;  // the tensors the launches read, alive until the receive
};

template <class Build>
class PreparedLowLatency {
  public:
    PreparedLowLatency(Build build, std::vector<uint8_t> header, int call_word, const PostArgs& post,
                       int64_t num_experts, int num_topk, const CastFormat& format,
                       const std::vector<PreparedOutputs>& halves, py::object key, const py::module_& torch)
        : build_(std::move(build)), torch_(torch), key_(std::move(key)), header_(std::move(header)),
          call_word_(call_word), num_topk_(num_topk), format_(format) {
        const LowLatencyLayout& layout = build_.layout();
        if (call_word < 0 || 8 * (int64_t{call_word} + 1) > static_cast<int64_t>(header_.size()))
            throw py::value_error("PreparedLowLatency: call word " + std::to_string(call_word) + " outside the " +
                                  std::to_string(header_.size()) + "-byte header");
        post_ = {reinterpret_cast<int64_t>(header_.data()), static_cast<int64_t>(header_.size()), std::get<2>(post),
                 std::get<3>(post), std::get<4>(post)};
        post_of(post_, layout);  // the header fits the cells
        const int R = layout.num_ranks;
        local_ = layout.experts_per_rank;
        if (num_experts != int64_t{local_} * R)
            throw py::value_error("PreparedLowLatency: num_experts " + std::to_string(num_experts) + " for " +
                                  std::to_string(local_) + " local experts on " + std::to_string(R) + " ranks");
        if (!halves.empty() && halves.size() != 2)
            throw py::value_error("PreparedLowLatency: need both halves' outputs");
        for (size_t h = 0; h < halves.size(); ++h) outputs_[h] = halves[h];
        scale_bytes_ = format.fp8 ? 4 * (layout.hidden / moe_comm::kFp8Group / (format.ue8m0 ? 4 : 1)) : 0;
    }

    // (taken, the record of the launches that ran: the send's if it failed, else with `receive` the receive's)
    std::tuple<bool, PreparedError> dispatch(py::handle key, py::handle x, py::handle topk_idx, py::handle recv_stats,
                                             py::handle wait_stats, int64_t number, int64_t call, bool receive) {
        const auto& t = torch_;
        const int device = build_.device();
        const int64_t M = build_.layout().max_tokens, H = build_.layout().hidden;
        moe_comm::python::TensorArg xa, ta;
        PreparedPending p;
        if (!moe_comm::python::same_key(key, key_) ||
            !moe_comm::python::read_tensor(x, t, t.bfloat16, 2, &xa, device) || xa.shape[1] != H || xa.shape[0] > M ||
            !xa.contiguous() ||
            !moe_comm::python::read_tensor(topk_idx, t, t.int64, 2, &ta, device) || ta.shape[0] != xa.shape[0] ||
            ta.shape[1] != num_topk_ || !ta.contiguous() || !stats(recv_stats, t.int32, local_, &p.recv_stats) ||
            !stats(wait_stats, t.int64, build_.layout().num_ranks, &p.wait_stats) || outputs_[0].recv_x == 0)
            return {false, std::nullopt};
        const PreparedOutputs& o = outputs_[(call - 1) & 1];
        p.dispatch = {xa.shape[0], scale_bytes_, num_topk_, format_, reinterpret_cast<const uint16_t*>(xa.data),
                      reinterpret_cast<const int64_t*>(ta.data), ptr<uint8_t>(o.recv_x), ptr<uint8_t>(o.recv_scales),
                      ptr<int32_t>(o.src_info), ptr<int64_t>(o.layout_range), ptr<int32_t>(o.recv_count)};
        p.is_dispatch = true;
        p.held = py::make_tuple(x, topk_idx, recv_stats, wait_stats);
        return {true, launch(std::move(p), number, call, receive)};
    }

    // (taken, record as dispatch's, out: the given or a new [T, hidden] bf16 tensor)
    std::tuple<bool, PreparedError, py::object> combine(py::handle key, py::handle x, py::handle topk_idx,
                                                        py::handle topk_weights, py::handle handle, py::handle out,
                                                        py::handle wait_stats, int64_t number, int64_t call,
                                                        bool receive) {
        const auto& t = torch_;
        const int device = build_.device();
        const int64_t R = build_.layout().num_ranks, M = build_.layout().max_tokens, H = build_.layout().hidden;
        const std::tuple<bool, PreparedError, py::object> not_taken{false, std::nullopt, py::none()};
        moe_comm::python::TensorArg xa, src, range, ta, wa, oa;
        PreparedPending p;
        if (!moe_comm::python::same_key(key, key_) || !PyTuple_CheckExact(handle.ptr()) ||
            PyTuple_GET_SIZE(handle.ptr()) != 5 || !moe_comm::python::read_tensor(x, t, t.bfloat16, 3, &xa, device) ||
            xa.shape[0] != local_ || xa.shape[1] != R * M || xa.shape[2] != H || !xa.contiguous() ||
            !moe_comm::python::read_tensor(PyTuple_GET_ITEM(handle.ptr(), 0), t, t.int32, 2, &src, device) ||
            src.shape[0] != local_ || src.shape[1] != R * M || !src.contiguous() ||
            !moe_comm::python::read_tensor(PyTuple_GET_ITEM(handle.ptr(), 1), t, t.int64, 2, &range, device) ||
            range.shape[0] != local_ || range.shape[1] != R || !range.contiguous() ||
            !moe_comm::python::read_tensor(topk_idx, t, t.int64, 2, &ta, device) || ta.shape[1] != num_topk_ ||
            ta.shape[0] > M || !ta.contiguous() ||
            !moe_comm::python::read_tensor(topk_weights, t, t.float32, 2, &wa, device) || wa.shape[0] != ta.shape[0] ||
            wa.shape[1] != num_topk_ || !wa.contiguous() || !stats(wait_stats, t.int64, R, &p.wait_stats))
            return not_taken;
        py::object result = py::reinterpret_borrow<py::object>(out);
        if (out.is_none()) {
            const py::object at = build_.device_object();
            result = at.is_none() ? t.empty(py::make_tuple(ta.shape[0], H), py::arg("dtype") = t.bfloat16)
                                  : t.empty(py::make_tuple(ta.shape[0], H), py::arg("dtype") = t.bfloat16,
                                            py::arg("device") = at);
        }
        if (!moe_comm::python::read_tensor(result, t, t.bfloat16, 2, &oa, device) || oa.shape[0] != ta.shape[0] ||
            oa.shape[1] != H || !oa.contiguous())
            return not_taken;
        p.combine = {ta.shape[0], num_topk_, reinterpret_cast<const uint16_t*>(xa.data),
                     reinterpret_cast<const int32_t*>(src.data), reinterpret_cast<const int64_t*>(range.data),
                     reinterpret_cast<const int64_t*>(ta.data), reinterpret_cast<const float*>(wa.data),
                     reinterpret_cast<uint16_t*>(oa.data), false};
        p.held = py::make_tuple(x, handle, topk_idx, topk_weights, result, wait_stats);
        return {true, launch(std::move(p), number, call, receive), result};
    }

    // The receive launch of the call last sent on `half` (its record).
    PreparedError receive(int half) {
        if (half != 0 && half != 1) throw py::value_error("PreparedLowLatency: half must be 0 or 1");
        PreparedPending& p = pending_[half];
        PreparedError record = build_.run(p, post_, true);
        if (!record) p.held = py::object();
        return record;
    }

  private:
    template <class T>
    static T* ptr(int64_t p) {
        return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
    }

    template <class T>
    bool stats(py::handle h, const py::object& dtype, int64_t size, T** out) const {
        *out = nullptr;
        if (h.is_none()) return true;
        moe_comm::python::TensorArg a;
        if (!Build::kStats || !moe_comm::python::read_tensor(h, torch_, dtype, 1, &a, build_.device()) ||
            a.shape[0] != size || !a.contiguous())
            return false;
        *out = reinterpret_cast<T*>(a.data);
        return true;
    }

    PreparedError launch(PreparedPending p, int64_t number, int64_t call, bool receive) {
        std::memcpy(header_.data() + 8 * call_word_, &number, 8);
        p.call = call;
        PreparedPending& slot = pending_[(call - 1) & 1];
        slot = std::move(p);
        PreparedError record = build_.run(slot, post_, false);
        if (!record && receive) record = build_.run(slot, post_, true);
        if (receive && !record) slot.held = py::object();
        return record;
    }

    Build build_;
    moe_comm::python::TorchObjects torch_;
    py::object key_;
    std::vector<uint8_t> header_;
    int call_word_;
    PostArgs post_;
    int32_t num_topk_;
    CastFormat format_;
    int32_t local_ = 0;
    int64_t scale_bytes_ = 0;
    PreparedOutputs outputs_[2] = {};
    PreparedPending pending_[2];
};

// Binds PreparedLowLatency<Build> as `PreparedLowLatency` of module `m`; `make(kernel, extra, torch)` builds the
// Build of a launch object `kernel` (and the build's trailing constructor arguments `extra`, a tuple).
template <class Build, class Make>
void def_prepared_low_latency(py::module_& m, Make make, const char* extra_doc) {
    using Prepared = PreparedLowLatency<Build>;
    py::class_<Prepared>(m, "PreparedLowLatency", "A low-latency dispatch or combine prepared for one signature.")
        .def(py::init([make](py::object kernel, int64_t header, int64_t header_bytes, int call_word,
                             const PostArgs& post, int64_t num_experts, int num_topk, bool fp8, bool round_scale,
                             bool ue8m0, const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>&
                                             halves,
                             py::object key, const py::module_& torch, py::tuple extra) {
                 std::vector<PreparedOutputs> outputs;
                 for (const auto& [x, scales, src, range, count] : halves)
                     outputs.push_back({x, scales, src, range, count});
                 if (header_bytes < 0) throw py::value_error("PreparedLowLatency: header_bytes must be >= 0");
                 const auto* bytes = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(header));
                 return Prepared(make(kernel, extra, torch), std::vector<uint8_t>(bytes, bytes + header_bytes),
                                 call_word, post, num_experts, num_topk, CastFormat{fp8, round_scale, ue8m0}, outputs,
                                 std::move(key), torch);
             }),
             py::arg("kernel"), py::arg("header"), py::arg("header_bytes"), py::arg("call_word"), py::arg("post"),
             py::arg("num_experts"), py::arg("num_topk"), py::arg("fp8"), py::arg("round_scale"), py::arg("ue8m0"),
             py::arg("halves"), py::arg("key"), py::arg("torch"), py::arg("extra") = py::tuple(),
             (std::string("kernel: the launch object (kept alive); header, header_bytes: the call header with call "
                          "number 0, copied (the call's number is written into word call_word); post: as a "
                          "launch's, its address unused; halves: a dispatch's outputs per buffer half (recv_x, the "
                          "scales' [E_loc, S, R * M] storage or 0, src_info, layout_range, recv_count addresses), "
                          "none for a combine; key: the signature every call must carry exactly; extra: ") +
              extra_doc).c_str())
        .def("dispatch", &Prepared::dispatch, py::arg("key"), py::arg("x"), py::arg("topk_idx"), py::arg("recv_stats"),
             py::arg("wait_stats"), py::arg("number"), py::arg("call"), py::arg("receive"),
             "(taken, error record or None) of low-latency call `call` (the Buffer's call `number`).")
        .def("combine", &Prepared::combine, py::arg("key"), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("handle"), py::arg("out"), py::arg("wait_stats"), py::arg("number"), py::arg("call"),
             py::arg("receive"), "(taken, error record or None, out).")
        .def("receive", &Prepared::receive, py::arg("half"),
             "The receive launch of the call last sent on `half`: its error record or None.");
}

}  // namespace moe_comm::cuda::python
