// moe_comm._C's prepared low-latency calls (csrc/cpu/prepared.h): each call's Python arguments are read and
// checked here, on the C side, against what the call was prepared for, so the Python side of a prepared
// call is a key lookup and this one crossing per op half (moe_comm/backends/portable/prepared.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../cpu/prepared.h"
#include "../cpu/prepared_normal.h"
#include "tensor_args.h"

namespace py = pybind11;
namespace cpu = moe_comm::cpu;
using moe_comm::python::read_tensor;
using moe_comm::python::same_key;
using moe_comm::python::TensorArg;
using moe_comm::python::TorchObjects;

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

template <typename T>
std::vector<T*> pointers(const std::vector<std::uintptr_t>& addresses) {
    std::vector<T*> out;
    out.reserve(addresses.size());
    for (std::uintptr_t a : addresses) out.push_back(ptr<T>(a));
    return out;
}

int check_half(int half) {
    if (half != 0 && half != 1)
        throw py::value_error("prepared call: half must be 0 or 1, got " + std::to_string(half));
    return half;
}

// The optional stats tensor of a call: null for None, else a contiguous [size] tensor of `dtype`, or false.
template <typename T>
bool stats_arg(py::handle stats, const TorchObjects& torch, const py::object& dtype, int64_t size, T** out) {
    *out = nullptr;
    if (stats.is_none()) return true;
    TensorArg a;
    if (!read_tensor(stats, torch, dtype, 1, &a) || a.shape[0] != size || !a.contiguous()) return false;
    *out = reinterpret_cast<T*>(a.data);
    return true;
}

// What both prepared ops hold besides their core: torch's objects, the signature, the tensors a pending
// receive reads (kept alive until it ran).
struct Common {
    TorchObjects torch;
    py::object key;
    py::object held[2];

    Common(const py::module_& torch_module, py::object signature) : torch(torch_module), key(std::move(signature)) {}
};

// What a prepared low-latency dispatch and combine share: their core's halves run with the GIL released, the
// tensors a pending receive reads kept alive until it ran.
template <class Core>
class LowLatencyCall {
  public:
    int receive(int half) {
        check_half(half);
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->receive(half);
        }
        if (status == cpu::PreparedStatus::kOk) common_.held[half] = py::object();
        return static_cast<int>(status);
    }

    std::tuple<int64_t, moe_comm::WaitOutcome> failure() const {
        return {core_->failure().index, core_->failure().outcome};
    }

  protected:
    LowLatencyCall(const py::module_& torch, py::object key) : common_(torch, std::move(key)) {}

    // The send half of call `number` on taken inputs (and with `receive` its receive half); `held`: what a receive
    // still to run reads.
    template <class Inputs>
    cpu::PreparedStatus run(const Inputs& in, int64_t number, int64_t seq, int slot, int half, bool receive,
                            py::object held) {
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->send(in, number, seq, slot, half);
            if (status == cpu::PreparedStatus::kOk && receive) status = core_->receive(half);
        }
        if (status != cpu::PreparedStatus::kNotTaken)
            common_.held[half] = receive && status == cpu::PreparedStatus::kOk ? py::object() : std::move(held);
        return status;
    }

    Common common_;
    std::unique_ptr<Core> core_;
};

class DispatchCall : public LowLatencyCall<cpu::PreparedDispatch> {
  public:
    DispatchCall(cpu::ShmPostPlan plan, cpu::DispatchGeometry geometry, const std::vector<py::tuple>& halves,
                 py::object key, const py::module_& torch)
        : LowLatencyCall(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks) {
        if (halves.size() != 2) throw py::value_error("PreparedDispatch: need the outputs of both halves");
        cpu::DispatchHalf h[2];
        for (int i = 0; i < 2; ++i) {
            const auto strides = halves[i][2].cast<std::tuple<int64_t, int64_t, int64_t>>();
            auto at = [&](int j) { return halves[i][j].cast<std::uintptr_t>(); };
            h[i] = {ptr<uint8_t>(at(0)), ptr<uint8_t>(at(1)),
                    {std::get<0>(strides), std::get<1>(strides), std::get<2>(strides)},
                    ptr<int32_t>(at(3)), ptr<int64_t>(at(4)), ptr<int32_t>(at(5))};
        }
        core_ = std::make_unique<cpu::PreparedDispatch>(std::move(plan), geometry, h);
    }

