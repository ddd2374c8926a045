// ThreadSanitizer stress of the host build of the CUDA kernels (launches.cpp on HostPlatform).
//
// R simulated ranks (2..4 per round) run in one process: each rank is a std::thread owning a zeroed
// heap buffer sized by NormalLayout / LowLatencyLayout, every rank sees every buffer (host::Peers),
// and each rank thread makes the launches the cuda_host backend makes, in its order
// (moe_comm/backends/cuda/normal.py, low_latency.py):
//
//   normal dispatch:         notify(epoch) -> dispatch        (epochs count notify / prologue calls)
//   normal cached dispatch:  prologue(epoch) -> dispatch
//   normal combine:          prologue(epoch) -> combine
//   low-latency dispatch:    ll_dispatch_send -> ll_dispatch_recv   (call n in buffer half (n - 1) % 2,
//                                                                    each posting and judging call headers)
//   low-latency combine:     ll_combine_send -> ll_combine_recv
//
// Half the rounds split the ranks into 2..3 nodes of 1..2 ranks and run normal mode across nodes instead
// (kernels/internode.h): internode_notify -> internode_dispatch, internode_prologue -> internode_dispatch
// (cached), internode_prologue -> internode_combine, every rank with an NVL buffer its node maps and an RDMA
// buffer its rail reaches, RDMA rings of 2..8 slots fed 1..slots/2 tokens at a time; outputs are checked
// against the same references (rows by global source rank, then token; exact sums), notify's forwarding
// counts against the routes.
//
// Every round draws its geometry from the seed: tokens 0..40 per rank, hidden 128 or 256 (512 for some
// low-latency rounds), top-k 1..4 distinct experts with some -1, 1..3 experts per rank, 1..3
// channels, 4..16 ring slots and a chunk of 1..slots-1, so rings wrap and senders wait for space.
// The main thread computes every input and, after the round, checks every output against a plain
// sequential reference (dispatch rows by source rank then source token; combine sums of small
// integers, exact in any row type; low-latency counts, ranges, src_info, messages and the weighted
// sum). Every rank's pid in host::Peers is 0: HostPlatform::peer_exited only checks pids > 0, so the
// waits have their deadline (--timeout) and no liveness check. Exit 0: every round matched; 1: a mismatch or a failed wait (printed); TSan's own exit code
// when it reports.
//
// Between the calls of a round every rank meets the others at a host rendezvous: the backend's
// handshake, an all-to-all before every call's first launch. --no-handshake drops it for the
// low-latency calls, whose protocol is meant to need no host synchronisation (CUDA graphs), and
// --no-handshake-normal also for the normal-mode calls. A normal-mode launch runs inside its call;
// with --async it runs on the rank's stream thread (moe_comm/backends/cuda/host_stream.py), so the
// next call's handshake may pass while it still runs (the backend with async_finish=True).
//
//   stress [--seed S] [--rounds N] [--no-handshake] [--no-handshake-normal] [--async] [--timeout SECONDS]
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launches.h"
#include "../platform/host.h"

namespace {

using namespace moe_comm::cuda;
using moe_comm::DType;
namespace numeric = moe_comm::numeric;

// ------------------------------------------------------------------------------------ utilities
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1)); }
    bool chance(int percent) { return range(0, 99) < percent; }
};

[[noreturn]] void fail_exit() {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
}

// A zeroed, page-aligned heap buffer: one rank's communication buffer.
struct Buffer {
    uint8_t* p = nullptr;
    size_t n = 0;
    explicit Buffer(size_t bytes) : n(bytes) {
        p = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
        if (!p) {
            std::fprintf(stderr, "stress: cannot allocate %zu bytes\n", bytes);
            fail_exit();
        }
        std::memset(p, 0, bytes);
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { std::free(p); }
};

// The handshake: every rank enters before any leaves (mutex and condition variable, which
// ThreadSanitizer models exactly).
class Rendezvous {
public:
    explicit Rendezvous(int n) : n_(n) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(m_);
        const uint64_t gen = gen_;
        if (++count_ == n_) {
            count_ = 0;
            ++gen_;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return gen_ != gen; });
        }
    }

private:
    std::mutex m_;
    std::condition_variable cv_;
    int n_, count_ = 0;
    uint64_t gen_ = 0;
};

int g_round = -1;  // for messages (written by main before a round's threads start)

void check_launch(const ErrorRecord& e, const char* what, int rank) {
    if (e.code == 0) return;
    std::fprintf(stderr,
                 "stress: round %d: rank %d: %s failed: code %d (1 timeout, 2 peer exited), wait kind %d, "
                 "waiter %d, peer %d, channel %d, observed %lld, expected %lld\n",
                 g_round, rank, what, e.code, e.kind, e.rank, e.peer, e.channel, static_cast<long long>(e.observed),
                 static_cast<long long>(e.expected));
    fail_exit();
}

int mismatches = 0;

template <class T>
void expect_eq(const T& got, const T& want, const std::string& what) {
    if (got == want) return;
    if (++mismatches <= 20)
        std::fprintf(stderr, "stress: round %d: %s: got %lld, expected %lld\n", g_round, what.c_str(),
                     static_cast<long long>(got), static_cast<long long>(want));
}

void expect_bytes(const uint8_t* got, const uint8_t* want, int64_t n, const std::string& what) {
    if (n <= 0 || std::memcmp(got, want, static_cast<size_t>(n)) == 0) return;
    int64_t i = 0;
    while (got[i] == want[i]) ++i;
    if (++mismatches <= 20)
        std::fprintf(stderr, "stress: round %d: %s: byte %lld of %lld: got 0x%02x, expected 0x%02x\n", g_round,
                     what.c_str(), static_cast<long long>(i), static_cast<long long>(n), got[i], want[i]);
}

std::string at(const char* what, int rank, int op) {
    return std::string(what) + " (rank " + std::to_string(rank) + ", call " + std::to_string(op) + ")";
}

std::vector<uint8_t> random_bytes(Rng& rng, int64_t n) {
    std::vector<uint8_t> v(static_cast<size_t>(n));
    for (auto& b : v) b = static_cast<uint8_t>(rng.next());
    return v;
}

// Finite bf16 of moderate magnitude (the FP8 cast's input).
uint16_t random_bf16(Rng& rng) {
    const uint64_t r = rng.next();
    const uint16_t sign = static_cast<uint16_t>((r & 1) << 15);
    const uint16_t exponent = static_cast<uint16_t>(118 + (r >> 1) % 18);
    return static_cast<uint16_t>(sign | (exponent << 7) | ((r >> 8) & 0x7f));
}

// Small integers: every sum of a few of them is exact in fp32, bf16 and fp16.
float f_normal(int r, int s, int64_t t, int64_t h) { return static_cast<float>((3 * r + 5 * s + 7 * t + h) % 9); }
float g_normal(int r, int s, int64_t t, int64_t j) { return 0.5f * static_cast<float>((r + 2 * s + t + 3 * j) % 5); }
float bias_value(int me, int64_t t, int64_t h, int which) { return static_cast<float>((t + h + which + me) % 4); }
float f_ll(int64_t e, int s, int64_t t, int64_t h) { return static_cast<float>((e + 3 * s + 5 * t + h) % 7); }

int64_t row_bytes(DType t, int64_t hidden) { return (t == DType::kFloat32 ? 4 : 2) * hidden; }

