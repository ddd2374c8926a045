#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "stream.h"

#include "api.h"
#include "bounds.h"
#include "check.h"
#include "parallel.h"

namespace moe_comm::cpu {
namespace {

// Copies one row of a field between strided storage and a contiguous run of bytes.
inline void copy_field(uint8_t* dst, int64_t dst_col_stride, const uint8_t* src, int64_t src_col_stride,
                       int64_t elem_bytes, int64_t num_cols, bool stream) {
    if (dst_col_stride == elem_bytes && src_col_stride == elem_bytes) {
        const auto n = static_cast<size_t>(elem_bytes * num_cols);
        if (stream && n >= kStreamRun)
            stream_copy(dst, src, n);
        else
            std::memcpy(dst, src, n);
        return;
    }
    for (int64_t c = 0; c < num_cols; ++c)
        std::memcpy(dst + c * dst_col_stride, src + c * src_col_stride, static_cast<size_t>(elem_bytes));
}

// Checks the sizes and that every segment fits in a record (pack_rows and unpack_rows); returns the
// segment with the fewest rows (the bound of every row index), or -1 when there is none.
int check_segments(const char* fn, const Segment* segments, int num_segments, int64_t num_rows,
                   int64_t record_bytes) {
    MC_CHECK(num_rows >= 0 && record_bytes >= 0 && num_segments >= 0,
             fn << ": num_rows, record_bytes and num_segments must be >= 0, got " << num_rows << ", " << record_bytes
                << ", " << num_segments);
    int fewest = -1;
    for (int s = 0; s < num_segments; ++s) {
        const Segment& seg = segments[s];
        MC_CHECK(seg.num_rows >= 0, fn << ": segment " << s << " has num_rows=" << seg.num_rows);
        check_in_record(fn, ("segment " + std::to_string(s)).c_str(), seg.offset, seg.num_cols, seg.elem_bytes,
                        record_bytes);
        if (fewest < 0 || seg.num_rows < segments[fewest].num_rows) fewest = s;
    }
    return fewest;
}

}  // namespace

void pack_rows(uint8_t* records,
               const Segment* segments, int num_segments, const int64_t* src_rows,
               int64_t num_rows, int64_t record_bytes,
               int num_threads) {
    const int fewest = check_segments("pack_rows", segments, num_segments, num_rows, record_bytes);
    if (fewest >= 0)
        check_indices("pack_rows", "src_rows", src_rows, num_rows, 0, -1, segments[fewest].num_rows,
                      "rows of segment " + std::to_string(fewest));
    const bool stream = num_rows * record_bytes >= kStreamBytes;
    parallel_for(num_rows, grain_rows(record_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            uint8_t* rec = records + i * record_bytes;
            for (int s = 0; s < num_segments; ++s) {
                const Segment& seg = segments[s];
                if (src_rows[i] < 0)
                    std::memset(rec + seg.offset, 0, static_cast<size_t>(seg.elem_bytes * seg.num_cols));
                else
                    copy_field(rec + seg.offset, seg.elem_bytes, seg.data + src_rows[i] * seg.row_stride,
                               seg.col_stride, seg.elem_bytes, seg.num_cols, stream);
            }
        }
        if (stream) stream_fence();
    });
}

void unpack_rows(const Segment* segments, int num_segments,
                 const uint8_t* records, const int64_t* dst_rows,
                 int64_t num_rows, int64_t record_bytes,
                 int num_threads) {
    const int fewest = check_segments("unpack_rows", segments, num_segments, num_rows, record_bytes);
    if (fewest >= 0 && dst_rows != nullptr)
        check_indices("unpack_rows", "dst_rows", dst_rows, num_rows, 0, 0, segments[fewest].num_rows,
                      "rows of segment " + std::to_string(fewest));
    if (fewest >= 0 && dst_rows == nullptr)
        MC_CHECK(num_rows <= segments[fewest].num_rows, "unpack_rows: num_rows = " << num_rows << " (without dst_rows) "
                                                            << "is more than the " << segments[fewest].num_rows
                                                            << " rows of segment " << fewest);
    const bool stream = num_rows * record_bytes >= kStreamBytes;
    parallel_for(num_rows, grain_rows(record_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const uint8_t* rec = records + i * record_bytes;
            const int64_t row = dst_rows == nullptr ? i : dst_rows[i];
            for (int s = 0; s < num_segments; ++s) {
                const Segment& seg = segments[s];
                copy_field(seg.data + row * seg.row_stride, seg.col_stride, rec + seg.offset, seg.elem_bytes,
                           seg.elem_bytes, seg.num_cols, stream);
            }
        }
        if (stream) stream_fence();
    });
}

}  // namespace moe_comm::cpu
