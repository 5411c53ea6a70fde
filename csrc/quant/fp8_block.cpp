// Front end of block-wise FP8 quantization: checks the tensors and the window, then runs the CPU or CUDA kernel.

#include "fp8_block.h"

#include "storage.h"

#include <c10/util/Exception.h>

#include <string>

namespace megarl::quant {
namespace {

// A 2-D tensor whose rows are contiguous runs (column stride 1), as the kernels address it.
void check_matrix(const at::Tensor& t, const char* arg, const std::string& what) {
  TORCH_CHECK(t.defined(), what, ": `", arg, "` is undefined");
  TORCH_CHECK(t.dim() == 2, what, ": `", arg, "` must be 2-D, not of shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, what, ": `", arg, "` must have contiguous rows (column stride 1, ",
              "e.g. a row slice or narrow(0, ...) of a contiguous tensor), not strides ", t.strides());
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1), what, ": `", arg, "` has rows that overlap (strides ",
              t.strides(), " for shape ", t.sizes(), ")");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what, ": `", arg, "` is on ", t.device(),
              ", not supported (CPU or CUDA)");
  TORCH_CHECK(holds_memory(t), what, ": `", arg, "` has no memory behind it: its storage holds ", t.storage().nbytes(),
              " bytes (offloaded with storage resize_(0)?); bring it back first");
}

}  // namespace

void fp8_block_quantize(const at::Tensor& source, const at::Tensor& out, const at::Tensor& scales, int64_t row_begin,
                        int64_t col_begin, int64_t block_rows, int64_t block_cols, const std::string& name) {
  const std::string what = name.empty() ? std::string("fp8_block_quantize") : "fp8_block_quantize(`" + name + "`)";
  check_matrix(source, "source", what);
  check_matrix(out, "out", what);
  check_matrix(scales, "scales", what);
  TORCH_CHECK(source.scalar_type() == at::kBFloat16 || source.scalar_type() == at::kFloat, what,
              ": `source` must be bfloat16 or float32, not ", source.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn, what, ": `out` must be float8_e4m3fn, not ",
              out.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, what, ": `scales` must be float32, not ", scales.scalar_type());
  TORCH_CHECK(out.device() == source.device() && scales.device() == source.device(), what,
              ": `source`, `out` and `scales` must be on one device, not ", source.device(), ", ", out.device(),
              " and ", scales.device());
  TORCH_CHECK(block_rows >= 1 && block_cols >= 1, what, ": `block_rows` and `block_cols` must be >= 1, not ",
              block_rows, " and ", block_cols);
  const int64_t rows = source.size(0);
  const int64_t cols = source.size(1);
  TORCH_CHECK(row_begin >= 0 && row_begin <= rows - out.size(0), what, ": `out`'s ", out.size(0),
              " rows from `row_begin` ", row_begin, " do not fit the source's ", rows, " rows");
  TORCH_CHECK(col_begin >= 0 && col_begin <= cols - out.size(1), what, ": `out`'s ", out.size(1),
              " columns from `col_begin` ", col_begin, " do not fit the source's ", cols, " columns");
  Window w{source.const_data_ptr(), rows, cols, source.stride(0), static_cast<uint8_t*>(out.data_ptr()),
           out.stride(0), scales.data_ptr<float>(), scales.stride(0), row_begin, col_begin, out.size(0), out.size(1),
           block_rows, block_cols};
  if (w.out_rows == 0 || w.out_cols == 0) {
    TORCH_CHECK(scales.numel() == 0, what, ": `out` is empty, so `scales` must be too, not of shape ", scales.sizes());
    return;
  }
  TORCH_CHECK(scales.size(0) == scale_rows(w) && scales.size(1) == scale_cols(w), what, ": `scales` must be [",
              scale_rows(w), ", ", scale_cols(w), "] (the ", block_rows, " x ", block_cols,
              " blocks that rows [", row_begin, ", ", row_begin + w.out_rows, ") and columns [", col_begin, ", ",
              col_begin + w.out_cols, ") touch), not ", scales.sizes());
  const bool bf16 = source.scalar_type() == at::kBFloat16;
  if (source.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    fp8_block_quantize_cuda(w, bf16, source.device().index());
    return;
#else
    TORCH_CHECK(false, what, ": this build of megarl._C has no CUDA kernels (rebuild on a GPU machine)");
#endif
  }
  fp8_block_quantize_cpu(w, bf16);
}

}  // namespace megarl::quant