// ------------------------------------------------------------------------------------ routing
// One rank's routing of one dispatch, and DeepEP's layout of it (ops.get_dispatch_layout), with
// the channel split of the normal kernels: channel c holds tokens [c * ceil(T / C), ...).
struct Route {
    int64_t T = 0;
    int K = 0;
    std::vector<int64_t> topk;        // [T][K] global expert or -1
    std::vector<float> weights;       // [T][K]
    std::vector<uint8_t> in_rank;     // [T][R]
    std::vector<int64_t> rows_to_rank;  // [R]
    std::vector<int64_t> per_expert;    // [E]
    std::vector<int64_t> chan_prefix;   // [R][C] cumulative
    std::vector<int32_t> send_pos;      // [T][R] index among the rows to r, or -1
    // across nodes (Round::nodes > 1)
    std::vector<int64_t> rdma_prefix;     // [Rn][C] cumulative tokens to each node
    std::vector<int32_t> send_rdma_head;  // [T][Rn] position among channel c(t)'s tokens to node n, or -1
};

// What a rank forwards in a dispatch across nodes: from each source node (the rank of its local index
// there), the cumulative tokens per channel for its node, and each forwarded token's destination bits
// in its node (source node ascending, then token).
struct Forwarding {
    std::vector<int64_t> recv_rdma_prefix;  // [Rn][C]
    std::vector<int32_t> bits;              // [N_fwd]
};

std::vector<int64_t> draw_topk(Rng& rng, int64_t T, int K, int E) {
    std::vector<int64_t> topk(static_cast<size_t>(T * K), -1);
    for (int64_t t = 0; t < T; ++t) {
        std::vector<int64_t> chosen;
        for (int j = 0; j < K; ++j) {
            if (rng.chance(15) || static_cast<int>(chosen.size()) == E) continue;  // -1
            int64_t e;
            do e = rng.range(0, E - 1);
            while (std::find(chosen.begin(), chosen.end(), e) != chosen.end());
            chosen.push_back(e);
            topk[static_cast<size_t>(t * K + j)] = e;
        }
    }
    return topk;
}

Route make_route(Rng& rng, int R, int L, int C, int K) {
    Route rt;
    const int E = R * L;
    rt.T = rng.chance(5) ? 0 : rng.range(0, 40);
    rt.K = K;
    rt.topk = draw_topk(rng, rt.T, rt.K, E);
    rt.weights.resize(rt.topk.size());
    for (auto& w : rt.weights) w = 0.25f * static_cast<float>(rng.range(1, 8));
    rt.in_rank.assign(static_cast<size_t>(rt.T * R), 0);
    rt.per_expert.assign(static_cast<size_t>(E), 0);
    for (int64_t t = 0; t < rt.T; ++t)
        for (int j = 0; j < rt.K; ++j) {
            const int64_t e = rt.topk[static_cast<size_t>(t * rt.K + j)];
            if (e < 0) continue;
            rt.per_expert[static_cast<size_t>(e)]++;
            rt.in_rank[static_cast<size_t>(t * R + e / L)] = 1;
        }
    rt.rows_to_rank.assign(static_cast<size_t>(R), 0);
    rt.chan_prefix.assign(static_cast<size_t>(R * C), 0);
    rt.send_pos.assign(static_cast<size_t>(rt.T * R), -1);
    const int64_t per = std::max<int64_t>((rt.T + C - 1) / C, 1);
    for (int64_t t = 0; t < rt.T; ++t)
        for (int r = 0; r < R; ++r)
            if (rt.in_rank[static_cast<size_t>(t * R + r)]) {
                rt.send_pos[static_cast<size_t>(t * R + r)] = static_cast<int32_t>(rt.rows_to_rank[static_cast<size_t>(r)]++);
                rt.chan_prefix[static_cast<size_t>(r * C + t / per)]++;
            }
    for (int r = 0; r < R; ++r)
        for (int c = 1; c < C; ++c) rt.chan_prefix[static_cast<size_t>(r * C + c)] += rt.chan_prefix[static_cast<size_t>(r * C + c - 1)];
    return rt;
}

int32_t node_bits(const Route& rt, int R, int NL, int64_t t, int n) {
    int32_t bits = 0;
    for (int l = 0; l < NL; ++l)
        if (rt.in_rank[static_cast<size_t>(t * R + n * NL + l)]) bits |= 1 << l;
    return bits;
}

// A route's node bookkeeping (DeepEP's rdma_channel_prefix_matrix and send_rdma_head).
void add_node_routing(Route& rt, int Rn, int NL, int C) {
    const int R = Rn * NL;
    rt.rdma_prefix.assign(static_cast<size_t>(Rn * C), 0);
    rt.send_rdma_head.assign(static_cast<size_t>(rt.T * Rn), -1);
    const int64_t per = std::max<int64_t>((rt.T + C - 1) / C, 1);
    for (int64_t t = 0; t < rt.T; ++t)
        for (int n = 0; n < Rn; ++n)
            if (node_bits(rt, R, NL, t, n)) {
                const int c = static_cast<int>(t / per);
                int64_t before = 0;  // this channel's earlier tokens to n
                for (int64_t u = c * per; u < t; ++u) before += node_bits(rt, R, NL, u, n) != 0;
                rt.send_rdma_head[static_cast<size_t>(t * Rn + n)] = static_cast<int32_t>(before);
                rt.rdma_prefix[static_cast<size_t>(n * C + c)]++;
            }
    for (int n = 0; n < Rn; ++n)
        for (int c = 1; c < C; ++c) rt.rdma_prefix[static_cast<size_t>(n * C + c)] += rt.rdma_prefix[static_cast<size_t>(n * C + c - 1)];
}

Forwarding forwarding(const std::vector<Route>& routes, int Rn, int NL, int C, int me) {
    Forwarding f;
    const int R = Rn * NL, node = me / NL, local = me % NL;
    for (int ns = 0; ns < Rn; ++ns) {
        const Route& src = routes[static_cast<size_t>(ns * NL + local)];
        for (int c = 0; c < C; ++c) f.recv_rdma_prefix.push_back(src.rdma_prefix[static_cast<size_t>(node * C + c)]);
        for (int64_t t = 0; t < src.T; ++t)
            if (const int32_t b = node_bits(src, R, NL, t, node)) f.bits.push_back(b);
    }
    return f;
}

// ------------------------------------------------------------------------------------ a round
enum class Kind { kDispatch, kCached, kCombine };

struct NormalRankIn {
    std::vector<uint8_t> x, scales;     // dispatch payload [T][x_bytes], [T][scale_bytes]
    std::vector<uint8_t> cx;            // combine rows [N_recv][row bytes]
    std::vector<float> cw;              // combine weights [N_recv][K]
    std::vector<uint8_t> b0, b1;        // combine biases [T][row bytes]
};

struct NotifyOut {
    std::vector<int32_t> rank_prefix;     // intranode
    std::vector<int32_t> gbl_prefix;      // across nodes: [R] rows from ranks 0..s
    std::vector<int64_t> recv_rdma;       // across nodes: [Rn][C]
    std::vector<int64_t> recv_offset, chan_offset, chan_count, per_expert;
    int64_t num_recv = -1;
};

struct NormalRankOut {
    NotifyOut notify;  // kDispatch
    std::vector<uint8_t> recv_x, recv_scales;
    std::vector<int64_t> recv_topk_idx;
    std::vector<float> recv_topk_weights;
    std::vector<int32_t> recv_src;
    std::vector<uint8_t> out;
    std::vector<float> out_weights;
};

