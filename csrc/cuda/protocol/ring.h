// A ring of one (channel, source rank) pair, in the receiver's buffer: num_slots slots and two
// monotonic counters (slot of position p: p % num_slots). The sender owns tail, the receiver head,
// each on its own 64-byte line. Reset to zero by the receiver before the barrier that opens a launch.
//
//   sender:   wait head >= sent + n - num_slots (n free slots)  ->  write slots  ->  publish tail
//   receiver: wait tail > consumed  ->  read slots [consumed, tail)  ->  publish head
//
// Both publishes are release stores (after the group's barrier, so they cover every lane's copy; a
// release is cumulative, and compiles to a system fence and a strong store), both waits acquire loads: the receiver sees the
// slots the tail covers, and the sender never overwrites a slot the receiver is still reading (a
// relaxed head, as DeepEP stores it, lets the sender's write race the receiver's read: ThreadSanitizer
// reports it). A chunk larger than the ring never finds room: callers keep n <= num_slots.
// Model: tools/spin/ring.pml.
#pragma once

#include "wait.h"

namespace moe_comm::cuda {

struct alignas(64) RingCounter {
    int64_t value;
    int64_t pad[7];
};

struct RingMeta {
    RingCounter tail;  // written by the sender (a peer), read by the receiver
    RingCounter head;  // written by the receiver, read by the sender (a peer)
};

struct Ring {
    RingMeta* meta;
    uint8_t* slots;
    int64_t num_slots;
    int64_t slot_bytes;

    MC_HD uint8_t* slot(int64_t position) const { return slots + (position % num_slots) * slot_bytes; }
};

// Sender: waits for n free slots after `sent`. False when the wait failed.
template <class P>
MC_HD bool ring_wait_space(const Watch& w, const Ring& ring, int64_t sent, int64_t n, int peer, int channel) {
    return wait_at_least<P>(w, &ring.meta->head.value, sent + n - ring.num_slots, WaitKind::kRingSpace, peer,
                            channel) != INT64_MIN;
}

// Sender: slots before `tail` are written.
template <class P>
MC_HD void ring_publish_tail(const Ring& ring, int64_t tail) {
#ifdef MOE_COMM_PLANT_RELAXED_TAIL  // test the test: the ThreadSanitizer stress must report this
    P::store_relaxed(&ring.meta->tail.value, tail);
#else
    P::store_release(&ring.meta->tail.value, tail);
#endif
}

// Receiver: waits for data past `consumed`; returns the tail seen, or INT64_MIN.
template <class P>
MC_HD int64_t ring_wait_data(const Watch& w, const Ring& ring, int64_t consumed, int peer, int channel) {
    return wait_at_least<P>(w, &ring.meta->tail.value, consumed + 1, WaitKind::kRingData, peer, channel);
}

// Receiver: slots before `head` are read.
template <class P>
MC_HD void ring_publish_head(const Ring& ring, int64_t head) {
    P::store_release(&ring.meta->head.value, head);
}

// A group's whole send through `ring`: `count` rows in chunks of at most `chunk` (<= num_slots),
// each chunk written by fill(slot, position) on every lane in position order, then published.
// False when a wait failed.
template <class P, class Fill>
MC_HD bool ring_send(const Watch& w, const Ring& ring, int64_t count, int64_t chunk, int peer, int channel,
                     Fill fill) {
    using G = typename P::Group;
    for (int64_t sent = 0; sent < count;) {
        const int64_t n = count - sent < chunk ? count - sent : chunk;
        int ok = 1;
        if (G::leader()) ok = ring_wait_space<P>(w, ring, sent, n, peer, channel);
        if (!G::broadcast(ok)) return false;
        for (int64_t i = sent; i < sent + n; ++i) fill(ring.slot(i), i);
        G::sync();
        sent += n;
        if (G::leader()) ring_publish_tail<P>(ring, sent);
    }
    return true;
}

}  // namespace moe_comm::cuda