    int send(py::handle key, py::handle x, py::handle topk_idx, py::handle recv_stats, py::handle wait_stats,
             int64_t number, int64_t seq, int slot, int half, bool receive) {
        check_half(half);
        check_half(slot);
        const auto not_taken = static_cast<int>(cpu::PreparedStatus::kNotTaken);
        const TorchObjects& torch = common_.torch;
        TensorArg xa, ta;
        cpu::DispatchInputs in;
        const int64_t local = g_.num_experts / num_ranks_;
        if (!same_key(key, common_.key) || !read_tensor(x, torch, torch.bfloat16, 2, &xa) ||
            xa.shape[1] != g_.hidden || !xa.contiguous() || !read_tensor(topk_idx, torch, torch.int64, 2, &ta) ||
            ta.shape[0] != xa.shape[0] || ta.shape[1] != g_.num_topk || !ta.contiguous() ||
            !stats_arg(recv_stats, torch, torch.int32, local, &in.recv_stats) ||
            !stats_arg(wait_stats, torch, torch.int64, num_ranks_, &in.wait_stats))
            return not_taken;
        in.x = reinterpret_cast<const uint16_t*>(xa.data);
        in.num_tokens = xa.shape[0];
        in.x_row_stride = g_.hidden;
        in.topk_idx = reinterpret_cast<const int64_t*>(ta.data);
        return static_cast<int>(run(in, number, seq, slot, half, receive, py::make_tuple(recv_stats, wait_stats)));
    }

  private:
    cpu::DispatchGeometry g_;
    int64_t num_ranks_;
};

class CombineCall : public LowLatencyCall<cpu::PreparedCombine> {
  public:
    CombineCall(cpu::ShmPostPlan plan, cpu::CombineGeometry geometry, py::object key, const py::module_& torch)
        : LowLatencyCall(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks) {
        core_ = std::make_unique<cpu::PreparedCombine>(std::move(plan), geometry);
    }

    // (status, out): out is the given or a new [T, hidden] bf16 tensor when the call was taken.
    std::tuple<int, py::object> send(py::handle key, py::handle x, py::handle topk_idx, py::handle topk_weights,
                                     py::handle handle, py::handle out, py::handle wait_stats, int64_t number,
                                     int64_t seq, int slot, int half, bool receive) {
        check_half(half);
        check_half(slot);
        const std::tuple<int, py::object> not_taken{static_cast<int>(cpu::PreparedStatus::kNotTaken), py::none()};
        const TorchObjects& torch = common_.torch;
        const int64_t R = num_ranks_, local = g_.num_experts / R, rows = R * g_.num_max_tokens;
        if (!same_key(key, common_.key) || !PyTuple_CheckExact(handle.ptr()) || PyTuple_GET_SIZE(handle.ptr()) != 5)
            return not_taken;
        TensorArg xa, src, range, ta, wa, oa;
        cpu::CombineInputs in;
        if (!read_tensor(x, torch, torch.bfloat16, 3, &xa) || xa.shape[0] != local || xa.shape[1] != rows ||
            xa.shape[2] != g_.hidden || !xa.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(handle.ptr(), 0), torch, torch.int32, 2, &src) || src.shape[0] != local ||
            src.shape[1] != rows || !src.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(handle.ptr(), 1), torch, torch.int64, 2, &range) ||
            range.shape[0] != local || range.shape[1] != R || !range.contiguous() ||
            !read_tensor(topk_idx, torch, torch.int64, 2, &ta) || ta.shape[1] != g_.num_topk || !ta.contiguous() ||
            ta.shape[0] > g_.num_max_tokens || !read_tensor(topk_weights, torch, torch.float32, 2, &wa) ||
            wa.shape[0] != ta.shape[0] || wa.shape[1] != g_.num_topk || !wa.contiguous() ||
            !stats_arg(wait_stats, torch, torch.int64, R, &in.wait_stats))
            return not_taken;
        const int64_t T = ta.shape[0];
        py::object result = py::reinterpret_borrow<py::object>(out);
        if (out.is_none()) result = torch.empty(py::make_tuple(T, g_.hidden), py::arg("dtype") = torch.bfloat16);
        if (!read_tensor(result, torch, torch.bfloat16, 2, &oa) || oa.shape[0] != T || oa.shape[1] != g_.hidden ||
            !oa.contiguous())
            return not_taken;
        in.x = reinterpret_cast<const uint16_t*>(xa.data);
        in.src_info = reinterpret_cast<const int32_t*>(src.data);
        in.layout_range = reinterpret_cast<const int64_t*>(range.data);
        in.topk_idx = reinterpret_cast<const int64_t*>(ta.data);
        in.topk_weights = reinterpret_cast<const float*>(wa.data);
        in.num_tokens = T;
        in.out = reinterpret_cast<uint16_t*>(oa.data);
        const cpu::PreparedStatus status =
            run(in, number, seq, slot, half, receive, py::make_tuple(topk_idx, topk_weights, result, wait_stats));
        if (status == cpu::PreparedStatus::kNotTaken) return not_taken;
        return {static_cast<int>(status), result};
    }

  private:
    cpu::CombineGeometry g_;
    int64_t num_ranks_;
};

