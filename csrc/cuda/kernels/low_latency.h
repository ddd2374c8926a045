// Low-latency (decode) kernels, written once for both targets. Fixed shapes, no host synchronisation:
// every size comes from the call's arguments, every wait is on a flag in a buffer half, so a launch
// sequence can be captured in a CUDA graph.
//
//   dispatch send (per token, then per expert e): cast each token once into the staging rows (FP8
//       with DeepEP's scales, or bf16 as is); then for expert e, in token order, put each token that
//       chose e into slot [e_loc][this rank][i] of e's rank, then signal its count (i + 1) after them
//   dispatch recv (per local expert): for each source rank ascending, wait for its count, take the
//       count and zero the signal, copy its slots to rows begin + j (blocks by source rank, then
//       source token: deterministic, where DeepEP's order is the order of arrival); then zero the rows
//       past the count (src_info -1), so the outputs need not be zeroed memory
//   combine send (per local expert): put each received row into its source rank's row
//       [expert][source token] (through this rank's staging when the source is across the network),
//       then signal that expert's flag after them
//   combine recv (per expert, then per token): wait for the flag of every expert whose rank is not
//       masked and zero it; then out[t] = bf16(0 + w_0 * y_0 + w_1 * y_1 + ...) over top-k slots in
//       order, in fp32 (multiply, then add)
//
// Peers are reached through a link (protocol/link.h): mapped buffers (NVLink, the host's shared memory)
// or NVSHMEM across nodes; puts and signals go through it, waits read this rank's own buffer. Every
// signal carries its call (wait.h call_signal: the call number beside the count), so a reader takes
// only this call's, never a stale one, and a later call's means out of step; calls alternate between
// the two halves (staging included), call n in half (n - 1) % 2. Readers still zero the signals they
// took, so a launch without a header (whose call number is its argument, the same in every replay of a
// CUDA graph) waits for fresh ones.
//
// The agreement in the data path (a launch given a call header, LowLatencyPost): before any byte of
// call n goes to rank d, the send waits until d has consumed call n - 2 (flow control: d's "consumed"
// cell in this rank's buffer), then puts this rank's header into d's header cell of the half and
// publishes its sequence word; then the rows, then the signals. A send first checks its top-k ids
// (range, an expert twice in a row): a bad one sets the header's rejected bit and message, and that
// send then puts no rows. The receive waits for every rank's header of call n, compares the words every
// rank must hold alike and the rejected bits, and on any difference records MISMATCH (the host then
// reads the headers and raises the verdict, the same on every rank) and reads no row; either way it ends
// by telling every source that call n is consumed. With a header the call number is counted in this
// rank's buffer (ll_counted), so the replays of a captured graph advance it as eager calls do. Without
// a header (a shrinking Buffer, whose host agreed first) the waits on signals are the only protocol.
// Models: tools/spin/ll_double_buffer.pml, tools/spin/ll_posts.pml.
#pragma once

#include <cstdint>

#include "../../common/call_header.h"
#include "../../common/digest.h"
#include "../../common/logfmt.h"
#include "../../common/numeric.h"
#include "../protocol/link.h"
#include "../protocol/wait.h"
#include "buffer_layout.h"
#include "copy.h"

