// LogFMT-10: the 10-bit log format of DeepEP's low-latency combine (`low_latency_combine(...,
// use_logfmt=True)`), as functions on one row of `hidden` bf16 channels, for host C++ (the CPU kernels)
// and CUDA device code (raw pointers, no allocation, no exceptions). Python's torch reference of the
// same formula is moe_comm/ops/logfmt.py; it reads every constant below through moe_comm._C.
//
// What DeepEP's kernel does (csrc/kernels/legacy/internode_ll.cu: logfmt_encode, logfmt_check_amaxmin,
// decode_and_accumulate, the combine sender and receiver), restated:
//
// * Divisions. Every 128 channels ("division") carry one (amax, amin) pair: the largest and smallest
//   |x| over the division, as bf16 (exact: they are |x| of bf16 inputs), zeros included in the min.
//   The metadata of all divisions leads the row: division d's amax at byte 4d, its amin at 4d + 2.
// * Logs of a division: log_amax = log2(amax); log_amin = max(log2(amin), log_amax - 32) (so a zero
//   amin, log2 = -inf, gives log_amax - 32: the receiver's explicit `amin == 0` case is the same value).
//   A division may be cast iff log_amax < 0 and log_amin < log_amax, i.e. 0 < amax < 1 and amin < amax.
// * Chunks: one cast decision covers a chunk of W channels, W = 1024 when hidden % 1024 == 0, else 512
//   (32 lanes x kNumSendUnrolls int4: kNumSendUnrolls = 4 or 2). The sender ANDs the division test over
//   the whole warp (warp_reduce_and<lanes per division, intergroup>); the receiver ANDs it over the
//   kNumSendUnrolls lanes that read 2 divisions each (warp_reduce_and<kNumSendUnrolls>): both are the
//   AND over the chunk's W / 128 divisions, computed from the same bf16 metadata, so they agree. The
//   receiver's 512-channel decode units take the decision of the chunk they lie in.
// * Payload: the chunks follow the metadata back to back, each either raw (2W bytes of bf16) or cast
//   (W / 16 blocks of 20 bytes: 10 bits per channel). Chunk c starts after the metadata and the sizes
//   of chunks 0..c-1, which the receiver gets from their decisions (DeepEP's prefix popcount).
// * Encode of a cast channel, with its division's logs:
//     step = (log_amax - log_amin) / 510,   step_inv = 1 / step,
//     rounding = 2 - log2((1 + exp2(step)) * 0.5) * step_inv,   fused = rounding - log_amin * step_inv,
//     code = floor(max(log2(|x|) * step_inv + fused, 0))          (9 bits; |x| = 0 gives code 0)
//   The rounding term puts the boundary between codes k and k+1 at the arithmetic mean of their decoded
//   values, so a value is coded to the nearest level in linear space.
// * Block packing: a block of 16 channels is 160 bits, five little-endian uint32: channel j's code at
//   bits 9j..9j+8 (codes straddle words), channel j's sign bit at bit 144 + j.
// * Decode: value = (code == 0 ? 0 : exp2((code - 1) * step + log_amin)), negated when the sign bit is
//   set (code 511 decodes to amax, code 1 to 2^log_amin); raw chunks decode to their bf16 values.
// * Combine: per token, acc = 0 (fp32); for top-k slot k ascending, skipping slots with topk_idx -1
//   (and masked ranks): acc += decoded * weight_k; out = bf16(acc), nearest even.
//
// Where this header differs from DeepEP's bits (and why):
// * log2 and exp2. DeepEP calls the GPU's MUFU approximations (lg2.approx.f32, ex2.approx.f32), which a
//   CPU cannot reproduce. Here both are computed once, deterministically, with IEEE fp32 operations
//   only (no libm, no FMA), so host and device give the same bits: log2 within 1 ulp of the true value
//   at every positive float (subnormals included), exp2 within 1.2 ulp (tests/ops/test_logfmt.py
//   measures both). DeepEP's codes and decoded values differ from ours by the MUFU error; this is the
//   one deviation in the formula itself. The points below are roundings DeepEP leaves to its compiler,
//   and inputs DeepEP mishandles or does not compile.
// * Rounding of multiply-adds. DeepEP's nvcc default (--fmad=true) fuses `log2(x) * step_inv + fused`,
//   `(code - 1) * step + log_amin` and `acc + decoded * weight` into FMAs; here every multiply and add
//   rounds on its own (mul_rn / add_rn: -ffp-contract=off on the host, --fmad=false on the device), as
//   in every moe-comm reduction.
// * Edge inputs. NaN: DeepEP's __hmax2 ignores NaN, so a NaN in a cast chunk is silently coded 0 (+-0);
//   here amax propagates NaN (an integer max of the bf16 bits of |x|: NaN > Inf > every finite), a NaN
//   division is never cast, and the NaN reaches the output as in the bf16 combine. Inf, or any |x| >= 1,
//   makes its chunk raw in both. Codes are clamped to 511: DeepEP cannot exceed 511.5 in exact
//   arithmetic, but its rounded floor could reach 512 and carry into the neighbouring code.
// * Hidden sizes. DeepEP compiles hidden % 512 == 0 only, where every chunk is full. Here hidden must be
//   a positive multiple of 128 (valid_hidden; callers refuse others naming hidden): W is chosen by the
//   same rule and the last chunk holds the hidden % W channels left (DeepEP's sizes never have one).
//   Every row then fits max_row_bytes(hidden) = 2 * hidden + 4 * hidden / 128, so slots are fixed-size,
//   and encode_row returns the bytes actually used (what a transport needs to send).
//
// Any bytes decode without reading outside max_row_bytes(hidden): a cast chunk is smaller than a raw one.
// The wire is little-endian (the hosts and GPUs moe-comm runs on all are).
#pragma once

