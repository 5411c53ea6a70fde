#pragma once

// The hand-over checksum (megarl/reshard/verify.py) of a block of a tensor's elements (checksum_math.h),
// read as signed integers of their size (1, 2, 4 or 8 bytes). CPU and CUDA kernels side by side.

#include "checksum_math.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace megarl::verify {

// int64 [2] on the tensor's device, each in [0, 2^31 - 1). CUDA: asynchronous on the current stream.
at::Tensor checksum(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t num_rows, int64_t run,
                    int64_t first, int64_t position_stride);

// Writes the block's two sums, reduced mod p, to out[0] and out[1].
void checksum_cpu(const Block& block, int64_t* out);

#ifdef MEGARL_WITH_CUDA
// Adds the block's two sums (not reduced) to `out`, int64 [2] on the block's device, on the current stream.
void checksum_cuda(const Block& block, const at::Tensor& out);
#endif

}  // namespace megarl::verify