namespace moe_comm::cuda {


// How dispatch sends x (the wire's Fp8Format, moe_comm.codes).
struct CastFormat {
    bool fp8, round_scale, ue8m0;
};

// One token's FP8 cast, bit for bit ops.quantize: per 128-channel group, amax = max(1e-4, max |x|)
// (NaN if any is NaN), scale = 448 / amax and scale_inv = amax * (1 / 448) in fp32, or both powers of
// two with round_scale; codes e4m3(x * scale); scales fp32 scale_inv, or UE8M0 exponent bytes.
template <class G>
MC_HD void cast_token(uint8_t* codes, uint8_t* scales, const uint16_t* x, int64_t hidden, CastFormat f) {
    const float q_max = 448.0f, q_max_inv = 1.0f / 448.0f;
    for (int64_t g = G::lane(); g < hidden / kFp8Group; g += G::lanes()) {
        const uint16_t* xg = x + g * kFp8Group;
        uint32_t top = numeric::bits_of(kAmaxFloor);
        for (int64_t i = 0; i < kFp8Group; ++i) {
            const uint32_t b = numeric::bits_of(numeric::bf16_to_float(xg[i])) & 0x7fffffffu;
            top = b > top ? b : top;
        }
        const float amax = top > 0x7f800000u ? numeric::from_bits(0x7fc00000u) : numeric::from_bits(top);
        float scale, scale_inv;
        if (f.round_scale) {
            const uint32_t bits = numeric::bits_of(numeric::mul_rn(amax, q_max_inv));
            const uint32_t e = ((bits >> 23) & 0xffu) - 127u + ((bits & ((1u << 23) - 1)) != 0 ? 1u : 0u);
            scale = numeric::from_bits((127u - e) << 23);
            scale_inv = numeric::from_bits((127u + e) << 23);
        } else {
            scale = q_max / amax;
            scale_inv = numeric::mul_rn(amax, q_max_inv);
        }
        for (int64_t i = 0; i < kFp8Group; ++i)
            codes[g * kFp8Group + i] = numeric::to_e4m3(numeric::mul_rn(numeric::bf16_to_float(xg[i]), scale));
        if (f.ue8m0)
            scales[g] = static_cast<uint8_t>(numeric::bits_of(scale_inv) >> 23);
        else
            copy_one(scales + 4 * g, &scale_inv, 4);
    }
}

// The call header a launch posts and judges (moe_comm/protocol/call_header.py). header null: none (the
// host agreed on the call before the launch).
struct LowLatencyPost {
    const uint8_t* header;   // [bytes] this rank's header of the call, on the launch's device
    int64_t bytes;           // <= layout.header_bytes
    int32_t rejected_word;   // the vector word of the rejected bit
    int32_t message_offset;  // where the rejection message starts (its room runs to `bytes`)
    uint64_t compare;        // bit w: vector word w must be alike in every rank's header (w < 64)
};

// What one rank's low-latency launch knows. Peers' buffers are reached through a link (protocol/link.h:
// a DirectLink over mapped buffers, or NVSHMEM's puts and signals across nodes): every body takes one.
struct LowLatencyContext {
    int32_t rank, num_ranks, half;
    LowLatencyLayout layout;
    uint8_t* const* peers;  // [R] every rank's low-latency buffer, mapped here (DirectLink's bases)
    const uint8_t* skip;    // [R] masked ranks: nothing is sent to or awaited from them
    Watch watch;
    int64_t call;           // this call's number (1, 2, ...; half = (call - 1) % 2)
    LowLatencyPost post;
};

// A little text into a fixed room (a rejection message written by the kernel), always zero-terminated.
struct Text {
    char* at;
    int64_t left;
    MC_HD void add(const char* s) {
        for (; *s && left > 1; ++s, --left) *at++ = *s;
        *at = 0;
    }
    MC_HD void add(int64_t v) {
        char digits[24];
        int n = 0;
        const bool negative = v < 0;
        uint64_t u = negative ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
        do {
            digits[n++] = static_cast<char>('0' + u % 10);
            u /= 10;
        } while (u);
        if (negative) digits[n++] = '-';
        char out[24];
        for (int i = 0; i < n; ++i) out[i] = digits[n - 1 - i];
        out[n] = 0;
        add(out);
    }
};

// The call number a launch with a header uses: counted in this rank's buffer (layout.call_count), not
// taken from the launch's arguments, so a CUDA graph's replays advance it as eager calls do (a replay
// that reused the captured numbers would meet its peers' flow-control cells already past them). Calls
// alternate halves, so the c-th call of half h is call 2 (c - 1) + h + 1. The first launch of a call
// (its send, or a rejection's post) counts it, with one agent, before any other block of the call runs;
// every later launch of the call only reads it. Without a header the launch's `call` stands.
MC_HD int64_t ll_call_number(int half, int64_t count) { return 2 * (count - 1) + half + 1; }

template <class L>
MC_HD LowLatencyContext ll_counted(const LowLatencyContext& k, const L& link, bool count) {
    LowLatencyContext c = k;
    if (!k.post.header) return c;
    int64_t* calls = link.local_flag(k.layout.call_count(k.half));
    if (count) *calls += 1;
    c.call = ll_call_number(k.half, *calls);
    return c;
}

// This rank's staged header of the call's half, in its own buffer (where its posts read it).
template <class L>
MC_HD uint8_t* ll_own_header(const LowLatencyContext& k, const L& link) {
    return link.local(k.layout.own_header(k.half));
}

// Stages this rank's header of the call (one agent): a copy of post.header. Returns where it is.
template <class L>
MC_HD uint8_t* ll_stage_header(const LowLatencyContext& k, const L& link) {
    uint8_t* own = ll_own_header(k, link);
    copy_one(own, k.post.header, k.post.bytes);
    return own;
}

// Sets the staged header's rejected bit; returns where its message goes.
MC_HD Text ll_rejection(const LowLatencyContext& k, uint8_t* own, const char* op) {
    const int64_t one = 1;
    copy_one(own + 8 * static_cast<int64_t>(k.post.rejected_word), &one, 8);
    Text text{reinterpret_cast<char*>(own + k.post.message_offset), k.post.bytes - k.post.message_offset};
    text.add(op);
    return text;
}

// The send's checks of top-k ids (one agent), the words of moe_comm.buffer.low_latency_args's host
// checks: an id outside [-1, num_experts), or a row that picks an expert twice, rejects the call.
// Returns whether they passed.
MC_HD bool ll_check_topk(const LowLatencyContext& k, uint8_t* own, const char* op, const int64_t* topk_idx,
                         int64_t num_tokens, int32_t num_topk) {
    const int64_t num_experts = static_cast<int64_t>(k.num_ranks) * k.layout.experts_per_rank;
    int64_t lo = 0, hi = 0, twice_row = -1, twice_expert = INT64_MAX;
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int32_t j = 0; j < num_topk; ++j) {
            const int64_t e = topk_idx[t * num_topk + j];
            lo = (t == 0 && j == 0) || e < lo ? e : lo;
            hi = (t == 0 && j == 0) || e > hi ? e : hi;
            for (int32_t i = 0; i < j && twice_row < 0 && e >= 0; ++i)
                if (topk_idx[t * num_topk + i] == e) twice_row = t;
        }
    if (twice_row >= 0) {  // the smallest expert that row picks twice
        const int64_t* row = topk_idx + twice_row * num_topk;
        for (int32_t j = 0; j < num_topk; ++j)
            for (int32_t i = 0; i < j; ++i)
                if (row[i] == row[j] && row[j] >= 0 && row[j] < twice_expert) twice_expert = row[j];
    }
    if (num_tokens * num_topk > 0 && (lo < -1 || hi >= num_experts)) {
        Text text = ll_rejection(k, own, op);
        text.add(": topk_idx must be expert ids in [-1, ");
        text.add(num_experts);
        text.add(") (num_experts=");
        text.add(num_experts);
        text.add("), got values in [");
        text.add(lo);
        text.add(", ");
        text.add(hi);
        text.add("]");
        return false;
    }
    if (twice_row >= 0) {
        Text text = ll_rejection(k, own, op);
        text.add(": topk_idx must be rows that pick each expert at most once, got row ");
        text.add(twice_row);
        text.add(" picking expert ");
        text.add(twice_expert);
        text.add(" twice");
        return false;
    }
    return true;
}

