// The documented limits of Ascend's MC2 dispatch/combine (see mc2_limits.h for the sources).
#include "mc2_limits.h"

#include <algorithm>
#include <initializer_list>
#include <string>

namespace moe_comm::ascend {
namespace {

std::string where(const Mc2Call& c) {
    std::string product = c.product == Product::kA2 ? "Atlas A2" : "Atlas A3";
    std::string alg = c.version == 2 ? ", comm_alg '" + c.comm_alg + "'" : "";
    return " on " + product + " (v" + std::to_string(c.version) + alg + ")";
}

std::string one_of(std::initializer_list<int64_t> allowed) {
    std::string s = "one of {";
    for (int64_t v : allowed) s += (s.size() > 8 ? ", " : "") + std::to_string(v);
    return s + "}";
}

bool in(int64_t v, std::initializer_list<int64_t> allowed) {
    return std::find(allowed.begin(), allowed.end(), v) != allowed.end();
}

std::string bad(const Mc2Call& c, const std::string& arg, const std::string& expected, int64_t got) {
    return arg + " must be " + expected + where(c) + ", got " + std::to_string(got);
}

std::string range(int64_t lo, int64_t hi) {
    return "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

std::string check_ep(const Mc2Call& c) {
    const int64_t ep = c.ep_world_size;
    const bool hierarchy = c.comm_alg == "hierarchy";
    if (c.version == 1) {
        if (c.product == Product::kA2 && !in(ep, {16, 32, 64})) return bad(c, "ep_world_size", one_of({16, 32, 64}), ep);
        if (c.product == Product::kA3 && !in(ep, {8, 16, 32, 64, 128, 144, 256, 288}))
            return bad(c, "ep_world_size", one_of({8, 16, 32, 64, 128, 144, 256, 288}), ep);
        return "";
    }
    if (c.product == Product::kA2) {
        if (hierarchy && !in(ep, {16, 32, 64})) return bad(c, "ep_world_size", one_of({16, 32, 64}), ep);
        if (!hierarchy && !in(ep, {2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256}))
            return bad(c, "ep_world_size", one_of({2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256}), ep);
        return "";
    }
    if (hierarchy && (ep < 16 || ep > 256 || ep % 16))
        return bad(c, "ep_world_size", "a multiple of 16 " + range(16, 256), ep);
    if (ep < 2 || ep > 768) return bad(c, "ep_world_size", range(2, 768), ep);
    return "";
}

std::string check_comm_alg(const Mc2Call& c) {
    if (c.version != 1 && c.version != 2) return bad(c, "version", "1 or 2", c.version);
    const std::string& a = c.comm_alg;
    if (c.version == 1 && !a.empty()) return "comm_alg is a v2 argument" + where(c) + ": leave it empty";
    if (c.version == 2 && c.product == Product::kA2 && a != "" && a != "fullmesh" && a != "hierarchy")
        return "comm_alg must be one of '', 'fullmesh', 'hierarchy'" + where(c) + ", got '" + a + "'";
    if (c.version == 2 && c.product == Product::kA3 && a != "" && a != "fullmesh_v1" && a != "fullmesh_v2" &&
        a != "hierarchy")
        return "comm_alg must be one of '', 'fullmesh_v1', 'fullmesh_v2', 'hierarchy'" + where(c) + ", got '" + a + "'";
    return "";
}

std::string check_experts(const Mc2Call& c) {
    const bool hierarchy = c.comm_alg == "hierarchy";
    const int64_t most = c.version == 1 || (c.product == Product::kA3 && hierarchy) ? 512 : 1024;
    if (c.moe_expert_num < 1 || c.moe_expert_num > most) return bad(c, "moe_expert_num", range(1, most), c.moe_expert_num);
    if (c.moe_expert_num % c.ep_world_size)
        return bad(c, "moe_expert_num", "a multiple of ep_world_size " + std::to_string(c.ep_world_size),
                   c.moe_expert_num);
    // A2 without the hierarchical algorithm holds at most 24 experts per rank
    if (c.product == Product::kA2 && !hierarchy && c.moe_expert_num / c.ep_world_size > 24)
        return bad(c, "moe_expert_num / ep_world_size (local experts)", "at most 24", c.moe_expert_num / c.ep_world_size);
    return "";
}

std::string check_hidden(const Mc2Call& c) {
    const int64_t h = c.hidden;
    if (c.product == Product::kA3) {
        if (c.version == 1 && h != 7168) return bad(c, "hidden", "7168", h);
        if (h < 1024 || h > 8192) return bad(c, "hidden", range(1024, 8192), h);
        return "";
    }
    const int64_t most = c.version == 2 && c.comm_alg == "hierarchy" ? 10240 : 7168;
    if (h < 32 || h > most || h % 32) return bad(c, "hidden", "a multiple of 32 " + range(32, most), h);
    return "";
}

std::string check_sizes(const Mc2Call& c) {
    const int64_t batch_most = c.product == Product::kA2 ? 256 : 512;
    if (c.batch < 1 || c.batch > batch_most)
        return bad(c, "num_max_dispatch_tokens_per_rank (the operators' BS)", range(1, batch_most), c.batch);
    int64_t topk_most = c.version == 1 ? (c.product == Product::kA2 ? 16 : 8) : 16;
    if (c.version == 2 && c.product == Product::kA3 && c.comm_alg == "fullmesh_v2") topk_most = 12;
    if (c.topk < 1 || c.topk > topk_most) return bad(c, "num_topk (the operators' K)", range(1, topk_most), c.topk);
    return "";
}

}  // namespace

std::string mc2_check(const Mc2Call& call) {
    for (auto check : {check_comm_alg, check_ep, check_experts, check_hidden, check_sizes}) {
        std::string wrong = check(call);
        if (!wrong.empty()) return wrong;
    }
    return "";
}

int64_t mc2_recv_rows(const Mc2Call& c) {
    const int64_t local = c.moe_expert_num / std::max<int64_t>(c.ep_world_size, 1);
    return c.batch * c.ep_world_size * std::min(local, c.topk);
}

int64_t mc2_min_buffsize_mb(const Mc2Call& c) {
    constexpr int64_t kMB = int64_t{1} << 20;
    const int64_t local = c.moe_expert_num / std::max<int64_t>(c.ep_world_size, 1);
    if (c.product == Product::kA2) {  // >= 2 * (BS * ep * min(local, K) * H * 2 B + 2 MB)
        const int64_t bytes = 2 * (mc2_recv_rows(c) * c.hidden * 2 + 2 * kMB);
        return (bytes + kMB - 1) / kMB;
    }
    // A3: 1 MB * (HCCL_BUFFSIZE - 2) / 2 >= BS * 2 * (H + 128) * (ep * local + K + 1)
    const int64_t bytes = 2 * c.batch * 2 * (c.hidden + 128) * (c.ep_world_size * local + c.topk + 1);
    return 2 + (bytes + kMB - 1) / kMB;
}

}  // namespace moe_comm::ascend
