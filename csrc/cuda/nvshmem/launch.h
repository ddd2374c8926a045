// moe_comm._cuda_nvshmem's launches (kernels.cu and the other .cu files of this folder), as the host
// code (bindings.cpp, a host compiler) calls them: plain C++ signatures, raw pointers, sizes and a
// cudaStream_t; each returns the launch's cudaError_t (cudaSuccess once it is enqueued).
//
// Every kernel here uses NVSHMEM's device API, so it runs only after init() (runtime.h) in this process:
// the device state those calls read is this module's own copy (libnvshmem_device.a is linked into the
// module), set up by init(). Symmetric addresses are nvshmem_malloc'd (runtime.h alloc()).
//
// Deadlines: a wait takes a budget in clock64() cycles (moe_comm::cuda::device::budget_cycles turns a
// timeout into one); the kernel measures it from its own start and never waits past it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe_comm::cuda::nvshmem {

// Threads per block (each kernel's __launch_bounds__).
constexpr int kProbeThreads = 256;  // put_signal_probe: one block moves the bytes
constexpr int kWaitThreads = 1;     // wait_signal_probe: one agent polls the signal

// The error record of a wait (int64_t[2], device or host-mapped memory, zeroed by the caller):
// [0] = 0 while fine, kProbeTimeout once the deadline passed; [1] = the signal's value observed then.
constexpr int64_t kProbeTimeout = 1;
constexpr int kProbeErrorWords = 2;

// One block: nvshmemx_putmem_signal_nbi_block(dst, src, bytes, sig, value, NVSHMEM_SIGNAL_SET, pe), then
// nvshmem_quiet() (the put and the signal are complete at `pe` when the kernel ends). dst and sig are
// symmetric addresses (this PE's names for them); src is any device memory of this PE.
cudaError_t launch_put_signal_probe(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value, int pe,
                                    cudaStream_t s);

// One thread: waits until *sig >= value (nvshmem_uint64_test, polled: NVSHMEM's own
// nvshmem_signal_wait_until cannot be bounded), at most budget_cycles clock64() cycles; past that it
// records {kProbeTimeout, observed} in error and returns. sig is a symmetric address of this PE.
cudaError_t launch_wait_signal_probe(uint64_t* sig, uint64_t value, int64_t budget_cycles, int64_t* error,
                                     cudaStream_t s);

}  // namespace moe_comm::cuda::nvshmem
