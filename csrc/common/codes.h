// The codes and constants that Python, the CPU kernels (csrc/cpu) and the CUDA kernels (csrc/cuda, both
// the device and the host build) share: one table, here. moe_comm._C and the CUDA modules bind it
// through codes_bindings.h, and tests/protocol/test_codes.py checks Python's copies
// (moe_comm/protocol/codes.py WireDType and WaitOutcome, ops.fp8.GROUP, ...) against what they bound.
//
// NOTES: the values travel (handshake vectors carry DType values, error records carry WaitOutcome
// values), so a member keeps its value forever; new members take new values.
#pragma once

#include <cstdint>

namespace moe_comm {

// Tensor element types: X(Python name, C++ member, value). The kernels take the float ones
// (FLOAT32, FLOAT16, BFLOAT16) for rows they read as numbers and refuse the others by name.
#define MOE_COMM_DTYPES(X)                   \
    X(FLOAT32, kFloat32, 0)                  \
    X(FLOAT16, kFloat16, 1)                  \
    X(BFLOAT16, kBFloat16, 2)                \
    X(FLOAT64, kFloat64, 3)                  \
    X(INT8, kInt8, 4)                        \
    X(UINT8, kUInt8, 5)                      \
    X(INT16, kInt16, 6)                      \
    X(INT32, kInt32, 7)                      \
    X(INT64, kInt64, 8)                      \
    X(BOOL, kBool, 9)                        \
    X(FLOAT8_E4M3FN, kFloat8E4M3FN, 10)      \
    X(FLOAT8_E5M2, kFloat8E5M2, 11)          \
    X(FLOAT8_E4M3FNUZ, kFloat8E4M3FNUZ, 12)  \
    X(FLOAT8_E5M2FNUZ, kFloat8E5M2FNUZ, 13)

enum class DType : int32_t {
#define MOE_COMM_DTYPE_MEMBER(name, member, value) member = value,
    MOE_COMM_DTYPES(MOE_COMM_DTYPE_MEMBER)
#undef MOE_COMM_DTYPE_MEMBER
};

// How a wait with a deadline ended, on the host (csrc/cpu/flags.h: the shm transport) and in the
// kernels (csrc/cuda/protocol/wait.h: a launch's error record): X(Python name, C++ member, value).
// PAST_TARGET: the flag came from a later exchange or call (out of step); MISMATCH: the call's headers
// (kernels/low_latency.h) disagree or a rank rejected its arguments (the host reads them for the verdict).
#define MOE_COMM_WAIT_OUTCOMES(X) \
    X(REACHED, kReached, 0)       \
    X(TIMEOUT, kTimeout, 1)       \
    X(PEER_EXITED, kPeerExited, 2) \
    X(PAST_TARGET, kPastTarget, 3) \
    X(MISMATCH, kMismatch, 4)

enum class WaitOutcome : int32_t {
#define MOE_COMM_WAIT_OUTCOME_MEMBER(name, member, value) member = value,
    MOE_COMM_WAIT_OUTCOMES(MOE_COMM_WAIT_OUTCOME_MEMBER)
#undef MOE_COMM_WAIT_OUTCOME_MEMBER
};

// Channels per FP8 scale (DeepEP's per-token 1x128 groups): Python ops.fp8.GROUP.
constexpr int64_t kFp8Group = 128;
// The smallest amax an FP8/INT8 scale is computed from, so an all-zero group gets a finite scale:
// Python ops.quant's floor.
constexpr float kAmaxFloor = 1e-4f;
// Ranks of one node (DeepEP's NUM_MAX_NVL_PEERS): Python core.config.NUM_MAX_NVL_PEERS.
constexpr int kMaxNodeRanks = 8;

// Whether `t` is one of the float types the kernels read as numbers.
constexpr bool is_float_row(DType t) {
    return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16;
}

// Bytes of one element of a float row type (0 for the others).
constexpr int64_t float_row_bytes(DType t) {
    return t == DType::kFloat32 ? 4 : (t == DType::kFloat16 || t == DType::kBFloat16) ? 2 : 0;
}

}  // namespace moe_comm