struct NormalOp {
    Kind kind;
    int route;                     // the dispatch's routing (kDispatch: the one it makes)
    int64_t x_bytes = 0, scale_bytes = 0;
    bool with_topk = false;        // kDispatch
    DType type = DType::kFloat32;  // kCombine
    bool with_weights = false, with_b0 = false, with_b1 = false;
    std::vector<NormalRankIn> in;  // [R]
    std::vector<NormalRankOut> out;
};

struct LlRankIn {
    std::vector<uint16_t> x;        // dispatch [T][H]
    std::vector<uint16_t> cx;       // combine [L][R * M][H]
    std::vector<float> cw;          // combine [T][K]
};

struct LlRankOut {
    std::vector<uint8_t> recv_x;
    std::vector<int32_t> recv_scales, src_info, recv_count;
    std::vector<int64_t> layout_range;
    std::vector<uint16_t> out;
};

struct LlOp {
    bool dispatch;
    int route;  // the dispatch's routing (in ll_routes)
    CastFormat format{false, false, false};
    int64_t scale_bytes = 0;
    std::vector<LlRankIn> in;
    std::vector<LlRankOut> out;
};

struct Round {
    int R, L, C;
    int nodes = 1, node_ranks = 0;            // nodes > 1: normal mode across nodes of node_ranks ranks
    int64_t rdma_slots = 0, rdma_chunk = 0;
    int64_t slots, chunk, hidden, alignment;
    int64_t M, ll_hidden;
    bool shake_normal, shake_ll, async_launch;
    double timeout_s;
    std::vector<std::vector<Route>> routes;     // [dispatch][rank]
    std::vector<std::vector<Forwarding>> fwd;   // [dispatch][rank] (across nodes)
    std::vector<std::vector<Route>> ll_routes;  // [dispatch][rank]
    std::vector<NormalOp> ops;
    std::vector<LlOp> ll_ops;
    std::vector<uint8_t*> normal_bases, rdma_bases, ll_bases;
};

// Rows rank `me` receives in a dispatch, in order: (source, token).
std::vector<std::pair<int, int64_t>> received(const Round& rd, int route, int me) {
    std::vector<std::pair<int, int64_t>> rows;
    for (int s = 0; s < rd.R; ++s) {
        const Route& rt = rd.routes[static_cast<size_t>(route)][static_cast<size_t>(s)];
        for (int64_t t = 0; t < rt.T; ++t)
            if (rt.in_rank[static_cast<size_t>(t * rd.R + me)]) rows.emplace_back(s, t);
    }
    return rows;
}

// Tokens of source s that chose expert e, in order (low-latency).
std::vector<int64_t> ll_tokens(const Route& rt, int64_t e) {
    std::vector<int64_t> v;
    for (int64_t t = 0; t < rt.T; ++t)
        for (int j = 0; j < rt.K; ++j)
            if (rt.topk[static_cast<size_t>(t * rt.K + j)] == e) v.push_back(t);
    return v;
}

Round make_round(Rng& rng, bool shake_ll, bool shake_normal, bool async_launch, double timeout_s) {
    Round rd;
    if (rng.chance(50)) {
        rd.nodes = static_cast<int>(rng.range(2, 3));
        rd.node_ranks = static_cast<int>(rng.range(1, 2));
        rd.rdma_slots = rng.range(2, 8);
        rd.rdma_chunk = rng.range(1, rd.rdma_slots / 2);
    }
    rd.R = rd.nodes > 1 ? rd.nodes * rd.node_ranks : static_cast<int>(rng.range(2, 4));
    rd.L = static_cast<int>(rng.range(1, 3));
    rd.C = static_cast<int>(rng.range(1, 3));
    rd.slots = rng.range(4, 16);
    rd.chunk = rng.range(1, rd.slots - 1);
    rd.hidden = rng.chance(50) ? 128 : 256;
    rd.alignment = rng.chance(50) ? 1 : rng.range(2, 8);
    rd.shake_normal = shake_normal;
    rd.shake_ll = shake_ll;
    rd.async_launch = async_launch;
    rd.timeout_s = timeout_s;
    const int R = rd.R, L = rd.L, C = rd.C;

    // normal mode: a dispatch first, then dispatches, cached dispatches and combines of the latest
    const int n_ops = static_cast<int>(rng.range(2, 5));
    for (int i = 0; i < n_ops; ++i) {
        NormalOp op;
        const int64_t roll = rng.range(0, 99);
        op.kind = i == 0 || roll < 30 ? Kind::kDispatch : roll < 50 ? Kind::kCached : Kind::kCombine;
        if (op.kind == Kind::kDispatch) {
            const int K = static_cast<int>(rng.range(1, 4));  // alike on every rank (the handshake checks it)
            rd.routes.emplace_back();
            for (int r = 0; r < R; ++r) rd.routes.back().push_back(make_route(rng, R, L, C, K));
            if (rd.nodes > 1) {
                for (auto& rt : rd.routes.back()) add_node_routing(rt, rd.nodes, rd.node_ranks, C);
                rd.fwd.emplace_back();
                for (int r = 0; r < R; ++r)
                    rd.fwd.back().push_back(forwarding(rd.routes.back(), rd.nodes, rd.node_ranks, C, r));
            }
        }
        op.route = static_cast<int>(rd.routes.size()) - 1;
        op.in.resize(static_cast<size_t>(R));
        op.out.resize(static_cast<size_t>(R));
        if (op.kind != Kind::kCombine) {
            const bool fp8 = rng.chance(30);
            op.x_bytes = fp8 ? rd.hidden : 2 * rd.hidden;
            op.scale_bytes = fp8 || rng.chance(20) ? 4 * (rd.hidden / 128) : 0;
            op.with_topk = op.kind == Kind::kDispatch && rng.chance(85);
        } else {
            const int64_t roll2 = rng.range(0, 2);
            op.type = roll2 == 0 ? DType::kFloat32 : roll2 == 1 ? DType::kBFloat16 : DType::kFloat16;
            op.x_bytes = row_bytes(op.type, rd.hidden);
            op.with_weights = rng.chance(60);
            op.with_b0 = rng.chance(30);
            op.with_b1 = op.with_b0 && rng.chance(50);
        }
        rd.ops.push_back(std::move(op));
    }
    // the payloads
    for (auto& op : rd.ops) {
        const auto& routes = rd.routes[static_cast<size_t>(op.route)];
        for (int r = 0; r < R; ++r) {
            auto& in = op.in[static_cast<size_t>(r)];
            const int64_t T = routes[static_cast<size_t>(r)].T, K = routes[0].K;
            if (op.kind != Kind::kCombine) {
                in.x = random_bytes(rng, T * op.x_bytes);
                in.scales = random_bytes(rng, T * op.scale_bytes);
                continue;
            }
            const auto rows = received(rd, op.route, r);
            const int64_t H = rd.hidden;
            in.cx.assign(static_cast<size_t>(static_cast<int64_t>(rows.size()) * op.x_bytes), 0);
            for (size_t i = 0; i < rows.size(); ++i)
                for (int64_t h = 0; h < H; ++h)
                    store_elem(in.cx.data() + static_cast<int64_t>(i) * op.x_bytes, h, op.type,
                               f_normal(r, rows[i].first, rows[i].second, h));
            if (op.with_weights) {
                in.cw.resize(rows.size() * static_cast<size_t>(K));
                for (size_t i = 0; i < rows.size(); ++i)
                    for (int64_t j = 0; j < K; ++j) in.cw[i * static_cast<size_t>(K) + static_cast<size_t>(j)] =
                        g_normal(r, rows[i].first, rows[i].second, j);
            }
            for (int which = 0; which < 2; ++which) {
                if (!(which ? op.with_b1 : op.with_b0)) continue;
                auto& b = which ? in.b1 : in.b0;
                b.assign(static_cast<size_t>(T * op.x_bytes), 0);
                for (int64_t t = 0; t < T; ++t)
                    for (int64_t h = 0; h < H; ++h) store_elem(b.data() + t * op.x_bytes, h, op.type, bias_value(r, t, h, which));
            }
        }
    }

    // low-latency: a dispatch first, then dispatches and combines of the latest
    rd.ll_hidden = rng.chance(15) ? 512 : rng.chance(50) ? 128 : 256;
    rd.M = rng.range(40, 48);
    const int n_ll = static_cast<int>(rng.range(2, 6));
    const int K_ll = static_cast<int>(rng.range(1, 4));
    for (int i = 0; i < n_ll; ++i) {
        LlOp op;
        op.dispatch = i == 0 || rng.chance(45);
        if (op.dispatch) {
            rd.ll_routes.emplace_back();
            for (int r = 0; r < R; ++r) {
                Route rt;
                rt.T = rng.range(0, 40);
                rt.K = K_ll;
                rt.topk = draw_topk(rng, rt.T, rt.K, R * L);
                rd.ll_routes.back().push_back(std::move(rt));
            }
            const int64_t roll = rng.range(0, 99);
            const bool ue8m0 = rd.ll_hidden % 512 == 0 && roll < 30;
            op.format = CastFormat{roll < 60, ue8m0 || (roll < 60 && rng.chance(50)), ue8m0};
            op.scale_bytes = !op.format.fp8 ? 0 : ue8m0 ? rd.ll_hidden / 128 : 4 * (rd.ll_hidden / 128);
        }
        op.route = static_cast<int>(rd.ll_routes.size()) - 1;
        op.in.resize(static_cast<size_t>(R));
        op.out.resize(static_cast<size_t>(R));
        const auto& routes = rd.ll_routes[static_cast<size_t>(op.route)];
        const int64_t H = rd.ll_hidden, rows = R * rd.M;
        for (int r = 0; r < R; ++r) {
            auto& in = op.in[static_cast<size_t>(r)];
            const Route& rt = routes[static_cast<size_t>(r)];
            if (op.dispatch) {
                in.x.resize(static_cast<size_t>(rt.T * H));
                for (auto& v : in.x) v = random_bf16(rng);
                continue;
            }
            // the rows this rank's experts return: row begin_s + i of local expert e holds f_ll of
            // (expert, source, token); rows no range covers are NaN, so a stray one shows
            in.cx.assign(static_cast<size_t>(L * rows * H), 0x7fc0);
            for (int e = 0; e < L; ++e) {
                int64_t row = 0;
                for (int s = 0; s < R; ++s)
                    for (int64_t t : ll_tokens(routes[static_cast<size_t>(s)], r * L + e)) {
                        for (int64_t h = 0; h < H; ++h)
                            in.cx[static_cast<size_t>((e * rows + row) * H + h)] =
                                numeric::float_to_bf16(f_ll(r * L + e, s, t, h));
                        ++row;
                    }
            }
            in.cw.resize(static_cast<size_t>(rt.T * rt.K));
            for (auto& w : in.cw) w = 0.5f * static_cast<float>(rng.range(0, 4));
        }
        rd.ll_ops.push_back(std::move(op));
    }
    return rd;
}

