// Front end of the hand-over checksum: validates the block against the tensor, then runs the CPU or CUDA kernel.

#include "checksum.h"

#include "storage.h"

#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <string>

namespace megarl::verify {
namespace {

// start + (rows - 1) * stride + run in *end, or false where int64 overflows: wrapped bounds would pass the check
// below and the kernel would read outside the tensor.
bool last_end(int64_t start, int64_t stride, int64_t rows, int64_t run, int64_t* end) {
  int64_t span = 0;
  return !c10::mul_overflows(rows - 1, stride, &span) && !c10::add_overflows(span, run, &span) &&
         !c10::add_overflows(start, span, end);
}

// An 8-byte element enters as its two 4-byte halves, low half first, at positions 2i and 2i + 1: every element
// is then below 2^32 and hashes injectively.
Block as_halves(const Block& b) {
  return {b.data, 4, 2 * b.offset, 2 * b.row_stride, b.num_rows, 2 * b.run, 2 * b.first, 2 * b.position_stride};
}

}  // namespace

at::Tensor checksum(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t num_rows, int64_t run,
                    int64_t first, int64_t position_stride, const std::string& name) {
  const std::string what = name.empty() ? std::string("checksum: the tensor") : "checksum: tensor `" + name + "`";
  TORCH_CHECK(t.defined() && t.is_contiguous(), what, " must be defined and contiguous");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what, " is on ", t.device(), ", not supported");
  const int64_t size = t.element_size();
  TORCH_CHECK(size == 1 || size == 2 || size == 4 || size == 8, what, " has ", size, "-byte elements");
  TORCH_CHECK(offset >= 0 && row_stride >= 0 && num_rows >= 0 && run >= 0 && first >= 0 && position_stride >= 0,
              "checksum: offsets, strides and counts must be >= 0");
  TORCH_CHECK(holds_memory(t), what, " has no memory behind it: its storage holds ", t.storage().nbytes(),
              " bytes, fewer than its ", t.nbytes(), " (offloaded with storage resize_(0)?); bring it back first");
  at::Tensor out = at::zeros({2}, t.options().dtype(at::kLong));
  if (num_rows == 0 || run == 0) {
    return out;
  }
  int64_t end = 0;
  TORCH_CHECK(last_end(offset, row_stride, num_rows, run, &end) && end <= t.numel(), "checksum: ", num_rows,
              " rows of ", run, " elements from element ", offset, " at stride ", row_stride, " run past the ",
              t.numel(), " elements of ", name.empty() ? std::string("the tensor") : "`" + name + "`");
  // Offsets within the tensor double safely for 8-byte elements (its bytes fit int64); positions need not.
  int64_t last = 0;
  TORCH_CHECK(last_end(first, position_stride, num_rows, run, &last) && !c10::mul_overflows(last, int64_t{2}, &last),
              "checksum: positions from ", first, " at stride ", position_stride, " over ", num_rows, " rows of ",
              run, " overflow int64");
  const Block elements{t.const_data_ptr(), size, offset, row_stride, num_rows, run, first, position_stride};
  const Block block = size == 8 ? as_halves(elements) : elements;
  if (t.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    checksum_cuda(block, out);
    // The kernel adds up its warps' sums unreduced; each prime reduces its own.
    out.narrow(0, 0, 1).remainder_(static_cast<int64_t>(kPrime0));
    out.narrow(0, 1, 1).remainder_(static_cast<int64_t>(kPrime1));
    return out;
#else
    TORCH_CHECK(false, "checksum: this build of megarl._C has no CUDA kernels (rebuild on a GPU machine)");
#endif
  }
  checksum_cpu(block, out.data_ptr<int64_t>());
  return out;
}

}  // namespace megarl::verify
