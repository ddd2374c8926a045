// combine_reduce: the AVX2 build of reduce.cpp where the CPU has it, else the generic build.
#include "api.h"
#include "check.h"

#include <atomic>
#include <string_view>

namespace moe_comm::cpu {

// The per-ISA builds of reduce.cpp, declared with api.h's signature.
using CombineReduce = decltype(combine_reduce);
namespace generic {
CombineReduce combine_reduce;
}
#ifdef MOE_COMM_HAVE_AVX2
namespace avx2 {
CombineReduce combine_reduce;
}
#endif

void combine_reduce(void* out, float* out_weights,
                    const uint8_t* const* sources, const int32_t* send_pos, const float* scale,
                    const void* bias0, const void* bias1,
                    int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                    int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                    int num_threads) {
    MC_CHECK(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
             "combine_reduce: unknown dtype code " << static_cast<int>(dtype));
#ifdef MOE_COMM_HAVE_AVX2
    if (std::string_view(combine_reduce_isa()) == "avx2")
        return avx2::combine_reduce(out, out_weights, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources,
                                    hidden, dtype, record_bytes, x_offset, weights_offset, num_topk, num_threads);
#endif
    generic::combine_reduce(out, out_weights, sources, send_pos, scale, bias0, bias1, num_tokens, num_sources, hidden,
                            dtype, record_bytes, x_offset, weights_offset, num_topk, num_threads);
}

namespace {
std::atomic<bool> generic_only{false};
}

void set_combine_reduce_generic(bool generic) { generic_only.store(generic); }

const char* combine_reduce_isa() {
#ifdef MOE_COMM_HAVE_AVX2
    static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (has_avx2 && !generic_only.load(std::memory_order_relaxed)) return "avx2";
#endif
    return "generic";
}

}  // namespace moe_comm::cpu