// A dispatch's outputs of `rows` rows, filled with values no kernel writes (so a row it misses shows).
void fill_dispatch_outputs(NormalRankOut& out, int64_t rows, const NormalOp& op, int32_t K) {
    out.recv_x.assign(static_cast<size_t>(rows * op.x_bytes), 0xee);
    out.recv_scales.assign(static_cast<size_t>(rows * op.scale_bytes), 0xee);
    out.recv_src.assign(static_cast<size_t>(rows), -7);
    if (K) {
        out.recv_topk_idx.assign(static_cast<size_t>(rows * K), -7);
        out.recv_topk_weights.assign(static_cast<size_t>(rows * K), -7.0f);
    }
}

// ------------------------------------------------------------------------------------ rank threads
// The backend's communication stream (moe_comm/backends/cuda/host_stream.py): one rank's launches in
// order. submit waits for the previous launch, then starts this one: on its own thread with --async
// (the call returns while the kernel still moves bytes, as with async_finish=True), else at once.
// run is a launch the caller waits for (notify: its outputs size the dispatch's).
struct Stream {
    bool async;
    std::thread last;
    void synchronize() {
        if (last.joinable()) last.join();
    }
    template <class F>
    void submit(F fn) {
        synchronize();
        if (async)
            last = std::thread(std::move(fn));
        else
            fn();
    }
    template <class F>
    void run(F fn) {
        synchronize();
        fn();
    }
    ~Stream() { synchronize(); }
};

