// What Ascend's MC2 expert-parallel operators (torch_npu.npu_moe_distribute_dispatch / _combine and
// their _v2) accept, as their documentation states it, and the sizes they imply. The ascend backend
// checks every call against these before it reaches the NPU, so a shape the operators refuse is a
// ValueError naming the argument instead of a device fault. Host-only C++: built and tested everywhere.
//
// NOTES: the numbers are the documented ones for Atlas A2 (910B) and Atlas A3 (910_93), v1 and v2
// (docs/vendors.md: MC2's limits and their sources); they change with CANN releases. One table here serves the
// Python adapter (moe_comm/backends/ascend/mc2.py reads them through moe_comm._C).
#pragma once

#include <cstdint>
#include <string>

namespace moe_comm::ascend {

enum class Product { kA2, kA3 };

// One MC2 dispatch/combine pair as the adapter would issue it. `batch` is each rank's row count (the
// adapter pads every rank's x to num_max_dispatch_tokens_per_rank, so all ranks send the same).
struct Mc2Call {
    Product product;
    int version;           // 1: npu_moe_distribute_dispatch, 2: _v2
    std::string comm_alg;  // v2 only: "" (the default), "fullmesh", "fullmesh_v1", "fullmesh_v2", "hierarchy"
    int64_t ep_world_size;
    int64_t moe_expert_num;
    int64_t hidden;
    int64_t batch;
    int64_t topk;
    bool quant;            // quant_mode 2 (dynamic INT8 per token)
};

// "" when the operators accept `call`, else what is wrong: the argument, what is accepted and what was
// given ("ep_world_size must be one of {16, 32, 64} on Atlas A2 (v1), got 4").
std::string mc2_check(const Mc2Call& call);

// Rows of expand_x one rank may receive (the operators' A): batch * ep_world_size * min(local experts, topk).
int64_t mc2_recv_rows(const Mc2Call& call);

// The least HCCL_BUFFSIZE (MB) the documented formula allows for `call`.
int64_t mc2_min_buffsize_mb(const Mc2Call& call);

}  // namespace moe_comm::ascend
