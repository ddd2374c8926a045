// What the device build's Python bindings share (bindings.cpp, bind_internode.cpp): pointer and size
// arguments given once for every rank of a launch or one per rank (PerRank), the error record as a
// Python value, the device guard, and Ranks: the ranks a launch serves, its peer table and its error
// records in pinned mapped memory.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "launch.h"
#include "runtime.h"

namespace moe_comm::cuda::device::bind {

namespace py = pybind11;
using namespace moe_comm::cuda;
using namespace moe_comm::cuda::device;

// A pointer or size argument: one value for every rank of the launch, or one per rank.
struct PerRank {
    std::vector<int64_t> values{0};
    bool per_rank = false;

    int64_t at(size_t r) const {
        if (!per_rank) return values[0];
        if (r >= values.size())
            throw py::value_error("a per-rank argument holds " + std::to_string(values.size()) +
                                  " values, but this launch serves more ranks");
        return values[r];
    }
    template <class T>
    T* ptr(size_t r) const {
        return reinterpret_cast<T*>(static_cast<uintptr_t>(at(r)));
    }
};

}  // namespace moe_comm::cuda::device::bind

namespace pybind11::detail {
template <>
struct type_caster<moe_comm::cuda::device::bind::PerRank> {
    using PerRank = moe_comm::cuda::device::bind::PerRank;
    PYBIND11_TYPE_CASTER(PerRank, const_name("int | Sequence[int]"));

    static bool scalar(handle h, int64_t& out) {
        if (h.is_none()) {
            out = 0;
            return true;
        }
        if (!PyLong_Check(h.ptr())) return false;
        out = PyLong_AsLongLong(h.ptr());
        if (out == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return false;
        }
        return true;
    }
    bool load(handle src, bool) {
        int64_t v = 0;
        if (scalar(src, v)) {
            value.values = {v};
            value.per_rank = false;
            return true;
        }
        if (!PySequence_Check(src.ptr()) || PyUnicode_Check(src.ptr()) || PyBytes_Check(src.ptr())) return false;
        const auto seq = reinterpret_borrow<sequence>(src);
        value.values.clear();
        for (const auto item : seq) {
            if (!scalar(item, v)) return false;
            value.values.push_back(v);
        }
        value.per_rank = true;
        return true;
    }
    static handle cast(const PerRank& p, return_value_policy, handle) {
        if (!p.per_rank) return PyLong_FromLongLong(p.values[0]);
        list out;
        for (int64_t v : p.values) out.append(v);
        return out.release();
    }
};
}  // namespace pybind11::detail