// A tensor argument as a record field (its rows and columns in bytes), or false.
bool field_arg(py::handle t, const TorchObjects& torch, const py::object& dtype, int64_t rows, int64_t cols,
               int64_t elem, int64_t offset, cpu::RowField* out) {
    TensorArg a;
    if (!read_tensor(t, torch, dtype, 2, &a) || a.shape[0] != rows || a.shape[1] != cols) return false;
    *out = {a.data, a.stride[0] * elem, a.stride[1] * elem, elem, cols, offset};
    return true;
}

// A normal-mode dispatch prepared on the shm transport: begin() (the handshake and the count exchange's
// post), then, once the caller made the outputs (their sizes follow from the handshake), finish().
class NormalDispatchCall {
  public:
    NormalDispatchCall(cpu::ShmPostPlan plan, cpu::NormalDispatchGeometry geometry, int64_t hidden, py::object x_dtype,
                       int64_t x_offset, py::object scales_dtype, int64_t num_scales, int64_t scales_offset,
                       py::object key, const py::module_& torch)
        : common_(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks), hidden_(hidden),
          x_dtype_(std::move(x_dtype)), scales_dtype_(std::move(scales_dtype)), x_offset_(x_offset),
          num_scales_(num_scales), scales_offset_(scales_offset),
          core_(std::make_unique<cpu::PreparedNormalDispatch>(std::move(plan), geometry)) {}

