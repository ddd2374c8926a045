// Expert-grouped rows <-> DeepEP's packed low-latency rows (see expert_rows.h).
#include "expert_rows.h"

#include <cstring>
#include <stdexcept>

namespace moe_comm::cpu {

std::string check_expert_counts(const int64_t* counts, int64_t local, int64_t capacity, int64_t grouped_rows) {
    int64_t total = 0;
    for (int64_t e = 0; e < local; ++e) {
        if (counts[e] < 0 || counts[e] > capacity)
            return "counts[" + std::to_string(e) + "] = " + std::to_string(counts[e]) + " is outside [0, " +
                   std::to_string(capacity) + "] (rows one expert can hold)";
        total += counts[e];
    }
    if (total > grouped_rows)
        return "the counts sum to " + std::to_string(total) + ", more than the " + std::to_string(grouped_rows) +
               " grouped rows";
    return "";
}

namespace {

template <bool kToPacked>
void copy_rows(uint8_t* dst, const uint8_t* src, const int64_t* counts, int64_t local, int64_t capacity,
               int64_t grouped_rows, int64_t row_bytes, const char* fn) {
    if (local < 0 || capacity < 0 || grouped_rows < 0 || row_bytes < 0)
        throw std::invalid_argument(std::string(fn) + ": sizes must not be negative");
    const std::string wrong = check_expert_counts(counts, local, capacity, grouped_rows);
    if (!wrong.empty()) throw std::invalid_argument(std::string(fn) + ": " + wrong);
    int64_t offset = 0;
    for (int64_t e = 0; e < local; ++e) {
        const int64_t packed_at = e * capacity * row_bytes, grouped_at = offset * row_bytes;
        if (counts[e])
            std::memcpy(dst + (kToPacked ? packed_at : grouped_at), src + (kToPacked ? grouped_at : packed_at),
                        counts[e] * row_bytes);
        offset += counts[e];
    }
}

}  // namespace

void grouped_to_packed(uint8_t* packed, const uint8_t* grouped, const int64_t* counts, int64_t local,
                       int64_t capacity, int64_t grouped_rows, int64_t row_bytes) {
    copy_rows<true>(packed, grouped, counts, local, capacity, grouped_rows, row_bytes, "grouped_to_packed");
}

void packed_to_grouped(uint8_t* grouped, const uint8_t* packed, const int64_t* counts, int64_t local,
                       int64_t capacity, int64_t grouped_rows, int64_t row_bytes) {
    copy_rows<false>(grouped, packed, counts, local, capacity, grouped_rows, row_bytes, "packed_to_grouped");
}

}  // namespace moe_comm::cpu
