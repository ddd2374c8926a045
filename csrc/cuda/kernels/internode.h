// Normal-mode kernels across nodes, written once for both targets (P: a platform; L: a link to the
// rank's rail, protocol/link.h). Rn nodes of NL ranks; rank (n, l) = n * NL + l. DeepEP's route: a
// token crosses between nodes once per destination node, to the rank of the sender's local index there
// (its forwarder), which passes it over the node's own rings (NVLink) to each destination rank.
//
//   notify:   reset own rings -> rail barrier -> node barrier (every rank has begun) -> each rank puts to
//             every rail peer its counts for that peer's node (a put with the barrier's signal) -> the
//             forwarder writes each node rank's cell (per source node) -> node barrier -> prefixes
//   dispatch: rdma_send (c, n): channel c's tokens for node n, in token order, into RDMA ring (c) at
//             forwarder (n, my l), each with its destination bits in node n;
//             forward (c): source nodes ascending, each one's tokens in order, copied into NVL ring
//             (c, my l) of every node rank whose bit is set;
//             nvl_recv (c, l): ring (c, l) holds sources (ns, l) for ns ascending, each in token order:
//             rows offset[s] + channel_offset[s][c] + j (rows by global source rank, then token)
//   combine:  prologue (reset, rail barrier, node barrier);
//             combine_send (c, l): the rows this rank got through forwarder l, in the order they came,
//             into NVL ring (c, my l) at forwarder l;
//             combine_forward (c): per source node, per forwarded token in order, waits for the rows of
//             every node rank it went to, sums them (fp32, ranks ascending) and rounds to x's type:
//             the node's partial, put into RDMA ring (c) at the source;
//             combine_recv (c): per token in order, sums the nodes' partials (fp32, nodes ascending),
//             then the biases: the portable backend's two-level sum, bit for bit
//
// Every sender drains its RDMA rings before its launch ends (rdma_ring.h), and a receiver that would
// block publishes every head it holds back first (so a batched head never deadlocks a sender). Every
// body returns false when a wait failed (the error record says which). Models:
// tools/spin/forward.pml (dispatch) and tools/spin/forward_combine.pml (combine).
#pragma once

#include <cstdint>

#include "../../common/numeric.h"
#include "../protocol/barrier.h"
#include "../protocol/rdma_ring.h"
#include "../protocol/ring.h"
#include "../protocol/wait.h"
#include "buffer_layout.h"
#include "copy.h"
#include "intranode.h"

namespace moe_comm::cuda {

constexpr int kMaxNodes = 64;      // nodes of a group (EP 512 of 8-GPU nodes)

// What one rank's internode launch knows.
struct InternodeContext {
    int32_t rank, node, local, num_nodes, node_ranks, num_channels;
    int64_t nvl_chunk, rdma_chunk;  // Config.num_max_{nvl,rdma}_chunked_send_tokens
    InternodeLayout layout;
    uint8_t* const* nvl_peers;      // [NL] the node's ranks' NVL buffers, mapped here (own at `local`)
    Watch watch;
    int64_t epoch;                  // this launch's number: its barriers are 2 * epoch - 1 and 2 * epoch

