// moe_comm._cuda_nvshmem's host runtime (runtime.cpp): NVSHMEM's host API behind plain C++ (raw
// pointers, std::string for the unique id bytes, std::runtime_error naming the call and the status on
// every failure: never NVSHMEM's own exit(-1)). No libtorch, no pybind11.
//
// Nothing here runs a CUDA or NVSHMEM call before it is asked to: the module imports without a GPU or a
// driver. build_version(), runtime_version() and unique_id() need no GPU; init() does (it is collective
// over the num_ranks processes that share the unique id), and every other call needs init() first.
//
// Two copies of NVSHMEM meet in this module: the device library (libnvshmem_device.a, linked in, with
// the version of the headers: build_version()) and the host library (libnvshmem_host.so.3, loaded at
// run time from the nvidia-nvshmem wheel: runtime_version()). A later host library works with an
// earlier device library of the same major version, not the other way round (compatibility()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_comm::cuda::nvshmem {

// sizeof(nvshmemx_uniqueid_t) (runtime.cpp checks it against the headers).
constexpr size_t kUniqueIdBytes = 128;

struct Version {
    int major = 0, minor = 0, patch = 0;
    std::string str() const;
};

// The CUDA runtime the module was compiled against (CUDART_VERSION: 13000 for 13.0): the nvidia-nvshmem
// wheel for it is nvidia-nvshmem-cu<CUDART_VERSION / 1000>.
int build_cudart_version();
// The NVSHMEM the module was compiled against (NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION of the headers,
// the version of the linked device library).
Version build_version();
// The host library this process loaded (nvshmemx_vendor_get_version_info: constants of the library, no
// nvshmem_init needed, no GPU).
Version runtime_version();
// "" when a host library of version `runtime` can serve a device library of version `build` (same major,
// runtime >= build); otherwise the reason, naming both versions.
std::string incompatibility(const Version& build, const Version& runtime);
// Throws std::runtime_error with incompatibility(build_version(), runtime_version()) unless it is "".
void require_compatible();

// nvshmemx_get_uniqueid, as kUniqueIdBytes bytes: made by one rank and sent to all (no GPU needed).
std::string unique_id();
// Collective over num_ranks processes: nvshmemx_set_attr_uniqueid_args + the init of
// nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, ...), on the current CUDA device (whose context it
// creates first: cudaFree(0)). Checks require_compatible() first. Throws on a non-zero status instead of
// exiting as nvshmemx_init_attr does (NVSHMEM's own init still exits the process on a few internal
// errors), and when NVSHMEM ends up only bootstrapped: once it returns, initialized() holds.
void init(const std::string& uid, int rank, int num_ranks);
// nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED.
bool initialized();
int my_pe();
int n_pes();
// nvshmem_malloc (collective: every PE, same size, same order), zeroed with cudaMemset and then
// synchronised (cudaDeviceSynchronize) so peers never see stale bytes. Throws on a null result.
void* alloc(size_t bytes);
// nvshmem_free (collective). free(nullptr) does nothing.
void free(void* symmetric);
// nvshmem_ptr: the address of `pe`'s copy of `symmetric` in this process when it is directly
// load/store-reachable (this PE, NVLink / same-node P2P); nullptr otherwise (use the put API).
void* peer_ptr(void* symmetric, int pe);
void barrier_all();
// nvshmem_finalize (collective); nothing when init() never ran.
void finalize();

}  // namespace moe_comm::cuda::nvshmem
