// Front end of the hand-over checksum: validates the block against the tensor, then runs the CPU or CUDA kernel.

#include "checksum.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

namespace megarl::verify {

at::Tensor checksum(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t num_rows, int64_t run,
                    int64_t first, int64_t position_stride) {
  TORCH_CHECK(t.defined() && t.is_contiguous(), "checksum: pass a defined, contiguous tensor");
  const int64_t size = t.element_size();
  TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8, "checksum: ", size, "-byte elements");
  TORCH_CHECK(offset >= 0 && row_stride >= 0 && num_rows >= 0 && run >= 0 && first >= 0 && position_stride >= 0,
              "checksum: offsets, strides and counts must be >= 0");
  TORCH_CHECK(num_rows == 0 || run == 0 || offset + (num_rows - 1) * row_stride + run <= t.numel(),
              "checksum: ", num_rows, " rows of ", run, " elements from element ", offset, " at stride ",
              row_stride, " run past the tensor's ", t.numel(), " elements");
  const Block block{t.data_ptr(), size, offset, row_stride, num_rows, run, first, position_stride};
  at::Tensor out = at::zeros({2}, t.options().dtype(at::kLong));
  if (num_rows == 0 || run == 0) {
    return out;
  }
  if (t.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    checksum_cuda(block, out);
    return out.remainder_(static_cast<int64_t>(kPrime));
#else
    TORCH_CHECK(false, "checksum: this build of megarl._C has no CUDA kernels (rebuild on a GPU machine)");
#endif
  }
  TORCH_CHECK(t.device().is_cpu(), "checksum: tensors on ", t.device(), " are not supported");
  checksum_cpu(block, out.data_ptr<int64_t>());
  return out;
}

}  // namespace megarl::verify