    int begin(py::handle key, py::handle x, py::handle scales, py::handle topk_idx, py::handle topk_weights,
              py::handle per_rank, py::handle in_rank, py::handle per_expert, int64_t number, int64_t seq_header,
              int64_t seq_meta, int64_t seq_data) {
        const auto not_taken = static_cast<int>(cpu::PreparedStatus::kNotTaken);
        const TorchObjects& t = common_.torch;
        const int64_t R = num_ranks_, K = g_.num_topk;
        TensorArg xa, ranks, experts, in, ta, wa;
        cpu::NormalDispatchInputs args;
        if (!same_key(key, common_.key) || !read_tensor(x, t, x_dtype_, 2, &xa) || xa.shape[1] != hidden_ ||
            xa.stride[1] != 1 || !read_tensor(in_rank, t, t.boolean, 2, &in) || in.shape[0] != xa.shape[0] ||
            in.shape[1] != R || !in.contiguous() || !read_tensor(per_rank, t, t.int32, 1, &ranks) ||
            ranks.shape[0] != R || !ranks.contiguous() || !read_tensor(per_expert, t, t.int32, 1, &experts) ||
            experts.shape[0] != g_.num_experts || !experts.contiguous())
            return not_taken;
        const int64_t T = xa.shape[0], x_elem = element_size(x_dtype_);
        args.x = {xa.data, xa.stride[0] * x_elem, x_elem, x_elem, hidden_, x_offset_};
        if (!scales_dtype_.is_none() &&
            !field_arg(scales, t, scales_dtype_, T, num_scales_, 4, scales_offset_, &args.scales))
            return not_taken;
        if (K && (!read_tensor(topk_idx, t, t.int64, 2, &ta) || ta.shape[0] != T || ta.shape[1] != K ||
                  !ta.contiguous() || !read_tensor(topk_weights, t, t.float32, 2, &wa) || wa.shape[0] != T ||
                  wa.shape[1] != K || !wa.contiguous()))
            return not_taken;
        args.topk_idx = K ? reinterpret_cast<const int64_t*>(ta.data) : nullptr;
        args.topk_weights = K ? reinterpret_cast<const float*>(wa.data) : nullptr;
        args.in_rank = in.data;
        args.per_rank = reinterpret_cast<const int32_t*>(ranks.data);
        args.per_expert = reinterpret_cast<const int32_t*>(experts.data);
        args.num_tokens = T;
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->begin(args, number, seq_header, seq_meta, seq_data);
        }
        if (status != cpu::PreparedStatus::kNotTaken)
            common_.held[0] = py::make_tuple(x, scales, topk_idx, topk_weights, in_rank);
        return static_cast<int>(status);
    }

    int finish(py::handle recv_x, py::handle recv_scales, py::handle recv_topk_idx, py::handle recv_topk_weights,
               py::handle recv_src_idx, py::handle rank_prefix, py::handle channel_prefix,
               py::handle recv_channel_prefix, py::handle send_head) {
        const TorchObjects& t = common_.torch;
        const int64_t R = num_ranks_, C = g_.num_channels, K = g_.num_topk;
        TensorArg x, src, prefix, chan, recv_chan, head, ti, tw;
        cpu::NormalDispatchOutputs out;
        const int64_t x_elem = element_size(x_dtype_);
        if (!read_tensor(recv_x, t, x_dtype_, 2, &x) || x.shape[1] != hidden_ || !x.contiguous() ||
            !read_tensor(recv_src_idx, t, t.int32, 1, &src) || src.shape[0] != x.shape[0] ||
            !read_tensor(rank_prefix, t, t.int32, 2, &prefix) || prefix.shape[0] != R || prefix.shape[1] != R ||
            !read_tensor(channel_prefix, t, t.int32, 2, &chan) || chan.shape[0] != R || chan.shape[1] != C ||
            !read_tensor(recv_channel_prefix, t, t.int32, 2, &recv_chan) || recv_chan.shape[0] != R ||
            recv_chan.shape[1] != C || !read_tensor(send_head, t, t.int32, 2, &head) || head.shape[1] != R)
            throw py::value_error("PreparedNormalDispatch.finish: outputs of other shapes than begin's call needs");
        const int64_t rows = x.shape[0];
        out.x = {x.data, hidden_ * x_elem, x_elem, x_elem, hidden_, x_offset_};
        if (!scales_dtype_.is_none() &&
            !field_arg(recv_scales, t, scales_dtype_, rows, num_scales_, 4, scales_offset_, &out.scales))
            throw py::value_error("PreparedNormalDispatch.finish: recv_scales");
        if (K && (!read_tensor(recv_topk_idx, t, t.int64, 2, &ti) || ti.shape[0] != rows || ti.shape[1] != K ||
                  !read_tensor(recv_topk_weights, t, t.float32, 2, &tw) || tw.shape[0] != rows || tw.shape[1] != K))
            throw py::value_error("PreparedNormalDispatch.finish: recv_topk_idx, recv_topk_weights");
        out.topk_idx = K ? reinterpret_cast<int64_t*>(ti.data) : nullptr;
        out.topk_weights = K ? reinterpret_cast<float*>(tw.data) : nullptr;
        out.src_idx = reinterpret_cast<int32_t*>(src.data);
        out.rows = rows;
        out.rank_prefix = reinterpret_cast<int32_t*>(prefix.data);
        out.channel_prefix = reinterpret_cast<int32_t*>(chan.data);
        out.recv_channel_prefix = reinterpret_cast<int32_t*>(recv_chan.data);
        out.send_head = reinterpret_cast<int32_t*>(head.data);
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->finish(out);
        }
        common_.held[0] = py::object();
        return static_cast<int>(status);
    }

    void refresh(const cpu::ShmPostPlan& plan) { core_->refresh_data(plan); }
    int64_t num_recv() const { return core_->num_recv(); }
    std::vector<int64_t> per_expert() const { return core_->per_expert(); }
    std::tuple<int64_t, moe_comm::WaitOutcome, int> failure() const {
        return {core_->failure().index, core_->failure().outcome, static_cast<int>(core_->round().round)};
    }

  private:
    static int64_t element_size(const py::object& dtype) { return dtype.attr("itemsize").cast<int64_t>(); }

    Common common_;
    cpu::NormalDispatchGeometry g_;
    int64_t num_ranks_, hidden_;
    py::object x_dtype_, scales_dtype_;
    int64_t x_offset_, num_scales_, scales_offset_;
    std::unique_ptr<cpu::PreparedNormalDispatch> core_;
};

