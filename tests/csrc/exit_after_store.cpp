// A peer that stores the flag a rank waits for and exits between the wait's last load of the flag and
// its look at the peer's process. The wait must take the flag, not report the peer exited: everything
// a dead process stored is there. The schedule is scripted, so every run is that interleaving: the look
// at a process opens /proc/<pid>/stat (cpu::process_alive), and this program is linked with
// -Wl,--wrap=fopen, so opening the stat file of kGonePid (no such process) stores the peer's flag
// first. Both waits are checked, the real code of each: the shm transport's (cpu::flags_wait) and the
// CUDA kernels' protocol on the host platform (cuda::wait_at_least, cuda::wait_call).
// Prints one line per case, "<case>: <outcome>"; exit 0.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "cpu/flags.h"
#include "cuda/platform/host.h"
#include "cuda/protocol/wait.h"

namespace {

constexpr long long kGonePid = 0x7ffffff0;  // above any pid_max: never a process
int64_t g_flag = 0;
int64_t g_stores = 0;  // what the peer stores just before it exits (0: it exits without storing)

}  // namespace

extern "C" FILE* __real_fopen(const char* path, const char* mode);

extern "C" FILE* __wrap_fopen(const char* path, const char* mode) {
    char gone[64];
    std::snprintf(gone, sizeof(gone), "/proc/%lld/stat", kGonePid);
    if (g_stores != 0 && std::strcmp(path, gone) == 0) moe_comm::cpu::flag_store(&g_flag, g_stores);
    return __real_fopen(path, mode);
}

namespace {

using moe_comm::WaitOutcome;
namespace cuda = moe_comm::cuda;

const char* name(WaitOutcome outcome) {
    switch (outcome) {
        case WaitOutcome::kReached: return "reached";
        case WaitOutcome::kTimeout: return "timeout";
        case WaitOutcome::kPeerExited: return "peer exited";
        default: return "other";
    }
}

void shm_wait(const char* label, int64_t stores) {
    g_flag = 0;
    g_stores = stores;
    int64_t* flags[] = {&g_flag};
    const int64_t targets[] = {5};
    const int64_t pids[] = {kGonePid};
    WaitOutcome outcome = WaitOutcome::kReached;
    moe_comm::cpu::flags_wait(flags, targets, pids, 1, 10.0, false, &outcome);
    std::printf("%s: %s\n", label, name(outcome));
}

template <class Wait>
void kernel_wait(const char* label, int64_t stores, Wait wait) {
    g_flag = 0;
    g_stores = stores;
    cuda::ErrorRecord err{};
    const int64_t pids[] = {0, kGonePid};
    const cuda::Watch watch{&err, cuda::HostPlatform::now() + 10'000'000'000LL, 0, pids};
    const int64_t got = wait(watch);
    if (got == INT64_MIN) {
        std::printf("%s: %s (peer %d)\n", label, name(static_cast<WaitOutcome>(err.code)), err.peer);
    } else {
        std::printf("%s: returned %lld\n", label, static_cast<long long>(got));
    }
}

}  // namespace

int main() {
    shm_wait("shm, stored then exited", 5);
    shm_wait("shm, exited without storing", 0);
    auto at_least = [](const cuda::Watch& w) {
        return cuda::wait_at_least<cuda::HostPlatform>(w, &g_flag, 5, cuda::WaitKind::kBarrier, 1, -1);
    };
    kernel_wait("kernel at least, stored then exited", 5, at_least);
    kernel_wait("kernel at least, exited without storing", 0, at_least);
    auto call = [](const cuda::Watch& w) {
        return cuda::wait_call<cuda::HostPlatform>(w, &g_flag, 3, cuda::WaitKind::kHeader, 1, -1);
    };
    kernel_wait("kernel call, stored then exited", cuda::call_signal(3, 9), call);
    kernel_wait("kernel call, exited without storing", 0, call);
    return 0;
}
