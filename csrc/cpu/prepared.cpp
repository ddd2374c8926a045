#include "prepared.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "../common/call_header.h"
#include "bounds.h"
#include "check.h"
#include "flags.h"
#include "post.h"

namespace moe_comm::cpu {
namespace {

constexpr int kNumSlots = 2;  // per channel (moe_comm/transport/shm_segment.py NUM_SLOTS)
constexpr int64_t kUnknown = -1;  // a per-rank word this rank cannot fill (moe_comm/protocol/codes.py UNKNOWN)

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Whether topk_idx [T, K] holds ids in [-1, num_experts) and no row picks an expert twice: what the
// checked path's argument checks accept (buffer/low_latency_args.py).
bool topk_valid(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts) {
    if (num_tokens * num_topk == 0) return true;
    int64_t lo, hi, dup_row, dup_expert;
    topk_summary(topk_idx, num_tokens, num_topk, &lo, &hi, &dup_row, &dup_expert);
    return lo >= -1 && hi < num_experts && dup_row < 0;
}

void add_stats(int32_t* recv_stats, const int32_t* recv_count, int64_t local, int64_t* wait_stats,
               int64_t num_ranks, int64_t waited_ns) {
    if (recv_stats != nullptr)
        for (int64_t e = 0; e < local; ++e) recv_stats[e] += recv_count[e];
    if (wait_stats != nullptr)
        for (int64_t r = 0; r < num_ranks; ++r) wait_stats[r] += waited_ns;
}

}  // namespace

void PreparedPosts::refresh_data(const ShmPostPlan& plan) {
    for (int k = 0; k < kNumSlots; ++k) {
        plan_.slots[k] = plan.slots[k], plan_.consumed[k] = plan.consumed[k];
        plan_.arrived[k] = plan.arrived[k], plan_.mine[k] = plan.mine[k];
    }
    plan_.slot_bytes = plan.slot_bytes;
}

PreparedPosts::PreparedPosts(ShmPostPlan plan) : plan_(std::move(plan)) {
    const int R = plan_.num_ranks;
    MC_CHECK(R > 0 && plan_.me >= 0 && plan_.me < R, "PreparedPosts: rank " << plan_.me << " of " << R);
    for (int k = 0; k < kNumSlots; ++k)
        MC_CHECK(static_cast<int>(plan_.slots[k].size()) == R && static_cast<int>(plan_.consumed[k].size()) == R &&
                     static_cast<int>(plan_.arrived[k].size()) == R && static_cast<int>(plan_.mine[k].size()) == R,
                 "PreparedPosts: need every rank's slot, consumed, arrived and own arrived flag for each slot");
    MC_CHECK(static_cast<int>(plan_.pids.size()) == R, "PreparedPosts: need one pid per rank");
    const int64_t words = plan_.per_rank_word + 4 * int64_t{R};
    MC_CHECK(plan_.header_bytes == static_cast<int64_t>(plan_.header.size()) &&
                 plan_.header_bytes >= 8 * std::max<int64_t>(words, 64) && plan_.call_word >= 0 &&
                 plan_.call_word < plan_.per_rank_word && plan_.rejected_word >= 0 && plan_.rejected_word < 64,
             "PreparedPosts: a header of " << plan_.header.size() << " bytes for " << words << " words");
    // Every header cell and every source's region inside the slot.
    MC_CHECK(plan_.record_bytes > 0 && plan_.room >= 0 && int64_t{R} * plan_.header_bytes <= plan_.rows_at &&
                 plan_.rows_at + int64_t{R} * plan_.room * plan_.record_bytes <= plan_.slot_bytes,
             "PreparedPosts: " << R << " regions of " << plan_.room << " records of " << plan_.record_bytes
                               << " bytes from byte " << plan_.rows_at << " exceed the " << plan_.slot_bytes
                               << "-byte slot");
    header_ = plan_.header;
    firsts_.resize(static_cast<size_t>(R));
    for (int s = 0; s < R; ++s) firsts_[static_cast<size_t>(s)] = s * plan_.room;
}

void PreparedPosts::set_header(int64_t number, const int64_t* per_rank) {
    std::memcpy(header_.data() + 8 * plan_.call_word, &number, 8);
    std::memcpy(header_.data() + 8 * plan_.per_rank_word, per_rank, 8 * 4 * static_cast<size_t>(plan_.num_ranks));
}

PreparedStatus PreparedPosts::post(int slot, int64_t seq, const int64_t* counts, const int64_t* firsts,
                                   const Segment* segments, int num_segments, const int64_t* src_rows,
                                   int64_t num_records, const int32_t* words, int64_t word_offset) {
    const ShmPostPlan& p = plan_;
    const PostPlan plan{p.slots[slot].data(), p.consumed[slot].data(), p.arrived[slot].data(), p.pids.data(),
                        p.num_ranks, p.slot_bytes, seq - kNumSlots, seq, p.timeout_s, header_.data(), p.header_bytes,
                        p.me * p.header_bytes, p.rows_at + p.me * p.room * p.record_bytes, counts, firsts, segments,
                        num_segments, src_rows, num_records, p.record_bytes, words, word_offset, p.num_threads};
    WaitOutcome outcome = WaitOutcome::kReached;
    const int64_t index = post_records(plan, &outcome);
    if (index < 0) return PreparedStatus::kOk;
    failure_ = {index, outcome};
    return PreparedStatus::kPostFailed;
}

PreparedStatus PreparedPosts::arrive(int slot, int64_t seq, int64_t* recv_counts) {
    const ShmPostPlan& p = plan_;
    std::vector<int64_t> targets(static_cast<size_t>(p.num_ranks), seq);
    WaitOutcome outcome = WaitOutcome::kReached;
    const int64_t index = flags_wait(p.mine[slot].data(), targets.data(), p.pids.data(), p.num_ranks, p.timeout_s,
                                     true, &outcome);
    if (index >= 0) {
        failure_ = {index, outcome};
        return PreparedStatus::kWaitFailed;
    }
    const uint8_t* first = p.slots[slot][p.me];
    if (!call_header::agree(first, p.header_bytes, nullptr, p.num_ranks, p.me, p.per_rank_word, p.rejected_word,
                            p.compare, nullptr))
        return PreparedStatus::kDisagree;
    for (int s = 0; s < p.num_ranks; ++s)
        recv_counts[s] = call_header::word(first + s * p.header_bytes, p.per_rank_word + p.me);
    return PreparedStatus::kOk;
}

void PreparedPosts::release(int slot, int64_t seq) { flag_store(plan_.consumed[slot][plan_.me], seq); }

// ---------------------------------------------------------------------------------------------- dispatch

PreparedDispatch::PreparedDispatch(ShmPostPlan plan, DispatchGeometry geometry, DispatchHalf halves[2])
    : PreparedPosts(std::move(plan)), g_(geometry) {
    const int64_t R = plan_.num_ranks, M = g_.num_max_tokens, K = g_.num_topk;
    MC_CHECK(g_.num_experts > 0 && g_.num_experts % R == 0 && M > 0 && K >= 0 && g_.hidden > 0 &&
                 g_.hidden % kFp8Group == 0,
             "PreparedDispatch: num_experts " << g_.num_experts << ", M " << M << ", num_topk " << K << ", hidden "
                                              << g_.hidden << " for " << R << " ranks");
    const int64_t x_bytes = g_.fp8 ? g_.hidden : 2 * g_.hidden;
    check_in_record("PreparedDispatch", "x", g_.x_offset, x_bytes, 1, plan_.record_bytes);
    if (g_.fp8) check_in_record("PreparedDispatch", "scales", g_.scales_offset, g_.num_scales, g_.scale_bytes,
                                plan_.record_bytes);
    check_in_record("PreparedDispatch", "src", g_.src_offset, 1, 4, plan_.record_bytes);
    check_in_record("PreparedDispatch", "expert", g_.expert_offset, 1, 4, plan_.record_bytes);
    for (int h = 0; h < 2; ++h) halves_[h] = halves[h];
    msg_.resize(static_cast<size_t>(M * K));
    experts_.resize(msg_.size());
    tokens_.resize(msg_.size());
    words_.resize(msg_.size());
    counts_.resize(static_cast<size_t>(R));
    firsts_send_.resize(static_cast<size_t>(R) + 1);
    per_rank_.assign(static_cast<size_t>(4 * R), kUnknown);
    recv_counts_.resize(static_cast<size_t>(R));
    src_index_.resize(static_cast<size_t>(M));
    for (int64_t t = 0; t < M; ++t) src_index_[static_cast<size_t>(t)] = static_cast<int32_t>(t);
    if (g_.fp8) {
        codes_.resize(static_cast<size_t>(M * g_.hidden));
        scales_.resize(static_cast<size_t>(M * g_.num_scales * g_.scale_bytes));
    }
}

PreparedStatus PreparedDispatch::send(const DispatchInputs& in, int64_t number, int64_t seq, int slot, int half) {
    const int64_t R = plan_.num_ranks, T = in.num_tokens, K = g_.num_topk, H = g_.hidden;
    const int64_t local = g_.num_experts / R;
    if (T < 0 || T > g_.num_max_tokens || !topk_valid(in.topk_idx, T, K, g_.num_experts))
        return PreparedStatus::kNotTaken;
    const int64_t n = low_latency_send_order(msg_.data(), experts_.data(), counts_.data(), in.topk_idx, T, K,
                                             g_.num_experts, R);
    for (int64_t d = 0; d < R; ++d)
        if (counts_[static_cast<size_t>(d)] > plan_.room) return PreparedStatus::kNotTaken;
    firsts_send_[0] = 0;
    for (int64_t d = 0; d < R; ++d) firsts_send_[static_cast<size_t>(d) + 1] = firsts_send_[d] + counts_[d];
    for (int64_t i = 0; i < n; ++i) {
        tokens_[static_cast<size_t>(i)] = msg_[static_cast<size_t>(i)] / K;
        words_[static_cast<size_t>(i)] = static_cast<int32_t>(experts_[static_cast<size_t>(i)] % local);
    }
    Segment segments[3];
    int num_segments = 0;
    if (g_.fp8) {
        if (T > 0)
            quantize_rows(codes_.data(), scales_.data(), in.x, nullptr, T, T, H, 1, DType::kBFloat16,
                          QuantFormat::kE4M3, g_.round_scale, g_.ue8m0, plan_.num_threads);
        segments[num_segments++] = {codes_.data(), H, 1, 1, H, g_.x_offset, T};
        const int64_t row = g_.num_scales * g_.scale_bytes;
        segments[num_segments++] = {scales_.data(), row, g_.scale_bytes, g_.scale_bytes, g_.num_scales,
                                    g_.scales_offset, T};
    } else {
        segments[num_segments++] = {reinterpret_cast<uint8_t*>(const_cast<uint16_t*>(in.x)), 2 * in.x_row_stride, 2,
                                    2, H, g_.x_offset, T};
    }
    segments[num_segments++] = {reinterpret_cast<uint8_t*>(src_index_.data()), 4, 4, 4, 1, g_.src_offset, T};
    std::copy(counts_.begin(), counts_.end(), per_rank_.begin());  // rows to each rank; the rest unknown
    set_header(number, per_rank_.data());
    pending_[half] = {seq, slot, in.recv_stats, in.wait_stats};
    return post(slot, seq, counts_.data(), firsts_send_.data(), segments, num_segments, tokens_.data(), n,
                words_.data(), g_.expert_offset);
}

PreparedStatus PreparedDispatch::receive(int half) {
    const Pending& p = pending_[half];
    const DispatchHalf& out = halves_[half];
    const int64_t begin = now_ns(), R = plan_.num_ranks, local = g_.num_experts / R;
    const PreparedStatus status = arrive(p.slot, p.seq, recv_counts_.data());
    if (status != PreparedStatus::kOk) return status;
    try {
        low_latency_unpack(out.recv_x, out.scales, out.src_info, out.recv_count, out.layout_range, records(p.slot),
                           recv_counts_.data(), firsts_.data(), R * plan_.room, R, local, R * g_.num_max_tokens,
                           plan_.record_bytes, g_.x_offset, g_.fp8 ? g_.hidden : 2 * g_.hidden, g_.scales_offset,
                           g_.fp8 ? g_.num_scales : 0, g_.scale_bytes, out.scales_strides[0], out.scales_strides[1],
                           out.scales_strides[2], g_.src_offset, g_.expert_offset, plan_.num_threads,
                           /*padded=*/true);
    } catch (...) {
        release(p.slot, p.seq);
        throw;
    }
    release(p.slot, p.seq);
    add_stats(p.recv_stats, out.recv_count, local, p.wait_stats, R, now_ns() - begin);
    return PreparedStatus::kOk;
}

// ---------------------------------------------------------------------------------------------- combine

PreparedCombine::PreparedCombine(ShmPostPlan plan, CombineGeometry geometry)
    : PreparedPosts(std::move(plan)), g_(geometry) {
    const int64_t R = plan_.num_ranks, M = g_.num_max_tokens, K = g_.num_topk;
    MC_CHECK(g_.num_experts > 0 && g_.num_experts % R == 0 && M > 0 && K >= 0 && g_.hidden > 0,
             "PreparedCombine: num_experts " << g_.num_experts << ", M " << M << ", num_topk " << K << ", hidden "
                                             << g_.hidden << " for " << R << " ranks");
    check_in_record("PreparedCombine", "x", 0, g_.hidden, 2, plan_.record_bytes);
    const int64_t local = g_.num_experts / R;
    for (Pending& p : pending_) {
        p.msg.resize(static_cast<size_t>(M * K));
        p.experts.resize(p.msg.size());
    }
    rows_.resize(static_cast<size_t>(local * R * M));
    counts_.resize(static_cast<size_t>(R));
    expected_.resize(static_cast<size_t>(R));
    firsts_send_.resize(static_cast<size_t>(R) + 1);
    per_rank_.resize(static_cast<size_t>(4 * R));
    recv_counts_.resize(static_cast<size_t>(R));
    pos_.resize(static_cast<size_t>(M * K));
    source_rows_.assign(static_cast<size_t>(K), R * plan_.room);
    sources_.resize(static_cast<size_t>(K));
}

PreparedStatus PreparedCombine::send(const CombineInputs& in, int64_t number, int64_t seq, int slot, int half) {
    const int64_t R = plan_.num_ranks, T = in.num_tokens, K = g_.num_topk, M = g_.num_max_tokens;
    const int64_t local = g_.num_experts / R, rows_per_expert = R * M;
    if (T < 0 || T > M || low_latency_layout_check(in.layout_range, local, R, rows_per_expert) >= 0 ||
        !topk_valid(in.topk_idx, T, K, g_.num_experts))
        return PreparedStatus::kNotTaken;
    Pending& p = pending_[half];
    // messages this rank sent with the dispatch, per destination: the rows it expects back
    const int64_t n = low_latency_send_order(p.msg.data(), p.experts.data(), expected_.data(), in.topk_idx, T, K,
                                             g_.num_experts, R);
    for (int64_t s = 0; s < R; ++s) {  // rows going back to each source rank
        int64_t rows = 0;
        for (int64_t e = 0; e < local; ++e) rows += in.layout_range[e * R + s] & 0xFFFFFFFF;
        if (rows > plan_.room) return PreparedStatus::kNotTaken;
        counts_[static_cast<size_t>(s)] = rows;
    }
    int64_t* part = per_rank_.data();
    std::copy(counts_.begin(), counts_.end(), part);
    std::copy(expected_.begin(), expected_.end(), part + R);
    low_latency_combine_digests(part + 2 * R, part + 3 * R, in.layout_range, in.src_info, p.msg.data(),
                                p.experts.data(), expected_.data(), local, R, rows_per_expert, K);
    const int64_t num_rows = low_latency_combine_rows(rows_.data(), in.layout_range, local, R, rows_per_expert,
                                                      static_cast<int64_t>(rows_.size()));
    firsts_send_[0] = 0;
    for (int64_t d = 0; d < R; ++d) firsts_send_[static_cast<size_t>(d) + 1] = firsts_send_[d] + counts_[d];
    set_header(number, per_rank_.data());
    const Segment x{reinterpret_cast<uint8_t*>(const_cast<uint16_t*>(in.x)), 2 * g_.hidden, 2, 2, g_.hidden, 0,
                    local * rows_per_expert};
    p.seq = seq, p.slot = slot, p.num_tokens = T, p.num_messages = n;
    p.topk_weights = in.topk_weights, p.out = in.out, p.wait_stats = in.wait_stats;
    return post(slot, seq, counts_.data(), firsts_send_.data(), &x, 1, rows_.data(), num_rows, nullptr, 0);
}

PreparedStatus PreparedCombine::receive(int half) {
    const Pending& p = pending_[half];
    const int64_t begin = now_ns(), R = plan_.num_ranks, K = g_.num_topk;
    const PreparedStatus status = arrive(p.slot, p.seq, recv_counts_.data());
    if (status != PreparedStatus::kOk) return status;
    try {
        low_latency_positions(pos_.data(), p.num_tokens * K, p.msg.data(), p.experts.data(), p.num_messages,
                              g_.num_experts / R, R, firsts_.data());
        std::fill(sources_.begin(), sources_.end(), records(p.slot));
        combine_reduce(p.out, nullptr, sources_.data(), source_rows_.data(), pos_.data(), p.topk_weights, nullptr,
                       nullptr, p.num_tokens, K, g_.hidden, DType::kBFloat16, plan_.record_bytes, 0, 0, 0,
                       plan_.num_threads);
    } catch (...) {
        release(p.slot, p.seq);
        throw;
    }
    release(p.slot, p.seq);
    add_stats(nullptr, nullptr, 0, p.wait_stats, R, now_ns() - begin);
    return PreparedStatus::kOk;
}

}  // namespace moe_comm::cpu
