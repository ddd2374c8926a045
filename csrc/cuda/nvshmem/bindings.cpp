// moe_comm._cuda_nvshmem: NVSHMEM's host API (runtime.h) and the kernels of this folder that use its
// device API (launch.h), for Python. Pointers are Python ints; no libtorch. Load it through
// moe_comm.backends.cuda.nvshmem_lib.load(), which turns a missing or mismatched NVSHMEM host library into
// one clear exception.
//
// Importing the module makes no CUDA or NVSHMEM call (static cudart; the NVSHMEM host library is only
// loaded, and runtime_version() reads constants of it), so it imports without a GPU or a driver. The
// calls that wait on other processes (init, alloc, free, barrier_all, finalize) and every launch release
// the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "../device/runtime.h"
#include "launch.h"
#include "runtime.h"

namespace py = pybind11;
namespace nv = moe_comm::cuda::nvshmem;

void bind_ep(py::module_& m);  // bind_ep.cpp: the expert-parallel launchers, codes and layouts

namespace {

using VersionTuple = std::tuple<int, int, int>;

VersionTuple as_tuple(const nv::Version& v) { return {v.major, v.minor, v.patch}; }
nv::Version as_version(const VersionTuple& t) { return {std::get<0>(t), std::get<1>(t), std::get<2>(t)}; }

template <class T>
T* ptr(int64_t p) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}
int64_t as_int(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }
cudaStream_t stream_of(int64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

// The kernels read this module's NVSHMEM device state, which init() sets up: refuse to launch before.
void require_initialized(const char* op) {
    if (!nv::initialized())
        throw std::runtime_error(std::string("moe_comm._cuda_nvshmem: ") + op +
                                 ": NVSHMEM is not initialized in this process (init(uid, rank, num_ranks) first)");
}

}  // namespace

PYBIND11_MODULE(_cuda_nvshmem, m) {
    m.doc() = "moe-comm's NVSHMEM module: NVSHMEM's host API and kernels that use its device API";
    bind_ep(m);

    m.attr("BUILD_VERSION") = py::make_tuple(nv::build_version().major, nv::build_version().minor,
                                             nv::build_version().patch);
    m.attr("BUILD_CUDART_VERSION") = nv::build_cudart_version();  // 13000: the nvidia-nvshmem-cu13 wheel
    m.attr("UNIQUE_ID_BYTES") = static_cast<int>(nv::kUniqueIdBytes);
    m.attr("PROBE_TIMEOUT") = nv::kProbeTimeout;
    m.attr("PROBE_ERROR_WORDS") = nv::kProbeErrorWords;

    // ------------------------------------------------------------------ versions (no GPU needed)
    m.def("runtime_version", [] { return as_tuple(nv::runtime_version()); },
          "(major, minor, patch) of the NVSHMEM host library this process loaded (libnvshmem_host.so.3).");
    m.def("incompatibility", [](const VersionTuple& build, const VersionTuple& runtime) {
        return nv::incompatibility(as_version(build), as_version(runtime));
    }, py::arg("build"), py::arg("runtime"),
       "'' when a host library of version `runtime` serves a device library of version `build` (same major, "
       "runtime >= build); otherwise why not.");

    // ------------------------------------------------------------------ host API
    m.def("unique_id", [] { return py::bytes(nv::unique_id()); },
          "nvshmemx_get_uniqueid: UNIQUE_ID_BYTES bytes that one rank makes and every rank passes to init().");
    m.def("init", [](const py::bytes& uid, int rank, int num_ranks) {
        std::string id = uid;
        py::gil_scoped_release unlocked;
        nv::init(id, rank, num_ranks);
    }, py::arg("uid"), py::arg("rank"), py::arg("num_ranks"),
       "Collective over num_ranks processes: NVSHMEM with a unique-id bootstrap, on the current CUDA device. "
       "Raises RuntimeError naming the call and its status (NVSHMEM's own init would exit the process).");
    m.def("initialized", &nv::initialized, "Whether NVSHMEM is initialized in this process.");
    m.def("my_pe", &nv::my_pe);
    m.def("n_pes", &nv::n_pes);
    m.def("alloc", [](size_t nbytes) {
        py::gil_scoped_release unlocked;
        return as_int(nv::alloc(nbytes));
    }, py::arg("nbytes"),
       "Collective nvshmem_malloc, zeroed on every PE before it returns anywhere; the address as an int.");
    m.def("free", [](int64_t p) {
        py::gil_scoped_release unlocked;
        nv::free(ptr<void>(p));
    }, py::arg("ptr"), "Collective nvshmem_free.");
    m.def("peer_ptr", [](int64_t p, int pe) { return as_int(nv::peer_ptr(ptr<void>(p), pe)); }, py::arg("ptr"),
          py::arg("pe"),
          "nvshmem_ptr: `pe`'s copy of the symmetric address `ptr` when loads and stores reach it directly "
          "(NVLink, this PE); 0 otherwise.");
    m.def("barrier_all", [] {
        py::gil_scoped_release unlocked;
        nv::barrier_all();
    });
    m.def("finalize", [] {
        py::gil_scoped_release unlocked;
        nv::finalize();
    }, "nvshmem_finalize (collective); nothing when not initialized.");

    // ------------------------------------------------------------------ probes (kernels.cu)
    m.def("put_signal_probe", [](int64_t dst, int64_t src, size_t nbytes, int64_t sig, uint64_t value, int pe,
                                 int64_t stream) {
        require_initialized("put_signal_probe");
        py::gil_scoped_release unlocked;
        moe_comm::cuda::device::check(
            nv::launch_put_signal_probe(ptr<void>(dst), ptr<const void>(src), nbytes, ptr<uint64_t>(sig), value, pe,
                                        stream_of(stream)),
            "moe_comm._cuda_nvshmem: put_signal_probe (launch)");
    }, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("sig"), py::arg("value"), py::arg("pe"),
       py::arg("stream") = 0,
       "Enqueues one block: nvshmemx_putmem_signal_nbi_block(dst, src, nbytes, sig, value, SIGNAL_SET, pe), then "
       "nvshmem_quiet. dst and sig are symmetric addresses (alloc()).");
    m.def("wait_signal_probe", [](int64_t sig, uint64_t value, double timeout_s, int64_t error, int64_t stream) {
        require_initialized("wait_signal_probe");
        py::gil_scoped_release unlocked;
        const int64_t budget =
            moe_comm::cuda::device::budget_cycles(timeout_s, moe_comm::cuda::device::current_device());
        moe_comm::cuda::device::check(
            nv::launch_wait_signal_probe(ptr<uint64_t>(sig), value, budget, ptr<int64_t>(error), stream_of(stream)),
            "moe_comm._cuda_nvshmem: wait_signal_probe (launch)");
    }, py::arg("sig"), py::arg("value"), py::arg("timeout_s"), py::arg("error"), py::arg("stream") = 0,
       "Enqueues one thread that waits until *sig >= value for at most timeout_s; past that it writes "
       "(PROBE_TIMEOUT, observed value) into error (PROBE_ERROR_WORDS int64s, zeroed by the caller).");
}