// A normal-mode combine prepared on the shm transport: begin() (the handshake), finish() (the rows and the sum).
class NormalCombineCall {
  public:
    NormalCombineCall(cpu::ShmPostPlan plan, cpu::NormalCombineGeometry geometry, py::object x_dtype, py::object key,
                      const py::module_& torch)
        : common_(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks), x_dtype_(std::move(x_dtype)),
          core_(std::make_unique<cpu::PreparedNormalCombine>(std::move(plan), geometry)) {}

    int begin(py::handle key, py::handle x, py::handle handle, py::handle topk_weights, py::handle bias0,
              py::handle bias1, int64_t number, int64_t seq_header, int64_t seq_data) {
        const auto not_taken = static_cast<int>(cpu::PreparedStatus::kNotTaken);
        const TorchObjects& t = common_.torch;
        const int64_t R = num_ranks_, K = g_.num_topk, H = g_.hidden;
        if (!same_key(key, common_.key) || !PyTuple_CheckExact(handle.ptr()) || PyTuple_GET_SIZE(handle.ptr()) != 6)
            return not_taken;
        TensorArg xa, prefix, src, in, head, wa, b0, b1;
        PyObject* h = handle.ptr();
        if (!read_tensor(x, t, x_dtype_, 2, &xa) || xa.shape[1] != H || !xa.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(h, 0), t, t.int32, 2, &prefix) || prefix.shape[0] != R ||
            prefix.shape[1] != R || !prefix.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(h, 3), t, t.int32, 1, &src) || !src.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(h, 4), t, t.boolean, 2, &in) || in.shape[1] != R || !in.contiguous() ||
            !read_tensor(PyTuple_GET_ITEM(h, 5), t, t.int32, 2, &head) || head.shape[0] != in.shape[0] ||
            head.shape[1] != R || !head.contiguous())
            return not_taken;
        const int64_t T = in.shape[0];
        if (K && (!read_tensor(topk_weights, t, t.float32, 2, &wa) || wa.shape[0] != xa.shape[0] ||
                  wa.shape[1] != K || !wa.contiguous()))
            return not_taken;
        for (auto [bias, arg] : {std::pair{bias0, &b0}, std::pair{bias1, &b1}})
            if (!bias.is_none() && (!read_tensor(bias, t, x_dtype_, 2, arg) || arg->shape[0] != T ||
                                    arg->shape[1] != H || !arg->contiguous()))
                return not_taken;
        cpu::NormalCombineInputs args;
        args.x = xa.data;
        args.rows = xa.shape[0];
        args.topk_weights = K ? reinterpret_cast<const float*>(wa.data) : nullptr;
        args.bias0 = bias0.is_none() ? nullptr : b0.data;
        args.bias1 = bias1.is_none() ? nullptr : b1.data;
        args.rank_prefix = reinterpret_cast<const int32_t*>(prefix.data);
        args.recv_src_idx = reinterpret_cast<const int32_t*>(src.data);
        args.src_rows = src.shape[0];
        args.in_rank = in.data;
        args.send_head = reinterpret_cast<const int32_t*>(head.data);
        args.num_tokens = T;
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->begin(args, number, seq_header, seq_data);
        }
        if (status != cpu::PreparedStatus::kNotTaken)
            common_.held[0] = py::make_tuple(x, handle, topk_weights, bias0, bias1);
        return static_cast<int>(status);
    }

    int finish(py::handle out, py::handle out_weights) {
        const TorchObjects& t = common_.torch;
        TensorArg oa, owa;
        if (!read_tensor(out, t, x_dtype_, 2, &oa) || oa.shape[1] != g_.hidden || !oa.contiguous() ||
            (g_.num_topk && (!read_tensor(out_weights, t, t.float32, 2, &owa) || owa.shape[0] != oa.shape[0] ||
                             owa.shape[1] != g_.num_topk || !owa.contiguous())))
            throw py::value_error("PreparedNormalCombine.finish: outputs of other shapes than begin's call needs");
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->finish(oa.data, g_.num_topk ? reinterpret_cast<float*>(owa.data) : nullptr);
        }
        common_.held[0] = py::object();
        return static_cast<int>(status);
    }

    void refresh(const cpu::ShmPostPlan& plan) { core_->refresh_data(plan); }
    int64_t need() const { return core_->need(); }
    std::tuple<int64_t, moe_comm::WaitOutcome, int> failure() const {
        return {core_->failure().index, core_->failure().outcome, static_cast<int>(core_->round().round)};
    }

  private:
    Common common_;
    cpu::NormalCombineGeometry g_;
    int64_t num_ranks_;
    py::object x_dtype_;
    std::unique_ptr<cpu::PreparedNormalCombine> core_;
};

}  // namespace

