// Index checks of the kernels' entry points. Each entry point runs them once per call, on the calling
// thread, before it touches memory: an exception thrown inside parallel_for's workers would call
// std::terminate. The scans are linear and branch-free until they find a bad value, so they cost
// nothing measurable next to the memory-bound kernels (bench/bench_kernels.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "check.h"

namespace moe_comm::cpu {

// Smallest and largest of index[0..n); for n == 0 (INT64_MAX, INT64_MIN), inside every range.
template <typename T>
inline void min_max(const T* index, int64_t n, int64_t* lo, int64_t* hi) {
    int64_t a = std::numeric_limits<int64_t>::max(), b = std::numeric_limits<int64_t>::min();
    for (int64_t i = 0; i < n; ++i) {
        const int64_t v = index[i];
        a = std::min(a, v);
        b = std::max(b, v);
    }
    *lo = a;
    *hi = b;
}

// "[i]" for a 1-D index array, "[i / cols, i % cols]" for a 2-D one (cols > 1 or `two_d`).
inline std::string position(int64_t i, int64_t cols, bool two_d) {
    if (!two_d) return "[" + std::to_string(i) + "]";
    return "[" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "]";
}

// Throws unless every index[i] (i < n) is in [low, high):
//   "<fn>: <arg>[pos] = <value> is outside [<low>, <high>) (<where>)"
// naming the first bad entry; `cols` > 0 makes positions 2-D ([i / cols, i % cols]).
template <typename T>
inline void check_indices(const char* fn, const char* arg, const T* index, int64_t n, int64_t cols, int64_t low,
                          int64_t high, const std::string& where) {
    int64_t lo, hi;
    min_max(index, n, &lo, &hi);
    if (lo >= low && hi < high) return;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t v = index[i];
        MC_CHECK(v >= low && v < high, fn << ": " << arg << position(i, std::max<int64_t>(cols, 1), cols > 0)
                                          << " = " << v << " is outside [" << low << ", " << high << ") (" << where
                                          << ")");
    }
}

// a * b, or INT64_MAX when that overflows (a, b >= 0): an exclusive upper bound that stays exact.
inline int64_t saturating_mul(int64_t a, int64_t b) {
    int64_t p;
    return __builtin_mul_overflow(a, b, &p) ? std::numeric_limits<int64_t>::max() : p;
}

// Throws unless bytes [offset, offset + num_elems * elem_bytes) lie inside a record of record_bytes.
inline void check_in_record(const char* fn, const char* what, int64_t offset, int64_t num_elems, int64_t elem_bytes,
                            int64_t record_bytes) {
    MC_CHECK(offset >= 0 && num_elems >= 0 && elem_bytes >= 0 &&
                 saturating_mul(num_elems, elem_bytes) <= record_bytes - offset,
             fn << ": " << what << " (" << num_elems << " x " << elem_bytes << " bytes at byte " << offset
                << ") does not fit in a record of record_bytes=" << record_bytes);
}

}  // namespace moe_comm::cpu
