// Where everything lives in one rank's communication buffer (its NVLink buffer: cudaMalloc'd and
// shared over CUDA IPC on the GPU, a shared-memory segment on the host). Every rank computes the same
// layout from the same call parameters, which the call's agreement has checked, so offsets into a
// peer's buffer are offsets into one's own. Python reads these through moe_comm._cuda_host, the only
// source of them.
#pragma once

#include <cstdint>

#include "../../common/logfmt.h"
#include "../platform/platform.h"
#include "../protocol/rdma_ring.h"
#include "../protocol/ring.h"

namespace moe_comm::cuda {

MC_HD int64_t align_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Normal mode: barrier counters, the notify cells, then per (channel, source) ring counters and slots.
struct NormalLayout {
    int32_t num_ranks, num_channels, experts_per_rank;
    int64_t num_slots, slot_bytes;
    int64_t arrive, notify, cell_words, ring_meta, ring_slots, total;

    NormalLayout() = default;  // uninitialised: a slot of the device build's launch arrays (device/launch.h)
    MC_HD NormalLayout(int32_t ranks, int32_t channels, int32_t local_experts, int64_t slots, int64_t slot)
        : num_ranks(ranks), num_channels(channels), experts_per_rank(local_experts), num_slots(slots),
          slot_bytes(align_up(slot, 16)) {
        arrive = 0;
        notify = align_up(8 * num_ranks, 128);
        // a source's cell: its rows to every rank, its tokens per local expert of the reader, and its
        // per-channel cumulative rows to the reader
        cell_words = num_ranks + experts_per_rank + num_channels;
        ring_meta = align_up(notify + 8 * cell_words * num_ranks, 128);
        ring_slots = ring_meta + static_cast<int64_t>(sizeof(RingMeta)) * num_channels * num_ranks;
        total = align_up(ring_slots + slot_bytes * num_slots * num_channels * num_ranks, 4096);
    }
    MC_HD Ring ring(uint8_t* base, int channel, int source) const {
        const int64_t k = static_cast<int64_t>(channel) * num_ranks + source;
        return Ring{reinterpret_cast<RingMeta*>(base + ring_meta) + k, base + ring_slots + k * num_slots * slot_bytes,
                    num_slots, slot_bytes};
    }
    MC_HD int64_t* arrive_of(uint8_t* base) const { return reinterpret_cast<int64_t*>(base + arrive); }
    MC_HD int64_t* cell(uint8_t* base, int source) const {
        return reinterpret_cast<int64_t*>(base + notify) + static_cast<int64_t>(source) * cell_words;
    }
};

// Normal mode across nodes (kernels/internode.h): Rn nodes of L ranks, rank = node * L + local. Two
// buffers per rank:
//   NVL  (mapped by the node's ranks): barrier counters [L], notify cells [L forwarders][Rn][cell],
//        rings [C][L forwarders] (ring.h) of nvl_slots slots (a forwarder's rows for this rank)
//   RDMA (reached by the rank's rail: the ranks of its local index): barrier counters [Rn], notify cells
//        [Rn sources][rail cell] and this rank's outgoing rail cells [Rn], then per (channel, rail
//        peer) the receive tails and the send heads (64-byte lines), the receive slots and the send
//        staging slots of rdma_slots slots (protocol/rdma_ring.h)
// A node cell (forwarder l to rank d, per source node ns): rows (ns, l) sends to d, its tokens per
// local expert of d, its cumulative tokens to d per channel. A rail cell (source to forwarder, for the
// forwarder's node n): the source's cumulative tokens to node n per channel, then a node cell's words
// for each rank of node n.
struct InternodeLayout {
    int32_t num_nodes, node_ranks, num_channels, experts_per_rank;
    int64_t nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes;
    int64_t node_cell_words, rail_cell_words;
    // NVL buffer
    int64_t nvl_arrive, nvl_cells, nvl_ring_meta, nvl_ring_slots, nvl_total;
    // RDMA buffer
    int64_t rdma_arrive, rdma_cells, rdma_cells_out, rdma_tails, rdma_heads, rdma_recv_slots, rdma_send_slots,
        rdma_total;

