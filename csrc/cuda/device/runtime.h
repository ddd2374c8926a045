// The device build's CUDA runtime pieces (runtime.cpp): errors as exceptions, device memory and
// pinned host-mapped memory owned by RAII objects, CUDA IPC handles as bytes, the clock budget of a
// timeout. Raw pointers only (no libtorch): Python sees addresses as ints. Nothing here runs a CUDA
// call before it is asked to, so the module imports on a machine without a GPU or a driver.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moe_comm::cuda::device {

// Throws std::runtime_error "<what>: <CUDA error name>: <message>" unless e is cudaSuccess.
void check(cudaError_t e, const std::string& what);

// Visible CUDA devices; 0 (not an error) without a driver or a device.
int device_count();
int current_device();
// Peak SM clock of `device` in kHz (cudaDevAttrClockRate): clock64() ticks per millisecond.
int64_t clock_khz(int device);
// A timeout as a clock64() budget on `device` (what the kernels add to clock64() at their start).
int64_t budget_cycles(double timeout_s, int device);

// cudaMalloc'd bytes, zeroed, freed with the object.
class DeviceMemory {
public:
    DeviceMemory() = default;
    explicit DeviceMemory(size_t bytes);
    ~DeviceMemory();
    DeviceMemory(DeviceMemory&& o) noexcept;
    DeviceMemory& operator=(DeviceMemory&& o) noexcept;
    DeviceMemory(const DeviceMemory&) = delete;
    DeviceMemory& operator=(const DeviceMemory&) = delete;

    void* get() const { return ptr_; }
    size_t bytes() const { return bytes_; }
    void reset();  // frees now

private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

// A table of values copied once into device memory (peer pointer tables).
template <class T>
class DeviceTable {
public:
    DeviceTable() = default;
    explicit DeviceTable(const std::vector<T>& values);
    T* get() const { return static_cast<T*>(mem_.get()); }
    void reset() { mem_.reset(); }

private:
    DeviceMemory mem_;
};

// Pinned host memory mapped into the device's address space (cudaHostAllocMapped), zeroed: what the
// device writes and the host reads after a launch (error records). host() and device() address the
// same bytes (equal under unified addressing).
class MappedMemory {
public:
    MappedMemory() = default;
    explicit MappedMemory(size_t bytes);
    ~MappedMemory();
    MappedMemory(MappedMemory&& o) noexcept;
    MappedMemory& operator=(MappedMemory&& o) noexcept;
    MappedMemory(const MappedMemory&) = delete;
    MappedMemory& operator=(const MappedMemory&) = delete;

    void* host() const { return host_; }
    void* device() const { return device_; }
    size_t bytes() const { return bytes_; }
    void reset();

private:
    void* host_ = nullptr;
    void* device_ = nullptr;
    size_t bytes_ = 0;
};

// A CUDA event for stream ordering (no timing), created on a device and destroyed with the object.
class StreamEvent {
public:
    explicit StreamEvent(int device);
    ~StreamEvent();
    StreamEvent(const StreamEvent&) = delete;
    StreamEvent& operator=(const StreamEvent&) = delete;

    // Orders `waiter` after the work queued so far on `first` (torch's Stream.wait_stream; allowed while a
    // graph is captured).
    void order(cudaStream_t waiter, cudaStream_t first) const;

private:
    int device_;
    cudaEvent_t event_ = nullptr;
};

// Whether `stream` is capturing a CUDA graph (no host wait may happen then).
bool capturing(cudaStream_t stream);

// CUDA IPC: the handle of a cudaMalloc'd allocation (its base address) as the bytes every rank
// all-gathers, and a peer's handle opened in this process (peer access enabled lazily).
constexpr size_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);
std::string ipc_get_handle(const void* base);
void* ipc_open_handle(const std::string& handle);
void ipc_close_handle(void* peer_base);

// One rank's shared buffer: its own allocation and the peers' allocations opened in this process.
// Teardown is collective: every rank close_peers(), a barrier, then close() (which frees the
// allocation; freeing an exported allocation a peer still maps is undefined behaviour). close()
// and the destructor also close any peer mapping still open.
class SharedBuffer {
public:
    explicit SharedBuffer(size_t bytes);
    ~SharedBuffer();
    SharedBuffer(const SharedBuffer&) = delete;
    SharedBuffer& operator=(const SharedBuffer&) = delete;

    void* ptr() const { return own_.get(); }
    size_t bytes() const { return own_.bytes(); }
    int device() const { return device_; }
    std::string handle() const;
    // handles[r] of every rank (this rank's own at `rank`): every rank's base in this process (null
    // where handles[r] is empty: a rank of another node, not mapped).
    std::vector<void*> open(const std::vector<std::string>& handles, int rank);
    const std::vector<void*>& bases() const { return bases_; }
    void close_peers();
    void close();

private:
    int device_ = 0;
    DeviceMemory own_;
    std::vector<void*> bases_;
    std::vector<void*> opened_;
};

template <class T>
DeviceTable<T>::DeviceTable(const std::vector<T>& values) : mem_(values.size() * sizeof(T)) {
    if (!values.empty())
        check(cudaMemcpy(mem_.get(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy (a peer table)");
}

}  // namespace moe_comm::cuda::device
