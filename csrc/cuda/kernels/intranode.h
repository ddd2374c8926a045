// Normal-mode (intranode) kernels, written once for both targets (P: a platform, platform.h).
//
//   notify:   reset own rings -> barrier -> write this rank's counts into every peer's cell ->
//             barrier -> read the cells: rank prefix matrix, receive offsets, per-expert counts (aligned)
//   dispatch: per (channel c, destination d) a sender pushes channel c's tokens for d through ring
//             (c, this rank) in d's buffer; per (c, source s) a receiver copies them to receive rows
//             offset[s] + channel_offset[s][c] + i (so rows come by source rank, then source token)
//   combine:  prologue (reset own rings -> barrier); per (c, d) a sender returns the rows it got from
//             d in channel c; per channel a receiver walks its tokens in order and sums each token's
//             rows over ranks ascending in fp32, then adds the biases: the portable backend's bits.
//
// A channel is DeepEP's contiguous token slice: ceil(num_tokens / num_channels) tokens each. Every
// body returns false when a wait failed (the error record says which); the launch then ends.
#pragma once

#include <cstdint>

#include "../../common/numeric.h"
#include "../protocol/barrier.h"
#include "../protocol/ring.h"
#include "../protocol/wait.h"
#include "buffer_layout.h"
#include "copy.h"