    InternodeLayout() = default;  // as NormalLayout's
    MC_HD InternodeLayout(int32_t nodes, int32_t ranks_per_node, int32_t channels, int32_t local_experts,
                          int64_t nvl_slot_count, int64_t nvl_slot, int64_t rdma_slot_count, int64_t rdma_slot)
        : num_nodes(nodes), node_ranks(ranks_per_node), num_channels(channels), experts_per_rank(local_experts),
          nvl_slots(nvl_slot_count), nvl_slot_bytes(align_up(nvl_slot, 16)), rdma_slots(rdma_slot_count),
          rdma_slot_bytes(align_up(rdma_slot, 16)) {
        const int64_t C = num_channels, L = node_ranks, Rn = num_nodes;
        node_cell_words = 1 + experts_per_rank + C;
        rail_cell_words = C + L * node_cell_words;
        nvl_arrive = 0;
        nvl_cells = align_up(8 * L, 128);
        nvl_ring_meta = align_up(nvl_cells + 8 * node_cell_words * Rn * L, 128);
        nvl_ring_slots = nvl_ring_meta + static_cast<int64_t>(sizeof(RingMeta)) * C * L;
        nvl_total = align_up(nvl_ring_slots + nvl_slot_bytes * nvl_slots * C * L, 4096);
        rdma_arrive = 0;
        rdma_cells = align_up(8 * Rn, 128);
        rdma_cells_out = align_up(rdma_cells + 8 * rail_cell_words * Rn, 128);
        rdma_tails = align_up(rdma_cells_out + 8 * rail_cell_words * Rn, 128);
        rdma_heads = rdma_tails + static_cast<int64_t>(sizeof(RingCounter)) * C * Rn;
        rdma_recv_slots = rdma_heads + static_cast<int64_t>(sizeof(RingCounter)) * C * Rn;
        rdma_send_slots = rdma_recv_slots + rdma_slot_bytes * rdma_slots * C * Rn;
        rdma_total = align_up(rdma_send_slots + rdma_slot_bytes * rdma_slots * C * Rn, 4096);
    }
    // The NVL ring of (channel, forwarder l) in a node rank's buffer.
    MC_HD Ring nvl_ring(uint8_t* base, int channel, int forwarder) const {
        const int64_t k = static_cast<int64_t>(channel) * node_ranks + forwarder;
        return Ring{reinterpret_cast<RingMeta*>(base + nvl_ring_meta) + k,
                    base + nvl_ring_slots + k * nvl_slots * nvl_slot_bytes, nvl_slots, nvl_slot_bytes};
    }
    MC_HD int64_t* nvl_arrive_of(uint8_t* base) const { return reinterpret_cast<int64_t*>(base + nvl_arrive); }
    // Forwarder l's words about source node ns, in a node rank's buffer.
    MC_HD int64_t* node_cell(uint8_t* base, int forwarder, int source_node) const {
        return reinterpret_cast<int64_t*>(base + nvl_cells) +
               (static_cast<int64_t>(forwarder) * num_nodes + source_node) * node_cell_words;
    }
    // The ring from rail peer `sender` to rail peer `receiver` in channel c: offsets valid in both buffers.
    MC_HD RdmaRing rdma_ring(int channel, int sender, int receiver) const {
        const int64_t in = static_cast<int64_t>(channel) * num_nodes + sender;     // at the receiver
        const int64_t out = static_cast<int64_t>(channel) * num_nodes + receiver;  // at the sender
        const int64_t line = static_cast<int64_t>(sizeof(RingCounter));
        return RdmaRing{rdma_tails + in * line, rdma_recv_slots + in * rdma_slots * rdma_slot_bytes,
                        rdma_heads + out * line, rdma_send_slots + out * rdma_slots * rdma_slot_bytes, rdma_slots,
                        rdma_slot_bytes};
    }
    MC_HD int64_t rail_arrive(int source) const { return rdma_arrive + 8 * static_cast<int64_t>(source); }
    MC_HD int64_t rail_cell(int source) const { return rdma_cells + 8 * rail_cell_words * source; }
    MC_HD int64_t rail_cell_out(int node) const { return rdma_cells_out + 8 * rail_cell_words * node; }
};

// Low-latency header cells: a call's header (moe_comm/protocol/call_header.py: the handshake vector,
// then a rejection message) in at most this many bytes: room for 64 scalar fields and 4 words per rank.
MC_HD int64_t low_latency_header_bytes(int32_t num_ranks) {
    return align_up(8 * (64 + 4 * static_cast<int64_t>(num_ranks)) + 1024, 64);
}

// Low-latency mode. First a control area, placed by the rank count alone (so ranks whose calls disagree
// on every other size still find each other's headers): per half and source rank the header's sequence
// word (the call number, published after the header) and the header cell; per half and destination
// rank the last call of that half the destination consumed of this rank's sends (flow control);
// this rank's own header per half (what its send posts, its in-kernel checks' verdict included); and per
// half the calls this rank has made in it (the call number lives where the kernels run: ll_call).
// Then two halves, used by alternate calls. A half holds the dispatch count signals [E_loc][R], the
// combine arrival flags [E], the dispatch receive slots [E_loc][R][M][message] or (in the same place)
// the combine receive rows [E][M][row] (a row: bf16 [hidden], or LogFMT-10 in at most row_bytes), then
// this rank's send staging (its FP8 cast of each token, [M] messages) or the combine rows it returns
// [E_loc][R * M][row],
// staged when they are LogFMT-encoded or some peers are reached through staging (across nodes, where
// puts go from registered memory). Staging sits in the halves so a call's outgoing puts may still be
// in flight while the next call stages (double buffering, as for the signals). Every place is an
// offset from the buffer's base, the same in every rank's buffer.
struct LowLatencyLayout {
    int32_t num_ranks, experts_per_rank;
    int64_t max_tokens, hidden, message_bytes, row_bytes;
    int64_t header_bytes, seqs, consumed, headers, own_headers, call_counts, control;
    int64_t counts, flags, dispatch_slots, combine_rows, staging, send_rows, half_bytes, total;

