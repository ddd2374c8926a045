// Raw-pointer C++ API of the CPU kernels behind moe_comm._C.
//
// No torch or pybind11 types appear here: callers pass data pointers, sizes and a thread count, so
// one build works with any torch version. Argument order: outputs, const inputs, sizes, knobs.
// Errors are thrown as std::invalid_argument with the offending values in the message. The enums are
// bound under their own names (moe_comm._C.DType, ...): Python passes their members, never integers.
// DType and WaitOutcome are the codes every build shares (csrc/common/codes.h).
// The shm transport's flags are in flags.h.
//
// NOTES: no input makes a kernel read or write out of bounds. Every entry point that takes an index
// checks it against the size of the memory it indexes (passed beside it, from the tensor itself),
// once per call, on the calling thread, before it touches memory; the message names the function,
// the argument, the entry and its value ("combine_reduce: send_pos[5, 1] = 1073741824 is outside
// [-1, 12) (rows of source 1)"). What the caller vouches for is the memory behind the pointers: that
// each holds the rows and strides its sizes say.
#pragma once

#include <cstdint>

#include "../common/codes.h"

namespace moe_comm::cpu {

// Element types of the float rows the kernels read and write: combine_reduce's (accumulated in fp32),
// quantize_rows' input and dequantize_rows' output; only FLOAT32, BFLOAT16 and FLOAT16 are taken.
using DType = ::moe_comm::DType;

// One field of a row record: `num_cols` elements of `elem_bytes` bytes at `data + row * row_stride
// + col * col_stride` for row in [0, num_rows), stored contiguously at byte `offset` inside each record.
struct Segment {
    uint8_t* data;
    int64_t row_stride;  // bytes between consecutive rows of the field
    int64_t col_stride;  // bytes between consecutive elements of one row
    int64_t elem_bytes;
    int64_t num_cols;
    int64_t offset;      // byte offset of the field inside a record
    int64_t num_rows;    // rows of the field's tensor: every row index must be below it
};

// What the argument checks read of `topk_idx` [num_tokens, num_topk] (moe_comm/buffer/*_args.py) in one
// pass: *lo and *hi its smallest and largest id (0, 0 when empty), and the first row (ascending) that
// picks an expert >= 0 twice: *dup_row, with *dup_expert the smallest such expert (-1, -1 when none).
void topk_summary(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t* lo, int64_t* hi,
                  int64_t* dup_row, int64_t* dup_expert);

// Routing histograms of `topk_idx` (DeepEP's get_dispatch_layout). Entries of -1 are skipped; a
// token counts once per destination rank however many of that rank's experts it picked.
//   num_tokens_per_rank[r]   = #{t : some k has topk_idx[t,k] / (num_experts/num_ranks) == r}
//   num_tokens_per_expert[e] = #{(t, k) : topk_idx[t,k] == e}
//   is_token_in_rank[t * num_ranks + r] = token t goes to rank r
// Checks: num_experts a positive multiple of num_ranks, num_tokens and num_topk >= 0, and every id in
// [-1, num_experts) (an id outside is never used as an index; the counts are not written and
// is_token_in_rank is unspecified when one is found).
void dispatch_layout(int32_t* num_tokens_per_rank, int32_t* num_tokens_per_expert, bool* is_token_in_rank,
                     const int64_t* topk_idx,
                     int64_t num_tokens, int64_t num_topk, int64_t num_ranks, int64_t num_experts,
                     int num_threads);

// Gathers source rows into records: record i (at records + i * record_bytes) receives, for every
// segment, row src_rows[i] of that segment's field, or zeros where src_rows[i] == -1.
// Checks: every src_rows[i] in [-1, segment.num_rows) for every segment, and every segment inside a record.
void pack_rows(uint8_t* records,
               const Segment* segments, int num_segments, const int64_t* src_rows,
               int64_t num_rows, int64_t record_bytes,
               int num_threads);

// Scatters records into fields: row dst_rows[i] (row i when dst_rows is null) of every segment's
// field receives its bytes of record i. Destination rows must be distinct.
// Checks: every dst_rows[i] in [0, segment.num_rows) for every segment (without dst_rows: num_rows <=
// every segment's num_rows), and every segment inside a record.
void unpack_rows(const Segment* segments, int num_segments,
                 const uint8_t* records, const int64_t* dst_rows,
                 int64_t num_rows, int64_t record_bytes,
                 int num_threads);

// Combine reduction, in a fixed order so results are bitwise reproducible:
//   acc = 0; for j in 0..num_sources-1: if send_pos[t, j] >= 0: acc += scale[t, j] * x(record send_pos[t, j] of source j)
//   out[t] = dtype(acc + bias0[t] + bias1[t])        (each bias optional, fp32 adds)
// A source j is a rank (normal mode) or a top-k slot (low-latency mode); its source_rows[j] records
// start at sources[j] and are record_bytes apart. Without `scale` (null) rows are added unscaled. x is
// `hidden` elements of `dtype` at byte `x_offset` of each record. When out_weights is non-null it
// receives the unscaled sum (no bias) of the `num_topk` fp32 weights at `weights_offset`. The
// multiply and the add are separate roundings (no FMA).
// Checks: every send_pos[t, j] in [-1, source_rows[j]), and x (and the weights, when read) inside a record.
void combine_reduce(void* out, float* out_weights,
                    const uint8_t* const* sources, const int64_t* source_rows, const int32_t* send_pos,
                    const float* scale,
                    const void* bias0, const void* bias1,
                    int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                    int64_t record_bytes, int64_t x_offset, int64_t weights_offset, int64_t num_topk,
                    int num_threads);

// Which build of combine_reduce this CPU runs: "avx2" or "generic". Tests force the generic build
// with set_combine_reduce_generic(true) to check that both give the same bits.
const char* combine_reduce_isa();
void set_combine_reduce_generic(bool generic);

// Formats of quantize_rows: FP8 E4M3 / E5M2 with one scale per 128 channels, or INT8 with one per row.
enum class QuantFormat { kE4M3, kE5M2, kInt8 };

// Per-token quantization of rows, optionally gathered (moe_comm/ops/quant.py and fp8.py give the formulas
// and the torch references it matches bit for bit). Output row r is input row source[r] / source_div
// (row r when source is null; a zero row where source[r] < 0) of `x` [*, hidden] in `in_dtype`, cast:
//   FP8:  per 128-channel group g, amax = max(1e-4, max |x_g|) (NaN propagates); scale = q_max / amax and
//         scale_inv = amax * (1 / q_max), or with round_scale the powers of two 2^-e and 2^e,
//         e = ceil(log2(amax / q_max)); out = fp8(x_g * scale) rounded as torch rounds (nearest even;
//         E4M3 saturates at +-448, E5M2 overflows to Inf, NaN stays NaN); scales [rows, hidden / 128]
//         fp32 scale_inv, or with ue8m0 one exponent byte of scale_inv per group ([rows, hidden / 128] bytes).
//   INT8: amax over the row, s = 127 / amax, out = clamp(rne(x * s), -127, 127), scales [rows] fp32 1 / s.
// hidden must be a multiple of 128 for FP8. `x` has x_rows rows.
// Checks: every source[r] in [-1, x_rows * source_div), so source[r] / source_div < x_rows (without
// source: num_rows <= x_rows); source_div > 0.
void quantize_rows(uint8_t* out, uint8_t* scales,
                   const void* x, const int64_t* source,
                   int64_t num_rows, int64_t x_rows, int64_t hidden, int64_t source_div, DType in_dtype,
                   QuantFormat format, bool round_scale, bool ue8m0, int num_threads);

// The inverse: out[r] (out_dtype) = code * scale in fp32, rounded to nearest even, for `q` [rows, hidden]
// codes and `scales` laid out as quantize_rows writes them.
void dequantize_rows(void* out, const uint8_t* q, const uint8_t* scales,
                     int64_t num_rows, int64_t hidden, DType out_dtype, QuantFormat format, bool ue8m0,
                     int num_threads);

// Builds of quantize_rows and dequantize_rows, in order: a cap admits every level up to it.
enum class IsaLevel { kGeneric, kAvx2, kAvx512 };

// Which build of quantize_rows and dequantize_rows this CPU runs: "avx512", "avx2" or "generic" (same
// bits): the best it supports up to the cap, which tests lower to run each build (kAvx512 by default).
// Checks: cap is a member of IsaLevel.
const char* quantize_rows_isa();
void set_quantize_rows_isa_cap(IsaLevel cap);

// Low-latency send order: the (token, k) messages of topk_idx [num_tokens, num_topk] with an expert
// (-1 skipped), sorted by expert id, then by t * num_topk + k (a stable counting sort). Writes msg[i]
// = t * num_topk + k and experts[i] for each message i, send_counts[r] = messages to rank
// r = expert / (num_experts / num_ranks); returns the number of messages.
// Checks: num_experts a non-negative multiple of num_ranks, and every id in [-1, num_experts).
int64_t low_latency_send_order(int64_t* msg, int64_t* experts, int64_t* send_counts,
                               const int64_t* topk_idx,
                               int64_t num_tokens, int64_t num_topk, int64_t num_experts, int64_t num_ranks);

// Rows a low-latency combine returns, in send order: for each source rank s, each local expert e,
// rows [begin, begin + count) of e (layout_range[e * num_ranks + s] = begin << 32 | count) as flat
// row indices e * rows_per_expert + row. Returns the number of rows written to `rows`, which has room
// for max_rows. Checks (before writing): every range has begin >= 0 and begin + count <=
// rows_per_expert, and the counts sum to at most max_rows (overlapping ranges could exceed it).
int64_t low_latency_combine_rows(int64_t* rows,
                                 const int64_t* layout_range,
                                 int64_t num_local_experts, int64_t num_ranks, int64_t rows_per_expert,
                                 int64_t max_rows);

// Where a low-latency combine finds each of its messages' returned row: the j-th message of
// low_latency_send_order's order sent to rank d (experts[i] / num_local_experts == d) comes back as
// row firsts[d] + j of the received records, so pos[msg[i]] = that row; pos[m] = -1 for a slot m that
// sent nothing. pos has num_slots (= T * K) entries. Checks (before writing): every msg[i] in
// [0, num_slots), every expert in [0, num_local_experts * num_ranks), every firsts[d] >= 0 and the
// rows inside int32.
void low_latency_positions(int32_t* pos, int64_t num_slots, const int64_t* msg, const int64_t* experts, int64_t n,
                           int64_t num_local_experts, int64_t num_ranks, const int64_t* firsts);

// Low-latency receive. The records of one low-latency dispatch arrive grouped by source rank
// (recv_counts[s] records from rank s), each source's records ordered by local expert, then token.
// Record j of block (s, e) lands at row r = begin[e, s] + j of local expert e, where begin[e, s] is
// the number of records for expert e from ranks before s (blocks by source rank ascending):
//   recv_x   + (e * rows_per_expert + r) * x_bytes        <- x_bytes at x_offset
//   scales   + e * scales_expert_stride + r * scales_row_stride + c * scales_col_stride
//                                                           <- num_scales elements of scale_bytes
//                                                              at scales_offset (skipped if null)
//   src_info[e * rows_per_expert + r]                      <- the int32 at src_offset
//   recv_count[e] = sum over s of count[e, s];  layout_range[e * num_ranks + s] = begin << 32 | count
// The int32 at expert_offset is the record's local expert. Rows past recv_count[e] are padding: x and
// scales zero, src_info -1 (every output byte is written, so the outputs may be recycled memory).
// `records` holds num_records records: source s's recv_counts[s] records follow one another from record
// firsts[s], or, with firsts null, right after source s - 1's (from record 0). Checks (before writing
// anything but the outputs' counts): every source's records inside [0, num_records) (with firsts null:
// recv_counts sum to num_records), every field inside a record, every record's expert in
// [0, num_local_experts), and no expert receiving more than rows_per_expert records. With `padded` the
// outputs already hold padding past their recv_count (a prepared call's buffer half, which an earlier call
// filled): only the rows that call filled and this one does not are cleared (outputs untouched by a failed
// check, so that stays true).
void low_latency_unpack(uint8_t* recv_x, uint8_t* scales, int32_t* src_info, int32_t* recv_count,
                        int64_t* layout_range,
                        const uint8_t* records, const int64_t* recv_counts, const int64_t* firsts,
                        int64_t num_records, int64_t num_ranks, int64_t num_local_experts, int64_t rows_per_expert,
                        int64_t record_bytes, int64_t x_offset, int64_t x_bytes,
                        int64_t scales_offset, int64_t num_scales, int64_t scale_bytes,
                        int64_t scales_expert_stride, int64_t scales_row_stride, int64_t scales_col_stride,
                        int64_t src_offset, int64_t expert_offset,
                        int num_threads, bool padded = false);

// Routing digests of the handshake (moe_comm/handshake.py: digests_reference is the specification).
// Keys are int32 (key_bytes 4, sign-extended) or int64; block b holds the next counts[b] keys and
//   out[b] = (sum over j < counts[b] of mix(mix(key_j) + j) mod 2^64) >> 2,   mix = splitmix64's finalizer.
// Checks: counts >= 0 summing to num_keys.
void block_digests(int64_t* out, const void* keys, int key_bytes, const int64_t* counts, int64_t num_blocks,
                   int64_t num_keys);

// One pass over a normal handle's is_token_in_rank [T, R] and send_head [T, R]: counts[r] = tokens sent
// to rank r, digests[r] = block digest of those tokens (ascending), and the flat index of the first
// entry of send_head that is not the send position of is_token_in_rank (destination-major, then token;
// -1 where not sent), or -1 when every entry is.
int64_t send_order_check(int64_t* counts, int64_t* digests, const bool* is_token_in_rank, const int32_t* send_head,
                         int64_t num_tokens, int64_t num_ranks);

// The routing digests of a low-latency combine, as both sides see it (block_digests' formula):
//   returned[s] over keys e << 32 | src_info[e, row] of the rows this rank returns to source s, in
//               low_latency_combine_rows' order (layout_range [E_loc, R] blocks; rows_per_expert rows each);
//   asked[d]    over keys (experts[i] % E_loc) << 32 | msg[i] / num_topk of the messages this rank sent
//               to rank d in low_latency_send_order's order (send_counts[d] of them).
// Checks: every layout_range block inside [0, rows_per_expert).
void low_latency_combine_digests(int64_t* returned, int64_t* asked, const int64_t* layout_range,
                                 const int32_t* src_info, const int64_t* msg, const int64_t* experts,
                                 const int64_t* send_counts, int64_t num_local_experts, int64_t num_ranks,
                                 int64_t rows_per_expert, int64_t num_topk);

// The flat index of the first entry of a low-latency handle's layout_range [E_loc, R] that is not a
// block where the one of the previous source rank ends (the first at 0), inside [0, rows_per_expert);
// -1 when every one is.
int64_t low_latency_layout_check(const int64_t* layout_range, int64_t num_local_experts, int64_t num_ranks,
                                 int64_t rows_per_expert);

// LogFMT-10 rows, DeepEP's 10-bit combine format: csrc/common/logfmt.h holds the format and the formula,
// moe_comm/ops/logfmt.py its torch reference. hidden must be a positive multiple of 128 (checked).
// Bytes of one row's slot: 2 * hidden + 4 * hidden / 128 (every chunk raw; cast chunks take less).
int64_t logfmt_row_bytes(int64_t hidden);

// Encodes row r of x (hidden bf16 at x + r * x_stride elements) into the logfmt_row_bytes(hidden)
// bytes at out + r * out_stride; the bytes past the row's encoded length are zeroed.
void logfmt_encode_rows(uint8_t* out, const uint16_t* x,
                        int64_t num_rows, int64_t hidden, int64_t out_stride, int64_t x_stride, int num_threads);

// Decodes: out[r * hidden + i] = 0 + decoded_i * 1 (fp32) for the row at enc + r * enc_stride. Any bytes
// decode (to some values) without a read outside the row's logfmt_row_bytes(hidden).
void logfmt_decode_rows(float* out, const uint8_t* enc,
                        int64_t num_rows, int64_t hidden, int64_t enc_stride, int num_threads);

// combine_reduce over LogFMT rows (DeepEP's use_logfmt combine), in the same fixed order:
//   acc = 0; for j in 0..num_sources-1: if send_pos[t, j] >= 0:
//       acc += decoded(record send_pos[t, j] of source j) * scale[t, j]
//   out[t] = dtype(acc + bias0[t] + bias1[t])        (each bias optional, fp32 adds)
// where each record holds a LogFMT row of `hidden` channels (logfmt_row_bytes(hidden) bytes) at byte
// x_offset, decoded straight into the accumulation (logfmt::decode_accumulate_row); without `scale`
// the weight is 1 (the same bits as an unscaled add). Multiply, then add: no FMA.
// Checks: hidden a positive multiple of 128, every send_pos[t, j] in [-1, source_rows[j]), and the
// row inside a record.
void combine_reduce_logfmt(void* out,
                           const uint8_t* const* sources, const int64_t* source_rows, const int32_t* send_pos,
                           const float* scale, const void* bias0, const void* bias1,
                           int64_t num_tokens, int64_t num_sources, int64_t hidden, DType dtype,
                           int64_t record_bytes, int64_t x_offset, int num_threads);

// Number of hardware threads, the default for num_threads.
int hardware_threads();

}  // namespace moe_comm::cpu
