// Prepared normal-mode calls over the shm transport (moe_comm/backends/portable/prepared_normal.py): a
// dispatch or combine of a signature seen before runs its three (dispatch) or two (combine) rounds here,
// on the wire exactly as the checked path's (backends/portable/normal.py: the handshake's post, the count
// exchange through the metadata cells, the payload exchange through the data slots), so ranks on either
// path meet in one call. No torch or pybind11 types, as in api.h.
//
// begin() checks what the checked path would check of the values, plans the sends and runs the handshake
// (and a dispatch's count exchange post); it returns kNotTaken having written nothing, or the handshake's
// kWaitFailed / kDisagree with nothing more done, or kGrow when the payload needs larger data slots (every
// rank sees the same counts, so every rank stops there: the caller maps larger slots, refreshes the plan's
// data-slot addresses and calls finish()). finish() moves the payload and fills the outputs.
#pragma once

#include <cstdint>
#include <vector>

#include "prepared.h"

namespace moe_comm::cpu {

enum class PreparedRound : int32_t { kHeader = 0, kMeta = 1, kData = 2 };

// Where a round's wait failed (with PreparedFailure): which round.
struct NormalFailure {
    PreparedRound round = PreparedRound::kHeader;
};

// A record field of a normal-mode call: its source (inputs) or destination (outputs) rows.
struct RowField {
    uint8_t* data = nullptr;
    int64_t row_stride = 0, col_stride = 0, elem_bytes = 0, num_cols = 0, offset = 0;  // bytes; offset in a record
};

struct NormalDispatchGeometry {
    int64_t num_experts = 0, num_channels = 0, num_worst = 0, alignment = 1;
    int64_t num_topk = 0;  // 0: no top-k travels
    int64_t topk_offset = 0, weights_offset = 0, src_offset = 0;  // record fields besides x and scales
    int worst_word = 0;    // the header word of num_worst_tokens (_check_worst compares it across ranks)
};

struct NormalDispatchInputs {
    RowField x, scales;            // scales.data null: none
    const int64_t* topk_idx = nullptr;
    const float* topk_weights = nullptr;
    const uint8_t* in_rank = nullptr;    // [T, R] bool
    const int32_t* per_rank = nullptr;   // [R]
    const int32_t* per_expert = nullptr; // [E]
    int64_t num_tokens = 0;
};

struct NormalDispatchOutputs {
    RowField x, scales;                       // [rows, ...], row r at data + r * row_stride
    int64_t* topk_idx = nullptr;              // [rows, K]
    float* topk_weights = nullptr;            // [rows, K]
    int32_t* src_idx = nullptr;               // [rows]
    int64_t rows = 0;
    int32_t* rank_prefix = nullptr;           // [R, R]
    int32_t* channel_prefix = nullptr;        // [R, C]
    int32_t* recv_channel_prefix = nullptr;   // [R, C]
    int32_t* send_head = nullptr;             // [T, R]
};

class PreparedNormalDispatch : public PreparedPosts {
  public:
    PreparedNormalDispatch(ShmPostPlan plan, NormalDispatchGeometry geometry);
    PreparedStatus begin(const NormalDispatchInputs& in, int64_t number, int64_t seq_header, int64_t seq_meta,
                         int64_t seq_data);
    PreparedStatus finish(const NormalDispatchOutputs& out);

    int64_t num_recv() const { return num_recv_; }
    int64_t need() const { return need_; }
    const std::vector<int64_t>& per_expert() const { return per_expert_; }  // aligned, valid after finish
    const NormalFailure& round() const { return round_; }

  private:
    NormalDispatchGeometry g_;
    NormalDispatchInputs in_;
    NormalFailure round_;
    int64_t seq_meta_ = 0, seq_data_ = 0, num_recv_ = 0, need_ = 0;
    int slot_meta_ = 0, slot_data_ = 0;
    std::vector<int64_t> matrix_, send_counts_, send_firsts_, send_rows_, per_rank_, recv_counts_, meta_, got_,
        per_expert_, zeros_;
    std::vector<int32_t> send_pos_, channel_prefix_;
    // this call's metadata cells and flags, from the mapping it posted them in
    std::vector<const uint8_t*> meta_mine_;
    std::vector<int64_t*> meta_mine_arrived_;
    int64_t* meta_own_consumed_ = nullptr;
};

struct NormalCombineGeometry {
    int64_t hidden = 0, x_elem = 0, num_topk = 0;  // num_topk 0: no weights travel
    int64_t weights_offset = 0;                    // of the weights in a record
    DType dtype = DType::kBFloat16;
    bool direct = false;  // records are plain rows of x: this rank's own rows are summed in place, not sent
    int digest_word = 0;  // the header word of the rank prefix matrix's digest (each call's)
};

struct NormalCombineInputs {
    const uint8_t* x = nullptr;           // [N, H] contiguous
    int64_t rows = 0;                     // N (received rows, or the padded ones)
    const float* topk_weights = nullptr;  // [N, K] or null
    const void* bias0 = nullptr;
    const void* bias1 = nullptr;
    const int32_t* rank_prefix = nullptr;  // the handle: [R, R]
    const int32_t* recv_src_idx = nullptr; // [N_padded]
    int64_t src_rows = 0;                  // its length
    const uint8_t* in_rank = nullptr;      // [T, R] bool
    const int32_t* send_head = nullptr;    // [T, R]
    int64_t num_tokens = 0;
};

class PreparedNormalCombine : public PreparedPosts {
  public:
    PreparedNormalCombine(ShmPostPlan plan, NormalCombineGeometry geometry);
    PreparedStatus begin(const NormalCombineInputs& in, int64_t number, int64_t seq_header, int64_t seq_data);
    // The rows back and their sum into out [T, H] (and out_weights [T, K], or null).
    PreparedStatus finish(void* out, float* out_weights);
    int64_t need() const { return need_; }
    const NormalFailure& round() const { return round_; }

  private:
    NormalCombineGeometry g_;
    NormalCombineInputs in_;
    NormalFailure round_;
    int64_t seq_data_ = 0, need_ = 0;
    int slot_data_ = 0;
    std::vector<int64_t> matrix_, returns_, expected_, digests_, per_rank_, send_rows_, firsts_, zeros_, source_rows_;
    std::vector<int32_t> send_pos_;
    std::vector<const uint8_t*> sources_;
};

}  // namespace moe_comm::cpu
