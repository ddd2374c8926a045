// The layout kernel (DeepEP's get_dispatch_layout): per token, which ranks it goes to, and counts per
// rank and per expert. One call per token, any number of agents at once: counts are atomic adds of
// integers, so the result is the same in any order. Ids outside [-1, num_experts) are skipped and
// flagged (the host raises, naming the first one).
#pragma once

#include <cstdint>

#include "../platform/platform.h"

namespace moe_comm::cuda {

struct LayoutArgs {
    int64_t num_tokens;
    int32_t num_topk, num_ranks, num_experts;
    const int64_t* topk_idx;   // [T][K]
    int64_t* per_rank;         // [R], zeroed by the caller
    int64_t* per_expert;       // [E], zeroed by the caller
    uint8_t* in_rank;          // [T][R]
    int64_t* bad;              // [1], zeroed by the caller: set to 1 when an id is out of range
};

template <class P>
MC_HD void layout_token(const LayoutArgs& a, int64_t t) {
    const int32_t per = a.num_experts / a.num_ranks;
    uint8_t* in = a.in_rank + t * a.num_ranks;
    for (int32_t r = 0; r < a.num_ranks; ++r) in[r] = 0;
    for (int32_t k = 0; k < a.num_topk; ++k) {
        const int64_t e = a.topk_idx[t * a.num_topk + k];
        if (e == -1) continue;
        if (e < -1 || e >= a.num_experts) {
            P::store_relaxed(a.bad, int64_t{1});
            continue;
        }
        in[e / per] = 1;
        P::atomic_add(a.per_expert + e, int64_t{1});
    }
    for (int32_t r = 0; r < a.num_ranks; ++r)
        if (in[r]) P::atomic_add(a.per_rank + r, int64_t{1});
}

}  // namespace moe_comm::cuda