// A combine's check of its handle (one agent), before any row goes out: layout_range [E_loc][R] must
// hold begin << 32 | count blocks by source ascending inside [0, R * M), each beginning where the one
// before ends (the words of moe_comm.protocol.low_latency_layout.layout_range_check's host check). A
// src_info outside [0, M) is not refused here: its row is never put (ll_combine_send), and the routing
// digests (ll_combine_routing) fail the call on every rank, as the portable backend's do.
MC_HD bool ll_check_handle(const LowLatencyContext& k, uint8_t* own, const int64_t* layout_range) {
    const int64_t rows = static_cast<int64_t>(k.num_ranks) * k.layout.max_tokens;
    for (int e = 0; e < k.layout.experts_per_rank; ++e) {
        int64_t next = 0;
        for (int s = 0; s < k.num_ranks; ++s) {
            const int64_t range = layout_range[e * k.num_ranks + s], begin = range >> 32, n = range & 0xffffffff;
            if (range < 0 || begin != next || begin + n > rows) {
                Text text = ll_rejection(k, own, "low_latency_combine");
                text.add(": handle[1] (layout_range) must be begin << 32 | count blocks by source rank ascending "
                         "inside [0, ");
                text.add(rows);
                text.add("), each beginning where the one before ends (begin[e, s] = count[e, 0] + ... + count[e, "
                         "s - 1]), got begin ");
                text.add(begin);
                text.add(", count ");
                text.add(n);
                text.add(" at [");
                text.add(static_cast<int64_t>(e));
                text.add(", ");
                text.add(static_cast<int64_t>(s));
                text.add("]");
                return false;
            }
            next = begin + n;
        }
    }
    return true;
}