namespace moe_comm::cuda {

// Element types of combine's rows: FLOAT32, BFLOAT16 or FLOAT16 of the shared DType (codes.h), checked by
// the bindings (combine_row_type) before a launch.

MC_HD float load_elem(const uint8_t* row, int64_t i, DType t) {
    if (t == DType::kFloat32) return reinterpret_cast<const float*>(row)[i];
    const uint16_t v = reinterpret_cast<const uint16_t*>(row)[i];
    return t == DType::kBFloat16 ? numeric::bf16_to_float(v) : numeric::half_to_float(v);
}

MC_HD void store_elem(uint8_t* row, int64_t i, DType t, float f) {
    if (t == DType::kFloat32)
        reinterpret_cast<float*>(row)[i] = f;
    else
        reinterpret_cast<uint16_t*>(row)[i] = t == DType::kBFloat16 ? numeric::float_to_bf16(f) : numeric::float_to_half(f);
}

MC_HD int64_t channel_begin(int64_t num_tokens, int num_channels, int c) {
    const int64_t per = (num_tokens + num_channels - 1) / num_channels;
    const int64_t b = (per > 0 ? per : 1) * c;
    return b < num_tokens ? b : num_tokens;
}

// What one rank's normal-mode launch knows: its buffers and its peers'.
struct NormalContext {
    int32_t rank, num_ranks, num_channels;
    int64_t chunk;            // Config.num_max_nvl_chunked_send_tokens
    NormalLayout layout;
    uint8_t* const* peers;    // [R] base of every rank's buffer, mapped here (own included)
    Watch watch;
    int64_t epoch;            // this launch's number: its barriers are 2 * epoch - 1 and 2 * epoch
};

// This rank's ring counters back to zero (before a barrier: no peer sends before they are).
template <class P>
MC_HD void reset_rings(const NormalContext& k) {
    uint8_t* mine = k.peers[k.rank];
    for (int c = 0; c < k.num_channels; ++c)
        for (int s = 0; s < k.num_ranks; ++s) {
            Ring r = k.layout.ring(mine, c, s);
            P::store_relaxed(&r.meta->tail.value, int64_t{0});
            P::store_relaxed(&r.meta->head.value, int64_t{0});
        }
}

// The opening of a combine or a cached dispatch: rings reset, then the barrier.
template <class P>
MC_HD bool prologue(const NormalContext& k, int64_t* const* arrive) {
    reset_rings<P>(k);
    return barrier<P>(k.watch, arrive, k.rank, k.num_ranks, 2 * k.epoch);
}

// ---------------------------------------------------------------------- notify
struct NotifyArgs {
    const int64_t* rows_to_rank;      // [R] rows this rank sends to each rank
    const int64_t* tokens_per_expert; // [E] this rank's tokens per expert
    const int64_t* channel_prefix;    // [R][C] cumulative rows to each rank through channels 0..c
    int64_t expert_alignment;
    // outputs (host-mapped on the device)
    int32_t* rank_prefix_matrix;      // [R][R] rows ranks 0..i send to rank j
    int64_t* recv_offset;             // [R] first receive row of each source
    int64_t* recv_channel_offset;     // [R][C] first row of channel c within source s's rows
    int64_t* recv_channel_count;      // [R][C]
    int64_t* recv_per_expert;         // [E_loc] rows per local expert, aligned up
    int64_t* num_recv;                // [1]
};

template <class P>
MC_HD bool notify(const NormalContext& k, const NotifyArgs& a, int64_t* const* arrive) {
    const int R = k.num_ranks, C = k.num_channels, L = k.layout.experts_per_rank;
    uint8_t* mine = k.peers[k.rank];
    reset_rings<P>(k);
    // Peers' previous launches may still read their cells or rings (which another call's layout puts
    // where the cells are): write into their buffers only once every rank has begun this one.
    if (!barrier<P>(k.watch, arrive, k.rank, R, 2 * k.epoch - 1)) return false;
    for (int d = 0; d < R; ++d) {
        int64_t* cell = k.layout.cell(k.peers[d], k.rank);
        for (int j = 0; j < R; ++j) cell[j] = a.rows_to_rank[j];
        for (int e = 0; e < L; ++e) cell[R + e] = a.tokens_per_expert[d * L + e];
        for (int c = 0; c < C; ++c) cell[R + L + c] = a.channel_prefix[d * C + c];
    }
    if (!barrier<P>(k.watch, arrive, k.rank, R, 2 * k.epoch)) return false;
    int64_t offset = 0;
    for (int e = 0; e < L; ++e) a.recv_per_expert[e] = 0;
    for (int s = 0; s < R; ++s) {
        const int64_t* cell = k.layout.cell(mine, s);
        for (int j = 0; j < R; ++j)
            a.rank_prefix_matrix[s * R + j] = static_cast<int32_t>((s ? a.rank_prefix_matrix[(s - 1) * R + j] : 0) + cell[j]);
        a.recv_offset[s] = offset;
        offset += cell[k.rank];
        for (int e = 0; e < L; ++e) a.recv_per_expert[e] += cell[R + e];
        for (int c = 0; c < C; ++c) {
            const int64_t before = c ? cell[R + L + c - 1] : 0;
            a.recv_channel_offset[s * C + c] = before;
            a.recv_channel_count[s * C + c] = cell[R + L + c] - before;
        }
    }
    for (int e = 0; e < L; ++e)
        a.recv_per_expert[e] = (a.recv_per_expert[e] + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    *a.num_recv = offset;
    return true;
}

// ---------------------------------------------------------------------- dispatch
// A slot: x row, scales row, top-k ids (int64, global), top-k weights (fp32), source token (int32).
struct DispatchArgs {
    int64_t num_tokens, x_bytes, scale_bytes;
    int32_t num_topk;
    const uint8_t* x;                 // [T][x_bytes]
    const uint8_t* scales;            // [T][scale_bytes] or null
    const int64_t* topk_idx;          // [T][K] or null
    const float* topk_weights;        // [T][K] or null
    const uint8_t* is_token_in_rank;  // [T][R]
    const int64_t* channel_prefix;    // [R][C] (this rank's sends, cumulative)
    const int64_t* recv_offset;       // [R]       (from notify, or the handle when cached)
    const int64_t* recv_channel_offset;  // [R][C]
    const int64_t* recv_channel_count;   // [R][C]
    uint8_t* recv_x;
    uint8_t* recv_scales;
    int64_t* recv_topk_idx;           // local expert ids, -1 for other ranks' experts
    float* recv_topk_weights;         // 0 where recv_topk_idx is -1
    int32_t* recv_src_idx;
};

MC_HD int64_t dispatch_slot_bytes(int64_t x_bytes, int64_t scale_bytes, int64_t num_topk) {
    return x_bytes + scale_bytes + 12 * num_topk + 4;
}

// Token t of a dispatch into a slot (every lane: the payload; the leader: the small fields).
template <class G>
MC_HD void pack_dispatch_slot(const DispatchArgs& a, uint8_t* slot, int64_t t) {
    const int64_t K = a.num_topk, off_s = a.x_bytes, off_i = off_s + a.scale_bytes, off_w = off_i + 8 * K,
                  off_src = off_w + 4 * K;
    copy_bytes<G>(slot, a.x + t * a.x_bytes, a.x_bytes);
    if (a.scales) copy_bytes<G>(slot + off_s, a.scales + t * a.scale_bytes, a.scale_bytes);
    if (G::leader()) {
        if (a.topk_idx) {
            copy_one(slot + off_i, a.topk_idx + t * K, 8 * K);
            copy_one(slot + off_w, a.topk_weights + t * K, 4 * K);
        }
        const int32_t src = static_cast<int32_t>(t);
        copy_one(slot + off_src, &src, 4);
    }
}

// A received slot into receive row `row` (every lane): top-k ids become local ids of this rank's
// experts [first, first + L), or -1 with weight 0.
template <class G>
MC_HD void unpack_dispatch_slot(const DispatchArgs& a, const uint8_t* slot, int64_t row, int64_t first, int64_t L) {
    const int64_t K = a.num_topk, off_s = a.x_bytes, off_i = off_s + a.scale_bytes, off_w = off_i + 8 * K,
                  off_src = off_w + 4 * K;
    copy_bytes<G>(a.recv_x + row * a.x_bytes, slot, a.x_bytes);
    if (a.recv_scales) copy_bytes<G>(a.recv_scales + row * a.scale_bytes, slot + off_s, a.scale_bytes);
    if (a.recv_topk_idx)
        for (int64_t j = G::lane(); j < K; j += G::lanes()) {
            int64_t e;
            float w;
            copy_one(&e, slot + off_i + 8 * j, 8);
            copy_one(&w, slot + off_w + 4 * j, 4);
            const bool local = e >= first && e < first + L;
            a.recv_topk_idx[row * K + j] = local ? e - first : -1;
            a.recv_topk_weights[row * K + j] = local ? w : 0.0f;
        }
    if (G::leader()) copy_one(a.recv_src_idx + row, slot + off_src, 4);
}

template <class P>
MC_HD bool dispatch_send(const NormalContext& k, const DispatchArgs& a, int c, int d) {
    using G = typename P::Group;
    const int R = k.num_ranks, C = k.num_channels;
    const int64_t count = a.channel_prefix[d * C + c] - (c ? a.channel_prefix[d * C + c - 1] : 0);
    const Ring ring = k.layout.ring(k.peers[d], c, k.rank);
    int64_t t = channel_begin(a.num_tokens, C, c);  // the next token of the channel to look at
    return ring_send<P>(k.watch, ring, count, k.chunk, d, c, [&](uint8_t* slot, int64_t) {
        while (!a.is_token_in_rank[t * R + d]) ++t;
        pack_dispatch_slot<G>(a, slot, t);
        ++t;
    });
}

template <class P>
MC_HD bool dispatch_recv(const NormalContext& k, const DispatchArgs& a, int c, int s) {
    using G = typename P::Group;
    const int C = k.num_channels;
    const int64_t count = a.recv_channel_count[s * C + c];
    const int64_t row0 = a.recv_offset[s] + a.recv_channel_offset[s * C + c];
    const Ring ring = k.layout.ring(k.peers[k.rank], c, s);
    const int64_t first = static_cast<int64_t>(k.rank) * k.layout.experts_per_rank, L = k.layout.experts_per_rank;
    for (int64_t consumed = 0; consumed < count;) {
        int64_t tail = 0;
        if (G::leader()) tail = ring_wait_data<P>(k.watch, ring, consumed, s, c);
        tail = G::broadcast(tail);
        if (tail == INT64_MIN) return false;
        for (int64_t i = consumed; i < tail; ++i) unpack_dispatch_slot<G>(a, ring.slot(i), row0 + i, first, L);
        G::sync();
        consumed = tail;
        if (G::leader()) ring_publish_head<P>(ring, consumed);
    }
    return true;
}

// ---------------------------------------------------------------------- combine
// A slot: the row (x_bytes) and, with weights, the row's top-k weights (fp32).
struct CombineArgs {
    int64_t num_tokens, hidden, x_bytes;
    int32_t num_topk;                  // 0: no weights
    DType type;
    const uint8_t* x;                  // [N_recv][x_bytes]: the rows this rank received in the dispatch
    const float* topk_weights;         // [N_recv][K] or null
    const int64_t* recv_offset;        // [R] (the dispatch's, from the handle)
    const int64_t* recv_channel_offset;// [R][C]
    const int64_t* recv_channel_count; // [R][C]
    const uint8_t* is_token_in_rank;   // [T][R] (this rank's dispatch)
    const int64_t* channel_prefix;     // [R][C] (this rank's dispatch, cumulative)
    const int32_t* send_pos;           // [T][R] row of token t among the rows sent to r, or -1
    const uint8_t* bias0;              // [T][x_bytes] or null
    const uint8_t* bias1;
    uint8_t* out;                      // [T][x_bytes]
    float* out_weights;                // [T][K] or null
};

template <class P>
MC_HD bool combine_send(const NormalContext& k, const CombineArgs& a, int c, int d) {
    using G = typename P::Group;
    const int C = k.num_channels;
    const int64_t count = a.recv_channel_count[d * C + c];
    const int64_t row0 = a.recv_offset[d] + a.recv_channel_offset[d * C + c];
    const Ring ring = k.layout.ring(k.peers[d], c, k.rank);
    const int64_t K = a.num_topk;
    return ring_send<P>(k.watch, ring, count, k.chunk, d, c, [&](uint8_t* slot, int64_t i) {
        copy_bytes<G>(slot, a.x + (row0 + i) * a.x_bytes, a.x_bytes);
        if (K) copy_bytes<G>(slot + a.x_bytes, a.topk_weights + (row0 + i) * K, 4 * K);
    });
}

// The receiver of channel c: for each token in order, waits for the rows of every rank it went to,
// then (all lanes) sums them over ranks ascending: out = ((0 + x_0 + x_1 + ...) + bias0) + bias1.
template <class P>
MC_HD bool combine_recv(const NormalContext& k, const CombineArgs& a, int c) {
    using G = typename P::Group;
    const int R = k.num_ranks, C = k.num_channels;
    const int64_t K = a.num_topk, H = a.hidden;
    const int64_t end = channel_begin(a.num_tokens, C, c + 1);
    uint8_t* mine = k.peers[k.rank];
    for (int64_t t = channel_begin(a.num_tokens, C, c); t < end; ++t) {
        int ok = 1;
        if (G::leader())
            for (int r = 0; r < R && ok; ++r)
                if (a.is_token_in_rank[t * R + r]) {
                    const int64_t pos = a.send_pos[t * R + r] - (c ? a.channel_prefix[r * C + c - 1] : 0);
                    ok = ring_wait_data<P>(k.watch, k.layout.ring(mine, c, r), pos, r, c) != INT64_MIN;
                }
        if (!G::broadcast(ok)) return false;
        uint8_t* out = a.out + t * a.x_bytes;
        for (int64_t h = G::lane(); h < H; h += G::lanes()) {
            float acc = 0.0f;
            for (int r = 0; r < R; ++r)
                if (a.is_token_in_rank[t * R + r]) {
                    const int64_t pos = a.send_pos[t * R + r] - (c ? a.channel_prefix[r * C + c - 1] : 0);
                    acc = numeric::add_rn(acc, load_elem(k.layout.ring(mine, c, r).slot(pos), h, a.type));
                }
            if (a.bias0) acc = numeric::add_rn(acc, load_elem(a.bias0 + t * a.x_bytes, h, a.type));
            if (a.bias1) acc = numeric::add_rn(acc, load_elem(a.bias1 + t * a.x_bytes, h, a.type));
            store_elem(out, h, a.type, acc);
        }
        if (a.out_weights)
            for (int64_t j = G::lane(); j < K; j += G::lanes()) {
                float acc = 0.0f;
                for (int r = 0; r < R; ++r)
                    if (a.is_token_in_rank[t * R + r]) {
                        const int64_t pos = a.send_pos[t * R + r] - (c ? a.channel_prefix[r * C + c - 1] : 0);
                        float w;
                        copy_one(&w, k.layout.ring(mine, c, r).slot(pos) + a.x_bytes + 4 * j, 4);
                        acc = numeric::add_rn(acc, w);
                    }
                a.out_weights[t * K + j] = acc;
            }
        G::sync();
        if (G::leader())
            for (int r = 0; r < R; ++r)
                if (a.is_token_in_rank[t * R + r]) {
                    const int64_t pos = a.send_pos[t * R + r] - (c ? a.channel_prefix[r * C + c - 1] : 0);
                    ring_publish_head<P>(k.layout.ring(mine, c, r), pos + 1);
                }
    }
    return true;
}

}  // namespace moe_comm::cuda
