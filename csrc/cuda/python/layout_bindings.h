// What every Python module of the CUDA kernels binds alike (moe_comm._cuda_host, moe_comm._cuda,
// moe_comm._cuda_nvshmem): the codes a launch's error record and rows carry (csrc/common/codes.h), and the buffer layouts of
// kernels/buffer_layout.h, so one Python adapter serves every build and they cannot disagree.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "../kernels/buffer_layout.h"
#include "../kernels/internode.h"
#include "../kernels/intranode.h"
#include "../../common/codes_bindings.h"
#include "../protocol/wait.h"

namespace moe_comm::cuda::python {

namespace py = pybind11;

// `type` as a combine's row type: FLOAT32, BFLOAT16 or FLOAT16 with x_bytes = hidden * its size, else
// std::invalid_argument (ValueError) naming it, before any launch reads a row.
inline DType combine_row_type(DType type, int64_t hidden, int64_t x_bytes) {
    if (!is_float_row(type) || x_bytes != hidden * float_row_bytes(type))
        throw std::invalid_argument("combine: type must be FLOAT32, BFLOAT16 or FLOAT16 with x_bytes = hidden * "
                                    "its size, got DType " + std::to_string(static_cast<int>(type)) + ", hidden " +
                                    std::to_string(hidden) + ", x_bytes " + std::to_string(x_bytes));
    return type;
}

inline void def_layouts(py::module_& m) {
    // module_local: moe_comm._cuda_host binds the same C++ enums; each module keeps its own Python type.
    py::enum_<WaitKind>(m, "WaitKind", py::module_local())
        .value("NONE", WaitKind::kNone).value("BARRIER", WaitKind::kBarrier)
        .value("RING_SPACE", WaitKind::kRingSpace).value("RING_DATA", WaitKind::kRingData)
        .value("COUNT", WaitKind::kCount).value("COMBINE_FLAG", WaitKind::kCombineFlag)
        .value("RDMA_SPACE", WaitKind::kRdmaSpace).value("RDMA_DATA", WaitKind::kRdmaData)
        .value("HEADER", WaitKind::kHeader).value("CONSUMED", WaitKind::kConsumed);
    moe_comm::python::def_codes(m, true);  // DType, WaitOutcome (error records), MAX_NODE_RANKS, ...
    m.attr("MAX_NODES") = kMaxNodes;

    // The layout of every build: csrc/cuda/kernels/buffer_layout.h.
    m.def("normal_bytes", [](int R, int C, int L, int64_t slots, int64_t slot_bytes) {
        return NormalLayout(R, C, L, slots, slot_bytes).total;
    }, py::arg("R"), py::arg("C"), py::arg("L"), py::arg("slots"), py::arg("slot_bytes"),
       "Bytes of one rank's normal-mode buffer.");
    m.def("dispatch_slot_bytes", &dispatch_slot_bytes, py::arg("x_bytes"), py::arg("scale_bytes"),
          py::arg("num_topk"), "Bytes of a dispatch ring slot (before alignment).");
    m.def("low_latency_header_bytes", &low_latency_header_bytes, py::arg("R"),
          "The room of one low-latency call header cell (a header may be smaller).");
    m.def("low_latency_control_bytes", [](int R) {
        return LowLatencyLayout(R, 1, 1, kFp8Group).control;  // the control area depends on R alone
    }, py::arg("R"), "Bytes of a low-latency buffer's control area (header cells, sequence words, flow "
       "control), where its halves start: the same for every call's sizes.");
    m.def("low_latency_bytes", [](int R, int L, int64_t M, int64_t H) {
        return LowLatencyLayout(R, L, M, H).total;
    }, py::arg("R"), py::arg("L"), py::arg("M"), py::arg("H"),
       "Bytes of one rank's low-latency buffer (both halves, staging included).");
    m.def("internode_bytes", [](int Rn, int NL, int C, int L, int64_t nvl_slots, int64_t nvl_slot_bytes,
                                int64_t rdma_slots, int64_t rdma_slot_bytes) {
        const InternodeLayout l(Rn, NL, C, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes);
        return std::make_pair(l.nvl_total, l.rdma_total);
    }, py::arg("Rn"), py::arg("NL"), py::arg("C"), py::arg("L"), py::arg("nvl_slots"), py::arg("nvl_slot_bytes"),
       py::arg("rdma_slots"), py::arg("rdma_slot_bytes"),
       "Bytes of one rank's (NVL, RDMA) buffers of normal mode across nodes.");
}

}  // namespace moe_comm::cuda::python
