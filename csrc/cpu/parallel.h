// A minimal parallel-for over a row range with std::thread (no OpenMP runtime to ship).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moe_comm::cpu {

// Rows smaller than this are handled by one thread: starting a thread costs ~10-30 us.
constexpr int64_t kBytesPerThread = 1 << 20;

// Rows of `row_bytes` each that make one thread's share of work.
inline int64_t grain_rows(int64_t row_bytes) {
    return std::max<int64_t>(1, kBytesPerThread / std::max<int64_t>(row_bytes, 1));
}

// Calls fn(begin, end) over disjoint chunks covering [0, n). Runs inline when the work is too small
// to pay for thread start-up (`grain` items per thread at least) or when num_threads <= 1.
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, int num_threads, Fn&& fn) {
    const int64_t max_by_grain = grain > 0 ? std::max<int64_t>(1, n / grain) : 1;
    const int threads = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), max_by_grain));
    if (threads <= 1) {
        if (n > 0) fn(int64_t{0}, n);
        return;
    }
    const int64_t chunk = (n + threads - 1) / threads;
    std::vector<std::thread> workers;
    workers.reserve(threads - 1);
    for (int i = 1; i < threads; ++i) {
        const int64_t begin = std::min(n, i * chunk), end = std::min(n, begin + chunk);
        if (begin < end) workers.emplace_back([&fn, begin, end] { fn(begin, end); });
    }
    fn(int64_t{0}, std::min(n, chunk));
    for (auto& w : workers) w.join();
}

}  // namespace moe_comm::cpu