// Where a header's per-rank words start: rows sent to each rank, rows expected from each, digests of
// the rows sent, of the rows expected (moe_comm.protocol.handshake.vector): [4][R] after the fields.
MC_HD int64_t ll_per_rank_words(const LowLatencyContext& k) { return k.post.message_offset / 8 - 4 * k.num_ranks; }

// Posts this rank's staged header of the call to `dest` (one group): waits until dest consumed call
// n - 2 of this half, then the header, then its sequence word. False when the wait gave up.
template <class P, class L>
MC_HD bool ll_post_header(const LowLatencyContext& k, const L& link, int dest) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    if (k.skip[dest]) return true;
    if (k.call > 2) {
        int64_t v = 0;
        if (G::leader())
            v = wait_at_least<P>(k.watch, link.local_flag(l.consumed_by(k.half, dest)), k.call - 2, WaitKind::kConsumed,
                                 dest, -1);
        if (G::broadcast(v) == INT64_MIN) return false;
    }
    link.template put<G>(dest, l.header(k.half, k.rank), ll_own_header(k, link), k.post.bytes);
    link.template publish<G>(dest, l.seq(k.half, k.rank), call_signal(k.call, 1));
    return true;
}

// Whether this rank's staged header of the call carries the rejected bit (its send then puts no rows).
template <class L>
MC_HD bool ll_rejected(const LowLatencyContext& k, const L& link) {
    int64_t v;
    copy_one(&v, ll_own_header(k, link) + 8 * static_cast<int64_t>(k.post.rejected_word), 8);
    return v != 0;
}

// The receive's verdict (one agent): waits for every unmasked rank's header of the call; false (the
// record says MISMATCH, or why the wait gave up) unless every compared word is alike and no rank
// rejected. The host reads the headers for the error it raises.
template <class P, class L>
MC_HD bool ll_judge(const LowLatencyContext& k, const L& link) {
    const LowLatencyLayout& l = k.layout;
    const LowLatencyPost& p = k.post;
    for (int s = 0; s < k.num_ranks; ++s)
        if (!k.skip[s]) {
            if (wait_call<P>(k.watch, link.local_flag(l.seq(k.half, s)), k.call, WaitKind::kHeader, s, -1) == INT64_MIN)
                return false;
            link.settle(l.seq(k.half, s), call_signal(k.call, 1));  // the header it covers is visible
        }
    call_header::Difference diff{};  // the cells of a half lie one after another, by source
    if (call_header::agree(link.local(l.header(k.half, 0)), l.header_bytes, k.skip, k.num_ranks, k.rank,
                           ll_per_rank_words(k), p.rejected_word, p.compare, &diff))
        return true;
    report<P>(k.watch, WaitOutcome::kMismatch, WaitKind::kHeader, diff.rank, diff.word, diff.seen, diff.wanted);
    return false;
}

// The end of a receive with a header (one agent): every unmasked source may reuse this half for call
// n + 2. Only after every read of the half's rows.
template <class P, class L>
MC_HD void ll_consumed(const LowLatencyContext& k, const L& link) {
    for (int s = 0; s < k.num_ranks; ++s)
        if (!k.skip[s]) link.signal(s, k.layout.consumed_by(k.half, k.rank), k.call);
}

struct LowLatencyDispatchArgs {
    int64_t num_tokens, scale_bytes;  // scale_bytes: of one message (0 without FP8)
    int32_t num_topk;
    CastFormat format;
    const uint16_t* x;          // [T][H] bf16
    const int64_t* topk_idx;    // [T][K], -1 (and masked ranks' experts) skipped
    uint8_t* recv_x;            // [E_loc][R * M][H] fp8 or bf16
    uint8_t* recv_scales;       // element (e, row, s) at e * S * R * M + s * R * M + row (DeepEP's layout)
    int32_t* src_info;          // [E_loc][R * M]
    int64_t* layout_range;      // [E_loc][R]
    int32_t* recv_count;        // [E_loc]
};