void run_normal(Round& rd, int me, Rendezvous& shake) {
    const host::Peers peers{rd.normal_bases, std::vector<int64_t>(static_cast<size_t>(rd.R), 0), me, rd.timeout_s};
    const int R = rd.R, C = rd.C, L = rd.L;
    const int64_t chunk = rd.chunk;
    int64_t epoch = 0;
    const NotifyOut* handle = nullptr;  // the latest dispatch's notify outputs (the backend's handle)
    Stream stream{rd.async_launch, {}};
    for (size_t i = 0; i < rd.ops.size(); ++i) {
        NormalOp& op = rd.ops[i];
        const Route& rt = rd.routes[static_cast<size_t>(op.route)][static_cast<size_t>(me)];
        const NormalRankIn& in = op.in[static_cast<size_t>(me)];
        NormalRankOut& out = op.out[static_cast<size_t>(me)];
        // the call: its handshake, then (the launcher) the previous launch waited for, then the launches
        if (rd.shake_normal) shake.arrive_and_wait();
        stream.synchronize();
        const int64_t e = ++epoch;
        if (op.kind == Kind::kCombine) {
            const int32_t K = op.with_weights ? rt.K : 0;
            const NormalLayout layout(R, C, 0, rd.slots, op.x_bytes + 4 * K);
            out.out.assign(static_cast<size_t>(rt.T * op.x_bytes), 0xee);
            if (K) out.out_weights.assign(static_cast<size_t>(rt.T * K), -1.0f);
            const CombineArgs a{rt.T, rd.hidden, op.x_bytes, K, op.type, in.cx.data(), K ? in.cw.data() : nullptr,
                                handle->recv_offset.data(), handle->chan_offset.data(), handle->chan_count.data(),
                                rt.in_rank.data(), rt.chan_prefix.data(), rt.send_pos.data(),
                                op.with_b0 ? in.b0.data() : nullptr, op.with_b1 ? in.b1.data() : nullptr,
                                out.out.data(), K ? out.out_weights.data() : nullptr};
            stream.submit([&peers, C, chunk, layout, e, a, me] {
                ErrorRecord err{};
                host::prologue(host::normal_context(peers, C, chunk, layout, e, &err));
                check_launch(err, "combine prologue", me);
                ErrorRecord err2{};
                host::combine(host::normal_context(peers, C, chunk, layout, e, &err2), a);
                check_launch(err2, "combine", me);
            });
            continue;
        }
        const bool cached = op.kind == Kind::kCached;
        const int32_t K = op.with_topk ? rt.K : 0;
        const NormalLayout layout(R, C, cached ? 0 : L, rd.slots, dispatch_slot_bytes(op.x_bytes, op.scale_bytes, K));
        if (!cached) {
            NotifyOut& n = out.notify;
            n.rank_prefix.assign(static_cast<size_t>(R * R), -7);
            n.recv_offset.assign(static_cast<size_t>(R), -7);
            n.chan_offset.assign(static_cast<size_t>(R * C), -7);
            n.chan_count.assign(static_cast<size_t>(R * C), -7);
            n.per_expert.assign(static_cast<size_t>(L), -7);
            const NotifyArgs a{rt.rows_to_rank.data(), rt.per_expert.data(), rt.chan_prefix.data(), rd.alignment,
                               n.rank_prefix.data(), n.recv_offset.data(), n.chan_offset.data(), n.chan_count.data(),
                               n.per_expert.data(), &n.num_recv};
            stream.run([&] {
                ErrorRecord err{};
                host::notify(host::normal_context(peers, C, chunk, layout, e, &err), a);
                check_launch(err, "notify", me);
            });
            handle = &n;
            if (n.num_recv < 0 || n.num_recv > 4 * 40 * 4) {
                std::fprintf(stderr, "stress: round %d: rank %d: notify gave num_recv %lld\n", g_round, me,
                             static_cast<long long>(n.num_recv));
                fail_exit();
            }
        }
        fill_dispatch_outputs(out, handle->num_recv, op, K);
        const DispatchArgs a{rt.T, op.x_bytes, op.scale_bytes, K, in.x.data(),
                             op.scale_bytes ? in.scales.data() : nullptr, K ? rt.topk.data() : nullptr,
                             K ? rt.weights.data() : nullptr, rt.in_rank.data(), rt.chan_prefix.data(),
                             handle->recv_offset.data(), handle->chan_offset.data(), handle->chan_count.data(),
                             out.recv_x.data(), op.scale_bytes ? out.recv_scales.data() : nullptr,
                             K ? out.recv_topk_idx.data() : nullptr, K ? out.recv_topk_weights.data() : nullptr,
                             out.recv_src.data()};
        stream.submit([&peers, C, chunk, layout, e, a, me, cached] {
            if (cached) {
                ErrorRecord err{};
                host::prologue(host::normal_context(peers, C, chunk, layout, e, &err));
                check_launch(err, "cached dispatch prologue", me);
            }
            ErrorRecord err{};
            host::dispatch(host::normal_context(peers, C, chunk, layout, e, &err), a);
            check_launch(err, cached ? "cached dispatch" : "dispatch", me);
        });
    }
    stream.synchronize();
}

// run_normal across nodes: the same calls on the internode kernels.
void run_internode(Round& rd, int me, Rendezvous& shake) {
    const int R = rd.R, C = rd.C, L = rd.L, Rn = rd.nodes, NL = rd.node_ranks;
    host::InternodePeers peers{{}, {}, std::vector<int64_t>(static_cast<size_t>(R), 0), me, NL, rd.timeout_s};
    for (int l = 0; l < NL; ++l) peers.nvl.push_back(rd.normal_bases[static_cast<size_t>((me / NL) * NL + l)]);
    for (int n = 0; n < Rn; ++n) peers.rdma.push_back(rd.rdma_bases[static_cast<size_t>(n * NL + me % NL)]);
    const int64_t chunk = rd.chunk, rdma_chunk = rd.rdma_chunk;
    int64_t epoch = 0;
    const NotifyOut* handle = nullptr;  // the latest dispatch's notify outputs (the backend's handle)
    Stream stream{rd.async_launch, {}};
    auto context = [&peers, C, chunk, rdma_chunk](const InternodeLayout& layout, int64_t e, ErrorRecord* err) {
        return host::internode_context(peers, C, chunk, rdma_chunk, layout, e, err);
    };
    for (size_t i = 0; i < rd.ops.size(); ++i) {
        NormalOp& op = rd.ops[i];
        const Route& rt = rd.routes[static_cast<size_t>(op.route)][static_cast<size_t>(me)];
        const Forwarding& fw = rd.fwd[static_cast<size_t>(op.route)][static_cast<size_t>(me)];
        const NormalRankIn& in = op.in[static_cast<size_t>(me)];
        NormalRankOut& out = op.out[static_cast<size_t>(me)];
        uint8_t* const* rdma = peers.rdma.data();
        if (rd.shake_normal) shake.arrive_and_wait();
        stream.synchronize();
        const int64_t e = ++epoch;
        if (op.kind == Kind::kCombine) {
            const int32_t K = op.with_weights ? rt.K : 0;
            const InternodeLayout layout(Rn, NL, C, 0, rd.slots, op.x_bytes + 4 * K, rd.rdma_slots, op.x_bytes + 4 * K);
            out.out.assign(static_cast<size_t>(rt.T * op.x_bytes), 0xee);
            if (K) out.out_weights.assign(static_cast<size_t>(rt.T * K), -1.0f);
            const InternodeCombineArgs a{
                CombineArgs{rt.T, rd.hidden, op.x_bytes, K, op.type, in.cx.data(), K ? in.cw.data() : nullptr,
                            handle->recv_offset.data(), handle->chan_offset.data(), handle->chan_count.data(), nullptr,
                            nullptr, nullptr, op.with_b0 ? in.b0.data() : nullptr, op.with_b1 ? in.b1.data() : nullptr,
                            out.out.data(), K ? out.out_weights.data() : nullptr},
                fw.recv_rdma_prefix.data(), fw.bits.data(), rt.send_rdma_head.data()};
            stream.submit([context, layout, e, a, me, rdma] {
                ErrorRecord err{};
                host::internode_prologue(context(layout, e, &err), rdma);
                check_launch(err, "internode combine prologue", me);
                ErrorRecord err2{};
                host::internode_combine(context(layout, e, &err2), rdma, a);
                check_launch(err2, "internode combine", me);
            });
            continue;
        }
        const bool cached = op.kind == Kind::kCached;
        const int32_t K = op.with_topk ? rt.K : 0;
        const int64_t slot = dispatch_slot_bytes(op.x_bytes, op.scale_bytes, K);
        const InternodeLayout layout(Rn, NL, C, cached ? 0 : L, rd.slots, slot, rd.rdma_slots, slot + 4);
        if (!cached) {
            NotifyOut& n = out.notify;
            n.gbl_prefix.assign(static_cast<size_t>(R), -7);
            n.recv_offset.assign(static_cast<size_t>(R), -7);
            n.chan_offset.assign(static_cast<size_t>(R * C), -7);
            n.chan_count.assign(static_cast<size_t>(R * C), -7);
            n.recv_rdma.assign(static_cast<size_t>(Rn * C), -7);
            n.per_expert.assign(static_cast<size_t>(L), -7);
            const InternodeNotifyArgs a{rt.rows_to_rank.data(), rt.per_expert.data(), rt.chan_prefix.data(),
                                        rt.rdma_prefix.data(), rd.alignment, n.gbl_prefix.data(), n.recv_offset.data(),
                                        n.chan_offset.data(), n.chan_count.data(), n.recv_rdma.data(),
                                        n.per_expert.data(), &n.num_recv};
            stream.run([&] {
                ErrorRecord err{};
                host::internode_notify(context(layout, e, &err), rdma, a);
                check_launch(err, "internode notify", me);
            });
            handle = &n;
            if (n.num_recv < 0 || n.num_recv > 6 * 40) {
                std::fprintf(stderr, "stress: round %d: rank %d: internode notify gave num_recv %lld\n", g_round, me,
                             static_cast<long long>(n.num_recv));
                fail_exit();
            }
        }
        fill_dispatch_outputs(out, handle->num_recv, op, K);
        const InternodeDispatchArgs a{
            DispatchArgs{rt.T, op.x_bytes, op.scale_bytes, K, in.x.data(), op.scale_bytes ? in.scales.data() : nullptr,
                         K ? rt.topk.data() : nullptr, K ? rt.weights.data() : nullptr, rt.in_rank.data(), nullptr,
                         handle->recv_offset.data(), handle->chan_offset.data(), handle->chan_count.data(),
                         out.recv_x.data(), op.scale_bytes ? out.recv_scales.data() : nullptr,
                         K ? out.recv_topk_idx.data() : nullptr, K ? out.recv_topk_weights.data() : nullptr,
                         out.recv_src.data()},
            rt.rdma_prefix.data(), fw.recv_rdma_prefix.data()};
        stream.submit([context, layout, e, a, me, rdma, cached] {
            if (cached) {
                ErrorRecord err{};
                host::internode_prologue(context(layout, e, &err), rdma);
                check_launch(err, "internode cached dispatch prologue", me);
            }
            ErrorRecord err{};
            host::internode_dispatch(context(layout, e, &err), rdma, a);
            check_launch(err, cached ? "internode cached dispatch" : "internode dispatch", me);
        });
    }
    stream.synchronize();
}

