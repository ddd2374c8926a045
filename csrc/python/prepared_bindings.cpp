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
    if (half != 0 && half != 1) throw py::value_error("prepared call: half must be 0 or 1, got " + std::to_string(half));
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

class DispatchCall {
  public:
    DispatchCall(cpu::ShmPostPlan plan, cpu::DispatchGeometry geometry, const std::vector<py::tuple>& halves,
                 py::object key, const py::module_& torch)
        : common_(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks) {
        if (halves.size() != 2) throw py::value_error("PreparedDispatch: need the outputs of both halves");
        cpu::DispatchHalf h[2];
        for (int i = 0; i < 2; ++i) {
            const auto strides = halves[i][2].cast<std::tuple<int64_t, int64_t, int64_t>>();
            h[i] = {ptr<uint8_t>(halves[i][0].cast<std::uintptr_t>()), ptr<uint8_t>(halves[i][1].cast<std::uintptr_t>()),
                    {std::get<0>(strides), std::get<1>(strides), std::get<2>(strides)},
                    ptr<int32_t>(halves[i][3].cast<std::uintptr_t>()), ptr<int64_t>(halves[i][4].cast<std::uintptr_t>()),
                    ptr<int32_t>(halves[i][5].cast<std::uintptr_t>())};
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
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->send(in, number, seq, slot, half);
            if (status == cpu::PreparedStatus::kOk && receive) status = core_->receive(half);
        }
        if (status != cpu::PreparedStatus::kNotTaken)
            common_.held[half] = receive && status == cpu::PreparedStatus::kOk ? py::object()
                                                                                : py::make_tuple(recv_stats, wait_stats);
        return static_cast<int>(status);
    }

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

  private:
    Common common_;
    cpu::DispatchGeometry g_;
    int64_t num_ranks_;
    std::unique_ptr<cpu::PreparedDispatch> core_;
};

class CombineCall {
  public:
    CombineCall(cpu::ShmPostPlan plan, cpu::CombineGeometry geometry, py::object key, const py::module_& torch)
        : common_(torch, std::move(key)), g_(geometry), num_ranks_(plan.num_ranks),
          core_(std::make_unique<cpu::PreparedCombine>(std::move(plan), geometry)) {}

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
        cpu::PreparedStatus status;
        {
            py::gil_scoped_release release;
            status = core_->send(in, number, seq, slot, half);
            if (status == cpu::PreparedStatus::kOk && receive) status = core_->receive(half);
        }
        if (status == cpu::PreparedStatus::kNotTaken) return not_taken;
        common_.held[half] = receive && status == cpu::PreparedStatus::kOk
                                 ? py::object()
                                 : py::make_tuple(topk_idx, topk_weights, result, wait_stats);
        return {static_cast<int>(status), result};
    }

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

  private:
    Common common_;
    cpu::CombineGeometry g_;
    int64_t num_ranks_;
    std::unique_ptr<cpu::PreparedCombine> core_;
};

}  // namespace

void def_prepared(py::module_& m) {
    py::enum_<cpu::PreparedStatus>(m, "PreparedStatus", "How a prepared call's half ended (csrc/cpu/prepared.h).")
        .value("OK", cpu::PreparedStatus::kOk)
        .value("NOT_TAKEN", cpu::PreparedStatus::kNotTaken)
        .value("POST_FAILED", cpu::PreparedStatus::kPostFailed)
        .value("WAIT_FAILED", cpu::PreparedStatus::kWaitFailed)
        .value("DISAGREE", cpu::PreparedStatus::kDisagree);

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
            "rows; and this rank's arrived flags per source.");

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
