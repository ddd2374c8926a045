#include "prepared_normal.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "../common/call_header.h"
#include "bounds.h"
#include "check.h"
#include "flags.h"
#include "post.h"

namespace moe_comm::cpu {
namespace {

constexpr int kNumSlots = 2;       // per channel (moe_comm/transport/shm_segment.py NUM_SLOTS)
constexpr int64_t kUnknown = -1;  // moe_comm/protocol/codes.py UNKNOWN

// Copies row `from` of `src` into row `to` of `dst` (fields of one element size and width).
void copy_row(const RowField& dst, int64_t to, const RowField& src, int64_t from) {
    uint8_t* d = dst.data + to * dst.row_stride;
    const uint8_t* s = src.data + from * src.row_stride;
    if (dst.col_stride == dst.elem_bytes && src.col_stride == src.elem_bytes) {
        std::memcpy(d, s, static_cast<size_t>(dst.elem_bytes * dst.num_cols));
        return;
    }
    for (int64_t c = 0; c < dst.num_cols; ++c)
        std::memcpy(d + c * dst.col_stride, s + c * src.col_stride, static_cast<size_t>(dst.elem_bytes));
}

// The segments of pack_rows / unpack_rows for these fields, rows from row `first` on (num_rows of them).
int segments_of(const RowField* fields, int n, int64_t first, int64_t num_rows, Segment* out) {
    int k = 0;
    for (int i = 0; i < n; ++i)
        if (fields[i].data != nullptr && fields[i].num_cols > 0)
            out[k++] = {fields[i].data + first * fields[i].row_stride, fields[i].row_stride, fields[i].col_stride,
                        fields[i].elem_bytes, fields[i].num_cols, fields[i].offset, num_rows};
    return k;
}

// The most rows one rank receives in an exchange of `matrix` ([s][d]: rows s sends d), without the
// rows a rank sends itself when `skip_self`.
int64_t most_received(const std::vector<int64_t>& matrix, int64_t R, bool skip_self) {
    int64_t most = 0;
    for (int64_t d = 0; d < R; ++d) {
        int64_t rows = 0;
        for (int64_t s = 0; s < R; ++s)
            if (!skip_self || s != d) rows += matrix[static_cast<size_t>(s * R + d)];
        most = std::max(most, rows);
    }
    return most;
}

}  // namespace

// An exchange of `matrix` in data slot `slot` (ShmTransport.exchange): to every rank d, after its slot is
// free, rows [firsts[d], firsts[d] + matrix[me][d]) of the gather at the offset the rows of lower ranks
// leave (none to itself with skip_self, but its flag still), then d's flag.
static PreparedStatus exchange_post(const ShmPostPlan& p, int slot, int64_t seq, const std::vector<int64_t>& matrix,
                                    bool skip_self, const int64_t* firsts, const Segment* segments, int num_segments,
                                    const int64_t* src_rows, int64_t num_records, int64_t record_bytes,
                                    PreparedFailure* failure) {
    const int64_t R = p.num_ranks, me = p.me;
    for (int64_t d = 0; d < R; ++d) {
        int64_t before = 0;
        for (int64_t i = 0; i < me; ++i)
            if (!skip_self || i != d) before += matrix[static_cast<size_t>(i * R + d)];
        const int64_t count = skip_self && d == me ? 0 : matrix[static_cast<size_t>(me * R + d)];
        const PostPlan plan{&p.slots[slot][d], &p.consumed[slot][d], &p.arrived[slot][d], &p.pids[d], 1,
                            p.slot_bytes, seq - kNumSlots, seq, p.timeout_s, nullptr, 0, 0, before * record_bytes,
                            &count, &firsts[d], segments, num_segments, src_rows, num_records, record_bytes,
                            nullptr, 0, p.num_threads};
        WaitOutcome outcome = WaitOutcome::kReached;
        if (post_records(plan, &outcome) >= 0) {
            *failure = {d, outcome};
            return PreparedStatus::kPostFailed;
        }
    }
    return PreparedStatus::kOk;
}

static PreparedStatus wait_all(int64_t* const* flags, int64_t seq, const ShmPostPlan& p, PreparedFailure* failure) {
    std::vector<int64_t> targets(static_cast<size_t>(p.num_ranks), seq);
    WaitOutcome outcome = WaitOutcome::kReached;
    const int64_t index = flags_wait(flags, targets.data(), p.pids.data(), p.num_ranks, p.timeout_s, true, &outcome);
    if (index < 0) return PreparedStatus::kOk;
    *failure = {index, outcome};
    return PreparedStatus::kWaitFailed;
}

// ---------------------------------------------------------------------------------------------- dispatch

PreparedNormalDispatch::PreparedNormalDispatch(ShmPostPlan plan, NormalDispatchGeometry geometry)
    : PreparedPosts(std::move(plan)), g_(geometry) {
    const int64_t R = plan_.num_ranks;
    MC_CHECK(g_.num_experts > 0 && g_.num_experts % R == 0 && g_.num_channels > 0 && g_.alignment > 0 &&
                 g_.num_topk >= 0 && g_.worst_word >= 0 && g_.worst_word < plan_.per_rank_word,
             "PreparedNormalDispatch: num_experts " << g_.num_experts << ", channels " << g_.num_channels
                                                    << ", alignment " << g_.alignment << " for " << R << " ranks");
    MC_CHECK(plan_.cell_bytes >= 8 * (g_.num_experts / R + g_.num_channels),
             "PreparedNormalDispatch: a metadata cell of " << plan_.cell_bytes << " bytes");
    for (int k = 0; k < kNumSlots; ++k)
        MC_CHECK(static_cast<int64_t>(plan_.meta_cells[k].size()) == R &&
                     static_cast<int64_t>(plan_.meta_mine[k].size()) == R,
                 "PreparedNormalDispatch: need every rank's metadata cells");
    if (g_.num_topk) {
        check_in_record("PreparedNormalDispatch", "topk_idx", g_.topk_offset, g_.num_topk, 8, plan_.record_bytes);
        check_in_record("PreparedNormalDispatch", "topk_weights", g_.weights_offset, g_.num_topk, 4,
                        plan_.record_bytes);
    }
    check_in_record("PreparedNormalDispatch", "src_idx", g_.src_offset, 1, 4, plan_.record_bytes);
    matrix_.resize(static_cast<size_t>(R * R));
    send_counts_.resize(static_cast<size_t>(R));
    send_firsts_.resize(static_cast<size_t>(R) + 1);
    per_rank_.resize(static_cast<size_t>(4 * R));
    recv_counts_.resize(static_cast<size_t>(R));
    zeros_.assign(static_cast<size_t>(R), 0);
    channel_prefix_.resize(static_cast<size_t>(R * g_.num_channels));
    const int64_t width = g_.num_experts / R + g_.num_channels;
    meta_.resize(static_cast<size_t>(R * width));
    got_.resize(static_cast<size_t>(R * width));
    per_expert_.resize(static_cast<size_t>(g_.num_experts / R));
}

PreparedStatus PreparedNormalDispatch::begin(const NormalDispatchInputs& in, int64_t number, int64_t seq_header,
                                             int64_t seq_meta, int64_t seq_data) {
    const int64_t R = plan_.num_ranks, T = in.num_tokens, C = g_.num_channels, local = g_.num_experts / R;
    // what the checked path checks of the values (buffer/normal_args.py check_dispatch_routing)
    std::fill(send_counts_.begin(), send_counts_.end(), 0);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < R; ++r) send_counts_[static_cast<size_t>(r)] += in.in_rank[t * R + r] ? 1 : 0;
    for (int64_t r = 0; r < R; ++r)
        if (send_counts_[static_cast<size_t>(r)] != in.per_rank[r]) return PreparedStatus::kNotTaken;
    in_ = in;
    // the send plan (ops/layout.py plan_sends): destination-major, tokens ascending
    send_firsts_[0] = 0;
    for (int64_t r = 0; r < R; ++r) send_firsts_[static_cast<size_t>(r) + 1] = send_firsts_[r] + send_counts_[r];
    send_rows_.resize(static_cast<size_t>(send_firsts_[static_cast<size_t>(R)]));
    send_pos_.assign(static_cast<size_t>(T * R), -1);
    for (int64_t r = 0, i = 0; r < R; ++r)
        for (int64_t t = 0; t < T; ++t)
            if (in.in_rank[t * R + r]) {
                send_rows_[static_cast<size_t>(i)] = t;
                send_pos_[static_cast<size_t>(t * R + r)] = static_cast<int32_t>(i++);
            }
    // the handshake: rows to each rank, the rest unknown
    std::fill(per_rank_.begin(), per_rank_.end(), kUnknown);
    std::copy(send_counts_.begin(), send_counts_.end(), per_rank_.begin());
    set_header(number, per_rank_.data());
    const int slot_header = static_cast<int>(seq_header % kNumSlots);
    round_ = {PreparedRound::kHeader};
    PreparedStatus status = post(slot_header, seq_header, zeros_.data(), zeros_.data(), nullptr, 0, nullptr, 0,
                                 nullptr, 0);
    if (status != PreparedStatus::kOk) return status;
    status = arrive(slot_header, seq_header, recv_counts_.data());
    if (status != PreparedStatus::kOk) return status;
    num_recv_ = 0;
    for (int64_t s = 0; s < R; ++s) {
        const uint8_t* header = header_of(slot_header, static_cast<int>(s));
        for (int64_t d = 0; d < R; ++d)
            matrix_[static_cast<size_t>(s * R + d)] = call_header::word(header, plan_.per_rank_word + d);
        num_recv_ += recv_counts_[static_cast<size_t>(s)];
    }
    for (int64_t d = 0; d < R; ++d) {  // _check_worst: a rank's num_worst_tokens holds what it receives
        int64_t received = 0;
        for (int64_t s = 0; s < R; ++s) received += matrix_[static_cast<size_t>(s * R + d)];
        const int64_t worst = call_header::word(header_of(slot_header, static_cast<int>(d)), g_.worst_word);
        if (worst > 0 && worst < received) return PreparedStatus::kDisagree;
    }
    release(slot_header, seq_header);
    // the counts per local expert and channel prefixes to every rank (ShmTransport.all_to_all)
    const int64_t per_channel = std::max<int64_t>((T + C - 1) / C, 1);
    std::fill(channel_prefix_.begin(), channel_prefix_.end(), 0);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < R; ++r)
            if (in.in_rank[t * R + r]) ++channel_prefix_[static_cast<size_t>(r * C + t / per_channel)];
    const int64_t width = local + C;
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t c = 1; c < C; ++c) channel_prefix_[r * C + c] += channel_prefix_[r * C + c - 1];
        for (int64_t e = 0; e < local; ++e) meta_[r * width + e] = in.per_expert[r * local + e];
        for (int64_t c = 0; c < C; ++c) meta_[r * width + local + c] = channel_prefix_[r * C + c];
    }
    seq_meta_ = seq_meta, slot_meta_ = static_cast<int>(seq_meta % kNumSlots);
    round_ = {PreparedRound::kMeta};
    for (int64_t d = 0; d < R; ++d) {
        int64_t* consumed = plan_.meta_consumed[slot_meta_][d];
        const int64_t free_at = seq_meta - kNumSlots;
        WaitOutcome outcome = WaitOutcome::kReached;
        if (free_at > 0 && flags_wait(&consumed, &free_at, &plan_.pids[d], 1, plan_.timeout_s, false, &outcome) >= 0) {
            failure_ = {d, outcome};
            return PreparedStatus::kPostFailed;
        }
        std::memcpy(plan_.meta_cells[slot_meta_][d], meta_.data() + d * width, static_cast<size_t>(8 * width));
        flag_store(plan_.meta_arrived[slot_meta_][d], seq_meta);
    }
    meta_mine_.assign(plan_.meta_mine[slot_meta_].begin(), plan_.meta_mine[slot_meta_].end());
    meta_mine_arrived_.assign(plan_.meta_mine_arrived[slot_meta_].begin(), plan_.meta_mine_arrived[slot_meta_].end());
    meta_own_consumed_ = plan_.meta_consumed[slot_meta_][plan_.me];
    seq_data_ = seq_data, slot_data_ = static_cast<int>(seq_data % kNumSlots);
    need_ = most_received(matrix_, R, true) * plan_.record_bytes;
    return need_ > plan_.slot_bytes ? PreparedStatus::kGrow : PreparedStatus::kOk;
}