#include <cstdint>
#include <cstring>

#include "numeric.h"

namespace moe_comm::logfmt {
namespace {

using numeric::add_rn;
using numeric::bf16_to_float;
using numeric::bits_of;
using numeric::from_bits;
using numeric::mul_rn;

constexpr int64_t kGroup = 128;         // channels per division: one (amax, amin) pair
constexpr int64_t kMetaBytes = 4;       // bytes of one division's pair
constexpr int64_t kBlock = 16;          // channels per packed block
constexpr int64_t kBlockBytes = 20;     // 16 x 9-bit codes + 16 sign bits
constexpr int64_t kWideChunk = 1024;    // W when hidden % 1024 == 0 (DeepEP's kNumSendUnrolls = 4)
constexpr int64_t kNarrowChunk = 512;   // W otherwise (kNumSendUnrolls = 2)
constexpr int64_t kMaxDivisionsPerChunk = kWideChunk / kGroup;
constexpr int kCodeBits = 9;
constexpr uint32_t kMaxCode = (1u << kCodeBits) - 1;        // 511
constexpr float kNumSteps = static_cast<float>(kMaxCode - 1);  // 510 steps from code 1 to code 511
constexpr float kMinClip = 32.0f;       // log_amin >= log_amax - 32

// ln(1 + f) for m = 1 + f in [sqrt(1/2), sqrt(2)]: with s = f / (2 + f), z = s^2,
//   ln(1 + f) = 2 atanh(s) = f - f^2/2 + s (f^2/2 + R),   R = z (L1 + L2 z + ... + L5 z^4),
// L_k = 2 / (2k + 1) (the atanh series), each the double rounded to float; the leading f - f^2/2 is carried
// as hi (12 significant bits) + lo, and multiplied by 1/ln2 = kInvLn2Hi (12 bits: exact products) + kInvLn2Lo.
constexpr double kLn2 = 0.69314718055994530942;
constexpr float kLog2C1 = static_cast<float>(2.0 / 3.0);
constexpr float kLog2C2 = static_cast<float>(2.0 / 5.0);
constexpr float kLog2C3 = static_cast<float>(2.0 / 7.0);
constexpr float kLog2C4 = static_cast<float>(2.0 / 9.0);
constexpr float kLog2C5 = static_cast<float>(2.0 / 11.0);
constexpr float kInvLn2Hi = 1.44287109375f;  // 1/ln2 rounded to 12 significant bits (0x3fb8b000)
constexpr float kInvLn2Lo = static_cast<float>(1.0 / kLn2 - 1.44287109375);
constexpr uint32_t kHiMask = 0xfffff000u;    // keeps 12 significant bits of hi
constexpr uint32_t kSqrt2Bits = 0x3fb504f3u;  // float nearest sqrt(2): mantissas above it are halved
// 2^r = 1 + E1 r + ... + E7 r^7 for |r| <= 1/2, E_k = ln2^k / k!, each the double rounded to float.
constexpr float kExp2C1 = static_cast<float>(kLn2);
constexpr float kExp2C2 = static_cast<float>(kLn2 * kLn2 / 2.0);
constexpr float kExp2C3 = static_cast<float>(kLn2 * kLn2 * kLn2 / 6.0);
constexpr float kExp2C4 = static_cast<float>(kLn2 * kLn2 * kLn2 * kLn2 / 24.0);
constexpr float kExp2C5 = static_cast<float>(kLn2 * kLn2 * kLn2 * kLn2 * kLn2 / 120.0);
constexpr float kExp2C6 = static_cast<float>(kLn2 * kLn2 * kLn2 * kLn2 * kLn2 * kLn2 / 720.0);
constexpr float kExp2C7 = static_cast<float>(kLn2 * kLn2 * kLn2 * kLn2 * kLn2 * kLn2 * kLn2 / 5040.0);
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: (y + it) - it rounds y to an integer, nearest even
constexpr float kExp2Clamp = 250.0f;        // |y| beyond it: 2^y is 0 or Inf anyway; keeps 2^(n/2) normal

MC_NUM float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

// 2^k for k in [-126, 127], exactly.
MC_NUM float pow2i(int32_t k) { return from_bits(static_cast<uint32_t>(k + 127) << 23); }

// log2(x): -Inf at +-0, +Inf at +Inf, NaN kept for NaN, the canonical NaN for x < 0; within 1 ulp
// elsewhere, subnormals included. Selects, no branches, so loops over it vectorize.
MC_NUM float log2(float x) {
    const uint32_t bits = bits_of(x);
    const bool subnormal = (bits & 0x7fffffffu) < 0x00800000u;
    const uint32_t b = bits_of(subnormal ? mul_rn(x, 8388608.0f) : x);  // * 2^23, exact
    uint32_t mant = (b & 0x007fffffu) | 0x3f800000u;                    // m in [1, 2)
    int32_t e = static_cast<int32_t>((b >> 23) & 0xffu) - (subnormal ? 150 : 127);
    const bool high = mant > kSqrt2Bits;  // m in [sqrt(1/2), sqrt(2)] keeps |s| <= 0.172
    mant = high ? mant - 0x00800000u : mant;
    e = high ? e + 1 : e;
    const float f = add_rn(from_bits(mant), -1.0f);  // exact
    const float s = div_rn(f, add_rn(f, 2.0f));
    const float z = mul_rn(s, s);
    float big_r = kLog2C5;
    big_r = add_rn(mul_rn(big_r, z), kLog2C4);
    big_r = add_rn(mul_rn(big_r, z), kLog2C3);
    big_r = add_rn(mul_rn(big_r, z), kLog2C2);
    big_r = add_rn(mul_rn(big_r, z), kLog2C1);
    big_r = mul_rn(big_r, z);
    const float hfsq = mul_rn(mul_rn(f, 0.5f), f);
    const float r = mul_rn(s, add_rn(hfsq, big_r));
    const float hi = from_bits(bits_of(add_rn(f, -hfsq)) & kHiMask);
    const float lo = add_rn(add_rn(add_rn(f, -hi), -hfsq), r);
    const float v_hi = mul_rn(hi, kInvLn2Hi);  // exact
    float v_lo = add_rn(mul_rn(add_rn(lo, hi), kInvLn2Lo), mul_rn(lo, kInvLn2Hi));
    const float k = static_cast<float>(e);
    const float w = add_rn(k, v_hi);
    v_lo = add_rn(v_lo, add_rn(add_rn(k, -w), v_hi));  // what k + v_hi lost
    const float result = add_rn(v_lo, w);
    const float inf = from_bits(0x7f800000u);
    return x == 0.0f ? -inf : x == inf ? inf : x < 0.0f ? from_bits(0x7fc00000u) : x != x ? x : result;
}

// 2^y: NaN kept, 0 below about -150, Inf from 128; within 1.2 ulp elsewhere, subnormal results rounded
// once. Exact at integers.
MC_NUM float exp2(float y) {
    float c = y > -kExp2Clamp ? y : -kExp2Clamp;  // NaN -> -250, selected away at the end
    c = c < kExp2Clamp ? c : kExp2Clamp;
    const float n = add_rn(add_rn(c, kRoundMagic), -kRoundMagic);
    const float r = add_rn(c, -n);  // exact, |r| <= 1/2
    float q = kExp2C7;
    q = add_rn(mul_rn(q, r), kExp2C6);
    q = add_rn(mul_rn(q, r), kExp2C5);
    q = add_rn(mul_rn(q, r), kExp2C4);
    q = add_rn(mul_rn(q, r), kExp2C3);
    q = add_rn(mul_rn(q, r), kExp2C2);
    q = add_rn(mul_rn(q, r), kExp2C1);
    const float p = add_rn(mul_rn(q, r), 1.0f);
    // 2^n in two normal halves: p * 2^na stays normal (exact), the second multiply rounds once.
    const int32_t ni = static_cast<int32_t>(n);
    const int32_t na = ni / 2, nb = ni - na;
    const float v = mul_rn(mul_rn(p, pow2i(na)), pow2i(nb));
    return y != y ? y : v;
}

MC_NUM bool valid_hidden(int64_t hidden) { return hidden > 0 && hidden % kGroup == 0; }

// Channels per cast decision: 1024 when hidden % 1024 == 0, else 512 (DeepEP's rule).
MC_NUM int64_t chunk_channels(int64_t hidden) { return hidden % kWideChunk == 0 ? kWideChunk : kNarrowChunk; }

MC_NUM int64_t num_chunks(int64_t hidden) {
    const int64_t w = chunk_channels(hidden);
    return (hidden + w - 1) / w;
}

MC_NUM int64_t meta_bytes(int64_t hidden) { return hidden / kGroup * kMetaBytes; }

// Bytes a row may take: all chunks raw. A slot of this size holds any row.
MC_NUM int64_t max_row_bytes(int64_t hidden) { return 2 * hidden + meta_bytes(hidden); }

// Payload bytes of a chunk of `channels` (a multiple of 128).
MC_NUM int64_t chunk_bytes(int64_t channels, bool cast) {
    return cast ? channels / kBlock * kBlockBytes : 2 * channels;
}

// One division's logs and parameters, from its metadata (identical on both sides: both read the row).
struct Division {
    float log_amin;
    float step;      // decode: value = exp2((code - 1) * step + log_amin)
    float step_inv;  // encode: code = floor(max(log2(|x|) * step_inv + fused, 0))
    float fused;
    bool cast;       // log_amax < 0 and log_amin < log_amax
};

MC_NUM uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

MC_NUM void store_u32(uint8_t* p, uint32_t v) { memcpy(p, &v, sizeof(v)); }

MC_NUM Division division(const uint8_t* row, int64_t d) {
    const uint32_t meta = load_u32(row + d * kMetaBytes);
    const float log_amax = log2(bf16_to_float(static_cast<uint16_t>(meta & 0xffffu)));
    const float floor_log = add_rn(log_amax, -kMinClip);
    const float log_amin_raw = log2(bf16_to_float(static_cast<uint16_t>(meta >> 16)));
    Division v;
    v.log_amin = log_amin_raw > floor_log ? log_amin_raw : floor_log;
    v.cast = log_amax < 0.0f && v.log_amin < log_amax;
    v.step = div_rn(add_rn(log_amax, -v.log_amin), kNumSteps);
    v.step_inv = div_rn(1.0f, v.step);
    const float midpoint = log2(mul_rn(add_rn(1.0f, exp2(v.step)), 0.5f));
    const float rounding = add_rn(2.0f, -mul_rn(midpoint, v.step_inv));
    v.fused = add_rn(rounding, -mul_rn(v.log_amin, v.step_inv));
    return v;
}

// Divisions [first, first + count) of chunk c, and whether the chunk is cast (the AND of theirs).
MC_NUM bool chunk_divisions(Division* out, int64_t* first, int64_t* count, const uint8_t* row, int64_t hidden,
                            int64_t c) {
    const int64_t w = chunk_channels(hidden);
    const int64_t begin = c * w, channels = hidden - begin < w ? hidden - begin : w;
    *first = begin / kGroup;
    *count = channels / kGroup;
    bool cast = true;
    for (int64_t i = 0; i < *count; ++i) {
        out[i] = division(row, *first + i);
        cast = cast && out[i].cast;
    }
    return cast;
}

MC_NUM bool chunk_casts(const uint8_t* row, int64_t hidden, int64_t c) {
    Division divs[kMaxDivisionsPerChunk];
    int64_t first, count;
    return chunk_divisions(divs, &first, &count, row, hidden, c);
}

// Byte offset of chunk c's payload in a row whose metadata is written.
MC_NUM int64_t chunk_offset(const uint8_t* row, int64_t hidden, int64_t c) {
    const int64_t w = chunk_channels(hidden);
    int64_t offset = meta_bytes(hidden);
    for (int64_t i = 0; i < c; ++i) {
        const int64_t channels = hidden - i * w < w ? hidden - i * w : w;
        offset += chunk_bytes(channels, chunk_casts(row, hidden, i));
    }
    return offset;
}

// Writes the metadata of row x (hidden bf16 channels): per division the integer max and min of the
// bf16 bits of |x|, which order as the values do and put NaN above Inf (so amax propagates NaN).
MC_NUM void encode_meta(uint8_t* row, const uint16_t* x, int64_t hidden) {
    for (int64_t d = 0; d < hidden / kGroup; ++d) {
        uint32_t amax = 0, amin = 0xffffu;
        for (int64_t i = d * kGroup; i < (d + 1) * kGroup; ++i) {
            const uint32_t a = x[i] & 0x7fffu;
            amax = a > amax ? a : amax;
            amin = a < amin ? a : amin;
        }
        store_u32(row + d * kMetaBytes, amax | (amin << 16));
    }
}

// One 16-channel block: codes[j] at bits 9j.., sign j at bit 144 + j of five little-endian words.
MC_NUM void pack_block(uint8_t* out, const uint32_t* codes, uint32_t signs) {
    uint32_t w[5] = {0, 0, 0, 0, signs << 16};
    for (int j = 0; j < kBlock; ++j) {
        const int bit = j * kCodeBits, word = bit / 32, shift = bit % 32;
        w[word] |= codes[j] << shift;
        if (shift > 32 - kCodeBits) w[word + 1] |= codes[j] >> (32 - shift);
    }
    for (int i = 0; i < 5; ++i) store_u32(out + 4 * i, w[i]);
}

MC_NUM uint32_t block_code(const uint32_t* w, int j) {
    const int bit = j * kCodeBits, word = bit / 32, shift = bit % 32;
    const uint32_t spill = shift > 32 - kCodeBits ? w[word + 1] << (32 - shift) : 0u;
    return ((w[word] >> shift) | spill) & kMaxCode;
}

// Channel j of a cast block (words w) of division dv, decoded: code 0 is 0, code k is
// 2^((k - 1) * step + log_amin), negated when its sign bit is set.
MC_NUM float block_value(const uint32_t* w, int j, const Division& dv) {
    const uint32_t code = block_code(w, j);
    const float mag = exp2(add_rn(mul_rn(add_rn(static_cast<float>(code), -1.0f), dv.step), dv.log_amin));
    const float v = code == 0 ? 0.0f : mag;
    return ((w[4] >> (16 + j)) & 1u) != 0 ? -v : v;
}

// Writes chunk c's payload at row + offset (metadata already written; offset = chunk_offset(row,
// hidden, c)); returns its bytes.
MC_NUM int64_t encode_chunk(uint8_t* row, const uint16_t* x, int64_t hidden, int64_t c, int64_t offset) {
    Division divs[kMaxDivisionsPerChunk];
    int64_t first, count;
    const bool cast = chunk_divisions(divs, &first, &count, row, hidden, c);
    uint8_t* out = row + offset;
    const uint16_t* xc = x + first * kGroup;
    if (!cast) {
        memcpy(out, xc, static_cast<size_t>(count * kGroup) * 2);
        return chunk_bytes(count * kGroup, false);
    }
    for (int64_t b = 0; b < count * kGroup / kBlock; ++b) {
        const Division& dv = divs[b * kBlock / kGroup];
        uint32_t codes[kBlock], signs = 0;
        for (int j = 0; j < kBlock; ++j) {
            const uint16_t v = xc[b * kBlock + j];
            signs |= static_cast<uint32_t>(v >> 15) << j;
            float t = add_rn(mul_rn(log2(bf16_to_float(v & 0x7fffu)), dv.step_inv), dv.fused);
            t = t > 0.0f ? t : 0.0f;  // |x| = 0: log2 = -Inf
            t = t < static_cast<float>(kMaxCode) ? t : static_cast<float>(kMaxCode);
            codes[j] = static_cast<uint32_t>(t);  // truncation = floor, t >= 0
        }
        pack_block(out + b * kBlockBytes, codes, signs);
    }
    return chunk_bytes(count * kGroup, true);
}

// Encodes row x (hidden bf16 channels, valid_hidden(hidden)) into row (room for max_row_bytes(hidden));
// returns the bytes written. Bytes past them are left as they were.
MC_NUM int64_t encode_row(uint8_t* row, const uint16_t* x, int64_t hidden) {
    encode_meta(row, x, hidden);
    int64_t offset = meta_bytes(hidden);
    for (int64_t c = 0; c < num_chunks(hidden); ++c) offset += encode_chunk(row, x, hidden, c, offset);
    return offset;
}

// acc[i] += decoded[i] * weight for chunk c's channels i (payload at row + offset); returns its bytes.
// Multiply, then add, each rounded (no FMA).
MC_NUM int64_t decode_accumulate_chunk(const uint8_t* row, int64_t hidden, int64_t c, int64_t offset, float weight,
                                       float* acc) {
    Division divs[kMaxDivisionsPerChunk];
    int64_t first, count;
    const bool cast = chunk_divisions(divs, &first, &count, row, hidden, c);
    const uint8_t* in = row + offset;
    float* ac = acc + first * kGroup;
    if (!cast) {
        for (int64_t i = 0; i < count * kGroup; ++i) {
            uint16_t v;
            memcpy(&v, in + 2 * i, sizeof(v));
            ac[i] = add_rn(ac[i], mul_rn(bf16_to_float(v), weight));
        }
        return chunk_bytes(count * kGroup, false);
    }
    for (int64_t b = 0; b < count * kGroup / kBlock; ++b) {
        const Division& dv = divs[b * kBlock / kGroup];
        uint32_t w[5];
        for (int i = 0; i < 5; ++i) w[i] = load_u32(in + b * kBlockBytes + 4 * i);
        for (int j = 0; j < kBlock; ++j)
            ac[b * kBlock + j] = add_rn(ac[b * kBlock + j], mul_rn(block_value(w, j, dv), weight));
    }
    return chunk_bytes(count * kGroup, true);
}

// Channel i of an encoded row, decoded: the value decode_accumulate_chunk multiplies by the weight (so a
// sum of decode_channel(row_j, hidden, i) * w_j, rounded per step, is bitwise decode_accumulate_row's).
// For kernels that reduce channel by channel without a row of scratch: it finds the chunk's payload
// from the metadata each time.
MC_NUM float decode_channel(const uint8_t* row, int64_t hidden, int64_t i) {
    const int64_t c = i / chunk_channels(hidden);
    Division divs[kMaxDivisionsPerChunk];
    int64_t first, count;
    const bool cast = chunk_divisions(divs, &first, &count, row, hidden, c);
    const uint8_t* in = row + chunk_offset(row, hidden, c);
    const int64_t k = i - first * kGroup;  // the channel within its chunk
    if (!cast) {
        uint16_t v;
        memcpy(&v, in + 2 * k, sizeof(v));
        return bf16_to_float(v);
    }
    const int64_t b = k / kBlock;
    const int j = static_cast<int>(k % kBlock);
    const Division& dv = divs[b * kBlock / kGroup];
    uint32_t w[5];
    for (int q = 0; q < 5; ++q) w[q] = load_u32(in + b * kBlockBytes + 4 * q);
    return block_value(w, j, dv);
}

// acc[i] += decoded[i] * weight for the hidden channels of an encoded row (valid_hidden(hidden)).
MC_NUM void decode_accumulate_row(const uint8_t* row, int64_t hidden, float weight, float* acc) {
    int64_t offset = meta_bytes(hidden);
    for (int64_t c = 0; c < num_chunks(hidden); ++c)
        offset += decode_accumulate_chunk(row, hidden, c, offset, weight, acc);
}

}  // namespace
}  // namespace moe_comm::logfmt
