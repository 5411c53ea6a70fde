#pragma once

// Block-wise FP8 (e4m3fn) quantization of a 2-D weight, one float32 scale per block (the engines' 128 x 128
// weight_block_size format; megarl/reshard/fp8_reference.py defines it). A call may write only a window of the output
// (an engine rank's TP shard): every block's scale is still computed from the whole block of the full source, so a
// block a shard boundary cuts gets on every rank the scale a single-rank quantization gives it. CPU and CUDA kernels
// side by side.

#include "fp8_block_math.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace megarl::quant {

// Quantizes source (bfloat16 or float32 [rows, cols], unit column stride) rows [row_begin, row_begin + out.size(0))
// and columns [col_begin, col_begin + out.size(1)) into `out` (float8_e4m3fn, unit column stride, the same device)
// and the scales of the blocks that window touches into `scales` (float32 [ceil((row_begin + out.size(0)) /
// block_rows) - row_begin / block_rows, the same for columns], unit column stride). `name` names the weight in
// errors. CUDA tensors: asynchronous on the current stream.
void fp8_block_quantize(const at::Tensor& source, const at::Tensor& out, const at::Tensor& scales, int64_t row_begin,
                        int64_t col_begin, int64_t block_rows, int64_t block_cols, const std::string& name = "");

// The kernels, given a checked window; `bf16` says the source's element type (else float32).
void fp8_block_quantize_cpu(const Window& w, bool bf16);

#ifdef MEGARL_WITH_CUDA
void fp8_block_quantize_cuda(const Window& w, bool bf16, int device);
#endif

}  // namespace megarl::quant