PreparedStatus PreparedNormalDispatch::finish(const NormalDispatchOutputs& out) {
    const int64_t R = plan_.num_ranks, me = plan_.me, T = in_.num_tokens, C = g_.num_channels;
    const int64_t local = g_.num_experts / R, K = g_.num_topk, rb = plan_.record_bytes;
    MC_CHECK(need_ <= plan_.slot_bytes, "PreparedNormalDispatch: " << need_ << " bytes of rows in a slot of "
                                                                   << plan_.slot_bytes);
    std::vector<int32_t> src_index(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) src_index[static_cast<size_t>(t)] = static_cast<int32_t>(t);
    const RowField topk_in{reinterpret_cast<uint8_t*>(const_cast<int64_t*>(in_.topk_idx)), 8 * K, 8, 8, K,
                           g_.topk_offset};
    const RowField weights_in{reinterpret_cast<uint8_t*>(const_cast<float*>(in_.topk_weights)), 4 * K, 4, 4, K,
                              g_.weights_offset};
    const RowField src_in{reinterpret_cast<uint8_t*>(src_index.data()), 4, 4, 4, 1, g_.src_offset};
    const RowField inputs[5] = {in_.x, in_.scales, K ? topk_in : RowField{}, K ? weights_in : RowField{}, src_in};
    Segment segments[5];
    const int n = segments_of(inputs, 5, 0, T, segments);
    round_ = {PreparedRound::kData};
    PreparedStatus status = exchange_post(plan_, slot_data_, seq_data_, matrix_, true, send_firsts_.data(), segments,
                                          n, send_rows_.data(), static_cast<int64_t>(send_rows_.size()), rb,
                                          &failure_);
    if (status != PreparedStatus::kOk) return status;
    // the counts per local expert and channel prefixes of every rank
    round_ = {PreparedRound::kMeta};
    status = wait_all(meta_mine_arrived_.data(), seq_meta_, plan_, &failure_);
    if (status != PreparedStatus::kOk) return status;
    const int64_t width = local + C;
    for (int64_t s = 0; s < R; ++s) std::memcpy(got_.data() + s * width, meta_mine_[s], static_cast<size_t>(8 * width));
    flag_store(meta_own_consumed_, seq_meta_);
    for (int64_t e = 0; e < local; ++e) {
        int64_t sum = 0;
        for (int64_t s = 0; s < R; ++s) sum += got_[static_cast<size_t>(s * width + e)];
        per_expert_[static_cast<size_t>(e)] = (sum + g_.alignment - 1) / g_.alignment * g_.alignment;
    }
    for (int64_t s = 0; s < R; ++s)
        for (int64_t c = 0; c < C; ++c)
            out.recv_channel_prefix[s * C + c] = c ? static_cast<int32_t>(got_[s * width + local + c - 1]) : 0;
    for (int64_t j = 0; j < R; ++j)
        for (int64_t i = 0, sum = 0; i < R; ++i) {
            sum += matrix_[static_cast<size_t>(i * R + j)];
            out.rank_prefix[i * R + j] = static_cast<int32_t>(sum);
        }
    std::copy(channel_prefix_.begin(), channel_prefix_.end(), out.channel_prefix);
    std::copy(send_pos_.begin(), send_pos_.end(), out.send_head);
    // the rows: received ones around this rank's own, which it copies from its inputs
    round_ = {PreparedRound::kData};
    status = wait_all(plan_.mine[slot_data_].data(), seq_data_, plan_, &failure_);
    if (status != PreparedStatus::kOk) return status;
    int64_t before = 0;
    for (int64_t s = 0; s < me; ++s) before += recv_counts_[static_cast<size_t>(s)];
    const int64_t own = recv_counts_[static_cast<size_t>(me)], after = num_recv_ - before - own;
    MC_CHECK(num_recv_ <= out.rows, "PreparedNormalDispatch: " << num_recv_ << " rows into " << out.rows);
    const RowField topk_out{reinterpret_cast<uint8_t*>(out.topk_idx), 8 * K, 8, 8, K, g_.topk_offset};
    const RowField weights_out{reinterpret_cast<uint8_t*>(out.topk_weights), 4 * K, 4, 4, K, g_.weights_offset};
    const RowField src_out{reinterpret_cast<uint8_t*>(out.src_idx), 4, 4, 4, 1, g_.src_offset};
    const RowField outputs[5] = {out.x, out.scales, K ? topk_out : RowField{}, K ? weights_out : RowField{}, src_out};
    const uint8_t* received = plan_.slots[slot_data_][me];
    try {
        Segment seg[5];
        int k = segments_of(outputs, 5, 0, before, seg);
        unpack_rows(seg, k, received, nullptr, before, rb, plan_.num_threads);
        k = segments_of(outputs, 5, before + own, after, seg);
        unpack_rows(seg, k, received + before * rb, nullptr, after, rb, plan_.num_threads);
    } catch (...) {
        release(slot_data_, seq_data_);
        throw;
    }
    release(slot_data_, seq_data_);
    for (int64_t i = 0; i < own; ++i) {
        const int64_t t = send_rows_[static_cast<size_t>(send_firsts_[static_cast<size_t>(me)] + i)];
        for (int f = 0; f < 5; ++f)
            if (outputs[f].data != nullptr && outputs[f].num_cols > 0) copy_row(outputs[f], before + i, inputs[f], t);
    }
    for (int64_t r = 0; r < num_recv_ && K; ++r)  // local expert ids; other ranks' experts -1 (weight 0)
        for (int64_t k = 0; k < K; ++k) {
            int64_t& id = out.topk_idx[r * K + k];
            id -= me * local;
            if (id < 0 || id >= local) id = -1, out.topk_weights[r * K + k] = 0.0f;
        }
    for (int64_t r = num_recv_; r < out.rows; ++r) {  // padding (num_worst_tokens)
        for (const RowField* f : {&out.x, &out.scales})
            if (f->data != nullptr)
                for (int64_t c = 0; c < f->num_cols; ++c)
                    std::memset(f->data + r * f->row_stride + c * f->col_stride, 0, static_cast<size_t>(f->elem_bytes));
        for (int64_t k = 0; k < K; ++k) out.topk_idx[r * K + k] = -1, out.topk_weights[r * K + k] = 0.0f;
        out.src_idx[r] = -1;
    }
    return PreparedStatus::kOk;
}