namespace moe_comm::cuda::device::bind {

namespace py = pybind11;

using Error = std::optional<std::tuple<int, int, int, int, int, int64_t, int64_t>>;

template <class T>
T* ptr(int64_t p) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

inline Error result(const ErrorRecord& e) {
    if (e.code == 0) return std::nullopt;
    return std::make_tuple(e.code, e.kind, e.rank, e.peer, e.channel, e.observed, e.expected);
}

// Runs with `device` current, then restores the caller's.
class DeviceGuard {
public:
    explicit DeviceGuard(int device) : device_(device) {
        check(cudaGetDevice(&previous_), "cudaGetDevice");
        if (previous_ != device_) check(cudaSetDevice(device_), "cudaSetDevice");
    }
    ~DeviceGuard() {
        if (previous_ != device_) (void)cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int device_, previous_ = 0;
};

inline cudaStream_t stream_of(int64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

inline std::vector<uint8_t*> pointers(const std::vector<int64_t>& values) {
    std::vector<uint8_t*> out;
    for (int64_t v : values) out.push_back(ptr<uint8_t>(v));
    return out;
}

// What every launcher shares: the ranks a launch serves, the error records, and (built from the
// buffers' bases, when given) the peer table.
struct Ranks {
    int device = 0;
    int32_t num_ranks = 0;       // R: the ranks of the buffer
    std::vector<int32_t> ranks;  // the ranks each launch serves: {rank}, or 0..R-1 emulated
    bool emulated = false;
    int64_t budget = 0;          // clock64 cycles of the timeout
    DeviceTable<uint8_t*> peers;
    MappedMemory errors;         // one ErrorRecord per served rank

    Ranks(const std::vector<int64_t>& bases, std::vector<int32_t> served, bool emulate, double timeout_s)
        : Ranks(static_cast<int32_t>(bases.size()), std::move(served), emulate, timeout_s) {
        peers = DeviceTable<uint8_t*>(pointers(bases));
    }

    Ranks(int32_t total, std::vector<int32_t> served, bool emulate, double timeout_s)
        : num_ranks(total), ranks(std::move(served)), emulated(emulate) {
        if (num_ranks <= 0) throw py::value_error("no ranks: bases is empty");
        if (ranks.size() > static_cast<size_t>(kMaxLaunchRanks))
            throw py::value_error(std::to_string(ranks.size()) + " emulated ranks: a launch serves at most " +
                                  std::to_string(kMaxLaunchRanks));
        for (int32_t r : ranks)
            if (r < 0 || r >= num_ranks)
                throw py::value_error("rank " + std::to_string(r) + " outside " + std::to_string(num_ranks) +
                                      " ranks");
        device = current_device();
        budget = budget_cycles(timeout_s, device);
        errors = MappedMemory(sizeof(ErrorRecord) * ranks.size());
    }

    size_t size() const { return ranks.size(); }
    ErrorRecord* device_record(size_t i) const { return static_cast<ErrorRecord*>(errors.device()) + i; }
    ErrorRecord* host_record(size_t i) const { return static_cast<ErrorRecord*>(errors.host()) + i; }
    Watch watch(size_t i) const { return Watch{device_record(i), budget, ranks[i], nullptr}; }
    void clear() const { std::memset(errors.host(), 0, errors.bytes()); }

    // None or the record (a real rank); a list of them (emulated).
    py::object results() const {
        // The device claims a record (code -1), fills it, then publishes the code with a release
        // store: read the code with acquire first, so a record read early is whole or absent.
        auto read = [&](size_t i) -> Error {
            ErrorRecord* e = host_record(i);
            if (std::atomic_ref<int32_t>(e->code).load(std::memory_order_acquire) <= 0) return std::nullopt;
            return result(*e);
        };
        if (!emulated) return py::cast(read(0));
        py::list out;
        for (size_t i = 0; i < size(); ++i) out.append(py::cast(read(i)));
        return out;
    }
};

inline const char* kernel_name(NormalKernel k) {
    switch (k) {
        case NormalKernel::kNotify: return "notify";
        case NormalKernel::kPrologue: return "prologue";
        case NormalKernel::kDispatch: return "dispatch";
        case NormalKernel::kCombine: return "combine";
        case NormalKernel::kInternodeNotify: return "internode notify";
        case NormalKernel::kInternodePrologue: return "internode prologue";
        case NormalKernel::kInternodeDispatch: return "internode dispatch";
        case NormalKernel::kInternodeCombine: return "internode combine";
    }
    return "?";
}

// A normal-mode launch of `blocks` blocks (all served ranks) that wait on each other: launched
// cooperatively (too large a grid is a clear error, not a hang, saying how many blocks `capacity`
// finds room for), waited for, its records read.
template <class B>
py::object launch_cooperative(Ranks& r, NormalKernel kernel, int64_t blocks, int64_t stream, const B& b,
                              cudaError_t (*fn)(const B&, cudaStream_t),
                              int64_t (*capacity)(NormalKernel) = &cooperative_capacity) {
    r.clear();  // nothing is in flight: every normal launch ends synchronised
    {
        py::gil_scoped_release unlocked;
        DeviceGuard on(r.device);
        const std::string op = std::string("moe_comm._cuda: ") + kernel_name(kernel);
        const cudaError_t e = fn(b, stream_of(stream));
        if (e == cudaErrorCooperativeLaunchTooLarge)
            check(e, op + ": its " + std::to_string(blocks) +
                         " blocks wait on each other, so they must all be resident at once, and this GPU holds " +
                         std::to_string(capacity(kernel)) + " of them (use fewer channels: Config.num_sms)");
        check(e, op + " (launch)");
        check(cudaStreamSynchronize(stream_of(stream)), op);
    }
    return r.results();
}

// The call headers a device build's low-latency launches read: the caller's header (host memory) copied
// into pinned memory mapped into the GPU, one cell per (buffer half, kind of launch), so a CUDA graph
// captures an address whose bytes stay those of that half's call of that kind (the kernels take the call
// number from the buffer, not from the header). The host rewrites a cell only for a later call of the
// same half and kind, after the receive of that half's previous call has waited for its stream (the
// backend's double buffering), so never under a launch that reads it.
enum class HeaderKind { kDispatch = 0, kCombine = 1, kReject = 2 };

struct HeaderCells {
    MappedMemory cells;  // [2 halves][3 kinds][header_bytes], allocated at the first header

    // Allocates the cells at the first header (on `device`; not while a graph is captured: a Buffer's
    // first low-latency call of a shape runs eagerly before its capture, as torch's warm-up does).
    LowLatencyPost place(const LowLatencyPost& p, const LowLatencyLayout& layout, int64_t call, HeaderKind kind,
                         int device) {
        if (!p.header) return p;
        const int64_t room = layout.header_bytes;
        if (!cells.host()) {
            DeviceGuard on(device);
            cells = MappedMemory(static_cast<size_t>(6 * room));
        }
        const int64_t at = (((call - 1) & 1) * 3 + static_cast<int64_t>(kind)) * room;
        std::memcpy(static_cast<uint8_t*>(cells.host()) + at, p.header, static_cast<size_t>(p.bytes));
        LowLatencyPost placed = p;
        placed.header = static_cast<const uint8_t*>(cells.device()) + at;
        return placed;
    }
};

// A low-latency call number: 1, 2, ... below 2^31 (signals carry it in their upper 32 bits).
inline void check_call(int64_t call) {
    if (call < 1 || call >= (int64_t{1} << 31))
        throw py::value_error("call must be in [1, 2^31), got " + std::to_string(call));
}

inline std::vector<int32_t> all_ranks(size_t n) {
    std::vector<int32_t> r;
    for (size_t i = 0; i < n; ++i) r.push_back(static_cast<int32_t>(i));
    return r;
}

}  // namespace moe_comm::cuda::device::bind