void def_prepared(py::module_& m) {
    py::enum_<cpu::PreparedStatus>(m, "PreparedStatus", "How a prepared call's half ended (csrc/cpu/prepared.h).")
        .value("OK", cpu::PreparedStatus::kOk)
        .value("NOT_TAKEN", cpu::PreparedStatus::kNotTaken)
        .value("POST_FAILED", cpu::PreparedStatus::kPostFailed)
        .value("WAIT_FAILED", cpu::PreparedStatus::kWaitFailed)
        .value("DISAGREE", cpu::PreparedStatus::kDisagree)
        .value("GROW", cpu::PreparedStatus::kGrow);

    py::class_<cpu::ShmPostPlan>(m, "ShmPostPlan", "Where a prepared call's posts go (csrc/cpu/prepared.h).")
        .def(py::init<>())
        .def_readwrite("num_ranks", &cpu::ShmPostPlan::num_ranks)
        .def_readwrite("me", &cpu::ShmPostPlan::me)
        .def_readwrite("timeout_s", &cpu::ShmPostPlan::timeout_s)
        .def_readwrite("slot_bytes", &cpu::ShmPostPlan::slot_bytes)
        .def_readwrite("pids", &cpu::ShmPostPlan::pids)
        .def_readwrite("header_bytes", &cpu::ShmPostPlan::header_bytes)
        .def_readwrite("rows_at", &cpu::ShmPostPlan::rows_at)
        .def_readwrite("room", &cpu::ShmPostPlan::room)
        .def_readwrite("record_bytes", &cpu::ShmPostPlan::record_bytes)
        .def_readwrite("call_word", &cpu::ShmPostPlan::call_word)
        .def_readwrite("rejected_word", &cpu::ShmPostPlan::rejected_word)
        .def_readwrite("per_rank_word", &cpu::ShmPostPlan::per_rank_word)
        .def_readwrite("compare", &cpu::ShmPostPlan::compare)
        .def_readwrite("num_threads", &cpu::ShmPostPlan::num_threads)
        .def(
            "set_header", [](cpu::ShmPostPlan& p, std::uintptr_t header, int64_t nbytes) {
                if (nbytes < 0) throw py::value_error("set_header: nbytes must be >= 0");
                const auto* bytes = ptr<const uint8_t>(header);
                p.header.assign(bytes, bytes + nbytes);
            },
            py::arg("header"), py::arg("nbytes"),
            "Copies the header template (call_header.encode of the call's vector: its address and size).")
        .def(
            "set_slot",
            [](cpu::ShmPostPlan& p, int slot, const std::vector<std::uintptr_t>& slots,
               const std::vector<std::uintptr_t>& consumed, const std::vector<std::uintptr_t>& arrived,
               const std::vector<std::uintptr_t>& mine) {
                check_half(slot);
                p.slots[slot] = pointers<uint8_t>(slots);
                p.consumed[slot] = pointers<int64_t>(consumed);
                p.arrived[slot] = pointers<int64_t>(arrived);
                p.mine[slot] = pointers<int64_t>(mine);
            },
            py::arg("slot"), py::arg("slots"), py::arg("consumed"), py::arg("arrived"), py::arg("mine"),
            "Data slot `slot`'s addresses per rank: its start, its consumed flag, its arrived flag for this rank's "
            "rows; and this rank's arrived flags per source.")
        .def_readwrite("cell_bytes", &cpu::ShmPostPlan::cell_bytes)
        .def(
            "set_meta_slot",
            [](cpu::ShmPostPlan& p, int slot, const std::vector<std::uintptr_t>& cells,
               const std::vector<std::uintptr_t>& arrived, const std::vector<std::uintptr_t>& consumed,
               const std::vector<std::uintptr_t>& mine, const std::vector<std::uintptr_t>& mine_arrived) {
                check_half(slot);
                p.meta_cells[slot] = pointers<uint8_t>(cells);
                p.meta_arrived[slot] = pointers<int64_t>(arrived);
                p.meta_consumed[slot] = pointers<int64_t>(consumed);
                const auto own = pointers<uint8_t>(mine);
                p.meta_mine[slot].assign(own.begin(), own.end());
                p.meta_mine_arrived[slot] = pointers<int64_t>(mine_arrived);
            },
            py::arg("slot"), py::arg("cells"), py::arg("arrived"), py::arg("consumed"), py::arg("mine"),
            py::arg("mine_arrived"),
            "Metadata slot `slot`'s addresses: per rank, this rank's cell there, its arrived flag for this rank, its "
            "consumed flag; and per source, its cell here and its arrived flag.");

    py::class_<cpu::NormalDispatchGeometry>(m, "NormalDispatchGeometry", "A prepared normal dispatch's sizes.")
        .def(py::init<>())
        .def_readwrite("num_experts", &cpu::NormalDispatchGeometry::num_experts)
        .def_readwrite("num_channels", &cpu::NormalDispatchGeometry::num_channels)
        .def_readwrite("num_worst", &cpu::NormalDispatchGeometry::num_worst)
        .def_readwrite("alignment", &cpu::NormalDispatchGeometry::alignment)
        .def_readwrite("num_topk", &cpu::NormalDispatchGeometry::num_topk)
        .def_readwrite("topk_offset", &cpu::NormalDispatchGeometry::topk_offset)
        .def_readwrite("weights_offset", &cpu::NormalDispatchGeometry::weights_offset)
        .def_readwrite("src_offset", &cpu::NormalDispatchGeometry::src_offset)
        .def_readwrite("worst_word", &cpu::NormalDispatchGeometry::worst_word);

    py::class_<cpu::NormalCombineGeometry>(m, "NormalCombineGeometry", "A prepared normal combine's sizes.")
        .def(py::init<>())
        .def_readwrite("hidden", &cpu::NormalCombineGeometry::hidden)
        .def_readwrite("x_elem", &cpu::NormalCombineGeometry::x_elem)
        .def_readwrite("num_topk", &cpu::NormalCombineGeometry::num_topk)
        .def_readwrite("weights_offset", &cpu::NormalCombineGeometry::weights_offset)
        .def_readwrite("dtype", &cpu::NormalCombineGeometry::dtype)
        .def_readwrite("direct", &cpu::NormalCombineGeometry::direct)
        .def_readwrite("digest_word", &cpu::NormalCombineGeometry::digest_word);

    py::class_<NormalDispatchCall>(m, "PreparedNormalDispatch", "A normal-mode dispatch prepared on the shm transport.")
        .def(py::init<cpu::ShmPostPlan, cpu::NormalDispatchGeometry, int64_t, py::object, int64_t, py::object, int64_t,
                      int64_t, py::object, const py::module_&>(),
             py::arg("plan"), py::arg("geometry"), py::arg("hidden"), py::arg("x_dtype"), py::arg("x_offset"),
             py::arg("scales_dtype"), py::arg("num_scales"), py::arg("scales_offset"), py::arg("key"), py::arg("torch"))
        .def("begin", &NormalDispatchCall::begin, py::arg("key"), py::arg("x"), py::arg("scales"), py::arg("topk_idx"),
             py::arg("topk_weights"), py::arg("num_tokens_per_rank"), py::arg("is_token_in_rank"),
             py::arg("num_tokens_per_expert"), py::arg("number"), py::arg("seq_header"), py::arg("seq_meta"),
             py::arg("seq_data"), "The handshake and the count exchange's post: a PreparedStatus value.")
        .def("finish", &NormalDispatchCall::finish, py::arg("recv_x"), py::arg("recv_scales"),
             py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"), py::arg("rank_prefix"),
             py::arg("channel_prefix"), py::arg("recv_channel_prefix"), py::arg("send_head"),
             "The payload into these outputs (recv_x with num_recv or num_worst_tokens rows): a PreparedStatus value.")
        .def("refresh", &NormalDispatchCall::refresh, py::arg("plan"),
             "After GROW: the data slots' addresses of the new mapping.")
        .def_property_readonly("num_recv", &NormalDispatchCall::num_recv)
        .def_property_readonly("per_expert", &NormalDispatchCall::per_expert)
        .def_property_readonly("failure", &NormalDispatchCall::failure,
                               "(index, WaitOutcome, round: 0 header, 1 metadata, 2 data) of the last failure.");

    py::class_<NormalCombineCall>(m, "PreparedNormalCombine", "A normal-mode combine prepared on the shm transport.")
        .def(py::init<cpu::ShmPostPlan, cpu::NormalCombineGeometry, py::object, py::object, const py::module_&>(),
             py::arg("plan"), py::arg("geometry"), py::arg("x_dtype"), py::arg("key"), py::arg("torch"))
        .def("begin", &NormalCombineCall::begin, py::arg("key"), py::arg("x"), py::arg("handle"),
             py::arg("topk_weights"), py::arg("bias0"), py::arg("bias1"), py::arg("number"), py::arg("seq_header"),
             py::arg("seq_data"), "The handshake: a PreparedStatus value.")
        .def("finish", &NormalCombineCall::finish, py::arg("out"), py::arg("out_weights"),
             "The rows back and their sum into out (and out_weights): a PreparedStatus value.")
        .def("refresh", &NormalCombineCall::refresh, py::arg("plan"))
        .def_property_readonly("need", &NormalCombineCall::need)
        .def_property_readonly("failure", &NormalCombineCall::failure);

    py::class_<cpu::DispatchGeometry>(m, "DispatchGeometry", "A prepared dispatch's sizes and record layout.")
        .def(py::init<>())
        .def_readwrite("num_experts", &cpu::DispatchGeometry::num_experts)
        .def_readwrite("num_max_tokens", &cpu::DispatchGeometry::num_max_tokens)
        .def_readwrite("hidden", &cpu::DispatchGeometry::hidden)
        .def_readwrite("num_topk", &cpu::DispatchGeometry::num_topk)
        .def_readwrite("fp8", &cpu::DispatchGeometry::fp8)
        .def_readwrite("round_scale", &cpu::DispatchGeometry::round_scale)
        .def_readwrite("ue8m0", &cpu::DispatchGeometry::ue8m0)
        .def_readwrite("x_offset", &cpu::DispatchGeometry::x_offset)
        .def_readwrite("scales_offset", &cpu::DispatchGeometry::scales_offset)
        .def_readwrite("num_scales", &cpu::DispatchGeometry::num_scales)
        .def_readwrite("scale_bytes", &cpu::DispatchGeometry::scale_bytes)
        .def_readwrite("src_offset", &cpu::DispatchGeometry::src_offset)
        .def_readwrite("expert_offset", &cpu::DispatchGeometry::expert_offset);

    py::class_<cpu::CombineGeometry>(m, "CombineGeometry", "A prepared combine's sizes.")
        .def(py::init<>())
        .def_readwrite("num_experts", &cpu::CombineGeometry::num_experts)
        .def_readwrite("num_max_tokens", &cpu::CombineGeometry::num_max_tokens)
        .def_readwrite("hidden", &cpu::CombineGeometry::hidden)
        .def_readwrite("num_topk", &cpu::CombineGeometry::num_topk);

    py::class_<DispatchCall>(m, "PreparedDispatch", "A low-latency dispatch prepared on the shm transport.")
        .def(py::init<cpu::ShmPostPlan, cpu::DispatchGeometry, const std::vector<py::tuple>&, py::object,
                      const py::module_&>(),
             py::arg("plan"), py::arg("geometry"), py::arg("halves"), py::arg("key"), py::arg("torch"),
             "halves: per buffer half (recv_x, scales or 0, scale strides in bytes, src_info, layout_range, "
             "recv_count) addresses; key: the signature the calls must carry, exactly.")
        .def("send", &DispatchCall::send, py::arg("key"), py::arg("x"), py::arg("topk_idx"), py::arg("recv_stats"),
             py::arg("wait_stats"), py::arg("number"), py::arg("seq"), py::arg("slot"), py::arg("half"),
             py::arg("receive"),
             "The send half of call `number` (and with `receive` its receive half): a PreparedStatus value.")
        .def("receive", &DispatchCall::receive, py::arg("half"))
        .def_property_readonly("failure", &DispatchCall::failure,
                               "(index, WaitOutcome) of the last POST_FAILED or WAIT_FAILED.");

    py::class_<CombineCall>(m, "PreparedCombine", "A low-latency combine prepared on the shm transport.")
        .def(py::init<cpu::ShmPostPlan, cpu::CombineGeometry, py::object, const py::module_&>(), py::arg("plan"),
             py::arg("geometry"), py::arg("key"), py::arg("torch"))
        .def("send", &CombineCall::send, py::arg("key"), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weights"),
             py::arg("handle"), py::arg("out"), py::arg("wait_stats"), py::arg("number"), py::arg("seq"),
             py::arg("slot"), py::arg("half"), py::arg("receive"),
             "(PreparedStatus value, out) of the send half of call `number` (and with `receive` its receive half).")
        .def("receive", &CombineCall::receive, py::arg("half"))
        .def_property_readonly("failure", &CombineCall::failure);
}