// ---------------------------------------------------------------------------------------------- combine

PreparedNormalCombine::PreparedNormalCombine(ShmPostPlan plan, NormalCombineGeometry geometry)
    : PreparedPosts(std::move(plan)), g_(geometry) {
    const int64_t R = plan_.num_ranks;
    MC_CHECK(g_.hidden > 0 && g_.num_topk >= 0 && g_.x_elem == float_row_bytes(g_.dtype) && g_.x_elem > 0,
             "PreparedNormalCombine: hidden " << g_.hidden << ", x_elem " << g_.x_elem);
    check_in_record("PreparedNormalCombine", "x", 0, g_.hidden, g_.x_elem, plan_.record_bytes);
    if (g_.num_topk) check_in_record("PreparedNormalCombine", "weights", g_.weights_offset, g_.num_topk, 4,
                                     plan_.record_bytes);
    MC_CHECK(g_.digest_word >= 0 && g_.digest_word < plan_.per_rank_word,
             "PreparedNormalCombine: digest word " << g_.digest_word);
    matrix_.resize(static_cast<size_t>(R * R));
    returns_.resize(static_cast<size_t>(R));
    expected_.resize(static_cast<size_t>(R));
    digests_.resize(static_cast<size_t>(2 * R));
    per_rank_.resize(static_cast<size_t>(4 * R));
    firsts_.resize(static_cast<size_t>(R) + 1);
    zeros_.assign(static_cast<size_t>(R), 0);
    source_rows_.resize(static_cast<size_t>(R));
    sources_.resize(static_cast<size_t>(R));
}