void run_low_latency(Round& rd, int me, Rendezvous& shake) {
    host::Peers peers{rd.ll_bases, std::vector<int64_t>(static_cast<size_t>(rd.R), 0), me, rd.timeout_s};
    const int R = rd.R, L = rd.L;
    const LowLatencyLayout layout(R, L, rd.M, rd.ll_hidden);
    const std::vector<uint8_t> skip(static_cast<size_t>(R), 0);
    const int64_t rows = R * rd.M, H = rd.ll_hidden;
    const LlRankOut* handle = nullptr;
    // Every call posts a header (kernels/low_latency.h): op and call number, compared by every receive,
    // so the flow control, the header cells and the sequence words race under TSan as in the backend.
    const int64_t fields = 24, message_offset = 8 * (fields + 4 * R);
    std::vector<int64_t> header(static_cast<size_t>(low_latency_header_bytes(R) / 8), 0);
    for (size_t i = 0; i < rd.ll_ops.size(); ++i) {
        LlOp& op = rd.ll_ops[i];
        const int64_t call = static_cast<int64_t>(i) + 1;
        header[0] = op.dispatch ? 4 : 5;
        header[1] = call;
        const LowLatencyPost post{reinterpret_cast<const uint8_t*>(header.data()),
                                  static_cast<int64_t>(header.size()) * 8, 2, static_cast<int32_t>(message_offset),
                                  uint64_t{3}};
        const Route& rt = rd.ll_routes[static_cast<size_t>(op.route)][static_cast<size_t>(me)];
        const LlRankIn& in = op.in[static_cast<size_t>(me)];
        LlRankOut& out = op.out[static_cast<size_t>(me)];
        if (rd.shake_ll) shake.arrive_and_wait();
        if (op.dispatch) {
            const int64_t x_bytes = x_wire_bytes(H, op.format.fp8), num_scales = op.scale_bytes / 4;
            out.recv_x.assign(static_cast<size_t>(L * rows * x_bytes), 0xee);
            out.recv_scales.assign(static_cast<size_t>(L * num_scales * rows), -7);
            out.src_info.assign(static_cast<size_t>(L * rows), -7);
            out.layout_range.assign(static_cast<size_t>(L * R), -7);
            out.recv_count.assign(static_cast<size_t>(L), -7);
            LowLatencyDispatchArgs a{rt.T, op.scale_bytes, rt.K, op.format, in.x.data(), rt.topk.data(),
                                     out.recv_x.data(),
                                     op.format.fp8 ? reinterpret_cast<uint8_t*>(out.recv_scales.data()) : nullptr,
                                     out.src_info.data(), out.layout_range.data(), out.recv_count.data()};
            ErrorRecord err{};
            host::ll_dispatch_send(host::low_latency_context(peers, call, layout, skip.data(), post, &err), a);
            check_launch(err, "low-latency dispatch send", me);
            ErrorRecord err2{};
            host::ll_dispatch_recv(host::low_latency_context(peers, call, layout, skip.data(), post, &err2), a);
            check_launch(err2, "low-latency dispatch receive", me);
            handle = &out;
        } else {
            out.out.assign(static_cast<size_t>(rt.T * H), 0xeeee);
            LowLatencyCombineArgs a{rt.T, rt.K, in.cx.data(), handle->src_info.data(), handle->layout_range.data(),
                                    rt.topk.data(), in.cw.data(), out.out.data(), false};
            ErrorRecord err{};
            host::ll_combine_send(host::low_latency_context(peers, call, layout, skip.data(), post, &err), a);
            check_launch(err, "low-latency combine send", me);
            ErrorRecord err2{};
            host::ll_combine_recv(host::low_latency_context(peers, call, layout, skip.data(), post, &err2), a);
            check_launch(err2, "low-latency combine receive", me);
        }
    }
}

// ------------------------------------------------------------------------------------ checks
struct Stats {
    int64_t ring_rows = 0, wrapped_rings = 0, full_chunks = 0, ll_messages = 0, launches = 0, internode_rounds = 0;
};