    LowLatencyLayout() = default;  // as NormalLayout's
    // A message slot holds the largest message of any format: bf16 x, fp32 scales, the source token.
    MC_HD LowLatencyLayout(int32_t ranks, int32_t local_experts, int64_t m, int64_t h)
        : num_ranks(ranks), experts_per_rank(local_experts), max_tokens(m), hidden(h) {
        header_bytes = low_latency_header_bytes(num_ranks);
        seqs = 0;
        consumed = align_up(16 * static_cast<int64_t>(num_ranks), 128);
        headers = align_up(consumed + 16 * static_cast<int64_t>(num_ranks), 128);
        own_headers = headers + 2 * num_ranks * header_bytes;
        call_counts = own_headers + 2 * header_bytes;
        control = align_up(call_counts + 16, 4096);
        message_bytes = align_up(2 * hidden + 4 * (hidden / 128) + 4, 16);
        row_bytes = align_up(logfmt::max_row_bytes(hidden), 16);  // >= 2 * hidden: a bf16 row fits
        const int64_t experts = static_cast<int64_t>(num_ranks) * experts_per_rank;
        counts = 0;
        flags = align_up(8 * experts_per_rank * num_ranks, 128);
        // A half serves one call at a time (flow control: call n + 2 writes to a rank's half only after
        // that rank received call n), so a dispatch's places and a combine's overlap, as in DeepEP.
        const int64_t slots = message_bytes * max_tokens * experts, rows = row_bytes * max_tokens * experts;
        dispatch_slots = align_up(flags + 8 * experts, 128);
        combine_rows = dispatch_slots;
        staging = align_up(dispatch_slots + (slots > rows ? slots : rows), 128);
        send_rows = staging;
        const int64_t staged = message_bytes * max_tokens;
        half_bytes = align_up(staging + (staged > rows ? staged : rows), 4096);
        total = control + 2 * half_bytes;
    }
    MC_HD int64_t seq(int h, int source) const { return seqs + 8 * (static_cast<int64_t>(h) * num_ranks + source); }
    // The last call of half h that rank `dest` received of this rank's sends (halves apart: hooks may
    // receive a later call first).
    MC_HD int64_t consumed_by(int h, int dest) const {
        return consumed + 8 * (static_cast<int64_t>(h) * num_ranks + dest);
    }
    MC_HD int64_t header(int h, int source) const {
        return headers + (static_cast<int64_t>(h) * num_ranks + source) * header_bytes;
    }
    MC_HD int64_t own_header(int h) const { return own_headers + h * header_bytes; }
    // How many calls this rank has made in half h (an int64 only this rank's launches touch).
    MC_HD int64_t call_count(int h) const { return call_counts + 8 * static_cast<int64_t>(h); }
    MC_HD int64_t half(int h) const { return control + h * half_bytes; }
    MC_HD int64_t count(int h, int local_expert, int source) const {
        return half(h) + counts + 8 * (static_cast<int64_t>(local_expert) * num_ranks + source);
    }
    MC_HD int64_t flag(int h, int expert) const { return half(h) + flags + 8 * static_cast<int64_t>(expert); }
    MC_HD int64_t slot(int h, int local_expert, int source, int64_t i) const {
        return half(h) + dispatch_slots +
               ((static_cast<int64_t>(local_expert) * num_ranks + source) * max_tokens + i) * message_bytes;
    }
    MC_HD int64_t combine_row(int h, int expert, int64_t token) const {
        return half(h) + combine_rows + (expert * max_tokens + token) * row_bytes;
    }
    MC_HD int64_t staged_message(int h, int64_t token) const { return half(h) + staging + token * message_bytes; }
    // Row r of the combine input [E_loc * R * M] staged for a put.
    MC_HD int64_t send_row(int h, int64_t r) const { return half(h) + send_rows + r * row_bytes; }
};

}  // namespace moe_comm::cuda