// The first step of a dispatch send with a header (one agent; k counted by ll_counted): this rank's
// header staged, its top-k checked. Returns whether rows may go out (false: the rejected bit is set).
template <class L>
MC_HD bool ll_stage_dispatch(const LowLatencyContext& k, const L& link, const LowLatencyDispatchArgs& a) {
    uint8_t* own = ll_stage_header(k, link);
    return ll_check_topk(k, own, "low_latency_dispatch", a.topk_idx, a.num_tokens, a.num_topk);
}

MC_HD int64_t x_wire_bytes(int64_t hidden, bool fp8) { return fp8 ? hidden : 2 * hidden; }

// The staging row of token t: its message as the wire carries it.
template <class P, class L>
MC_HD void ll_cast(const LowLatencyContext& k, const L& link, const LowLatencyDispatchArgs& a, int64_t t) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    uint8_t* msg = link.local(l.staged_message(k.half, t));
    const int64_t x_bytes = x_wire_bytes(l.hidden, a.format.fp8);
    if (a.format.fp8)
        cast_token<G>(msg, msg + x_bytes, a.x + t * l.hidden, l.hidden, a.format);
    else
        copy_bytes<G>(msg, a.x + t * l.hidden, x_bytes);
    if (G::leader()) {
        const int32_t src = static_cast<int32_t>(t);
        copy_one(msg + x_bytes + a.scale_bytes, &src, 4);
    }
}

template <class P, class L>
MC_HD void ll_dispatch_send(const LowLatencyContext& k, const L& link, const LowLatencyDispatchArgs& a, int expert) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    const int dest = expert / l.experts_per_rank, e_loc = expert % l.experts_per_rank;
    if (k.skip[dest]) return;
    int64_t n = 0;
    for (int64_t t = 0; t < a.num_tokens; ++t)
        for (int32_t j = 0; j < a.num_topk; ++j)
            if (a.topk_idx[t * a.num_topk + j] == expert)
                link.template put<G>(dest, l.slot(k.half, e_loc, k.rank, n++), link.local(l.staged_message(k.half, t)),
                                     l.message_bytes);
    link.template publish<G>(dest, l.count(k.half, e_loc, k.rank), call_signal(k.call, n + 1));
}

template <class P, class L>
MC_HD bool ll_dispatch_recv(const LowLatencyContext& k, const L& link, const LowLatencyDispatchArgs& a, int e_loc) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    const int64_t rows = static_cast<int64_t>(k.num_ranks) * l.max_tokens;
    const int64_t x_bytes = x_wire_bytes(l.hidden, a.format.fp8), num_scales = a.scale_bytes / 4;
    int64_t row = 0;
    for (int s = 0; s < k.num_ranks; ++s) {
        int64_t n = 0;
        if (!k.skip[s]) {
            int64_t v = 0;
            if (G::leader()) {
                int64_t* count = link.local_flag(l.count(k.half, e_loc, s));
                v = wait_call<P>(k.watch, count, k.call, WaitKind::kCount, s, e_loc);
                if (v != INT64_MIN) {
                    link.settle(l.count(k.half, e_loc, s), call_signal(k.call, v));  // its slots are visible
                    P::store_relaxed(count, int64_t{0});  // a replayed graph's call waits for a fresh one
                }
            }
            v = G::broadcast(v);
            if (v == INT64_MIN) return false;
            n = v - 1;
        }
        for (int64_t i = 0; i < n; ++i) {
            const uint8_t* msg = link.local(l.slot(k.half, e_loc, s, i));
            const int64_t r = row + i;
            copy_bytes<G>(a.recv_x + (e_loc * rows + r) * x_bytes, msg, x_bytes);
            for (int64_t j = G::lane(); a.recv_scales && j < num_scales; j += G::lanes())
                copy_one(a.recv_scales + 4 * ((e_loc * num_scales + j) * rows + r), msg + x_bytes + 4 * j, 4);
            if (G::leader()) copy_one(a.src_info + e_loc * rows + r, msg + x_bytes + a.scale_bytes, 4);
        }
        if (G::leader()) a.layout_range[e_loc * k.num_ranks + s] = (row << 32) | n;
        row += n;
    }
    if (G::leader()) a.recv_count[e_loc] = static_cast<int32_t>(row);
    // The rows past the count are padding (zero x and scales, src_info -1): the outputs may be recycled
    // memory, and whole outputs stay bitwise reproducible.
    zero_bytes<G>(a.recv_x + (e_loc * rows + row) * x_bytes, (rows - row) * x_bytes);
    for (int64_t j = 0; a.recv_scales && j < num_scales; ++j)
        zero_bytes<G>(a.recv_scales + 4 * ((e_loc * num_scales + j) * rows + row), 4 * (rows - row));
    for (int64_t r = row + G::lane(); r < rows; r += G::lanes()) a.src_info[e_loc * rows + r] = -1;
    G::sync();
    return true;
}