    MC_HD int node_rank(int l) const { return node * node_ranks + l; }  // the global rank of node rank l
    MC_HD int rail_rank(int n) const { return n * node_ranks + local; }  // the global rank of rail peer n
};

// A barrier of this rank's rail, through the link: every rank signals its arrival into every rail
// peer's counter, then waits for its own (barrier.h's protocol; the link delivers the stores).
template <class P, class L>
MC_HD bool rail_barrier(const InternodeContext& k, const L& rdma, int64_t epoch) {
    for (int n = 0; n < k.num_nodes; ++n) rdma.signal(n, k.layout.rail_arrive(k.node), epoch);
    for (int n = 0; n < k.num_nodes; ++n)
        if (wait_at_least<P>(k.watch, rdma.local_flag(k.layout.rail_arrive(n)), epoch, WaitKind::kBarrier,
                             k.rail_rank(n), -1) == INT64_MIN)
            return false;
    return true;
}

template <class P>
MC_HD bool node_barrier(const InternodeContext& k, int64_t epoch) {
    int64_t* arrive[kMaxNodeRanks];
    for (int l = 0; l < k.node_ranks; ++l) arrive[l] = k.layout.nvl_arrive_of(k.nvl_peers[l]);
    for (int l = 0; l < k.node_ranks; ++l) P::store_release(arrive[l] + k.local, epoch);
    for (int l = 0; l < k.node_ranks; ++l)
        if (wait_at_least<P>(k.watch, arrive[k.local] + l, epoch, WaitKind::kBarrier, k.node_rank(l), -1) ==
            INT64_MIN)
            return false;
    return true;
}

// This rank's ring counters back to zero: its NVL rings, its RDMA receive tails and send heads (each
// counter is reset by the rank whose memory holds it, before a barrier: no peer writes one before).
template <class P, class L>
MC_HD void internode_reset(const InternodeContext& k, const L& rdma) {
    uint8_t* mine = k.nvl_peers[k.local];
    for (int c = 0; c < k.num_channels; ++c) {
        for (int l = 0; l < k.node_ranks; ++l) {
            Ring r = k.layout.nvl_ring(mine, c, l);
            P::store_relaxed(&r.meta->tail.value, int64_t{0});
            P::store_relaxed(&r.meta->head.value, int64_t{0});
        }
        for (int n = 0; n < k.num_nodes; ++n) {
            P::store_relaxed(rdma.local_flag(k.layout.rdma_ring(c, n, k.node).tail), int64_t{0});
            P::store_relaxed(rdma.local_flag(k.layout.rdma_ring(c, k.node, n).head), int64_t{0});
        }
    }
}

// The opening of a combine or a cached dispatch: counters reset, then every rank of the group has
// begun (the rail barrier, then the node barrier: once past it, every rank of every rail has arrived).
template <class P, class L>
MC_HD bool internode_prologue(const InternodeContext& k, const L& rdma) {
    internode_reset<P>(k, rdma);
    return rail_barrier<P>(k, rdma, 2 * k.epoch - 1) && node_barrier<P>(k, 2 * k.epoch - 1);
}

// ---------------------------------------------------------------------- notify
struct InternodeNotifyArgs {
    const int64_t* rows_to_rank;             // [R] rows this rank sends to each rank
    const int64_t* tokens_per_expert;        // [E] this rank's tokens per expert
    const int64_t* channel_prefix;           // [R][C] cumulative tokens to each rank through channels 0..c
    const int64_t* rdma_channel_prefix;      // [Rn][C] cumulative tokens to each node through channels 0..c
    int64_t expert_alignment;
    // outputs (host-mapped on the device)
    int32_t* recv_gbl_rank_prefix;           // [R] rows this rank receives from ranks 0..s (inclusive)
    int64_t* recv_offset;                    // [R] first receive row of each source
    int64_t* recv_channel_offset;            // [R][C] first row of channel c within source s's rows
    int64_t* recv_channel_count;             // [R][C]
    int64_t* recv_rdma_channel_prefix;       // [Rn][C] cumulative tokens this rank forwards from node n
    int64_t* recv_per_expert;                // [E_loc] rows per local expert, aligned up
    int64_t* num_recv;                       // [1]
};

// One agent per rank.
template <class P, class L>
MC_HD bool internode_notify(const InternodeContext& k, const L& rdma, const InternodeNotifyArgs& a) {
    const int Rn = k.num_nodes, NL = k.node_ranks, C = k.num_channels, E = k.layout.experts_per_rank;
    const int64_t cell_words = k.layout.node_cell_words, rail_words = k.layout.rail_cell_words;
    internode_reset<P>(k, rdma);
    // Peers' previous launches may still read their cells: write into them only once all have begun.
    if (!rail_barrier<P>(k, rdma, 2 * k.epoch - 1) || !node_barrier<P>(k, 2 * k.epoch - 1)) return false;
    // Rail: to the forwarder of each node, this rank's counts for that node; the put carries the
    // barrier's signal, so a forwarder past its wait has every cell.
    for (int n = 0; n < Rn; ++n) {
        int64_t* cell = reinterpret_cast<int64_t*>(rdma.local(k.layout.rail_cell_out(n)));
        for (int c = 0; c < C; ++c) cell[c] = a.rdma_channel_prefix[n * C + c];
        for (int l = 0; l < NL; ++l) {
            const int d = n * NL + l;
            int64_t* words = cell + C + l * cell_words;
            words[0] = a.rows_to_rank[d];
            for (int e = 0; e < E; ++e) words[1 + e] = a.tokens_per_expert[d * E + e];
            for (int c = 0; c < C; ++c) words[1 + E + c] = a.channel_prefix[d * C + c];
        }
        rdma.template put<typename P::Group>(n, k.layout.rail_cell(k.node), cell, 8 * rail_words);
        rdma.template publish<typename P::Group>(n, k.layout.rail_arrive(k.node), 2 * k.epoch);
    }
    for (int n = 0; n < Rn; ++n) {
        if (wait_at_least<P>(k.watch, rdma.local_flag(k.layout.rail_arrive(n)), 2 * k.epoch, WaitKind::kBarrier,
                             k.rail_rank(n), -1) == INT64_MIN)
            return false;
        rdma.settle(k.layout.rail_arrive(n), 2 * k.epoch);  // its cell is visible
    }
    // Node: to each rank of this node, what every source node of this rank's rail sends it.
    for (int ns = 0; ns < Rn; ++ns) {
        const int64_t* from = reinterpret_cast<const int64_t*>(rdma.local(k.layout.rail_cell(ns)));
        for (int c = 0; c < C; ++c) a.recv_rdma_channel_prefix[ns * C + c] = from[c];
        for (int l = 0; l < NL; ++l) {
            int64_t* to = k.layout.node_cell(k.nvl_peers[l], k.local, ns);
            for (int64_t i = 0; i < cell_words; ++i) to[i] = from[C + l * cell_words + i];
        }
    }
    rdma.quiet();
    if (!node_barrier<P>(k, 2 * k.epoch)) return false;
    // Rows come by global source rank s = ns * NL + l ascending.
    uint8_t* mine = k.nvl_peers[k.local];
    int64_t offset = 0;
    for (int e = 0; e < E; ++e) a.recv_per_expert[e] = 0;
    for (int ns = 0; ns < Rn; ++ns)
        for (int l = 0; l < NL; ++l) {
            const int s = ns * NL + l;
            const int64_t* cell = k.layout.node_cell(mine, l, ns);
            a.recv_offset[s] = offset;
            offset += cell[0];
            a.recv_gbl_rank_prefix[s] = static_cast<int32_t>(offset);
            for (int e = 0; e < E; ++e) a.recv_per_expert[e] += cell[1 + e];
            for (int c = 0; c < C; ++c) {
                const int64_t before = c ? cell[1 + E + c - 1] : 0;
                a.recv_channel_offset[s * C + c] = before;
                a.recv_channel_count[s * C + c] = cell[1 + E + c] - before;
            }
        }
    for (int e = 0; e < E; ++e)
        a.recv_per_expert[e] = (a.recv_per_expert[e] + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    *a.num_recv = offset;
    return true;
}

// ---------------------------------------------------------------------- dispatch
// An RDMA slot is a dispatch slot (intranode.h) followed by the token's destination bits in the node.
struct InternodeDispatchArgs {
    DispatchArgs d;                          // recv_* by global source rank (notify's, or the handle's)
    const int64_t* rdma_channel_prefix;      // [Rn][C] this rank's tokens to each node, cumulative
    const int64_t* recv_rdma_channel_prefix; // [Rn][C] tokens this rank forwards from each node, cumulative
};

MC_HD int64_t channel_count(const int64_t* prefix, int C, int row, int c) {
    return prefix[row * C + c] - (c ? prefix[row * C + c - 1] : 0);
}

// Token t's destinations among node n's ranks, as bits (0: none).
MC_HD int32_t node_bits(const InternodeContext& k, const uint8_t* is_token_in_rank, int64_t t, int n) {
    const int R = k.num_nodes * k.node_ranks;
    int32_t bits = 0;
    for (int l = 0; l < k.node_ranks; ++l)
        if (is_token_in_rank[t * R + n * k.node_ranks + l]) bits |= 1 << l;
    return bits;
}

template <class P, class L>
MC_HD bool internode_rdma_send(const InternodeContext& k, const L& rdma, const InternodeDispatchArgs& a, int c,
                               int n) {
    using G = typename P::Group;
    const DispatchArgs& d = a.d;
    const int C = k.num_channels;
    const int64_t count = channel_count(a.rdma_channel_prefix, C, n, c);
    const int64_t bits_at = dispatch_slot_bytes(d.x_bytes, d.scale_bytes, d.num_topk);
    const RdmaRing ring = k.layout.rdma_ring(c, k.node, n);
    int64_t t = channel_begin(d.num_tokens, C, c);  // the next token of the channel to look at
    for (int64_t sent = 0; sent < count;) {
        const int64_t m = count - sent < k.rdma_chunk ? count - sent : k.rdma_chunk;
        int ok = 1;
        if (G::leader()) ok = rdma_wait_space<P>(k.watch, rdma, ring, sent, m, k.rail_rank(n), c);
        if (!G::broadcast(ok)) return false;
        for (int64_t i = sent; i < sent + m; ++i) {
            int32_t bits;
            while ((bits = node_bits(k, d.is_token_in_rank, t, n)) == 0) ++t;
            uint8_t* slot = rdma.local(ring.staged(i));
            pack_dispatch_slot<G>(d, slot, t);
            if (G::leader()) copy_one(slot + bits_at, &bits, 4);
            ++t;
        }
        rdma_put<P, G>(rdma, n, ring, sent, m);
        sent += m;
    }
    return true;
}

// The end of an RDMA sender's launch (one agent): its ring of channel c to rail peer n, which carried
// channel_count(prefix, n, c) positions, is consumed (rdma_ring.h), and its puts are complete.
template <class P, class L>
MC_HD bool internode_rdma_drain(const InternodeContext& k, const L& rdma, const int64_t* prefix, int c, int n) {
    const bool ok = rdma_drain<P>(k.watch, rdma, k.layout.rdma_ring(c, k.node, n),
                                  channel_count(prefix, k.num_channels, n, c), k.rail_rank(n), c);
    rdma.quiet();
    return ok;
}

template <class P, class L>
MC_HD bool internode_forward(const InternodeContext& k, const L& rdma, const InternodeDispatchArgs& a, int c) {
    using G = typename P::Group;
    const DispatchArgs& d = a.d;
    const int C = k.num_channels, NL = k.node_ranks;
    const int64_t slot_bytes = dispatch_slot_bytes(d.x_bytes, d.scale_bytes, d.num_topk);
    uint8_t* const* peers = k.nvl_peers;
    int64_t sent[kMaxNodeRanks] = {};  // positions written to each node rank's ring (c, my local)
    for (int ns = 0; ns < k.num_nodes; ++ns) {
        const int64_t count = channel_count(a.recv_rdma_channel_prefix, C, ns, c);
        const RdmaRing ring = k.layout.rdma_ring(c, ns, k.node);
        for (int64_t consumed = 0; consumed < count;) {
            int64_t tail = 0;
            if (G::leader()) tail = rdma_wait_data<P>(k.watch, rdma, ring, consumed, k.rail_rank(ns), c);
            tail = G::broadcast(tail);
            if (tail == INT64_MIN) return false;
            const int64_t end = tail < consumed + k.nvl_chunk ? tail : consumed + k.nvl_chunk;
#ifdef MOE_COMM_PLANT_EARLY_FORWARD_HEAD  // test the test: the TSan stress and forward.pml must catch this
            if (G::leader()) rdma_release(rdma, ns, ring, end);
#endif
            for (int l = 0; l < NL; ++l) {
                int64_t m = 0;
                for (int64_t i = consumed; i < end; ++i) {
                    int32_t bits;
                    copy_one(&bits, rdma.local(ring.slot(i)) + slot_bytes, 4);
                    m += (bits >> l) & 1;
                }
                if (m == 0) continue;
                const Ring out = k.layout.nvl_ring(peers[l], c, k.local);
                int ok = 1;
                if (G::leader()) ok = ring_wait_space<P>(k.watch, out, sent[l], m, k.node_rank(l), c);
                if (!G::broadcast(ok)) return false;
                int64_t p = sent[l];
                for (int64_t i = consumed; i < end; ++i) {
                    const uint8_t* slot = rdma.local(ring.slot(i));
                    int32_t bits;
                    copy_one(&bits, slot + slot_bytes, 4);
                    if ((bits >> l) & 1) copy_bytes<G>(out.slot(p++), slot, slot_bytes);
                }
                G::sync();
                sent[l] = p;
                if (G::leader()) ring_publish_tail<P>(out, p);
            }
            G::sync();  // every lane's reads of the RDMA slots are done before they are freed
#ifndef MOE_COMM_PLANT_EARLY_FORWARD_HEAD
            if (G::leader()) rdma_release(rdma, ns, ring, end);
#endif
            consumed = end;
        }
    }
    if (G::leader()) rdma.quiet();
    return true;
}

template <class P>
MC_HD bool internode_nvl_recv(const InternodeContext& k, const InternodeDispatchArgs& a, int c, int l) {
    using G = typename P::Group;
    const DispatchArgs& d = a.d;
    const int C = k.num_channels, NL = k.node_ranks;
    const Ring ring = k.layout.nvl_ring(k.nvl_peers[k.local], c, l);
    const int64_t first = static_cast<int64_t>(k.rank) * k.layout.experts_per_rank, E = k.layout.experts_per_rank;
    // Ring position i is row i - begin of source (ns, l) in channel c, begin the position where source
    // ns's rows start (sources come by node ascending).
    int ns = 0;
    int64_t begin = 0;
    auto rows_of = [&](int n) { return d.recv_channel_count[(n * NL + l) * C + c]; };
    int64_t count = 0;
    for (int n = 0; n < k.num_nodes; ++n) count += rows_of(n);
    for (int64_t consumed = 0; consumed < count;) {
        int64_t tail = 0;
        if (G::leader()) tail = ring_wait_data<P>(k.watch, ring, consumed, k.node_rank(l), c);
        tail = G::broadcast(tail);
        if (tail == INT64_MIN) return false;
        for (int64_t i = consumed; i < tail; ++i) {
            for (; i - begin >= rows_of(ns); ++ns) begin += rows_of(ns);
            const int s = ns * NL + l;
            unpack_dispatch_slot<G>(d, ring.slot(i), d.recv_offset[s] + d.recv_channel_offset[s * C + c] + i - begin,
                                    first, E);
        }
        G::sync();
        consumed = tail;
        if (G::leader()) ring_publish_head<P>(ring, consumed);
    }
    return true;
}

// ---------------------------------------------------------------------- combine
// An NVL slot: a row (x_bytes) and, with weights, its top-k weights (fp32); an RDMA slot: a node's
// partial of a token in the same form.
struct InternodeCombineArgs {
    CombineArgs c;                           // x, topk_weights, recv_* (global sources), biases, out
    const int64_t* recv_rdma_channel_prefix; // [Rn][C] tokens this rank forwarded from each node, cumulative
    const int32_t* forward_bits;             // [N_fwd] each forwarded token's destination bits in this node
                                             // (forwarded tokens by source node, then token)
    const int32_t* send_rdma_head;           // [T][Rn] token t's position among channel c(t)'s tokens to
                                             // node n, or -1
};

template <class P>
MC_HD bool internode_combine_send(const InternodeContext& k, const InternodeCombineArgs& a, int c, int l) {
    using G = typename P::Group;
    const CombineArgs& x = a.c;
    const int C = k.num_channels, NL = k.node_ranks;
    const Ring ring = k.layout.nvl_ring(k.nvl_peers[l], c, k.local);
    const int64_t K = x.num_topk;
    // The rows go back in the order forwarder l sent them: sources (ns, l) by node ascending (see
    // internode_nvl_recv), each in token order.
    auto rows_of = [&](int n) { return x.recv_channel_count[(n * NL + l) * C + c]; };
    int64_t count = 0;
    for (int n = 0; n < k.num_nodes; ++n) count += rows_of(n);
    int ns = 0;
    int64_t begin = 0;
    return ring_send<P>(k.watch, ring, count, k.nvl_chunk, k.node_rank(l), c, [&](uint8_t* slot, int64_t i) {
        for (; i - begin >= rows_of(ns); ++ns) begin += rows_of(ns);
        const int s = ns * NL + l;
        const int64_t row = x.recv_offset[s] + x.recv_channel_offset[s * C + c] + i - begin;
        copy_bytes<G>(slot, x.x + row * x.x_bytes, x.x_bytes);
        if (K) copy_bytes<G>(slot + x.x_bytes, x.topk_weights + row * K, 4 * K);
    });
}

template <class P, class L>
MC_HD bool internode_combine_forward(const InternodeContext& k, const L& rdma, const InternodeCombineArgs& a,
                                     int c) {
    using G = typename P::Group;
    const CombineArgs& x = a.c;
    const int C = k.num_channels, NL = k.node_ranks;
    const int64_t K = x.num_topk, H = x.hidden;
    uint8_t* mine = k.nvl_peers[k.local];
    int64_t pos[kMaxNodeRanks] = {};  // rows of node rank l consumed from NVL ring (c, l)
    int64_t first = 0;                // this source node's first forwarded token (forward_bits' order)
    for (int ns = 0; ns < k.num_nodes; ++ns) {
        const int64_t count = channel_count(a.recv_rdma_channel_prefix, C, ns, c);
        const int64_t token0 = first + (c ? a.recv_rdma_channel_prefix[ns * C + c - 1] : 0);
        first += a.recv_rdma_channel_prefix[ns * C + C - 1];
        const RdmaRing ring = k.layout.rdma_ring(c, k.node, ns);
        for (int64_t sent = 0; sent < count;) {
            const int64_t m = count - sent < k.rdma_chunk ? count - sent : k.rdma_chunk;
            int ok = 1;
            if (G::leader()) ok = rdma_wait_space<P>(k.watch, rdma, ring, sent, m, k.rail_rank(ns), c);
            if (!G::broadcast(ok)) return false;
            for (int64_t i = sent; i < sent + m; ++i) {
                const int32_t bits = a.forward_bits[token0 + i];
                if (G::leader())
                    for (int l = 0; l < NL && ok; ++l)
                        if ((bits >> l) & 1)
                            ok = ring_wait_data<P>(k.watch, k.layout.nvl_ring(mine, c, l), pos[l], k.node_rank(l), c) !=
                                 INT64_MIN;
                if (!G::broadcast(ok)) return false;
                uint8_t* partial = rdma.local(ring.staged(i));
                for (int64_t h = G::lane(); h < H; h += G::lanes()) {
                    float acc = 0.0f;
                    for (int l = 0; l < NL; ++l)
                        if ((bits >> l) & 1)
                            acc = numeric::add_rn(acc, load_elem(k.layout.nvl_ring(mine, c, l).slot(pos[l]), h, x.type));
                    store_elem(partial, h, x.type, acc);  // the node's partial, rounded to x's type
                }
                for (int64_t j = G::lane(); j < K; j += G::lanes()) {
                    float acc = 0.0f;
                    for (int l = 0; l < NL; ++l)
                        if ((bits >> l) & 1) {
                            float w;
                            copy_one(&w, k.layout.nvl_ring(mine, c, l).slot(pos[l]) + x.x_bytes + 4 * j, 4);
                            acc = numeric::add_rn(acc, w);
                        }
                    copy_one(partial + x.x_bytes + 4 * j, &acc, 4);
                }
                G::sync();
                for (int l = 0; l < NL; ++l)
                    if ((bits >> l) & 1) {
                        if (G::leader()) ring_publish_head<P>(k.layout.nvl_ring(mine, c, l), pos[l] + 1);
                        ++pos[l];
                    }
            }
            rdma_put<P, G>(rdma, ns, ring, sent, m);
            sent += m;
        }
    }
    return true;
}

// Before a receiver blocks on a ring it publishes every head it holds back (heads are batched by
// rdma_chunk): a sender waiting for that space then always gets it.
template <class L>
MC_HD void flush_heads(const InternodeContext& k, const L& rdma, int c, const int64_t* consumed, int64_t* published) {
    for (int n = 0; n < k.num_nodes; ++n)
        if (consumed[n] > published[n]) {
            rdma_release(rdma, n, k.layout.rdma_ring(c, n, k.node), consumed[n]);
            published[n] = consumed[n];
        }
}

template <class P, class L>
MC_HD bool internode_combine_recv(const InternodeContext& k, const L& rdma, const InternodeCombineArgs& a, int c) {
    using G = typename P::Group;
    const CombineArgs& x = a.c;
    const int Rn = k.num_nodes, C = k.num_channels;
    const int64_t K = x.num_topk, H = x.hidden;
    int64_t consumed[kMaxNodes] = {}, published[kMaxNodes] = {};  // the leader's
    const int64_t end = channel_begin(x.num_tokens, C, c + 1);
    for (int64_t t = channel_begin(x.num_tokens, C, c); t < end; ++t) {
        const int32_t* head = a.send_rdma_head + t * Rn;
        int ok = 1;
        if (G::leader())
            for (int n = 0; n < Rn && ok; ++n) {
                if (head[n] < 0) continue;
                const RdmaRing ring = k.layout.rdma_ring(c, n, k.node);
                if (P::load_acquire(rdma.local_flag(ring.tail)) <= head[n])
                    flush_heads(k, rdma, c, consumed, published);
                ok = rdma_wait_data<P>(k.watch, rdma, ring, head[n], k.rail_rank(n), c) != INT64_MIN;
            }
        if (!G::broadcast(ok)) return false;
        uint8_t* out = x.out + t * x.x_bytes;
        for (int64_t h = G::lane(); h < H; h += G::lanes()) {
            float acc = 0.0f;
            for (int n = 0; n < Rn; ++n)
                if (head[n] >= 0)
                    acc = numeric::add_rn(acc, load_elem(rdma.local(k.layout.rdma_ring(c, n, k.node).slot(head[n])), h,
                                                         x.type));
            if (x.bias0) acc = numeric::add_rn(acc, load_elem(x.bias0 + t * x.x_bytes, h, x.type));
            if (x.bias1) acc = numeric::add_rn(acc, load_elem(x.bias1 + t * x.x_bytes, h, x.type));
            store_elem(out, h, x.type, acc);
        }
        if (x.out_weights)
            for (int64_t j = G::lane(); j < K; j += G::lanes()) {
                float acc = 0.0f;
                for (int n = 0; n < Rn; ++n)
                    if (head[n] >= 0) {
                        float w;
                        copy_one(&w, rdma.local(k.layout.rdma_ring(c, n, k.node).slot(head[n])) + x.x_bytes + 4 * j, 4);
                        acc = numeric::add_rn(acc, w);
                    }
                x.out_weights[t * K + j] = acc;
            }
        G::sync();
        if (G::leader())
            for (int n = 0; n < Rn; ++n) {
                if (head[n] < 0) continue;
                consumed[n] = head[n] + 1;
                if (consumed[n] - published[n] >= k.rdma_chunk) {
                    rdma_release(rdma, n, k.layout.rdma_ring(c, n, k.node), consumed[n]);
                    published[n] = consumed[n];
                }
            }
    }
    if (G::leader()) {
        flush_heads(k, rdma, c, consumed, published);
        rdma.quiet();
    }
    return true;
}

}  // namespace moe_comm::cuda