void check_normal(const Round& rd, Stats& st) {
    const int R = rd.R, C = rd.C, L = rd.L;
    for (size_t i = 0; i < rd.ops.size(); ++i) {
        const NormalOp& op = rd.ops[i];
        const int oi = static_cast<int>(i);
        const auto& routes = rd.routes[static_cast<size_t>(op.route)];
        st.launches += R * 2;
        for (int me = 0; me < R; ++me) {
            const NormalRankOut& out = op.out[static_cast<size_t>(me)];
            const Route& rt = routes[static_cast<size_t>(me)];
            const auto rows = received(rd, op.route, me);
            const int64_t N = static_cast<int64_t>(rows.size());
            // ring traffic: rows per (channel, source) ring into me
            for (int s = 0; s < R; ++s)
                for (int c = 0; c < C; ++c) {
                    const Route& src = routes[static_cast<size_t>(s)];
                    const int64_t n = src.chan_prefix[static_cast<size_t>(me * C + c)] -
                                      (c ? src.chan_prefix[static_cast<size_t>(me * C + c - 1)] : 0);
                    st.ring_rows += n;
                    st.wrapped_rings += n > rd.slots;
                    st.full_chunks += n / rd.chunk;
                }
            if (op.kind == Kind::kDispatch) {
                const NotifyOut& n = out.notify;
                expect_eq(n.num_recv, N, at("notify num_recv", me, oi));
                int64_t offset = 0;
                for (int s = 0; s < R; ++s) {
                    const Route& src = routes[static_cast<size_t>(s)];
                    for (int j = 0; j < R && rd.nodes == 1; ++j) {
                        int64_t sum = 0;
                        for (int q = 0; q <= s; ++q) sum += routes[static_cast<size_t>(q)].rows_to_rank[static_cast<size_t>(j)];
                        expect_eq<int64_t>(n.rank_prefix[static_cast<size_t>(s * R + j)], sum,
                                           at("notify rank_prefix_matrix", me, oi) + "[" + std::to_string(s) + "][" + std::to_string(j) + "]");
                    }
                    if (rd.nodes > 1)
                        expect_eq<int64_t>(n.gbl_prefix[static_cast<size_t>(s)], offset + src.rows_to_rank[static_cast<size_t>(me)],
                                           at("internode notify recv_gbl_rank_prefix_sum", me, oi));
                    expect_eq(n.recv_offset[static_cast<size_t>(s)], offset, at("notify recv_offset", me, oi));
                    offset += src.rows_to_rank[static_cast<size_t>(me)];
                    for (int c = 0; c < C; ++c) {
                        const int64_t before = c ? src.chan_prefix[static_cast<size_t>(me * C + c - 1)] : 0;
                        expect_eq(n.chan_offset[static_cast<size_t>(s * C + c)], before, at("notify recv_channel_offset", me, oi));
                        expect_eq(n.chan_count[static_cast<size_t>(s * C + c)],
                                  src.chan_prefix[static_cast<size_t>(me * C + c)] - before, at("notify recv_channel_count", me, oi));
                    }
                }
                if (rd.nodes > 1) {
                    const Forwarding& fw = rd.fwd[static_cast<size_t>(op.route)][static_cast<size_t>(me)];
                    for (size_t j = 0; j < fw.recv_rdma_prefix.size(); ++j)
                        expect_eq(n.recv_rdma[j], fw.recv_rdma_prefix[j], at("internode notify recv_rdma_channel_prefix", me, oi));
                }
                for (int e = 0; e < L; ++e) {
                    int64_t sum = 0;
                    for (int s = 0; s < R; ++s) sum += routes[static_cast<size_t>(s)].per_expert[static_cast<size_t>(me * L + e)];
                    sum = (sum + rd.alignment - 1) / rd.alignment * rd.alignment;
                    expect_eq(n.per_expert[static_cast<size_t>(e)], sum, at("notify recv_per_expert", me, oi));
                }
            }
            if (op.kind != Kind::kCombine) {
                const int64_t K = op.with_topk ? rt.K : 0;
                for (int64_t i2 = 0; i2 < N; ++i2) {
                    const int s = rows[static_cast<size_t>(i2)].first;
                    const int64_t t = rows[static_cast<size_t>(i2)].second;
                    const Route& src = routes[static_cast<size_t>(s)];
                    const NormalRankIn& sin = op.in[static_cast<size_t>(s)];
                    const std::string row = " row " + std::to_string(i2) + " (source " + std::to_string(s) + ", token " + std::to_string(t) + ")";
                    expect_bytes(out.recv_x.data() + i2 * op.x_bytes, sin.x.data() + t * op.x_bytes, op.x_bytes,
                                 at("dispatch recv_x", me, oi) + row);
                    expect_bytes(out.recv_scales.data() + i2 * op.scale_bytes, sin.scales.data() + t * op.scale_bytes,
                                 op.scale_bytes, at("dispatch recv_scales", me, oi) + row);
                    expect_eq<int64_t>(out.recv_src[static_cast<size_t>(i2)], t, at("dispatch recv_src_idx", me, oi) + row);
                    for (int64_t j = 0; j < K; ++j) {
                        const int64_t e = src.topk[static_cast<size_t>(t * K + j)];
                        const bool local = e >= me * L && e < (me + 1) * L;
                        expect_eq<int64_t>(out.recv_topk_idx[static_cast<size_t>(i2 * K + j)], local ? e - me * L : -1,
                                           at("dispatch recv_topk_idx", me, oi) + row);
                        const float w = local ? src.weights[static_cast<size_t>(t * K + j)] : 0.0f;
                        expect_bytes(reinterpret_cast<const uint8_t*>(&out.recv_topk_weights[static_cast<size_t>(i2 * K + j)]),
                                     reinterpret_cast<const uint8_t*>(&w), 4, at("dispatch recv_topk_weights", me, oi) + row);
                    }
                }
            } else {
                const int64_t K = op.with_weights ? rt.K : 0;
                std::vector<uint8_t> want(static_cast<size_t>(rt.T * op.x_bytes));
                for (int64_t t = 0; t < rt.T; ++t) {
                    for (int64_t h = 0; h < rd.hidden; ++h) {
                        float acc = 0.0f;
                        for (int r = 0; r < R; ++r)
                            if (rt.in_rank[static_cast<size_t>(t * R + r)]) acc += f_normal(r, me, t, h);
                        if (op.with_b0) acc += bias_value(me, t, h, 0);
                        if (op.with_b1) acc += bias_value(me, t, h, 1);
                        store_elem(want.data() + t * op.x_bytes, h, op.type, acc);
                    }
                    for (int64_t j = 0; j < K; ++j) {
                        float acc = 0.0f;
                        for (int r = 0; r < R; ++r)
                            if (rt.in_rank[static_cast<size_t>(t * R + r)]) acc += g_normal(r, me, t, j);
                        expect_bytes(reinterpret_cast<const uint8_t*>(&out.out_weights[static_cast<size_t>(t * K + j)]),
                                     reinterpret_cast<const uint8_t*>(&acc), 4,
                                     at("combine out_weights", me, oi) + " token " + std::to_string(t));
                    }
                }
                for (int64_t t = 0; t < rt.T; ++t)
                    expect_bytes(out.out.data() + t * op.x_bytes, want.data() + t * op.x_bytes, op.x_bytes,
                                 at("combine out", me, oi) + " token " + std::to_string(t));
            }
        }
    }
}

