// Prepared low-latency calls over the shm transport (moe_comm/backends/portable/prepared.py): what the
// first, fully checked call of a signature established (the geometry, where every rank's data slots and
// flags are, the record layout, the header template, the outputs of both buffer halves) is fixed here,
// so that each later call of the signature is one native call per op half. No torch or pybind11 types,
// as in api.h.
//
// The wire format is the checked path's, byte for byte (ShmTransport.post, call_header.py, the records of
// portable/low_latency.py): a rank on the prepared path and a rank on the checked path meet in one call.
//
// A send half either posts the whole call or returns kNotTaken having written nothing, not even to
// scratch that a pending receive reads: the checked path then runs the call from the start and words
// the error. A receive half that cannot finish (a wait that failed, headers that differ) returns its
// status with the slot untouched; the caller judges it with the checked path's code.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/codes.h"
#include "api.h"

namespace moe_comm::cpu {

enum class PreparedStatus : int32_t {
    kOk = 0,
    kNotTaken = 1,    // an input differs from what the prepared call accepts: nothing was written
    kPostFailed = 2,  // a flow-control wait failed while posting (failed_index: the rank, failed_outcome: why)
    kWaitFailed = 3,  // the receive's wait failed (failed_index: the source not reached, failed_outcome: why)
    kDisagree = 4,    // every header arrived, and they differ (or one carries a rejection)
    kGrow = 5,        // (normal mode) the payload needs larger data slots than those mapped now
};

// Where one rank's posts go, per data slot: the shm transport's segments of the R ranks of the host
// (every rank of the group: prepared calls run only then). Fixed while the segments stay mapped.
struct ShmPostPlan {
    int num_ranks = 0, me = 0;
    double timeout_s = 0;
    int64_t slot_bytes = 0;                   // one data slot's capacity
    std::vector<int64_t> pids;                // [R]
    std::vector<uint8_t*> slots[2];           // [slot][d]: d's data slot
    std::vector<int64_t*> consumed[2];        // [slot][d]: d's "slot consumed" flag
    std::vector<int64_t*> arrived[2];         // [slot][d]: d's "arrived from me" flag
    std::vector<int64_t*> mine[2];            // [slot][s]: my "arrived from s" flag
    // The post's geometry (ShmTransport.post): header cells first, then each source's region of `room`
    // records of `record_bytes` at rows_at + s * room * record_bytes.
    int64_t header_bytes = 0, rows_at = 0, room = 0, record_bytes = 0;
    // Words of a header (csrc/common/call_header.h): the call number's, the rejected bit's, where the
    // per-rank parts start (len(Field)), and the mask of words every rank's must hold alike.
    int call_word = 0, rejected_word = 0, per_rank_word = 0;
    uint64_t compare = 0;
    std::vector<uint8_t> header;              // the template: every word but the call and the per-rank parts
    int num_threads = 1;
    // The metadata channel (ShmTransport.all_to_all), for normal-mode calls: per slot, per host rank.
    int64_t cell_bytes = 0;
    std::vector<uint8_t*> meta_cells[2];          // [slot][d]: this rank's cell in d's segment
    std::vector<int64_t*> meta_arrived[2];        // [slot][d]: d's "arrived from me" flag
    std::vector<int64_t*> meta_consumed[2];       // [slot][d]: d's "cell consumed" flag
    std::vector<const uint8_t*> meta_mine[2];     // [slot][s]: s's cell in this rank's segment
    std::vector<int64_t*> meta_mine_arrived[2];   // [slot][s]
};

// Why the last call failed, for the caller's error (valid after kPostFailed / kWaitFailed).
struct PreparedFailure {
    int64_t index = -1;
    WaitOutcome outcome = WaitOutcome::kReached;
};

// The shared part: posting a header and records to every rank, waiting for and judging a call's headers.
class PreparedPosts {
  public:
    explicit PreparedPosts(ShmPostPlan plan);
    const ShmPostPlan& plan() const { return plan_; }
    const PreparedFailure& failure() const { return failure_; }
    // After the transport grew its data slots: their new addresses (the metadata cells stay where they were).
    void refresh_data(const ShmPostPlan& plan);

  protected:
    // Writes call `number`'s header (the template, the call number, the [4][R] per-rank words) into
    // header_, for the post of exchange `seq` into data slot `slot`.
    void set_header(int64_t number, const int64_t* per_rank);
    // The post of exchange seq (ShmTransport.post): to every rank, the flow-control wait, the header,
    // records [firsts[d], firsts[d] + counts[d]) of the gather, the publish.
    PreparedStatus post(int slot, int64_t seq, const int64_t* counts, const int64_t* firsts, const Segment* segments,
                        int num_segments, const int64_t* src_rows, int64_t num_records, const int32_t* words,
                        int64_t word_offset);
    // Waits for every rank's post of exchange seq in `slot` and judges the headers; on kOk fills
    // recv_counts[s] (rows s sent here, each within `room`).
    PreparedStatus arrive(int slot, int64_t seq, int64_t* recv_counts);
    // This rank is done with `slot`'s rows of exchange seq.
    void release(int slot, int64_t seq);
    // The header of rank s in `slot` (valid after arrive).
    const uint8_t* header_of(int slot, int s) const { return plan_.slots[slot][plan_.me] + s * plan_.header_bytes; }
    const uint8_t* records(int slot) const { return plan_.slots[slot][plan_.me] + plan_.rows_at; }

