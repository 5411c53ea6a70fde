#pragma once

// A segment copies num_rows rows of row_bytes bytes; each side has its own start and row stride.
// Kept free of torch headers so the CUDA kernel's translation unit can include it.

#include <cstdint>

namespace megarl::copy {

// Columns of the int64 [n, 8] table, in order.
enum Column : int64_t {
  kSrcIndex = 0,
  kSrcOffset,
  kSrcStride,
  kDstIndex,
  kDstOffset,
  kDstStride,
  kNumRows,
  kRowBytes,
  kNumColumns,
};

// A validated segment with its pointers resolved; strides and sizes are in bytes.
struct Segment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t num_rows;
  int64_t row_bytes;
  int64_t src_stride;
  int64_t dst_stride;
};

}  // namespace megarl::copy
