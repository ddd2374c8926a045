// Release/acquire flags in shared memory, and the deadline-bounded wait the shm transport uses.
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <thread>

#include "check.h"
#include "flags.h"

namespace moe_comm::cpu {
namespace {

// How often a waiting rank checks the deadline and whether peers still run.
constexpr auto kCheckEvery = std::chrono::milliseconds(20);
// Busy polls before the waiter yields, then how long it polls with sched_yield before it naps:
// yielding hands the core to a runnable peer when ranks outnumber cores, and otherwise wakes
// within microseconds (a nap costs ~60 us of timer slack).
constexpr int kSpins = 256;
constexpr auto kYieldFor = std::chrono::microseconds(500);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// 1: every flag reached; 0: flag *first_missing is below its target; -1: flag *first_missing is
// past its target although an exact value was asked for (the setter is out of step).
int reached(int64_t* const* flags, const int64_t* targets, int64_t n, bool exact, int64_t* first_missing) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t value = flag_load(flags[i]);
        if (value < targets[i] || (exact && value > targets[i])) {
            *first_missing = i;
            return value < targets[i] ? 0 : -1;
        }
    }
    return 1;
}

}  // namespace

void flag_store(int64_t* flag, int64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

int64_t flag_load(const int64_t* flag) { return __atomic_load_n(flag, __ATOMIC_ACQUIRE); }

bool process_alive(int64_t pid) {
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) {
        if (errno != ENOENT) return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH;
        return false;
    }
    char buf[512];
    const size_t len = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[len] = '\0';
    const char* paren = std::strrchr(buf, ')');
    // "pid (comm) S ...": an exited process that is not yet reaped (zombie) counts as dead.
    return paren == nullptr || (paren[1] != '\0' && paren[2] != 'Z' && paren[2] != 'X');
}

int64_t flags_wait(int64_t* const* flags, const int64_t* targets, const int64_t* pids, int64_t n,
                   double timeout_s, bool exact, WaitOutcome* outcome) {
    MC_CHECK(n >= 0 && timeout_s >= 0, "flags_wait: n=" << n << " timeout_s=" << timeout_s);
    *outcome = WaitOutcome::kReached;
    int64_t missing = 0;
    int state = 0;
    int spins = 0;
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(timeout_s));
    auto next_check = start + kCheckEvery;
    const auto stop_yielding = start + kYieldFor;
    auto sleep = std::chrono::microseconds(1);
    while ((state = reached(flags, targets, n, exact, &missing)) != 1) {
        if (state == -1) {
            *outcome = WaitOutcome::kPastTarget;
            return missing;
        }
        if (spins < kSpins) {
            ++spins;
            cpu_relax();
            continue;
        }
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_check) {
            next_check = now + kCheckEvery;
            for (int64_t i = 0; i < n; ++i) {
                // The process first, then its flag: a peer that set the flag and exited after the last
                // look is not reported (what a dead process stored is all there once it is gone).
                if (pids[i] > 0 && !process_alive(pids[i]) && flag_load(flags[i]) < targets[i]) {
                    *outcome = WaitOutcome::kPeerExited;
                    return i;
                }
            }
            if (now >= deadline) {
                *outcome = WaitOutcome::kTimeout;
                return missing;
            }
        }
        if (now < stop_yielding) {
            sched_yield();
            continue;
        }
        std::this_thread::sleep_for(sleep);
        sleep = std::min(sleep * 2, std::chrono::microseconds(50));
    }
    return -1;
}

}  // namespace moe_comm::cpu