struct LowLatencyCombineArgs {
    int64_t num_tokens;
    int32_t num_topk;
    const uint16_t* x;            // [E_loc][R * M][H] bf16: rows to return (the combine input)
    const int32_t* src_info;      // [E_loc][R * M] (the dispatch's handle)
    const int64_t* layout_range;  // [E_loc][R]
    const int64_t* topk_idx;      // [T][K] this rank's, masked ranks' experts -1
    const float* topk_weights;    // [T][K]
    uint16_t* out;                // [T][H] bf16
    bool logfmt;                  // rows travel LogFMT-10 encoded (common/logfmt.h), decoded in the sum
};

// A combine's routing in its staged header (one agent), as the portable backend's handshake carries it
// (moe_comm.protocol.digest.low_latency_combine_digests): rows this rank returns to each source and
// their digest (keys e_loc << 32 | src_info, by local expert then row), rows it expects from each rank
// and their digest (keys e_loc << 32 | token over its routable top-k, by expert then token). Every
// receive compares them pairwise (ll_judge), so a handle of another dispatch fails on every rank.
MC_HD void ll_combine_routing(const LowLatencyContext& k, uint8_t* own, const LowLatencyCombineArgs& a) {
    const LowLatencyLayout& l = k.layout;
    const int R = k.num_ranks, L = l.experts_per_rank;
    const int64_t rows = static_cast<int64_t>(R) * l.max_tokens, base = ll_per_rank_words(k);
    int64_t* words = reinterpret_cast<int64_t*>(own);  // staged in this rank's buffer: 8-byte aligned
    for (int s = 0; s < R; ++s) {
        uint64_t sum = 0;
        int64_t j = 0;
        for (int e = 0; e < L; ++e) {
            const int64_t range = a.layout_range[e * R + s], begin = range >> 32, n = range & 0xffffffff;
            for (int64_t r = begin; r < begin + n; ++r, ++j)
                sum += digest::term(static_cast<uint64_t>(e) << 32 | static_cast<uint64_t>(a.src_info[e * rows + r]),
                                    j);
        }
        words[base + s] = j;
        words[base + 2 * R + s] = digest::finish(sum);
    }
    for (int d = 0; d < R; ++d) {
        uint64_t sum = 0;
        int64_t j = 0;
        for (int e = 0; e < L; ++e)
            for (int64_t t = 0; t < a.num_tokens; ++t)
                for (int32_t i = 0; i < a.num_topk; ++i)
                    if (a.topk_idx[t * a.num_topk + i] == static_cast<int64_t>(d) * L + e) {
                        sum += digest::term(static_cast<uint64_t>(e) << 32 | static_cast<uint64_t>(t), j++);
                        break;
                    }
        words[base + R + d] = j;
        words[base + 3 * R + d] = digest::finish(sum);
    }
}

// The first step of a combine send with a header (one agent; k counted): the header staged, the top-k
// and the handle checked, the routing's words filled. Returns whether rows may go out.
template <class L>
MC_HD bool ll_stage_combine(const LowLatencyContext& k, const L& link, const LowLatencyCombineArgs& a) {
    uint8_t* own = ll_stage_header(k, link);
    const bool clean = ll_check_topk(k, own, "low_latency_combine", a.topk_idx, a.num_tokens, a.num_topk) &&
                       ll_check_handle(k, own, a.layout_range);
    if (clean) ll_combine_routing(k, own, a);
    return clean;
}

