// Where everything lives in one rank's communication buffer (its NVLink buffer: cudaMalloc'd and
// shared over CUDA IPC on the GPU, a shared-memory segment on the host). Every rank computes the same
// layout from the same call parameters, which the call's agreement has checked, so offsets into a
// peer's buffer are offsets into one's own. Python reads these through moe_comm._cuda_host, the only
// source of them.
#pragma once

#include <cstdint>

#include "../platform/platform.h"
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

// Low-latency mode: two halves, used by alternate calls. A half holds the dispatch count signals
// [E_loc][R], the combine arrival flags [E], the dispatch receive slots [E_loc][R][M][message] and the
// combine receive rows [E][M][hidden] bf16. A rank's own send staging (its FP8 cast of each token)
// sits after the halves.
struct LowLatencyLayout {
    int32_t num_ranks, experts_per_rank;
    int64_t max_tokens, hidden, message_bytes;
    int64_t counts, flags, dispatch_slots, combine_rows, half_bytes, staging, total;

    LowLatencyLayout() = default;  // as NormalLayout's
    // A message slot holds the largest message of any format: bf16 x, fp32 scales, the source token.
    MC_HD LowLatencyLayout(int32_t ranks, int32_t local_experts, int64_t m, int64_t h)
        : num_ranks(ranks), experts_per_rank(local_experts), max_tokens(m), hidden(h) {
        message_bytes = align_up(2 * hidden + 4 * (hidden / 128) + 4, 16);
        const int64_t experts = static_cast<int64_t>(num_ranks) * experts_per_rank;
        counts = 0;
        flags = align_up(8 * experts_per_rank * num_ranks, 128);
        dispatch_slots = align_up(flags + 8 * experts, 128);
        combine_rows = dispatch_slots + message_bytes * max_tokens * experts_per_rank * num_ranks;
        half_bytes = align_up(combine_rows + 2 * hidden * max_tokens * experts, 4096);
        staging = 2 * half_bytes;
        total = align_up(staging + message_bytes * max_tokens, 4096);
    }
    MC_HD uint8_t* half(uint8_t* base, int h) const { return base + h * half_bytes; }
    MC_HD int64_t* count(uint8_t* half_base, int local_expert, int source) const {
        return reinterpret_cast<int64_t*>(half_base + counts) + static_cast<int64_t>(local_expert) * num_ranks + source;
    }
    MC_HD int64_t* flag(uint8_t* half_base, int expert) const {
        return reinterpret_cast<int64_t*>(half_base + flags) + expert;
    }
    MC_HD uint8_t* slot(uint8_t* half_base, int local_expert, int source, int64_t i) const {
        return half_base + dispatch_slots +
               ((static_cast<int64_t>(local_expert) * num_ranks + source) * max_tokens + i) * message_bytes;
    }
    MC_HD uint16_t* combine_row(uint8_t* half_base, int expert, int64_t token) const {
        return reinterpret_cast<uint16_t*>(half_base + combine_rows) + (expert * max_tokens + token) * hidden;
    }
};

}  // namespace moe_comm::cuda
