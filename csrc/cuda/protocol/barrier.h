// The barrier of one node's ranks. Each rank's buffer holds arrive[R], monotonic: barrier number e
// (every rank counts its barriers alike) stores e into arrive[me] of every rank, then waits until its
// own arrive[i] >= e for every i. Monotonic counters need no reset, so no reset can race a late
// reader. The stores are releases: what a rank wrote before the barrier is visible to
// every rank after it. Run by one agent per rank. Model: tools/spin/barrier.pml.
#pragma once

#include "wait.h"

namespace moe_comm::cuda {

template <class P>
MC_HD bool barrier(const Watch& w, int64_t* const* arrive, int rank, int num_ranks, int64_t epoch) {
    for (int i = 0; i < num_ranks; ++i) P::store_release(arrive[i] + rank, epoch);
    for (int i = 0; i < num_ranks; ++i)
        if (wait_at_least<P>(w, arrive[rank] + i, epoch, WaitKind::kBarrier, i, -1) == INT64_MIN) return false;
    return true;
}

}  // namespace moe_comm::cuda