PreparedStatus PreparedNormalCombine::begin(const NormalCombineInputs& in, int64_t number, int64_t seq_header,
                                            int64_t seq_data) {
    const int64_t R = plan_.num_ranks, me = plan_.me;
    // the handle, as protocol/handle.py NormalHandle.from_tuple checks it
    int64_t previous = 0;
    for (int64_t s = 0; s < R; ++s) {
        for (int64_t j = 0; j < R; ++j) {
            const int64_t step = in.rank_prefix[s * R + j] - (s ? in.rank_prefix[(s - 1) * R + j] : 0);
            if (step < 0) return PreparedStatus::kNotTaken;
        }
        returns_[static_cast<size_t>(s)] = in.rank_prefix[s * R + me] - previous;
        previous = in.rank_prefix[s * R + me];
    }
    const int64_t num_recv = previous;
    if (num_recv > in.src_rows || (in.rows != num_recv && in.rows != in.src_rows)) return PreparedStatus::kNotTaken;
    if (send_order_check(expected_.data(), digests_.data() + R, reinterpret_cast<const bool*>(in.in_rank),
                         in.send_head, in.num_tokens, R) >= 0)
        return PreparedStatus::kNotTaken;
    in_ = in;
    block_digests(digests_.data(), in.recv_src_idx, 4, returns_.data(), R, num_recv);
    int64_t prefix_digest;
    const int64_t cells = R * R;
    block_digests(&prefix_digest, in.rank_prefix, 4, &cells, 1, cells);
    std::copy(returns_.begin(), returns_.end(), per_rank_.begin());
    std::copy(expected_.begin(), expected_.end(), per_rank_.begin() + R);
    std::copy(digests_.begin(), digests_.begin() + R, per_rank_.begin() + 2 * R);
    std::copy(digests_.begin() + R, digests_.end(), per_rank_.begin() + 3 * R);
    set_header(number, per_rank_.data());
    std::memcpy(header_.data() + 8 * g_.digest_word, &prefix_digest, 8);
    const int slot_header = static_cast<int>(seq_header % kNumSlots);
    round_ = {PreparedRound::kHeader};
    PreparedStatus status = post(slot_header, seq_header, zeros_.data(), zeros_.data(), nullptr, 0, nullptr, 0,
                                 nullptr, 0);
    if (status != PreparedStatus::kOk) return status;
    std::vector<int64_t> recv(static_cast<size_t>(R));
    status = arrive(slot_header, seq_header, recv.data());
    if (status != PreparedStatus::kOk) return status;
    for (int64_t s = 0; s < R; ++s)
        for (int64_t d = 0; d < R; ++d)
            matrix_[static_cast<size_t>(s * R + d)] =
                call_header::word(header_of(slot_header, static_cast<int>(s)), plan_.per_rank_word + d);
    release(slot_header, seq_header);
    seq_data_ = seq_data, slot_data_ = static_cast<int>(seq_data % kNumSlots);
    need_ = most_received(matrix_, R, g_.direct) * plan_.record_bytes;
    return need_ > plan_.slot_bytes ? PreparedStatus::kGrow : PreparedStatus::kOk;
}

