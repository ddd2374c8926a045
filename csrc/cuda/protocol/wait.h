// Waits with a deadline, and the error record a failed wait leaves: no wait spins forever, on the
// host or on the device. The first failed wait of a launch writes the record (which wait, which peer,
// what it saw and wanted); every other wait of the launch sees the record and gives up too, so the
// launch ends and the host raises CommTimeoutError / PeerExitedError naming the peer.
#pragma once

#include <cstdint>

#include "../../common/codes.h"
#include "../platform/platform.h"

namespace moe_comm::cuda {

// Which wait failed (bound to Python as moe_comm._cuda_host.WaitKind).
enum class WaitKind : int32_t {
    kNone = 0,
    kBarrier = 1,        // a peer's arrival at a barrier
    kRingSpace = 2,      // a receiver freeing ring slots (the sender waits)
    kRingData = 3,       // a sender publishing ring slots (the receiver waits)
    kCount = 4,          // a low-latency dispatch count signal
    kCombineFlag = 5,    // a low-latency combine arrival flag
    kRdmaSpace = 6,      // an RDMA ring's receiver consuming slots (the sender waits; also its drain)
    kRdmaData = 7,       // an RDMA ring's sender putting slots (the receiver waits)
    kHeader = 8,         // a peer's low-latency call header (the receive waits)
    kConsumed = 9,       // a peer receiving call n - 2 of a buffer half (the sender of call n waits)
};

// Host-visible (pinned, mapped on the device); one per rank and launch.
struct ErrorRecord {
    int32_t code;     // WaitOutcome (codes.h): kReached until a wait fails, -1 while the record is filled
    int32_t kind;     // WaitKind
    int32_t rank;     // the rank that waited
    int32_t peer;     // the rank it waited for
    int32_t channel;  // channel, local expert or expert of the wait (-1: none)
    int32_t pad;
    int64_t observed; // the flag's value when it gave up
    int64_t expected; // the value it waited for (>=)
};

// What every wait of one rank's launch shares: where to report, the deadline, who is waiting, and
// (host only) the peers' pids so a wait for an exited process fails at once.
struct Watch {
    ErrorRecord* err;
    int64_t deadline;      // in P::now() units
    int32_t rank;
    const int64_t* pids;   // [num_ranks] or nullptr
};

template <class P>
MC_HD bool failed(const Watch& w) {
    return P::load_relaxed(&w.err->code) != 0;
}

template <class P>
MC_HD void report(const Watch& w, WaitOutcome code, WaitKind kind, int peer, int channel, int64_t observed,
                  int64_t expected) {
    if (P::cas32(&w.err->code, 0, -1)) {  // claim the record, fill it, then publish the code
        w.err->kind = static_cast<int32_t>(kind);
        w.err->rank = w.rank;
        w.err->peer = peer;
        w.err->channel = channel;
        w.err->observed = observed;
        w.err->expected = expected;
        P::store_release(&w.err->code, static_cast<int32_t>(code));
    }
}

// Every 256th spin of a wait: whether it must give up because another wait of the launch failed, the
// deadline passed or (host) the peer exited; the latter two are recorded (seen / wanted: what it saw
// and waited for). A peer found exited gets one more load first (`gone`, the wait's own): it may have
// stored the flag after the last load and then exited, and all a dead process stored is there.
template <class P>
MC_HD bool gives_up(const Watch& w, int64_t spins, WaitKind kind, int peer, int channel, int64_t seen,
                    int64_t wanted, bool& gone) {
    if (gone) {
        report<P>(w, WaitOutcome::kPeerExited, kind, peer, channel, seen, wanted);
        return true;
    }
    if ((spins & 255) != 255) return false;
    if (failed<P>(w)) return true;
    if (P::now() > w.deadline) {
        report<P>(w, WaitOutcome::kTimeout, kind, peer, channel, seen, wanted);
        return true;
    }
    gone = P::peer_exited(w.pids, peer);
    return false;
}

// Spins until *flag >= target (acquire), the deadline passes, or another wait of the launch failed.
// Returns the value seen, or INT64_MIN when it gave up (the record says why).
template <class P>
MC_HD int64_t wait_at_least(const Watch& w, const int64_t* flag, int64_t target, WaitKind kind, int peer,
                            int channel) {
    bool gone = false;
    for (int64_t spins = 0;; ++spins) {
        int64_t v = P::load_acquire(flag);
        if (v >= target) return v;
        if (gives_up<P>(w, spins, kind, peer, channel, v, target, gone)) return INT64_MIN;
        P::relax(spins);
    }
}

// A signal that carries its call: call << 32 | value (0 < value < 2^32, call < 2^31).
MC_HD int64_t call_signal(int64_t call, int64_t value) { return (call << 32) | value; }

// Spins until *flag carries call `call` (acquire), the deadline passes, another wait of the launch
// failed, or the flag carries a later call (the sender is ahead of this rank: out of step, PAST_TARGET).
// An earlier call's value is what the half held before: keep waiting. Returns the value part, or
// INT64_MIN when it gave up (the record says why). The value is tested too (never 0 in a signal), so
// the flag is read as one 64-bit load: ptxas narrows a load whose low half nobody reads.
template <class P>
MC_HD int64_t wait_call(const Watch& w, const int64_t* flag, int64_t call, WaitKind kind, int peer, int channel) {
    bool gone = false;
    for (int64_t spins = 0;; ++spins) {
        const int64_t v = P::load_acquire(flag), seen = v >> 32;
        if (seen == call && (v & 0xffffffff) != 0) return v & 0xffffffff;
        if (seen > call) {
            report<P>(w, WaitOutcome::kPastTarget, kind, peer, channel, seen, call);
            return INT64_MIN;
        }
        if (gives_up<P>(w, spins, kind, peer, channel, seen, call, gone)) return INT64_MIN;
        P::relax(spins);
    }
}

}  // namespace moe_comm::cuda
