// What every Python module of the CUDA kernels binds alike (moe_comm._cuda_host, moe_comm._cuda,
// moe_comm._cuda_nvshmem): the codes a launch's error record and rows carry (csrc/common/codes.h), and the buffer layouts of
// kernels/buffer_layout.h, so one Python adapter serves every build and they cannot disagree.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../kernels/buffer_layout.h"
#include "../kernels/internode.h"
#include "../kernels/intranode.h"
#include "../kernels/low_latency.h"
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

// A low-latency launch's call header, as every build's launches take it: (header address or 0, bytes,
// rejected word, message offset, compared words). Checked against the layout's header cells.
using PostArgs = std::tuple<int64_t, int64_t, int32_t, int32_t, uint64_t>;

inline LowLatencyPost post_of(const PostArgs& a, const LowLatencyLayout& layout) {
    const LowLatencyPost p{reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(std::get<0>(a))), std::get<1>(a),
                           std::get<2>(a), std::get<3>(a), std::get<4>(a)};
    // the vector's words (those compared, the rejected bit) come before the message, inside the cell
    const int64_t words = p.message_offset / 8;
    const bool compared_inside = words >= 64 || (p.compare >> words) == 0;
    if (p.header && (p.bytes <= 0 || p.bytes > layout.header_bytes || p.rejected_word < 0 ||
                     p.rejected_word >= 64 || p.rejected_word >= words || !compared_inside ||
                     p.message_offset % 8 || p.message_offset >= p.bytes))
        throw py::value_error("post: a header of " + std::to_string(p.bytes) + " bytes (at most " +
                              std::to_string(layout.header_bytes) + "), rejected word " +
                              std::to_string(p.rejected_word) + " (< 64), message at byte " +
                              std::to_string(p.message_offset) + " (after every compared word, inside the header)");
    return p;
}

// Where each header cell of a rank's low-latency buffer starts: [half * R + source] (the host reads
// them for a verdict's error).
inline std::vector<int64_t> header_offsets(const LowLatencyLayout& layout) {
    std::vector<int64_t> out;
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < layout.num_ranks; ++s) out.push_back(layout.header(h, s));
    return out;
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