PreparedStatus PreparedNormalCombine::finish(void* out, float* out_weights) {
    const int64_t R = plan_.num_ranks, me = plan_.me, rb = plan_.record_bytes, K = g_.num_topk;
    MC_CHECK(need_ <= plan_.slot_bytes, "PreparedNormalCombine: " << need_ << " bytes of rows in a slot of "
                                                                  << plan_.slot_bytes);
    firsts_[0] = 0;
    for (int64_t s = 0; s < R; ++s) firsts_[static_cast<size_t>(s) + 1] = firsts_[s] + returns_[s];
    const int64_t num_return = firsts_[static_cast<size_t>(R)];
    send_rows_.resize(static_cast<size_t>(num_return));
    for (int64_t i = 0; i < num_return; ++i) send_rows_[static_cast<size_t>(i)] = i;
    const Segment fields[2] = {
        {const_cast<uint8_t*>(in_.x), g_.hidden * g_.x_elem, g_.x_elem, g_.x_elem, g_.hidden, 0, in_.rows},
        {reinterpret_cast<uint8_t*>(const_cast<float*>(in_.topk_weights)), 4 * K, 4, 4, K,
         g_.weights_offset, in_.rows}};
    round_ = {PreparedRound::kData};
    PreparedStatus status = exchange_post(plan_, slot_data_, seq_data_, matrix_, g_.direct, firsts_.data(), fields,
                                          K && in_.topk_weights != nullptr ? 2 : 1, send_rows_.data(), num_return,
                                          rb, &failure_);
    if (status != PreparedStatus::kOk) return status;
    status = wait_all(plan_.mine[slot_data_].data(), seq_data_, plan_, &failure_);
    if (status != PreparedStatus::kOk) return status;
    // where combine finds each token's row among those each rank returns (normal_layout.rows_within_destination
    // when they come back per source; the send position itself when all come back in one block)
    const int64_t T = in_.num_tokens;
    send_pos_.resize(static_cast<size_t>(T * R));
    std::vector<int64_t> starts(static_cast<size_t>(R) + 1, 0);
    for (int64_t r = 0; r < R; ++r) starts[static_cast<size_t>(r) + 1] = starts[r] + expected_[r];
    for (int64_t t = 0; t < T; ++t)
        for (int64_t r = 0; r < R; ++r) {
            const int32_t head = in_.send_head[t * R + r];
            send_pos_[static_cast<size_t>(t * R + r)] =
                !g_.direct ? head : head >= 0 ? static_cast<int32_t>(head - starts[static_cast<size_t>(r)]) : -1;
        }
    const uint8_t* received = plan_.slots[slot_data_][me];
    int64_t total = 0;
    for (int64_t s = 0; s < R; ++s) total += matrix_[static_cast<size_t>(s * R + me)];
    for (int64_t s = 0, begin = 0; s < R; ++s) {
        if (!g_.direct) {
            sources_[static_cast<size_t>(s)] = received, source_rows_[static_cast<size_t>(s)] = total;
        } else if (s == me) {  // this rank's own rows, in place in x
            sources_[static_cast<size_t>(s)] = in_.x + firsts_[static_cast<size_t>(me)] * g_.hidden * g_.x_elem;
            source_rows_[static_cast<size_t>(s)] = returns_[static_cast<size_t>(me)];
        } else {
            const int64_t count = matrix_[static_cast<size_t>(s * R + me)];
            sources_[static_cast<size_t>(s)] = received + begin * rb, source_rows_[static_cast<size_t>(s)] = count;
            begin += count;
        }
    }
    try {
        combine_reduce(out, out_weights, sources_.data(), source_rows_.data(), send_pos_.data(), nullptr, in_.bias0,
                       in_.bias1, T, R, g_.hidden, g_.dtype, rb, 0, g_.weights_offset, out_weights != nullptr ? K : 0,
                       plan_.num_threads);
    } catch (...) {
        release(slot_data_, seq_data_);
        throw;
    }
    release(slot_data_, seq_data_);
    return PreparedStatus::kOk;
}

}  // namespace moe_comm::cpu
