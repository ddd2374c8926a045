// A low-latency post through shared memory (moe_comm/transport/shm.py, ShmTransport.post) in one
// native call: every destination's header, rows and publish, with the flow-control wait before each.
// No torch or pybind11 types, as in api.h.
#pragma once

#include <cstdint>

#include "api.h"
#include "flags.h"

namespace moe_comm::cpu {

// Where and what one post writes. Destination d's data slot starts at slots[d] and holds slot_bytes:
// the header goes to [header_at, header_at + header_bytes), its records to [rows_at, rows_at +
// counts[d] * record_bytes). Record j of destination d is record firsts[d] + j of the gather: the
// segments' rows src_rows[firsts[d] + j] (pack_rows), then, when words is not null, the int32
// words[firsts[d] + j] at word_offset.
struct PostPlan {
    uint8_t* const* slots;
    int64_t* const* consumed;   // [n] the destination's "slot consumed" flag
    int64_t* const* arrived;    // [n] the destination's "arrived from this rank" flag
    const int64_t* pids;        // [n] the destination's process (<= 0: not checked)
    int64_t num_dests, slot_bytes;
    int64_t free_at, seq;       // wait until *consumed >= free_at (none when free_at <= 0); publish seq
    double timeout_s;
    const uint8_t* header;
    int64_t header_bytes, header_at, rows_at;
    const int64_t* counts;      // [n]
    const int64_t* firsts;      // [n]
    const Segment* segments;
    int num_segments;
    const int64_t* src_rows;    // [num_records]
    int64_t num_records, record_bytes;
    const int32_t* words;       // [num_records] or null
    int64_t word_offset;
    int num_threads;
};

// For each destination in order: waits until its slot is free (flags_wait on consumed, with the
// deadline and the destination's liveness), writes the header and the records, then publishes
// arrived = seq with a release store. Checks every place inside a slot and every record inside the
// gather before writing anything (std::invalid_argument). Returns -1 with *outcome = kReached, or the
// index of the destination whose wait failed, with *outcome saying why (nothing written to it or after).
int64_t post_records(const PostPlan& plan, WaitOutcome* outcome);

}  // namespace moe_comm::cpu
