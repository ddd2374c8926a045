// moe_comm._cuda_nvshmem's smoke kernels (launch.h): one put-with-signal and one bounded wait through
// NVSHMEM's device API, so the relocatable-device-code build and its device link against
// libnvshmem_device.a are exercised. Later kernels go in other .cu files of this folder (one line in
// CMakeLists.txt each, MOE_COMM_NVSHMEM_SOURCES).
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "launch.h"

namespace moe_comm::cuda::nvshmem {
namespace {

__global__ void __launch_bounds__(kProbeThreads, 1)
    put_signal_probe_kernel(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value, int pe) {
    // Block-collective: every thread of the block calls it with the same arguments.
    nvshmemx_putmem_signal_nbi_block(dst, src, bytes, sig, value, NVSHMEM_SIGNAL_SET, pe);
    __syncthreads();
    // One thread's quiet after the block barrier completes the block's put and signal (fences are
    // cumulative: what the barrier ordered before it is covered).
    if (threadIdx.x == 0) nvshmem_quiet();
}

__global__ void __launch_bounds__(kWaitThreads, 1)
    wait_signal_probe_kernel(uint64_t* sig, uint64_t value, int64_t budget_cycles, int64_t* error) {
    const long long start = clock64();
    // nvshmem_uint64_test: one volatile read of the signal; when it holds, the fence (and, over a proxy
    // transport, the consistency step) that nvshmem_signal_wait_until does after its unbounded spin.
    while (!nvshmem_uint64_test(sig, NVSHMEM_CMP_GE, value)) {
        if (clock64() - start > budget_cycles) {
            error[1] = static_cast<int64_t>(nvshmem_signal_fetch(sig));
            __threadfence_system();  // the observed value before the code (a host-mapped record)
            *reinterpret_cast<volatile int64_t*>(&error[0]) = kProbeTimeout;
            return;
        }
    }
}

}  // namespace

cudaError_t launch_put_signal_probe(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value, int pe,
                                    cudaStream_t s) {
    void* args[] = {&dst, &src, &bytes, &sig, &value, &pe};
    return cudaLaunchKernel(reinterpret_cast<const void*>(&put_signal_probe_kernel), dim3(1), dim3(kProbeThreads),
                            args, 0, s);
}

cudaError_t launch_wait_signal_probe(uint64_t* sig, uint64_t value, int64_t budget_cycles, int64_t* error,
                                     cudaStream_t s) {
    void* args[] = {&sig, &value, &budget_cycles, &error};
    return cudaLaunchKernel(reinterpret_cast<const void*>(&wait_signal_probe_kernel), dim3(1), dim3(kWaitThreads),
                            args, 0, s);
}

}  // namespace moe_comm::cuda::nvshmem
