// Low-latency (decode) kernels, written once for both targets. Fixed shapes, no host synchronisation:
// every size comes from the call's arguments, every wait is on a flag in a buffer half, so a launch
// sequence can be captured in a CUDA graph.
//
//   dispatch send (per token, then per expert e): cast each token once into the staging rows (FP8
//       with DeepEP's scales, or bf16 as is); then for expert e, in token order, put each token that
//       chose e into slot [e_loc][this rank][i] of e's rank, then signal its count (i + 1) after them
//   dispatch recv (per local expert): for each source rank ascending, wait for its count, take the
//       count and zero the signal, copy its slots to rows begin + j (blocks by source rank, then
//       source token: deterministic, where DeepEP's order is the order of arrival)
//   combine send (per local expert): put each received row into its source rank's row
//       [expert][source token] (through this rank's staging when the source is across the network),
//       then signal that expert's flag after them
//   combine recv (per expert, then per token): wait for the flag of every expert whose rank is not
//       masked and zero it; then out[t] = bf16(0 + w_0 * y_0 + w_1 * y_1 + ...) over top-k slots in
//       order, in fp32 (multiply, then add)
//
// Peers are reached through a link (protocol/link.h): mapped buffers (NVLink, the host's shared memory)
// or NVSHMEM across nodes; puts and signals go through it, waits read this rank's own buffer. Signals
// are zeroed by their reader, and calls alternate between the two halves (staging included): call n + 2
// reuses call n's half only after every rank has finished call n + 1, which needs call n received.
// Model: tools/spin/ll_double_buffer.pml.
#pragma once

#include <cstdint>

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

// What one rank's low-latency launch knows. Peers' buffers are reached through a link (protocol/link.h:
// a DirectLink over mapped buffers, or NVSHMEM's puts and signals across nodes): every body takes one.
struct LowLatencyContext {
    int32_t rank, num_ranks, half;
    LowLatencyLayout layout;
    uint8_t* const* peers;  // [R] every rank's low-latency buffer, mapped here (DirectLink's bases)
    const uint8_t* skip;    // [R] masked ranks: nothing is sent to or awaited from them
    Watch watch;
};

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
    link.template publish<G>(dest, l.count(k.half, e_loc, k.rank), n + 1);
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
                v = wait_at_least<P>(k.watch, count, 1, WaitKind::kCount, s, e_loc);
                if (v != INT64_MIN) {
                    link.settle(l.count(k.half, e_loc, s), v);  // the slots the count covers are visible
                    P::store_relaxed(count, int64_t{0});
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
            const int64_t r = e_loc * rows + begin + i;
            const void* row = staged ? static_cast<const void*>(link.local(l.send_row(k.half, r)))
                                     : static_cast<const void*>(a.x + r * l.hidden);
            link.template put<G>(s, l.combine_row(k.half, expert, a.src_info[r]), row, row_bytes);
        }
        link.template publish<G>(s, l.flag(k.half, expert), int64_t{1});
    }
}

// Waits for expert `expert`'s rows (unless its rank is masked) and zeroes its flag.
template <class P, class L>
MC_HD bool ll_combine_wait(const LowLatencyContext& k, const L& link, int expert) {
    const LowLatencyLayout& l = k.layout;
    const int owner = expert / l.experts_per_rank;
    if (k.skip[owner]) return true;
    int64_t* flag = link.local_flag(l.flag(k.half, expert));
    if (wait_at_least<P>(k.watch, flag, 1, WaitKind::kCombineFlag, owner, expert) == INT64_MIN) return false;
    link.settle(l.flag(k.half, expert), 1);  // the rows the flag covers are visible
    P::store_relaxed(flag, int64_t{0});
    return true;
}

template <class P, class L>
MC_HD void ll_combine_reduce(const LowLatencyContext& k, const L& link, const LowLatencyCombineArgs& a, int64_t t) {
    using G = typename P::Group;
    const LowLatencyLayout& l = k.layout;
    for (int64_t h = G::lane(); h < l.hidden; h += G::lanes()) {
        float acc = 0.0f;
        for (int32_t j = 0; j < a.num_topk; ++j) {
            const int64_t e = a.topk_idx[t * a.num_topk + j];
            if (e < 0) continue;
            const uint8_t* row = link.local(l.combine_row(k.half, static_cast<int>(e), t));
            float y;
            if (a.logfmt) {
                y = logfmt::decode_channel(row, l.hidden, h);
            } else {
                uint16_t v;
                copy_one(&v, row + 2 * h, 2);
                y = numeric::bf16_to_float(v);
            }
            acc = numeric::add_rn(acc, numeric::mul_rn(a.topk_weights[t * a.num_topk + j], y));
        }
        a.out[t * l.hidden + h] = numeric::float_to_bf16(acc);
    }
}

}  // namespace moe_comm::cuda
