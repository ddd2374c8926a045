// LogFMT-10 rows on the CPU (api.h: logfmt_row_bytes, logfmt_encode_rows, logfmt_decode_rows): the
// row functions of csrc/common/logfmt.h, one row per iteration, rows split over threads.
#include <algorithm>
#include <cstring>

#include "api.h"
#include "check.h"
#include "parallel.h"
#include "../common/logfmt.h"

namespace moe_comm::cpu {

int64_t logfmt_row_bytes(int64_t hidden) {
    MC_CHECK(logfmt::valid_hidden(hidden),
             "logfmt: hidden must be a positive multiple of " << logfmt::kGroup << ", got " << hidden);
    return logfmt::max_row_bytes(hidden);
}

void logfmt_encode_rows(uint8_t* out, const uint16_t* x,
                        int64_t num_rows, int64_t hidden, int64_t out_stride, int64_t x_stride, int num_threads) {
    const int64_t row_bytes = logfmt_row_bytes(hidden);
    MC_CHECK(num_rows >= 0 && out_stride >= row_bytes && x_stride >= hidden,
             "logfmt_encode_rows: need num_rows >= 0, out_stride >= " << row_bytes << " and x_stride >= " << hidden
                                                                      << ", got " << num_rows << ", " << out_stride
                                                                      << ", " << x_stride);
    parallel_for(num_rows, grain_rows(row_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            uint8_t* row = out + r * out_stride;
            const int64_t used = logfmt::encode_row(row, x + r * x_stride, hidden);
            std::memset(row + used, 0, static_cast<size_t>(row_bytes - used));
        }
    });
}

void logfmt_decode_rows(float* out, const uint8_t* enc,
                        int64_t num_rows, int64_t hidden, int64_t enc_stride, int num_threads) {
    const int64_t row_bytes = logfmt_row_bytes(hidden);
    MC_CHECK(num_rows >= 0 && enc_stride >= row_bytes,
             "logfmt_decode_rows: need num_rows >= 0 and enc_stride >= " << row_bytes << ", got " << num_rows << ", "
                                                                         << enc_stride);
    parallel_for(num_rows, grain_rows(row_bytes), num_threads, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float* acc = out + r * hidden;
            std::fill(acc, acc + hidden, 0.0f);
            logfmt::decode_accumulate_row(enc + r * enc_stride, hidden, 1.0f, acc);
        }
    });
}

}  // namespace moe_comm::cpu