void check_low_latency(const Round& rd, Stats& st) {
    const int R = rd.R, L = rd.L;
    const int64_t rows = R * rd.M, H = rd.ll_hidden;
    for (size_t i = 0; i < rd.ll_ops.size(); ++i) {
        const LlOp& op = rd.ll_ops[i];
        const int oi = static_cast<int>(i);
        const auto& routes = rd.ll_routes[static_cast<size_t>(op.route)];
        st.launches += 2 * R;
        for (int me = 0; me < R; ++me) {
            const LlRankOut& out = op.out[static_cast<size_t>(me)];
            if (op.dispatch) {
                const int64_t x_bytes = x_wire_bytes(H, op.format.fp8), num_scales = op.scale_bytes / 4;
                std::vector<uint8_t> msg(static_cast<size_t>(x_bytes + op.scale_bytes));
                for (int e = 0; e < L; ++e) {
                    int64_t row = 0;
                    for (int s = 0; s < R; ++s) {
                        const Route& src = routes[static_cast<size_t>(s)];
                        const auto tokens = ll_tokens(src, me * L + e);
                        const int64_t n = static_cast<int64_t>(tokens.size());
                        st.ll_messages += n;
                        const std::string where = " (local expert " + std::to_string(e) + ", source " + std::to_string(s) + ")";
                        expect_eq(out.layout_range[static_cast<size_t>(e * R + s)], (row << 32) | n,
                                  at("low-latency layout_range", me, oi) + where);
                        for (int64_t q = 0; q < n; ++q) {
                            const int64_t t = tokens[static_cast<size_t>(q)], r = row + q;
                            const uint16_t* x = op.in[static_cast<size_t>(s)].x.data() + t * H;
                            if (op.format.fp8)
                                cast_token<HostPlatform::Group>(msg.data(), msg.data() + x_bytes, x, H, op.format);
                            else
                                std::memcpy(msg.data(), x, static_cast<size_t>(x_bytes));
                            const std::string w = where + " row " + std::to_string(r) + " token " + std::to_string(t);
                            expect_eq<int64_t>(out.src_info[static_cast<size_t>(e * rows + r)], t, at("low-latency src_info", me, oi) + w);
                            expect_bytes(out.recv_x.data() + (e * rows + r) * x_bytes, msg.data(), x_bytes,
                                         at("low-latency recv_x", me, oi) + w);
                            for (int64_t j = 0; j < num_scales; ++j)
                                expect_bytes(reinterpret_cast<const uint8_t*>(out.recv_scales.data() + (e * num_scales + j) * rows + r),
                                             msg.data() + x_bytes + 4 * j, 4, at("low-latency recv_scales", me, oi) + w);
                        }
                        row += n;
                    }
                    expect_eq<int64_t>(out.recv_count[static_cast<size_t>(e)], row, at("low-latency recv_count", me, oi));
                }
            } else {
                const Route& rt = routes[static_cast<size_t>(me)];
                const LlRankIn& in = op.in[static_cast<size_t>(me)];
                for (int64_t t = 0; t < rt.T; ++t)
                    for (int64_t h = 0; h < H; ++h) {
                        float acc = 0.0f;
                        for (int j = 0; j < rt.K; ++j) {
                            const int64_t e = rt.topk[static_cast<size_t>(t * rt.K + j)];
                            if (e < 0) continue;
                            const float y = numeric::bf16_to_float(numeric::float_to_bf16(f_ll(e, me, t, h)));
                            acc = numeric::add_rn(acc, numeric::mul_rn(in.cw[static_cast<size_t>(t * rt.K + j)], y));
                        }
                        expect_eq<int64_t>(out.out[static_cast<size_t>(t * H + h)], numeric::float_to_bf16(acc),
                                           at("low-latency combine out", me, oi) + " token " + std::to_string(t) +
                                               " channel " + std::to_string(h));
                    }
            }
        }
    }
}

// ------------------------------------------------------------------------------------ main
int64_t arg_int(int argc, char** argv, const char* name, int64_t fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (std::strcmp(argv[i], name) == 0) return std::strtoll(argv[i + 1], nullptr, 10);
    return fallback;
}

bool arg_flag(int argc, char** argv, const char* name) {
    for (int i = 1; i < argc; ++i)
        if (std::strcmp(argv[i], name) == 0) return true;
    return false;
}

}  // namespace

int main(int argc, char** argv) {
    const uint64_t seed = static_cast<uint64_t>(arg_int(argc, argv, "--seed", 1));
    const int rounds = static_cast<int>(arg_int(argc, argv, "--rounds", 30));
    const double timeout_s = static_cast<double>(arg_int(argc, argv, "--timeout", 60));
    const bool no_shake_normal = arg_flag(argc, argv, "--no-handshake-normal");
    const bool shake_ll = !arg_flag(argc, argv, "--no-handshake") && !no_shake_normal;
    const bool async_launch = arg_flag(argc, argv, "--async");
    Rng rng{seed};
    Stats st;
    for (int round = 0; round < rounds; ++round) {
        g_round = round;
        Round rd = make_round(rng, shake_ll, !no_shake_normal, async_launch, timeout_s);
        const int R = rd.R;
        int64_t normal_bytes = 0, rdma_bytes = 0;
        for (const NormalOp& op : rd.ops) {
            const int K = rd.routes[static_cast<size_t>(op.route)][0].K;
            const int64_t slot = op.kind == Kind::kCombine
                                     ? op.x_bytes + 4 * (op.with_weights ? K : 0)
                                     : dispatch_slot_bytes(op.x_bytes, op.scale_bytes, op.with_topk ? K : 0);
            const int experts = op.kind == Kind::kDispatch ? rd.L : 0;
            if (rd.nodes > 1) {
                const InternodeLayout l(rd.nodes, rd.node_ranks, rd.C, experts, rd.slots, slot, rd.rdma_slots,
                                        op.kind == Kind::kCombine ? slot : slot + 4);
                normal_bytes = std::max(normal_bytes, l.nvl_total);
                rdma_bytes = std::max(rdma_bytes, l.rdma_total);
            } else {
                normal_bytes = std::max(normal_bytes, NormalLayout(R, rd.C, experts, rd.slots, slot).total);
            }
        }
        const int64_t ll_bytes = LowLatencyLayout(R, rd.L, rd.M, rd.ll_hidden).total;
        std::vector<std::unique_ptr<Buffer>> buffers;
        for (int r = 0; r < R; ++r) {
            buffers.push_back(std::make_unique<Buffer>(static_cast<size_t>(normal_bytes)));
            rd.normal_bases.push_back(buffers.back()->p);
        }
        for (int r = 0; r < R && rdma_bytes; ++r) {
            buffers.push_back(std::make_unique<Buffer>(static_cast<size_t>(rdma_bytes)));
            rd.rdma_bases.push_back(buffers.back()->p);
        }
        for (int r = 0; r < R; ++r) {
            buffers.push_back(std::make_unique<Buffer>(static_cast<size_t>(ll_bytes)));
            rd.ll_bases.push_back(buffers.back()->p);
        }
        Rendezvous shake(R);
        std::vector<std::thread> ranks;
        for (int r = 0; r < R; ++r)
            ranks.emplace_back([&rd, &shake, r] {
                if (rd.nodes > 1)
                    run_internode(rd, r, shake);
                else
                    run_normal(rd, r, shake);
                run_low_latency(rd, r, shake);
            });
        for (auto& t : ranks) t.join();
        check_normal(rd, st);
        check_low_latency(rd, st);
        st.internode_rounds += rd.nodes > 1;
        if (mismatches) {
            std::fprintf(stderr,
                         "stress: round %d (seed %llu) FAILED: %d mismatches (ranks %d, nodes %d, experts per rank %d, "
                         "channels %d, slots %lld, chunk %lld, hidden %lld / %lld)\n",
                         round, static_cast<unsigned long long>(seed), mismatches, R, rd.nodes, rd.L, rd.C,
                         static_cast<long long>(rd.slots), static_cast<long long>(rd.chunk),
                         static_cast<long long>(rd.hidden), static_cast<long long>(rd.ll_hidden));
            fail_exit();
        }
    }
    std::printf("stress: %d rounds passed (seed %llu; handshake: normal %s, low-latency %s; normal launches %s): "
                "%lld ring rows, %lld ring transfers past the ring's size, %lld full chunks, %lld low-latency "
                "messages, %lld launches, %lld rounds across nodes\n",
                rounds, static_cast<unsigned long long>(seed), no_shake_normal ? "off" : "on",
                shake_ll ? "on" : "off", async_launch ? "async" : "in the call", static_cast<long long>(st.ring_rows), static_cast<long long>(st.wrapped_rings),
                static_cast<long long>(st.full_chunks), static_cast<long long>(st.ll_messages),
                static_cast<long long>(st.launches), static_cast<long long>(st.internode_rounds));
    return 0;
}
