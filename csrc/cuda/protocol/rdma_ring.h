// A ring between nodes (one per channel, sender and receiver), written through a link (link.h). Each
// side waits only on its own memory: the receiver's buffer holds the slots and the tail, the sender's
// holds the head and its staging slots (the same positions; NVSHMEM puts from registered memory).
// Counters are monotonic within a launch (slot of position p: p % num_slots) and reset by their owner
// before the barrier that opens a launch.
//
//   sender:   wait head >= sent + n - num_slots  ->  write staging slots  ->  put them to the receiver's
//             slots  ->  publish the receiver's tail (put, then signal)
//             ... after its last chunk: drain, wait head >= count
//   receiver: wait tail > consumed  ->  read slots [consumed, tail)  ->  signal the sender's head
//
// The drain makes every remote write into a rank's buffer of launch k (the receiver's last head
// signal included) happen before that rank ends launch k, so the reset that opens launch k + 1 can
// never be overwritten by a late signal of launch k. A chunk larger than the ring never finds room:
// callers keep n <= num_slots. Model: tools/spin/forward.pml, forward_combine.pml.
#pragma once

#include "wait.h"

namespace moe_comm::cuda {

struct RdmaRing {
    int64_t tail;     // the tail counter, in the receiver's buffer
    int64_t slots;    // slot 0, in the receiver's buffer
    int64_t head;     // the head counter, in the sender's buffer
    int64_t staging;  // staging slot 0, in the sender's buffer
    int64_t num_slots, slot_bytes;

    MC_HD int64_t slot(int64_t position) const { return slots + (position % num_slots) * slot_bytes; }
    MC_HD int64_t staged(int64_t position) const { return staging + (position % num_slots) * slot_bytes; }
};

// Sender: waits (one agent) for n free slots after `sent`. False when the wait failed.
template <class P, class L>
MC_HD bool rdma_wait_space(const Watch& w, const L& link, const RdmaRing& ring, int64_t sent, int64_t n,
                           int peer_rank, int channel) {
    return wait_at_least<P>(w, link.local_flag(ring.head), sent + n - ring.num_slots, WaitKind::kRdmaSpace,
                            peer_rank, channel) != INT64_MIN;
}

// Sender (the group): staged positions [sent, sent + n) to the receiver `peer`, then its tail.
template <class P, class G, class L>
MC_HD void rdma_put(const L& link, int peer, const RdmaRing& ring, int64_t sent, int64_t n) {
    G::sync();  // every lane's staging writes are done before any lane puts them
    const int64_t first = sent % ring.num_slots;
    const int64_t before_wrap = ring.num_slots - first < n ? ring.num_slots - first : n;
    link.template put<G>(peer, ring.slot(sent), link.local(ring.staged(sent)), before_wrap * ring.slot_bytes);
    if (before_wrap < n)
        link.template put<G>(peer, ring.slot(0), link.local(ring.staged(0)), (n - before_wrap) * ring.slot_bytes);
    link.template publish<G>(peer, ring.tail, sent + n);
}

// Sender (one agent): waits until the receiver has consumed all `count` positions.
template <class P, class L>
MC_HD bool rdma_drain(const Watch& w, const L& link, const RdmaRing& ring, int64_t count, int peer_rank,
                      int channel) {
    return count == 0 ||
           wait_at_least<P>(w, link.local_flag(ring.head), count, WaitKind::kRdmaSpace, peer_rank, channel) != INT64_MIN;
}

// Receiver (one agent): waits for data past `consumed` (and for it to be visible: the link's settle);
// returns the tail seen, or INT64_MIN.
template <class P, class L>
MC_HD int64_t rdma_wait_data(const Watch& w, const L& link, const RdmaRing& ring, int64_t consumed, int peer_rank,
                             int channel) {
    const int64_t tail =
        wait_at_least<P>(w, link.local_flag(ring.tail), consumed + 1, WaitKind::kRdmaData, peer_rank, channel);
    if (tail != INT64_MIN) link.settle(ring.tail, tail);
    return tail;
}

// Receiver (one agent, after the group's reads): positions before `head` are free again at `peer`.
template <class L>
MC_HD void rdma_release(const L& link, int peer, const RdmaRing& ring, int64_t head) {
    link.signal(peer, ring.head, head);
}

}  // namespace moe_comm::cuda
