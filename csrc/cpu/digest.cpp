// Routing digests for the handshake (moe_comm/handshake.py gives the formula and the reference):
// two ranks that hold the same sequence of token keys for a block of rows get the same 62-bit value.
#include <vector>

#include "../common/digest.h"
#include "api.h"
#include "check.h"

namespace moe_comm::cpu {

using digest::finish;
using digest::term;

void block_digests(int64_t* out, const void* keys, int key_bytes, const int64_t* counts, int64_t num_blocks,
                   int64_t num_keys) {
    MC_CHECK(key_bytes == 4 || key_bytes == 8, "block_digests: key_bytes must be 4 or 8, got " << key_bytes);
    int64_t total = 0;
    for (int64_t b = 0; b < num_blocks; ++b) {
        MC_CHECK(counts[b] >= 0, "block_digests: counts[" << b << "] = " << counts[b] << " is negative");
        total += counts[b];
    }
    MC_CHECK(total == num_keys, "block_digests: blocks of " << total << " keys in all, but " << num_keys << " keys");
    const auto* k32 = static_cast<const int32_t*>(keys);
    const auto* k64 = static_cast<const int64_t*>(keys);
    for (int64_t b = 0, i = 0; b < num_blocks; ++b) {
        uint64_t sum = 0;
        for (int64_t j = 0; j < counts[b]; ++j, ++i) {
            const int64_t key = key_bytes == 4 ? k32[i] : k64[i];  // sign-extended, as the reference's int64 view
            sum += term(static_cast<uint64_t>(key), j);
        }
        out[b] = finish(sum);
    }
}

int64_t send_order_check(int64_t* counts, int64_t* digests, const bool* is_token_in_rank, const int32_t* send_head,
                         int64_t num_tokens, int64_t num_ranks) {
    std::vector<int64_t> start(static_cast<size_t>(num_ranks) + 1, 0);
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t r = 0; r < num_ranks; ++r) start[static_cast<size_t>(r) + 1] += is_token_in_rank[t * num_ranks + r];
    for (int64_t r = 0; r < num_ranks; ++r) {
        counts[r] = start[static_cast<size_t>(r) + 1];
        start[static_cast<size_t>(r) + 1] += start[static_cast<size_t>(r)];
    }
    std::vector<int64_t> seen(static_cast<size_t>(num_ranks), 0);
    std::vector<uint64_t> sums(static_cast<size_t>(num_ranks), 0);
    int64_t first_bad = -1;
    for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t r = 0; r < num_ranks; ++r) {
            const int64_t at = t * num_ranks + r;
            int64_t expected = -1;
            if (is_token_in_rank[at]) {
                const int64_t j = seen[static_cast<size_t>(r)]++;
                expected = start[static_cast<size_t>(r)] + j;
                sums[static_cast<size_t>(r)] += term(static_cast<uint64_t>(t), j);
            }
            if (first_bad < 0 && send_head[at] != expected) first_bad = at;
        }
    for (int64_t r = 0; r < num_ranks; ++r) digests[r] = finish(sums[static_cast<size_t>(r)]);
    return first_bad;
}

void low_latency_combine_digests(int64_t* returned, int64_t* asked, const int64_t* layout_range,
                                 const int32_t* src_info, const int64_t* msg, const int64_t* experts,
                                 const int64_t* send_counts, int64_t num_local_experts, int64_t num_ranks,
                                 int64_t rows_per_expert, int64_t num_topk) {
    const int64_t E = num_local_experts, R = num_ranks;
    for (int64_t s = 0; s < R; ++s) {  // combine_rows order: by source rank, then local expert, then row
        uint64_t sum = 0;
        int64_t j = 0;
        for (int64_t e = 0; e < E; ++e) {
            const int64_t range = layout_range[e * R + s], begin = range >> 32, count = range & 0xFFFFFFFF;
            MC_CHECK(begin >= 0 && begin + count <= rows_per_expert,
                     "low_latency_combine_digests: layout_range[" << e << ", " << s << "] spans rows [" << begin
                                                                  << ", " << begin + count << "), outside [0, "
                                                                  << rows_per_expert << ")");
            for (int64_t row = begin; row < begin + count; ++row, ++j) {
                const uint64_t key = static_cast<uint64_t>(e) << 32 |
                                     static_cast<uint64_t>(static_cast<int64_t>(src_info[e * rows_per_expert + row]));
                sum += term(key, j);
            }
        }
        returned[s] = finish(sum);
    }
    const int64_t divisor = num_topk > 0 ? num_topk : 1;
    for (int64_t d = 0, i = 0; d < R; ++d) {  // send order: by destination, then expert, then token
        uint64_t sum = 0;
        for (int64_t j = 0; j < send_counts[d]; ++j, ++i) {
            const uint64_t key = static_cast<uint64_t>(experts[i] % E) << 32 | static_cast<uint64_t>(msg[i] / divisor);
            sum += term(key, j);
        }
        asked[d] = finish(sum);
    }
}

int64_t low_latency_layout_check(const int64_t* layout_range, int64_t num_local_experts, int64_t num_ranks,
                                 int64_t rows_per_expert) {
    for (int64_t e = 0; e < num_local_experts; ++e) {
        int64_t next = 0;  // blocks by source rank ascending, each where the one before ends
        for (int64_t s = 0; s < num_ranks; ++s) {
            const int64_t at = e * num_ranks + s, range = layout_range[at];
            const int64_t begin = range >> 32, count = range & 0xFFFFFFFF;
            if (range < 0 || begin != next || begin + count > rows_per_expert) return at;
            next = begin + count;
        }
    }
    return -1;
}

}  // namespace moe_comm::cpu
