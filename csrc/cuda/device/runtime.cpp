// The device build's CUDA runtime pieces (runtime.h).
#include "runtime.h"

#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

namespace moe_comm::cuda::device {

void check(cudaError_t e, const std::string& what) {
    if (e == cudaSuccess) return;
    (void)cudaGetLastError();  // clear a non-sticky error, so the next call does not report it again
    throw std::runtime_error(what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

int current_device() {
    int d = 0;
    check(cudaGetDevice(&d), "cudaGetDevice");
    return d;
}

int64_t clock_khz(int device) {
    int khz = 0;
    check(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device), "cudaDeviceGetAttribute(ClockRate)");
    return khz;
}

int64_t budget_cycles(double timeout_s, int device) {
    // clock64() + budget must not overflow: a budget of over 2^62 cycles (decades) is forever.
    const double cycles = timeout_s * 1e3 * static_cast<double>(clock_khz(device));
    const double cap = static_cast<double>(int64_t{1} << 62);
    return cycles <= 0 ? 0 : cycles >= cap ? int64_t{1} << 62 : static_cast<int64_t>(cycles);
}

// ---------------------------------------------------------------------- DeviceMemory
DeviceMemory::DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    check(cudaMalloc(&ptr_, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)");
    const cudaError_t e = cudaMemset(ptr_, 0, bytes);
    if (e != cudaSuccess) {
        reset();
        check(e, "cudaMemset");
    }
}

DeviceMemory::~DeviceMemory() { reset(); }

DeviceMemory::DeviceMemory(DeviceMemory&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& o) noexcept {
    if (this != &o) {
        reset();
        ptr_ = std::exchange(o.ptr_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
}

void DeviceMemory::reset() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);  // at interpreter exit the runtime may be gone: ignored
    ptr_ = nullptr;
    bytes_ = 0;
}

// ---------------------------------------------------------------------- MappedMemory
StreamEvent::StreamEvent(int device) : device_(device) {
    int previous = 0;
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device_) check(cudaSetDevice(device_), "cudaSetDevice");
    const cudaError_t e = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (previous != device_) (void)cudaSetDevice(previous);
    check(e, "cudaEventCreateWithFlags");
}

StreamEvent::~StreamEvent() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

void StreamEvent::order(cudaStream_t waiter, cudaStream_t first) const {
    check(cudaEventRecord(event_, first), "cudaEventRecord");
    check(cudaStreamWaitEvent(waiter, event_, 0), "cudaStreamWaitEvent");
}

bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
}

MappedMemory::MappedMemory(size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    check(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc(" + std::to_string(bytes) + " bytes, mapped)");
    std::memset(host_, 0, bytes);
    const cudaError_t e = cudaHostGetDevicePointer(&device_, host_, 0);
    if (e != cudaSuccess) {
        reset();
        check(e, "cudaHostGetDevicePointer");
    }
}

MappedMemory::~MappedMemory() { reset(); }

MappedMemory::MappedMemory(MappedMemory&& o) noexcept
    : host_(std::exchange(o.host_, nullptr)), device_(std::exchange(o.device_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}

MappedMemory& MappedMemory::operator=(MappedMemory&& o) noexcept {
    if (this != &o) {
        reset();
        host_ = std::exchange(o.host_, nullptr);
        device_ = std::exchange(o.device_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
}

void MappedMemory::reset() {
    if (host_ != nullptr) (void)cudaFreeHost(host_);
    host_ = device_ = nullptr;
    bytes_ = 0;
}

// ---------------------------------------------------------------------- IPC
std::string ipc_get_handle(const void* base) {
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, const_cast<void*>(base)), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void* ipc_open_handle(const std::string& handle) {
    if (handle.size() != kIpcHandleBytes)
        throw std::invalid_argument("a CUDA IPC handle is " + std::to_string(kIpcHandleBytes) + " bytes, got " +
                                    std::to_string(handle.size()));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return p;
}

void ipc_close_handle(void* peer_base) { check(cudaIpcCloseMemHandle(peer_base), "cudaIpcCloseMemHandle"); }

// ---------------------------------------------------------------------- SharedBuffer
SharedBuffer::SharedBuffer(size_t bytes) : device_(current_device()), own_(bytes) {}

SharedBuffer::~SharedBuffer() { close(); }

std::string SharedBuffer::handle() const {
    if (own_.get() == nullptr) throw std::runtime_error("SharedBuffer: closed (or empty): no IPC handle");
    return ipc_get_handle(own_.get());
}

std::vector<void*> SharedBuffer::open(const std::vector<std::string>& handles, int rank) {
    if (!opened_.empty()) throw std::runtime_error("SharedBuffer.open: the peers are open already");
    if (rank < 0 || static_cast<size_t>(rank) >= handles.size())
        throw std::invalid_argument("SharedBuffer.open: rank " + std::to_string(rank) + " outside " +
                                    std::to_string(handles.size()) + " handles");
    std::vector<void*> bases(handles.size(), nullptr);
    try {
        for (size_t r = 0; r < handles.size(); ++r) {
            if (static_cast<int>(r) == rank) {
                bases[r] = own_.get();
                continue;
            }
            if (handles[r].empty()) continue;  // a rank of another node: not mapped here
            bases[r] = ipc_open_handle(handles[r]);
            opened_.push_back(bases[r]);
        }
    } catch (...) {
        for (void* p : opened_) (void)cudaIpcCloseMemHandle(p);
        opened_.clear();
        throw;
    }
    bases_ = bases;
    return bases;
}

void SharedBuffer::close_peers() {
    for (void* p : opened_) (void)cudaIpcCloseMemHandle(p);  // best effort: teardown goes on
    opened_.clear();
    bases_.clear();
}

void SharedBuffer::close() {
    close_peers();
    own_.reset();
}

}  // namespace moe_comm::cuda::device
