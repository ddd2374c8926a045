// Binds the shared codes of codes.h into a Python module, under the same names in every module that
// binds them (moe_comm._C, moe_comm._cuda_host, moe_comm._cuda, moe_comm._cuda_nvshmem), so one
// Python adapter serves every build. Included by binding files only (it needs pybind11).
#pragma once

#include <pybind11/pybind11.h>

#include "codes.h"

namespace moe_comm::python {

// `local`: the type is private to the module (py::module_local), for modules that may be loaded
// beside another module binding the same C++ enum.
inline void def_codes(pybind11::module_& m, bool local) {
    namespace py = pybind11;
    auto dtype = local ? py::enum_<DType>(m, "DType", "Tensor element types (csrc/common/codes.h).", py::module_local())
                       : py::enum_<DType>(m, "DType", "Tensor element types (csrc/common/codes.h).");
#define MOE_COMM_BIND_DTYPE(name, member, code) dtype.value(#name, DType::member);
    MOE_COMM_DTYPES(MOE_COMM_BIND_DTYPE)
#undef MOE_COMM_BIND_DTYPE
    auto outcome = local ? py::enum_<WaitOutcome>(m, "WaitOutcome", "How a wait ended (csrc/common/codes.h).",
                                                 py::module_local())
                         : py::enum_<WaitOutcome>(m, "WaitOutcome", "How a wait ended (csrc/common/codes.h).");
#define MOE_COMM_BIND_OUTCOME(name, member, code) outcome.value(#name, WaitOutcome::member);
    MOE_COMM_WAIT_OUTCOMES(MOE_COMM_BIND_OUTCOME)
#undef MOE_COMM_BIND_OUTCOME
    m.attr("FP8_GROUP") = kFp8Group;
    m.attr("AMAX_FLOOR") = kAmaxFloor;
    m.attr("MAX_NODE_RANKS") = kMaxNodeRanks;
}

}  // namespace moe_comm::python
