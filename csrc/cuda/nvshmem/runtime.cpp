// moe_comm._cuda_nvshmem's host runtime (runtime.h).
#include "runtime.h"

#include <cuda_runtime_api.h>
// The host API only (host/nvshmem_api.h, host/nvshmemx_api.h): the device API is kernels.cu's.
#include <nvshmem_host.h>

#include <cstring>
#include <stdexcept>

namespace moe_comm::cuda::nvshmem {
namespace {

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes, "nvshmemx_uniqueid_t changed size");

const char* status_name(int status) {
    switch (status) {
        case NVSHMEMX_SUCCESS: return "NVSHMEMX_SUCCESS";
        case NVSHMEMX_ERROR_INVALID_VALUE: return "NVSHMEMX_ERROR_INVALID_VALUE";
        case NVSHMEMX_ERROR_OUT_OF_MEMORY: return "NVSHMEMX_ERROR_OUT_OF_MEMORY";
        case NVSHMEMX_ERROR_NOT_SUPPORTED: return "NVSHMEMX_ERROR_NOT_SUPPORTED";
        case NVSHMEMX_ERROR_SYMMETRY: return "NVSHMEMX_ERROR_SYMMETRY";
        case NVSHMEMX_ERROR_GPU_NOT_SELECTED: return "NVSHMEMX_ERROR_GPU_NOT_SELECTED";
        case NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED: return "NVSHMEMX_ERROR_COLLECTIVE_LAUNCH_FAILED";
        case NVSHMEMX_ERROR_INTERNAL: return "NVSHMEMX_ERROR_INTERNAL";
        default: return "an unknown NVSHMEM status";
    }
}

// Throws "moe_comm._cuda_nvshmem: <what>: status <n> (<name>)" unless status is 0.
void check(int status, const std::string& what) {
    if (status == 0) return;
    throw std::runtime_error("moe_comm._cuda_nvshmem: " + what + ": status " + std::to_string(status) + " (" +
                             status_name(status) + ")");
}

void check_cuda(cudaError_t e, const std::string& what) {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();
    throw std::runtime_error("moe_comm._cuda_nvshmem: " + what + ": " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
}

void require_initialized(const char* what) {
    if (!initialized())
        throw std::runtime_error(std::string("moe_comm._cuda_nvshmem: ") + what +
                                 ": NVSHMEM is not initialized in this process (call init(uid, rank, num_ranks) "
                                 "on every rank first)");
}

}  // namespace

// The build's NVSHMEM and CUDA runtime versions as text in the module's file:
// moe_comm/backends/cuda/nvshmem_lib.py reads them from there when the module cannot be imported (its
// host library missing), to name the wheel and version to install.
#define MOE_COMM_STR2(x) #x
#define MOE_COMM_STR(x) MOE_COMM_STR2(x)
extern "C" __attribute__((used, visibility("hidden"))) const char moe_comm_nvshmem_build_version[] =
    "MOE_COMM_NVSHMEM_BUILD_VERSION=" MOE_COMM_STR(NVSHMEM_VENDOR_MAJOR_VERSION) "." MOE_COMM_STR(
        NVSHMEM_VENDOR_MINOR_VERSION) "." MOE_COMM_STR(NVSHMEM_VENDOR_PATCH_VERSION) ";CUDART_VERSION=" MOE_COMM_STR(
        CUDART_VERSION) ";";

std::string Version::str() const {
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

int build_cudart_version() { return CUDART_VERSION; }

Version build_version() {
    return Version{NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

Version runtime_version() {
    // In the host library (3.4.5) this only stores three constants: no init, no GPU, no CUDA call.
    Version v;
    nvshmemx_vendor_get_version_info(&v.major, &v.minor, &v.patch);
    return v;
}

std::string incompatibility(const Version& build, const Version& runtime) {
    const std::string both = "the module was built against NVSHMEM " + build.str() +
                             " (its device library, libnvshmem_device.a) and loaded host library "
                             "libnvshmem_host.so.3 is NVSHMEM " + runtime.str();
    if (runtime.major != build.major) return both + ": the major versions differ";
    if (runtime.minor < build.minor || (runtime.minor == build.minor && runtime.patch < build.patch))
        return both + ": the host library is older than the device library (it must be the same or later, "
                      "same major version)";
    return "";
}

void require_compatible() {
    const std::string why = incompatibility(build_version(), runtime_version());
    if (!why.empty()) throw std::runtime_error("moe_comm._cuda_nvshmem: " + why);
}

std::string unique_id() {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    check(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void init(const std::string& uid, int rank, int num_ranks) {
    if (uid.size() != kUniqueIdBytes)
        throw std::invalid_argument("moe_comm._cuda_nvshmem: init: a unique id is " + std::to_string(kUniqueIdBytes) +
                                    " bytes (unique_id()), got " + std::to_string(uid.size()));
    if (num_ranks <= 0 || rank < 0 || rank >= num_ranks)
        throw std::invalid_argument("moe_comm._cuda_nvshmem: init: rank " + std::to_string(rank) + " outside " +
                                    std::to_string(num_ranks) + " ranks");
    if (nvshmemx_init_status() != NVSHMEM_STATUS_NOT_INITIALIZED)
        throw std::runtime_error("moe_comm._cuda_nvshmem: init: NVSHMEM is initialized already in this process "
                                 "(status " + std::to_string(nvshmemx_init_status()) +
                                 "), by this module or by another user of libnvshmem_host.so.3");
    require_compatible();
    // A context on the current device first: NVSHMEM initialises on the context current at init and,
    // finding none, only bootstraps (status NVSHMEM_STATUS_IS_BOOTSTRAPPED) and defers the device part.
    check_cuda(cudaFree(nullptr), "cudaFree(0) (the current device's context, before NVSHMEM's init)");
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, uid.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    check(nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
    // nvshmemx_init_attr (host/nvshmemx_api.h) is this plus exit(-1) on a non-zero status: the same
    // call, with the status thrown instead. nvshmemi_init_thread lives in libnvshmem_device.a (linked
    // into this module): it initialises the host library and then this module's copy of the device
    // state, with the headers' version for the host library's own compatibility check.
    nvshmemx_init_init_attr_ver_only(attr);
    int provided = 0;
    const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                        NVSHMEM_VENDOR_PATCH_VERSION};
    check(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version),
          "nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, rank " + std::to_string(rank) + " of " +
              std::to_string(num_ranks) + ")");
    if (!initialized())
        throw std::runtime_error("moe_comm._cuda_nvshmem: init: nvshmemx_init_attr returned 0 but NVSHMEM's "
                                 "status is " + std::to_string(nvshmemx_init_status()) +
                                 ", not initialized (1: bootstrapped only, the device part was deferred)");
}

bool initialized() {
    const int s = nvshmemx_init_status();
    return s >= NVSHMEM_STATUS_IS_INITIALIZED && s != NVSHMEM_STATUS_INVALID;
}

int my_pe() {
    require_initialized("my_pe");
    return nvshmem_my_pe();
}

int n_pes() {
    require_initialized("n_pes");
    return nvshmem_n_pes();
}

void* alloc(size_t bytes) {
    require_initialized("alloc");
    if (bytes == 0) throw std::invalid_argument("moe_comm._cuda_nvshmem: alloc: 0 bytes");
    void* p = nvshmem_malloc(bytes);
    if (p == nullptr)
        throw std::runtime_error("moe_comm._cuda_nvshmem: nvshmem_malloc(" + std::to_string(bytes) +
                                 " bytes) returned null (the symmetric heap is NVSHMEM_SYMMETRIC_SIZE, "
                                 "default 1 GiB per PE)");
    try {
        check_cuda(cudaMemset(p, 0, bytes), "cudaMemset (a symmetric allocation)");
        check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (after zeroing a symmetric allocation)");
    } catch (...) {
        nvshmem_free(p);
        throw;
    }
    // No peer writes into this PE's copy before it is zeroed.
    nvshmem_barrier_all();
    return p;
}

void free(void* symmetric) {
    if (symmetric == nullptr) return;
    require_initialized("free");
    nvshmem_free(symmetric);
}

void* peer_ptr(void* symmetric, int pe) {
    require_initialized("peer_ptr");
    if (pe < 0 || pe >= nvshmem_n_pes())
        throw std::invalid_argument("moe_comm._cuda_nvshmem: peer_ptr: PE " + std::to_string(pe) + " outside " +
                                    std::to_string(nvshmem_n_pes()) + " PEs");
    return nvshmem_ptr(symmetric, pe);
}

void barrier_all() {
    require_initialized("barrier_all");
    nvshmem_barrier_all();
}

void finalize() {
    if (nvshmemx_init_status() == NVSHMEM_STATUS_NOT_INITIALIZED) return;
    nvshmem_finalize();
}

}  // namespace moe_comm::cuda::nvshmem
