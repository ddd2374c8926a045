// moe_comm._C's bindings (with prepared_bindings.cpp, the only files of _C that see pybind11): turn Python
// ints (tensor data_ptr()s) into raw pointers and release the GIL around every kernel so communication
// threads keep running.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../ascend/mc2_limits.h"
#include "../common/call_header.h"
#include "../common/codes_bindings.h"
#include "../common/logfmt.h"
#include "../cpu/api.h"
#include "../cpu/expert_rows.h"
#include "../cpu/flags.h"
#include "../cpu/post.h"

namespace py = pybind11;
namespace cpu = moe_comm::cpu;
namespace ascend = moe_comm::ascend;

namespace {

template <typename T>
T* ptr(std::uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

// (data_ptr, row_stride_bytes, col_stride_bytes, elem_bytes, num_cols, offset_bytes, num_rows)
using SegmentTuple = std::tuple<std::uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

std::vector<cpu::Segment> to_segments(const std::vector<SegmentTuple>& tuples) {
    std::vector<cpu::Segment> segments;
    segments.reserve(tuples.size());
    for (const auto& [data, row_stride, col_stride, elem_bytes, num_cols, offset, num_rows] : tuples)
        segments.push_back({ptr<uint8_t>(data), row_stride, col_stride, elem_bytes, num_cols, offset, num_rows});
    return segments;
}

py::dict build_info() {
    py::dict info;
    info["version"] = MOE_COMM_VERSION;
    info["cpu"] = true;
    info["cuda"] = false;
    info["ascend"] = false;
    info["bang"] = false;
    info["hardware_threads"] = cpu::hardware_threads();
    info["combine_reduce_isa"] = cpu::combine_reduce_isa();
    info["quantize_rows_isa"] = cpu::quantize_rows_isa();
    // Why CMake left moe_comm._cuda and moe_comm._cuda_nvshmem out of this build ("" for one it built),
    // decided at configure time (CMakeLists.txt passes them to this file alone); moe_comm.build_info()
    // reports the reason of each module that is missing.
#if !defined(MOE_COMM_CUDA_NOT_BUILT) || !defined(MOE_COMM_NVSHMEM_NOT_BUILT)
#error "CMakeLists.txt defines MOE_COMM_CUDA_NOT_BUILT and MOE_COMM_NVSHMEM_NOT_BUILT (string literals) for this file"
#endif
    info["cuda_not_built"] = MOE_COMM_CUDA_NOT_BUILT;
    info["cuda_nvshmem_not_built"] = MOE_COMM_NVSHMEM_NOT_BUILT;
    return info;
}

// Every constant of csrc/common/logfmt.h's formula, for the torch reference (moe_comm/ops/logfmt.py).
py::dict logfmt_constants() {
    namespace lf = moe_comm::logfmt;
    py::dict c;
    c["group"] = lf::kGroup;
    c["meta_bytes"] = lf::kMetaBytes;
    c["block"] = lf::kBlock;
    c["block_bytes"] = lf::kBlockBytes;
    c["wide_chunk"] = lf::kWideChunk;
    c["narrow_chunk"] = lf::kNarrowChunk;
    c["code_bits"] = lf::kCodeBits;
    c["max_code"] = lf::kMaxCode;
    c["num_steps"] = lf::kNumSteps;
    c["min_clip"] = lf::kMinClip;
    c["log2_coefficients"] = std::vector<float>{lf::kLog2C1, lf::kLog2C2, lf::kLog2C3, lf::kLog2C4, lf::kLog2C5};
    c["inv_ln2_hi"] = lf::kInvLn2Hi;
    c["inv_ln2_lo"] = lf::kInvLn2Lo;
    c["hi_mask"] = lf::kHiMask;
    c["sqrt2_bits"] = lf::kSqrt2Bits;
    c["exp2_coefficients"] = std::vector<float>{lf::kExp2C1, lf::kExp2C2, lf::kExp2C3, lf::kExp2C4, lf::kExp2C5,
                                                lf::kExp2C6, lf::kExp2C7};
    c["round_magic"] = lf::kRoundMagic;
    c["exp2_clamp"] = lf::kExp2Clamp;
    return c;
}

}  // namespace

void def_prepared(py::module_& m);  // prepared_bindings.cpp

ascend::Mc2Call mc2_call(const std::string& product, int version, const std::string& comm_alg, int64_t ep_world_size,
                         int64_t moe_expert_num, int64_t hidden, int64_t batch, int64_t topk, bool quant) {
    if (product != "A2" && product != "A3")
        throw std::invalid_argument("mc2: product must be 'A2' or 'A3', got '" + product + "'");
    return {product == "A2" ? ascend::Product::kA2 : ascend::Product::kA3, version, comm_alg, ep_world_size,
            moe_expert_num, hidden, batch, topk, quant};
}

// The host-side logic of the vendor backends (csrc/ascend, csrc/vendor) under moe_comm._C.
void def_vendor(py::module_& m) {
    auto mc2_args = [] {
        return std::make_tuple(py::arg("product"), py::arg("version"), py::arg("comm_alg"), py::arg("ep_world_size"),
                               py::arg("moe_expert_num"), py::arg("hidden"), py::arg("batch"), py::arg("topk"),
                               py::arg("quant"));
    };
    auto [a0, a1, a2, a3, a4, a5, a6, a7, a8] = mc2_args();
    m.def("mc2_check", [](const std::string& p, int v, const std::string& alg, int64_t ep, int64_t e, int64_t h,
                          int64_t bs, int64_t k, bool q) { return ascend::mc2_check(mc2_call(p, v, alg, ep, e, h, bs, k, q)); },
          a0, a1, a2, a3, a4, a5, a6, a7, a8, "What MC2 refuses of this call, or ''.");
    m.def("mc2_recv_rows", [](const std::string& p, int v, const std::string& alg, int64_t ep, int64_t e, int64_t h,
                              int64_t bs, int64_t k, bool q) { return ascend::mc2_recv_rows(mc2_call(p, v, alg, ep, e, h, bs, k, q)); },
          a0, a1, a2, a3, a4, a5, a6, a7, a8, "Rows of expand_x one rank may receive (MC2's A).");
    m.def("mc2_min_buffsize_mb", [](const std::string& p, int v, const std::string& alg, int64_t ep, int64_t e,
                                    int64_t h, int64_t bs, int64_t k, bool q) {
              return ascend::mc2_min_buffsize_mb(mc2_call(p, v, alg, ep, e, h, bs, k, q)); },
          a0, a1, a2, a3, a4, a5, a6, a7, a8, "The least HCCL_BUFFSIZE (MB) MC2's formula allows.");
    m.def(
        "check_expert_counts",
        [](const std::vector<int64_t>& counts, int64_t capacity, int64_t grouped_rows) {
            return cpu::check_expert_counts(counts.data(), static_cast<int64_t>(counts.size()), capacity,
                                               grouped_rows);
        },
        py::arg("counts"), py::arg("capacity"), py::arg("grouped_rows"));
    for (bool to_packed : {true, false}) {
        m.def(
            to_packed ? "grouped_to_packed" : "packed_to_grouped",
            [to_packed](std::uintptr_t packed, std::uintptr_t grouped, const std::vector<int64_t>& counts,
                        int64_t capacity, int64_t grouped_rows, int64_t row_bytes) {
                py::gil_scoped_release release;
                const auto local = static_cast<int64_t>(counts.size());
                if (to_packed)
                    cpu::grouped_to_packed(ptr<uint8_t>(packed), ptr<const uint8_t>(grouped), counts.data(), local,
                                              capacity, grouped_rows, row_bytes);
                else
                    cpu::packed_to_grouped(ptr<uint8_t>(grouped), ptr<const uint8_t>(packed), counts.data(), local,
                                              capacity, grouped_rows, row_bytes);
            },
            py::arg("packed"), py::arg("grouped"), py::arg("counts"), py::arg("capacity"), py::arg("grouped_rows"),
            py::arg("row_bytes"));
    }
}

PYBIND11_MODULE(_C, m) {
    m.doc() = "moe-comm native kernels (raw-pointer API; no libtorch linkage)";

    // The codes the kernels take and return, named as Python names enum members: the shared ones
    // (DType, WaitOutcome) from csrc/common/codes.h, the CPU kernels' own from csrc/cpu/api.h. Not
    // arithmetic: a member never equals an int, and a bound function given an int raises TypeError.
    py::enum_<cpu::QuantFormat>(m, "QuantFormat", "Format of quantize_rows' codes (csrc/cpu/api.h).")
        .value("E4M3", cpu::QuantFormat::kE4M3)
        .value("E5M2", cpu::QuantFormat::kE5M2)
        .value("INT8", cpu::QuantFormat::kInt8);
    py::enum_<cpu::IsaLevel>(m, "IsaLevel", "Build of quantize_rows, ordered; the cap of set_quantize_rows_isa_cap.")
        .value("GENERIC", cpu::IsaLevel::kGeneric)
        .value("AVX2", cpu::IsaLevel::kAvx2)
        .value("AVX512", cpu::IsaLevel::kAvx512);
    moe_comm::python::def_codes(m, false);  // DType, WaitOutcome and the shared constants
    m.def("build_info", &build_info, "What this build of moe_comm._C contains.");

    m.def(
        "topk_summary",
        [](std::uintptr_t topk_idx, int64_t num_tokens, int64_t num_topk) {
            int64_t lo, hi, dup_row, dup_expert;
            {
                py::gil_scoped_release release;
                cpu::topk_summary(ptr<const int64_t>(topk_idx), num_tokens, num_topk, &lo, &hi, &dup_row, &dup_expert);
            }
            return std::make_tuple(lo, hi, dup_row, dup_expert);
        },
        py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
        "(smallest id, largest id, first row picking an expert twice or -1, that expert or -1) of a contiguous "
        "[T, K] int64 topk_idx (csrc/cpu/api.h).");

    m.def(
        "dispatch_layout",
        [](std::uintptr_t num_tokens_per_rank, std::uintptr_t num_tokens_per_expert, std::uintptr_t is_token_in_rank,
           std::uintptr_t topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_ranks, int64_t num_experts,
           int num_threads) {
            py::gil_scoped_release release;
            cpu::dispatch_layout(ptr<int32_t>(num_tokens_per_rank), ptr<int32_t>(num_tokens_per_expert),
                                 ptr<bool>(is_token_in_rank), ptr<const int64_t>(topk_idx), num_tokens, num_topk,
                                 num_ranks, num_experts, num_threads);
        },
        py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"),
        py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_ranks"), py::arg("num_experts"),
        py::arg("num_threads"));

    m.def(
        "pack_rows",
        [](std::uintptr_t records, const std::vector<SegmentTuple>& segments, std::uintptr_t src_rows,
           int64_t num_rows, int64_t record_bytes, int num_threads) {
            const auto segs = to_segments(segments);
            py::gil_scoped_release release;
            cpu::pack_rows(ptr<uint8_t>(records), segs.data(), static_cast<int>(segs.size()),
                           ptr<const int64_t>(src_rows), num_rows, record_bytes, num_threads);
        },
        py::arg("records"), py::arg("segments"), py::arg("src_rows"), py::arg("num_rows"), py::arg("record_bytes"),
        py::arg("num_threads"));

    m.def(
        "unpack_rows",
        [](const std::vector<SegmentTuple>& segments, std::uintptr_t records, std::uintptr_t dst_rows, int64_t num_rows,
           int64_t record_bytes, int num_threads) {
            const auto segs = to_segments(segments);
            py::gil_scoped_release release;
            cpu::unpack_rows(segs.data(), static_cast<int>(segs.size()), ptr<const uint8_t>(records),
                             ptr<const int64_t>(dst_rows), num_rows, record_bytes, num_threads);
        },
        py::arg("segments"), py::arg("records"), py::arg("dst_rows"), py::arg("num_rows"), py::arg("record_bytes"),
        py::arg("num_threads"));

    m.def(
        "combine_reduce",
        [](std::uintptr_t out, std::uintptr_t out_weights, const std::vector<std::uintptr_t>& sources,
           const std::vector<int64_t>& source_rows, std::uintptr_t send_pos, std::uintptr_t scale,
           std::uintptr_t bias0, std::uintptr_t bias1, int64_t num_tokens, int64_t num_sources, int64_t hidden,
           cpu::DType dtype, int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
           int num_threads) {
            if (static_cast<int64_t>(sources.size()) != num_sources || source_rows.size() != sources.size())
                throw std::invalid_argument("combine_reduce: need one records base and one row count per source (" +
                                            std::to_string(num_sources) + "), got " + std::to_string(sources.size()) +
                                            " and " + std::to_string(source_rows.size()));
            std::vector<const uint8_t*> bases(sources.size());
            for (size_t j = 0; j < sources.size(); ++j) bases[j] = ptr<const uint8_t>(sources[j]);
            py::gil_scoped_release release;
            cpu::combine_reduce(ptr<void>(out), ptr<float>(out_weights), bases.data(), source_rows.data(),
                                ptr<const int32_t>(send_pos), ptr<const float>(scale), ptr<const void>(bias0),
                                ptr<const void>(bias1), num_tokens, num_sources, hidden, dtype, record_bytes,
                                x_offset, weights_offset, num_topk, num_threads);
        },
        py::arg("out"), py::arg("out_weights"), py::arg("sources"), py::arg("source_rows"), py::arg("send_pos"),
        py::arg("scale"),
        py::arg("bias0"), py::arg("bias1"), py::arg("num_tokens"), py::arg("num_sources"), py::arg("hidden"), py::arg("dtype"),
        py::arg("record_bytes"), py::arg("x_offset"), py::arg("weights_offset"), py::arg("num_topk"),
        py::arg("num_threads"));

    m.def(
        "combine_reduce_logfmt",
        [](std::uintptr_t out, const std::vector<std::uintptr_t>& sources, const std::vector<int64_t>& source_rows,
           std::uintptr_t send_pos, std::uintptr_t scale, std::uintptr_t bias0, std::uintptr_t bias1,
           int64_t num_tokens, int64_t num_sources, int64_t hidden, cpu::DType dtype, int64_t record_bytes,
           int64_t x_offset, int num_threads) {
            if (static_cast<int64_t>(sources.size()) != num_sources || source_rows.size() != sources.size())
                throw std::invalid_argument("combine_reduce_logfmt: need one records base and one row count per "
                                            "source (" + std::to_string(num_sources) + "), got " +
                                            std::to_string(sources.size()) + " and " +
                                            std::to_string(source_rows.size()));
            std::vector<const uint8_t*> bases(sources.size());
            for (size_t j = 0; j < sources.size(); ++j) bases[j] = ptr<const uint8_t>(sources[j]);
            py::gil_scoped_release release;
            cpu::combine_reduce_logfmt(ptr<void>(out), bases.data(), source_rows.data(), ptr<const int32_t>(send_pos),
                                       ptr<const float>(scale), ptr<const void>(bias0), ptr<const void>(bias1),
                                       num_tokens, num_sources, hidden, dtype, record_bytes, x_offset, num_threads);
        },
        py::arg("out"), py::arg("sources"), py::arg("source_rows"), py::arg("send_pos"), py::arg("scale"),
        py::arg("bias0"), py::arg("bias1"), py::arg("num_tokens"), py::arg("num_sources"), py::arg("hidden"),
        py::arg("dtype"), py::arg("record_bytes"), py::arg("x_offset"), py::arg("num_threads"));

    m.def("logfmt_row_bytes", &cpu::logfmt_row_bytes, py::arg("hidden"));
    m.def("logfmt_constants", &logfmt_constants, "The constants of csrc/common/logfmt.h's formula.");
    m.def(
        "logfmt_encode_rows",
        [](std::uintptr_t out, std::uintptr_t x, int64_t num_rows, int64_t hidden, int64_t out_stride,
           int64_t x_stride, int num_threads) {
            py::gil_scoped_release release;
            cpu::logfmt_encode_rows(ptr<uint8_t>(out), ptr<const uint16_t>(x), num_rows, hidden, out_stride, x_stride,
                                    num_threads);
        },
        py::arg("out"), py::arg("x"), py::arg("num_rows"), py::arg("hidden"), py::arg("out_stride"),
        py::arg("x_stride"), py::arg("num_threads"));
    m.def(
        "logfmt_decode_rows",
        [](std::uintptr_t out, std::uintptr_t enc, int64_t num_rows, int64_t hidden, int64_t enc_stride,
           int num_threads) {
            py::gil_scoped_release release;
            cpu::logfmt_decode_rows(ptr<float>(out), ptr<const uint8_t>(enc), num_rows, hidden, enc_stride,
                                    num_threads);
        },
        py::arg("out"), py::arg("enc"), py::arg("num_rows"), py::arg("hidden"), py::arg("enc_stride"),
        py::arg("num_threads"));

    m.def(
        "low_latency_send_order",
        [](std::uintptr_t msg, std::uintptr_t experts, std::uintptr_t send_counts, std::uintptr_t topk_idx,
           int64_t num_tokens, int64_t num_topk, int64_t num_experts, int64_t num_ranks) {
            py::gil_scoped_release release;
            return cpu::low_latency_send_order(ptr<int64_t>(msg), ptr<int64_t>(experts), ptr<int64_t>(send_counts),
                                               ptr<const int64_t>(topk_idx), num_tokens, num_topk, num_experts,
                                               num_ranks);
        },
        py::arg("msg"), py::arg("experts"), py::arg("send_counts"), py::arg("topk_idx"), py::arg("num_tokens"),
        py::arg("num_topk"), py::arg("num_experts"), py::arg("num_ranks"));

    m.def(
        "low_latency_positions",
        [](std::uintptr_t pos, int64_t num_slots, std::uintptr_t msg, std::uintptr_t experts, int64_t n,
           int64_t num_local_experts, int64_t num_ranks, const std::vector<int64_t>& firsts) {
            if (static_cast<int64_t>(firsts.size()) != num_ranks)
                throw std::invalid_argument("low_latency_positions: firsts must have num_ranks entries");
            py::gil_scoped_release release;
            cpu::low_latency_positions(ptr<int32_t>(pos), num_slots, ptr<const int64_t>(msg),
                                       ptr<const int64_t>(experts), n, num_local_experts, num_ranks, firsts.data());
        },
        py::arg("pos"), py::arg("num_slots"), py::arg("msg"), py::arg("experts"), py::arg("n"),
        py::arg("num_local_experts"), py::arg("num_ranks"), py::arg("firsts"));

    m.def(
        "low_latency_combine_rows",
        [](std::uintptr_t rows, std::uintptr_t layout_range, int64_t num_local_experts, int64_t num_ranks,
           int64_t rows_per_expert, int64_t max_rows) {
            py::gil_scoped_release release;
            return cpu::low_latency_combine_rows(ptr<int64_t>(rows), ptr<const int64_t>(layout_range),
                                                 num_local_experts, num_ranks, rows_per_expert, max_rows);
        },
        py::arg("rows"), py::arg("layout_range"), py::arg("num_local_experts"), py::arg("num_ranks"),
        py::arg("rows_per_expert"), py::arg("max_rows"));

    m.def(
        "low_latency_unpack",
        [](std::uintptr_t recv_x, std::uintptr_t scales, std::uintptr_t src_info, std::uintptr_t recv_count,
           std::uintptr_t layout_range, std::uintptr_t records, std::uintptr_t recv_counts, std::uintptr_t firsts,
           int64_t num_records,
           int64_t num_ranks, int64_t num_local_experts, int64_t rows_per_expert, int64_t record_bytes, int64_t x_offset,
           int64_t x_bytes, int64_t scales_offset, int64_t num_scales, int64_t scale_bytes,
           int64_t scales_expert_stride, int64_t scales_row_stride, int64_t scales_col_stride, int64_t src_offset,
           int64_t expert_offset, int num_threads) {
            py::gil_scoped_release release;
            cpu::low_latency_unpack(ptr<uint8_t>(recv_x), ptr<uint8_t>(scales), ptr<int32_t>(src_info),
                                    ptr<int32_t>(recv_count), ptr<int64_t>(layout_range), ptr<const uint8_t>(records),
                                    ptr<const int64_t>(recv_counts), ptr<const int64_t>(firsts), num_records,
                                    num_ranks, num_local_experts,
                                    rows_per_expert,
                                    record_bytes, x_offset, x_bytes, scales_offset, num_scales, scale_bytes,
                                    scales_expert_stride, scales_row_stride, scales_col_stride, src_offset,
                                    expert_offset, num_threads);
        },
        py::arg("recv_x"), py::arg("scales"), py::arg("src_info"), py::arg("recv_count"), py::arg("layout_range"),
        py::arg("records"), py::arg("recv_counts"), py::arg("firsts"), py::arg("num_records"), py::arg("num_ranks"),
        py::arg("num_local_experts"),
        py::arg("rows_per_expert"), py::arg("record_bytes"), py::arg("x_offset"), py::arg("x_bytes"),
        py::arg("scales_offset"), py::arg("num_scales"), py::arg("scale_bytes"), py::arg("scales_expert_stride"),
        py::arg("scales_row_stride"), py::arg("scales_col_stride"), py::arg("src_offset"), py::arg("expert_offset"),
        py::arg("num_threads"));

    m.def(
        "quantize_rows",
        [](std::uintptr_t out, std::uintptr_t scales, std::uintptr_t x, std::uintptr_t source, int64_t num_rows,
           int64_t x_rows, int64_t hidden, int64_t source_div, cpu::DType in_dtype, cpu::QuantFormat format,
           bool round_scale, bool ue8m0, int num_threads) {
            py::gil_scoped_release release;
            cpu::quantize_rows(ptr<uint8_t>(out), ptr<uint8_t>(scales), ptr<const void>(x), ptr<const int64_t>(source),
                               num_rows, x_rows, hidden, source_div, in_dtype, format, round_scale, ue8m0, num_threads);
        },
        py::arg("out"), py::arg("scales"), py::arg("x"), py::arg("source"), py::arg("num_rows"), py::arg("x_rows"),
        py::arg("hidden"), py::arg("source_div"), py::arg("in_dtype"), py::arg("format"), py::arg("round_scale"), py::arg("ue8m0"),
        py::arg("num_threads"));

    m.def(
        "dequantize_rows",
        [](std::uintptr_t out, std::uintptr_t q, std::uintptr_t scales, int64_t num_rows, int64_t hidden,
           cpu::DType out_dtype, cpu::QuantFormat format, bool ue8m0, int num_threads) {
            py::gil_scoped_release release;
            cpu::dequantize_rows(ptr<void>(out), ptr<const uint8_t>(q), ptr<const uint8_t>(scales), num_rows, hidden,
                                 out_dtype, format, ue8m0, num_threads);
        },
        py::arg("out"), py::arg("q"), py::arg("scales"), py::arg("num_rows"), py::arg("hidden"), py::arg("out_dtype"),
        py::arg("format"), py::arg("ue8m0"), py::arg("num_threads"));

    m.def(
        "flag_store", [](std::uintptr_t flag, int64_t value) { cpu::flag_store(ptr<int64_t>(flag), value); },
        py::arg("flag"), py::arg("value"));
    m.def(
        "flag_load", [](std::uintptr_t flag) { return cpu::flag_load(ptr<const int64_t>(flag)); }, py::arg("flag"));
    m.def("process_alive", &cpu::process_alive, py::arg("pid"));
    m.def(
        "flags_wait",
        [](const std::vector<std::uintptr_t>& flags, const std::vector<int64_t>& targets,
           const std::vector<int64_t>& pids, double timeout_s, bool exact) {
            const auto n = static_cast<int64_t>(flags.size());
            if (targets.size() != flags.size() || pids.size() != flags.size())
                throw std::invalid_argument("flags_wait: flags, targets and pids must have the same length");
            std::vector<int64_t*> addresses(flags.size());
            for (size_t i = 0; i < flags.size(); ++i) addresses[i] = ptr<int64_t>(flags[i]);
            cpu::WaitOutcome outcome = cpu::WaitOutcome::kReached;
            int64_t index;
            {
                py::gil_scoped_release release;
                index = cpu::flags_wait(addresses.data(), targets.data(), pids.data(), n, timeout_s, exact, &outcome);
            }
            return std::make_tuple(index, outcome);
        },
        py::arg("flags"), py::arg("targets"), py::arg("pids"), py::arg("timeout_s"), py::arg("exact"),
        "Waits for flags[i] >= targets[i] (== when exact); returns (-1, WaitOutcome.REACHED) or (index of a flag "
        "not reached, WaitOutcome.TIMEOUT | PEER_EXITED | PAST_TARGET).");

    m.def(
        "headers_agree",
        [](std::uintptr_t first, int64_t stride, int num_ranks, int me, int64_t per_rank, int rejected,
           uint64_t compare) {
            // every word read (the per-rank words, and words 0-63 of the compare mask) inside each header
            if (num_ranks <= 0 || me < 0 || me >= num_ranks || per_rank < 0 || rejected < 0 || rejected >= 64 ||
                stride < 8 * std::max<int64_t>(per_rank + 4 * static_cast<int64_t>(num_ranks), 64))
                throw std::invalid_argument("headers_agree: num_ranks > 0, me in [0, num_ranks), rejected in [0, 64) "
                                            "and headers of at least 8 * max(per_rank + 4 * num_ranks, 64) bytes "
                                            "needed");
            std::vector<int64_t> sent_to_me(static_cast<size_t>(num_ranks));
            const auto* headers = ptr<const uint8_t>(first);
            moe_comm::call_header::Difference diff{};
            const bool agreed = moe_comm::call_header::agree(headers, stride, nullptr, num_ranks, me, per_rank, rejected,
                                                             compare, &diff);
            for (int s = 0; s < num_ranks; ++s)
                sent_to_me[static_cast<size_t>(s)] = moe_comm::call_header::word(headers + s * stride, per_rank + me);
            return std::make_tuple(agreed, sent_to_me);
        },
        py::arg("first"), py::arg("stride"), py::arg("num_ranks"), py::arg("me"), py::arg("per_rank"),
        py::arg("rejected"), py::arg("compare"),
        "(whether the call headers at first + s * stride agree (csrc/common/call_header.h), the rows each rank "
        "sends rank me).");

    m.def(
        "post_records",
        [](const std::vector<std::uintptr_t>& slots, const std::vector<std::uintptr_t>& consumed,
           const std::vector<std::uintptr_t>& arrived, const std::vector<int64_t>& pids, int64_t slot_bytes,
           int64_t free_at, int64_t seq, double timeout_s, std::uintptr_t header, int64_t header_bytes,
           int64_t header_at, int64_t rows_at, const std::vector<int64_t>& counts, const std::vector<int64_t>& firsts,
           const std::vector<SegmentTuple>& segments, std::uintptr_t src_rows, int64_t num_records,
           int64_t record_bytes, std::uintptr_t words, int64_t word_offset, int num_threads) {
            const size_t n = slots.size();
            if (consumed.size() != n || arrived.size() != n || pids.size() != n || counts.size() != n ||
                firsts.size() != n)
                throw std::invalid_argument("post_records: slots, consumed, arrived, pids, counts and firsts must "
                                            "have the same length");
            std::vector<uint8_t*> slot_ptrs(n);
            std::vector<int64_t*> consumed_ptrs(n), arrived_ptrs(n);
            for (size_t i = 0; i < n; ++i) {
                slot_ptrs[i] = ptr<uint8_t>(slots[i]);
                consumed_ptrs[i] = ptr<int64_t>(consumed[i]);
                arrived_ptrs[i] = ptr<int64_t>(arrived[i]);
            }
            const auto segs = to_segments(segments);
            const cpu::PostPlan plan{slot_ptrs.data(), consumed_ptrs.data(), arrived_ptrs.data(), pids.data(),
                                     static_cast<int64_t>(n), slot_bytes, free_at, seq, timeout_s,
                                     ptr<const uint8_t>(header), header_bytes, header_at, rows_at, counts.data(),
                                     firsts.data(), segs.data(), static_cast<int>(segs.size()),
                                     ptr<const int64_t>(src_rows), num_records, record_bytes,
                                     ptr<const int32_t>(words), word_offset, num_threads};
            cpu::WaitOutcome outcome = cpu::WaitOutcome::kReached;
            int64_t index;
            {
                py::gil_scoped_release release;
                index = cpu::post_records(plan, &outcome);
            }
            return std::make_tuple(index, outcome);
        },
        py::arg("slots"), py::arg("consumed"), py::arg("arrived"), py::arg("pids"), py::arg("slot_bytes"),
        py::arg("free_at"), py::arg("seq"), py::arg("timeout_s"), py::arg("header"), py::arg("header_bytes"),
        py::arg("header_at"), py::arg("rows_at"), py::arg("counts"), py::arg("firsts"), py::arg("segments"),
        py::arg("src_rows"), py::arg("num_records"), py::arg("record_bytes"), py::arg("words"),
        py::arg("word_offset"), py::arg("num_threads"),
        "One low-latency post into every destination's data slot (csrc/cpu/post.h); returns (-1, "
        "WaitOutcome.REACHED) or (index of the destination whose free-slot wait failed, its outcome).");

    m.def(
        "block_digests",
        [](std::uintptr_t out, std::uintptr_t keys, int key_bytes, const std::vector<int64_t>& counts,
           int64_t num_keys) {
            py::gil_scoped_release release;
            cpu::block_digests(ptr<int64_t>(out), ptr<const void>(keys), key_bytes, counts.data(),
                               static_cast<int64_t>(counts.size()), num_keys);
        },
        py::arg("out"), py::arg("keys"), py::arg("key_bytes"), py::arg("counts"), py::arg("num_keys"));
    m.def(
        "send_order_check",
        [](std::uintptr_t counts, std::uintptr_t digests, std::uintptr_t is_token_in_rank, std::uintptr_t send_head,
           int64_t num_tokens, int64_t num_ranks) {
            py::gil_scoped_release release;
            return cpu::send_order_check(ptr<int64_t>(counts), ptr<int64_t>(digests), ptr<const bool>(is_token_in_rank),
                                         ptr<const int32_t>(send_head), num_tokens, num_ranks);
        },
        py::arg("counts"), py::arg("digests"), py::arg("is_token_in_rank"), py::arg("send_head"), py::arg("num_tokens"),
        py::arg("num_ranks"));

    m.def(
        "low_latency_combine_digests",
        [](std::uintptr_t returned, std::uintptr_t asked, std::uintptr_t layout_range, std::uintptr_t src_info,
           std::uintptr_t msg, std::uintptr_t experts, const std::vector<int64_t>& send_counts,
           int64_t num_local_experts, int64_t rows_per_expert, int64_t num_topk) {
            py::gil_scoped_release release;
            cpu::low_latency_combine_digests(ptr<int64_t>(returned), ptr<int64_t>(asked), ptr<const int64_t>(layout_range),
                                             ptr<const int32_t>(src_info), ptr<const int64_t>(msg),
                                             ptr<const int64_t>(experts), send_counts.data(), num_local_experts,
                                             static_cast<int64_t>(send_counts.size()), rows_per_expert, num_topk);
        },
        py::arg("returned"), py::arg("asked"), py::arg("layout_range"), py::arg("src_info"), py::arg("msg"),
        py::arg("experts"), py::arg("send_counts"), py::arg("num_local_experts"), py::arg("rows_per_expert"),
        py::arg("num_topk"));
    m.def(
        "low_latency_layout_check",
        [](std::uintptr_t layout_range, int64_t num_local_experts, int64_t num_ranks, int64_t rows_per_expert) {
            return cpu::low_latency_layout_check(ptr<const int64_t>(layout_range), num_local_experts, num_ranks,
                                                 rows_per_expert);
        },
        py::arg("layout_range"), py::arg("num_local_experts"), py::arg("num_ranks"), py::arg("rows_per_expert"));

    m.def("combine_reduce_isa", &cpu::combine_reduce_isa);
    m.def("quantize_rows_isa", &cpu::quantize_rows_isa);
    m.def("set_quantize_rows_isa_cap", &cpu::set_quantize_rows_isa_cap, py::arg("cap"));
    m.def("set_combine_reduce_generic", &cpu::set_combine_reduce_generic, py::arg("generic"));
    m.def("hardware_threads", &cpu::hardware_threads);
    def_vendor(m);
    def_prepared(m);
}
