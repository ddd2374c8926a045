// Rows between the vendors' expert-grouped layout and DeepEP's packed low-latency layout, for the
// Ascend and Cambricon backends. Ascend's MC2 dispatch (expand_x) and Cambricon's all-to-all hand back
// one [A, row] block whose rows are grouped by local expert (counts[e] rows for expert e, experts
// ascending); DeepEP's callers see [E_loc, capacity, row] with expert e's rows at [e, 0, counts[e]).
// Combine goes the other way. Host-only C++ (a CPU copy: the vendors' tensors reach it on CPU in the
// contract tests, and the NPU/MLU paths use the same offsets through torch).
//
// NOTES: no counts make these read or write out of bounds: they are checked against both shapes first.
#pragma once

#include <cstdint>
#include <string>

namespace moe_comm::cpu {

// "" when `counts` [local] fit: every count in [0, capacity] and their sum at most grouped_rows; else
// what is wrong, naming the expert and the value.
std::string check_expert_counts(const int64_t* counts, int64_t local, int64_t capacity, int64_t grouped_rows);

// packed[e, j] = grouped[offset(e) + j] for j < counts[e], offset(e) = counts[0] + ... + counts[e - 1];
// rows of packed past a count are left as they are. Throws std::invalid_argument unless the counts fit.
void grouped_to_packed(uint8_t* packed, const uint8_t* grouped, const int64_t* counts, int64_t local,
                       int64_t capacity, int64_t grouped_rows, int64_t row_bytes);

// The inverse: grouped[offset(e) + j] = packed[e, j] for j < counts[e]; grouped rows past the sum are
// left as they are. Throws std::invalid_argument unless the counts fit.
void packed_to_grouped(uint8_t* grouped, const uint8_t* packed, const int64_t* counts, int64_t local,
                       int64_t capacity, int64_t grouped_rows, int64_t row_bytes);

}  // namespace moe_comm::cpu