    ShmPostPlan plan_;
    PreparedFailure failure_;
    std::vector<uint8_t> header_;
    std::vector<int64_t> firsts_;  // [R]: s * room, where source s's records start
};

// One buffer half's dispatch outputs (moe_comm.protocol.low_latency_layout.dispatch_outputs).
struct DispatchHalf {
    uint8_t* recv_x = nullptr;
    uint8_t* scales = nullptr;                   // null for BF16
    int64_t scales_strides[3] = {0, 0, 0};       // bytes: expert, row, column
    int32_t* src_info = nullptr;
    int64_t* layout_range = nullptr;
    int32_t* recv_count = nullptr;
};

struct DispatchGeometry {
    int64_t num_experts = 0, num_max_tokens = 0, hidden = 0;
    int64_t num_topk = 0;
    bool fp8 = false, round_scale = false, ue8m0 = false;
    // The record (portable/low_latency.py _dispatch_records): x (bf16, or FP8 codes), scales, src, expert.
    int64_t x_offset = 0, scales_offset = 0, num_scales = 0, scale_bytes = 0, src_offset = 0, expert_offset = 0;
};

// A dispatch's per-call inputs, their metadata already checked against the geometry by the binding.
struct DispatchInputs {
    const uint16_t* x = nullptr;       // [T, hidden] bf16, rows x_row_stride elements apart, columns contiguous
    int64_t num_tokens = 0, x_row_stride = 0;
    const int64_t* topk_idx = nullptr;  // [T, num_topk] int64, contiguous
    int32_t* recv_stats = nullptr;      // [E_loc] or null
    int64_t* wait_stats = nullptr;      // [R] or null
};

class PreparedDispatch : public PreparedPosts {
  public:
    PreparedDispatch(ShmPostPlan plan, DispatchGeometry geometry, DispatchHalf halves[2]);
    // The send half of call `number` as exchange `seq` into data slot `slot`, its outputs in buffer half `half`.
    PreparedStatus send(const DispatchInputs& in, int64_t number, int64_t seq, int slot, int half);
    // The receive half of the call last sent on `half`: rows unpacked into its outputs, slot freed, stats added.
    PreparedStatus receive(int half);

  private:
    struct Pending {
        int64_t seq = 0;
        int slot = 0;
        int32_t* recv_stats = nullptr;
        int64_t* wait_stats = nullptr;
    };
    DispatchGeometry g_;
    DispatchHalf halves_[2];
    Pending pending_[2];
    std::vector<int64_t> msg_, experts_, tokens_, counts_, firsts_send_, per_rank_, recv_counts_;
    std::vector<int32_t> words_, src_index_;
    std::vector<uint8_t> codes_, scales_;  // the FP8 cast of x, [M, hidden] and [M, num_scales]
};

// One combine's per-call inputs, checked by the binding (shapes, dtypes, contiguity).
struct CombineInputs {
    const uint16_t* x = nullptr;            // [E_loc, R * M, hidden] bf16, contiguous
    const int32_t* src_info = nullptr;      // [E_loc, R * M]
    const int64_t* layout_range = nullptr;  // [E_loc, R]
    const int64_t* topk_idx = nullptr;      // [T, num_topk]
    const float* topk_weights = nullptr;    // [T, num_topk]
    int64_t num_tokens = 0;
    uint16_t* out = nullptr;                // [T, hidden] bf16, contiguous
    int64_t* wait_stats = nullptr;          // [R] or null
};

struct CombineGeometry {
    int64_t num_experts = 0, num_max_tokens = 0, hidden = 0, num_topk = 0;
};

class PreparedCombine : public PreparedPosts {
  public:
    PreparedCombine(ShmPostPlan plan, CombineGeometry geometry);
    PreparedStatus send(const CombineInputs& in, int64_t number, int64_t seq, int slot, int half);
    PreparedStatus receive(int half);

  private:
    struct Pending {
        int64_t seq = 0;
        int slot = 0;
        int64_t num_tokens = 0, num_messages = 0;
        const float* topk_weights = nullptr;
        uint16_t* out = nullptr;
        int64_t* wait_stats = nullptr;
        std::vector<int64_t> msg, experts;  // this call's send order (its returned rows' places)
    };
    CombineGeometry g_;
    Pending pending_[2];
    std::vector<int64_t> rows_, counts_, expected_, firsts_send_, per_rank_, recv_counts_, source_rows_;
    std::vector<int32_t> pos_;
    std::vector<const uint8_t*> sources_;
};

}  // namespace moe_comm::cpu
