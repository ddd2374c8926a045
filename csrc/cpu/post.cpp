#include "post.h"

#include <cstring>
#include <string>

#include "bounds.h"
#include "check.h"

namespace moe_comm::cpu {

int64_t post_records(const PostPlan& p, WaitOutcome* outcome) {
    const char* fn = "post_records";
    MC_CHECK(p.num_dests >= 0 && p.slot_bytes >= 0 && p.header_bytes >= 0 && p.record_bytes >= 0 &&
                 p.num_records >= 0,
             fn << ": num_dests, slot_bytes, header_bytes, record_bytes and num_records must be >= 0, got "
                << p.num_dests << ", " << p.slot_bytes << ", " << p.header_bytes << ", " << p.record_bytes << ", "
                << p.num_records);
    MC_CHECK(p.header_at >= 0 && p.header_at <= p.slot_bytes - p.header_bytes,
             fn << ": the header [" << p.header_at << ", +" << p.header_bytes << ") is outside the slot of "
                << p.slot_bytes << " bytes");
    MC_CHECK(p.rows_at >= 0 && p.rows_at <= p.slot_bytes,
             fn << ": rows_at " << p.rows_at << " is outside the slot of " << p.slot_bytes << " bytes");
    if (p.words != nullptr) check_in_record(fn, "word", p.word_offset, 1, sizeof(int32_t), p.record_bytes);
    const int64_t room = p.record_bytes > 0 ? (p.slot_bytes - p.rows_at) / p.record_bytes : INT64_MAX;
    for (int64_t d = 0; d < p.num_dests; ++d) {
        const int64_t first = p.firsts[d], count = p.counts[d];
        MC_CHECK(count >= 0 && count <= room,
                 fn << ": counts[" << d << "] = " << count << " is outside [0, " << room << "] (the records a slot holds)");
        MC_CHECK(first >= 0 && first <= p.num_records - count,
                 fn << ": records [" << first << ", +" << count << ") of destination " << d
                    << " are outside the gather's " << p.num_records);
    }
    // Every gathered row inside every segment, before any destination is written (pack_rows checks
    // again, per destination, when it is too late to write nothing).
    int fewest = -1;
    for (int s = 0; s < p.num_segments; ++s)
        if (fewest < 0 || p.segments[s].num_rows < p.segments[fewest].num_rows) fewest = s;
    if (fewest >= 0)
        check_indices(fn, "src_rows", p.src_rows, p.num_records, 0, -1, p.segments[fewest].num_rows,
                      "rows of segment " + std::to_string(fewest));
    *outcome = WaitOutcome::kReached;
    for (int64_t d = 0; d < p.num_dests; ++d) {
        if (p.free_at > 0 &&
            flags_wait(&p.consumed[d], &p.free_at, &p.pids[d], 1, p.timeout_s, false, outcome) >= 0)
            return d;
        uint8_t* slot = p.slots[d];
        std::memcpy(slot + p.header_at, p.header, static_cast<size_t>(p.header_bytes));
        const int64_t first = p.firsts[d], count = p.counts[d];
        if (count > 0) {
            uint8_t* rows = slot + p.rows_at;
            pack_rows(rows, p.segments, p.num_segments, p.src_rows + first, count, p.record_bytes, p.num_threads);
            if (p.words != nullptr)
                for (int64_t j = 0; j < count; ++j)
                    std::memcpy(rows + j * p.record_bytes + p.word_offset, p.words + first + j, sizeof(int32_t));
        }
        flag_store(p.arrived[d], p.seq);
    }
    return -1;
}

}  // namespace moe_comm::cpu