// Each row is first written into this rank's buffer (from where the put reads it) when it travels
// LogFMT-encoded (one lane encodes a row) or goes to a staged peer (across nodes); a direct peer's bf16
// rows go from x at once.
template <class P, class L>
MC_HD void ll_combine_send(const LowLatencyContext& k, const L& link, const LowLatencyCombineArgs& a, int e_loc) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    const int expert = k.rank * l.experts_per_rank + e_loc;
    const int64_t rows = static_cast<int64_t>(k.num_ranks) * l.max_tokens;
    const int64_t row_bytes = a.logfmt ? logfmt::max_row_bytes(l.hidden) : 2 * l.hidden;
    for (int s = 0; s < k.num_ranks; ++s) {
        if (k.skip[s]) continue;
        const bool staged = link.staged(s) || a.logfmt;
        const int64_t range = a.layout_range[e_loc * k.num_ranks + s], begin = range >> 32, n = range & 0xffffffff;
        if (a.logfmt) {
            for (int64_t i = G::lane(); i < n; i += G::lanes()) {
                const int64_t r = e_loc * rows + begin + i;
                logfmt::encode_row(link.local(l.send_row(k.half, r)), a.x + r * l.hidden, l.hidden);
            }
            G::sync();
        } else if (staged) {
            for (int64_t i = 0; i < n; ++i) {
                const int64_t r = e_loc * rows + begin + i;
                copy_bytes<G>(link.local(l.send_row(k.half, r)), a.x + r * l.hidden, row_bytes);
            }
            G::sync();
        }
        for (int64_t i = 0; i < n; ++i) {
            const int64_t r = e_loc * rows + begin + i, token = a.src_info[r];
            if (token < 0 || token >= l.max_tokens) continue;  // a tampered handle: never outside the row
            const void* row = staged ? static_cast<const void*>(link.local(l.send_row(k.half, r)))
                                     : static_cast<const void*>(a.x + r * l.hidden);
            link.template put<G>(s, l.combine_row(k.half, expert, token), row, row_bytes);
        }
        link.template publish<G>(s, l.flag(k.half, expert), call_signal(k.call, 1));
    }
}

// Waits for expert `expert`'s rows of the call (unless its rank is masked) and zeroes its flag.
template <class P, class L>
MC_HD bool ll_combine_wait(const LowLatencyContext& k, const L& link, int expert) {
    const LowLatencyLayout& l = k.layout;
    const int owner = expert / l.experts_per_rank;
    if (k.skip[owner]) return true;
    int64_t* flag = link.local_flag(l.flag(k.half, expert));
    if (wait_call<P>(k.watch, flag, k.call, WaitKind::kCombineFlag, owner, expert) == INT64_MIN) return false;
    link.settle(l.flag(k.half, expert), call_signal(k.call, 1));  // the rows the flag covers are visible
    P::store_relaxed(flag, int64_t{0});  // a replayed graph's call waits for a fresh one
    return true;
}

// Channels one lane sums together: on the GPU a 16-byte vector of bf16 from each row (coalesced across
// a group's lanes); on the host, whose group is one lane, an FP8 group's 128 (fixed-length loops the
// compiler vectorises, each top-k row's address and weight read once per 128 channels, not per 8).
// hidden is a multiple of 128, so of this too. Every channel still sums its top-k slots in order, so the
// bits do not depend on it.
#if defined(__CUDA_ARCH__)
constexpr int64_t kReduceChannels = 8;
#else
constexpr int64_t kReduceChannels = 128;
#endif

template <class P, class L>
MC_HD void ll_combine_reduce(const LowLatencyContext& k, const L& link, const LowLatencyCombineArgs& a, int64_t t) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    for (int64_t h0 = G::lane() * kReduceChannels; h0 < l.hidden; h0 += G::lanes() * kReduceChannels) {
        float acc[kReduceChannels] = {};
        for (int32_t j = 0; j < a.num_topk; ++j) {
            const int64_t e = a.topk_idx[t * a.num_topk + j];
            if (e < 0) continue;
            const uint8_t* row = link.local(l.combine_row(k.half, static_cast<int>(e), t));
            const float w = a.topk_weights[t * a.num_topk + j];
            float y[kReduceChannels];
            if (a.logfmt) {
                for (int64_t c = 0; c < kReduceChannels; ++c) y[c] = logfmt::decode_channel(row, l.hidden, h0 + c);
            } else {
                uint16_t v[kReduceChannels];
                copy_one(v, row + 2 * h0, sizeof(v));
                for (int64_t c = 0; c < kReduceChannels; ++c) y[c] = numeric::bf16_to_float(v[c]);
            }
            for (int64_t c = 0; c < kReduceChannels; ++c) acc[c] = numeric::add_rn(acc[c], numeric::mul_rn(w, y[c]));
        }
        for (int64_t c = 0; c < kReduceChannels; ++c) a.out[t * l.hidden + h0 + c] = numeric::float_to_bf16(acc[c]);
    }
}

}  // namespace moe_comm::cuda
