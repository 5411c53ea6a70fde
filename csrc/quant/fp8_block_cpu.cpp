// CPU kernel of block-wise FP8 quantization: the blocks the window touches spread over threads (at::parallel_for);
// each reads its whole block of the source for the amax, then writes the part of it inside the window.

#include "fp8_block.h"
#include "fp8_block_math.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace megarl::quant {
namespace {

template <typename T>
float load(const T* p);

template <>
float load<uint16_t>(const uint16_t* p) {
  return bf16_to_float(*p);
}

template <>
float load<float>(const float* p) {
  return *p;
}

template <typename T>
void quantize_blocks(const Window& w) {
  const T* source = static_cast<const T*>(w.source);
  const int64_t bi0 = first_block_row(w);
  const int64_t bj0 = first_block_col(w);
  const int64_t grid_cols = scale_cols(w);
  at::parallel_for(0, scale_rows(w) * grid_cols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t bi = bi0 + b / grid_cols;
      const int64_t bj = bj0 + b % grid_cols;
      // The whole block of the full source.
      const int64_t r0 = bi * w.block_rows;
      const int64_t r1 = std::min(r0 + w.block_rows, w.rows);
      const int64_t c0 = bj * w.block_cols;
      const int64_t c1 = std::min(c0 + w.block_cols, w.cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = source + r * w.source_stride;
        for (int64_t c = c0; c < c1; ++c) {
          amax = max_of(amax, magnitude(load(row + c)));
        }
      }
      const float scale = block_scale(amax);
      w.scales[(bi - bi0) * w.scale_stride + (bj - bj0)] = scale;
      // Its part inside the window.
      const int64_t wr0 = std::max(r0, w.row_begin);
      const int64_t wr1 = std::min(r1, w.row_begin + w.out_rows);
      const int64_t wc0 = std::max(c0, w.col_begin);
      const int64_t wc1 = std::min(c1, w.col_begin + w.out_cols);
      for (int64_t r = wr0; r < wr1; ++r) {
        const T* row = source + r * w.source_stride;
        uint8_t* out = w.out + (r - w.row_begin) * w.out_stride;
        for (int64_t c = wc0; c < wc1; ++c) {
          out[c - w.col_begin] = quantize_one(load(row + c), scale);
        }
      }
    }
  });
}

}  // namespace

void fp8_block_quantize_cpu(const Window& w, bool bf16) {
  if (bf16) {
    quantize_blocks<uint16_t>(w);
  } else {
    quantize_blocks<float>(w);
  }
}

}  // namespace megarl::quant
