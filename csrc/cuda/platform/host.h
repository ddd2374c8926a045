// The host platform: the flag operations as C++ atomics on the same memory the ranks share (POSIX
// shared memory standing in for CUDA IPC), and one thread per simulated warp group. Built into
// moe_comm._cuda_host (the cuda_host backend) and into the ThreadSanitizer stress test.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "platform.h"
#include "../../cpu/flags.h"

namespace moe_comm::cuda {

struct HostPlatform {
    template <class T>
    static T load_acquire(const T* p) {
        return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_acquire);
    }
    template <class T>
    static void store_release(T* p, T v) {
        std::atomic_ref<T>(*p).store(v, std::memory_order_release);
    }
    template <class T>
    static T load_relaxed(const T* p) {
        return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_relaxed);
    }
    template <class T>
    static void store_relaxed(T* p, T v) {
        std::atomic_ref<T>(*p).store(v, std::memory_order_relaxed);
    }
    template <class T>
    static T atomic_add(T* p, T v) {
        return std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_acq_rel);
    }
    static bool cas32(int32_t* p, int32_t expected, int32_t v) {
        return std::atomic_ref<int32_t>(*p).compare_exchange_strong(expected, v, std::memory_order_acq_rel);
    }
    static void fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
    static int64_t now() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    // Ranks share few cores: a spinning thread gives its core to the agent it waits for, and after
    // a while naps, so a long wait costs little.
    static void relax(int64_t spins) {
        if (spins < 4096) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // A wait for a process that has exited fails at once instead of at its deadline.
    static bool peer_exited(const int64_t* pids, int peer) {
        return pids != nullptr && peer >= 0 && pids[peer] > 0 && !cpu::process_alive(pids[peer]);
    }

    // One thread is the whole group: every lane loop runs on it, sync is program order.
    struct Group {
        static constexpr int lane() { return 0; }
        static constexpr int lanes() { return 1; }
        static void sync() {}
        static constexpr bool leader() { return true; }
        template <class T>
        static T broadcast(T v) { return v; }
    };
};

}  // namespace moe_comm::cuda
