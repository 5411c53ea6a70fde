#pragma once

// The hand-over checksum (megarl/reshard/verify.py) of a block of a tensor's elements (checksum_math.h), each read
// as an unsigned integer of its size (1, 2, 4 or 8 bytes). CPU and CUDA kernels side by side.

#include "checksum_math.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace megarl::verify {

// int64 [2] on the tensor's device, each below its prime (2^32 - 5, 2^32 - 17). CUDA: asynchronous on the current
// stream. `name` (the parameter's, when known) names the tensor in errors.
at::Tensor checksum(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t num_rows, int64_t run,
                    int64_t first, int64_t position_stride, const std::string& name = "");

// Writes the block's two sums, reduced mod each prime, to out[0] and out[1]. Elements of 1, 2 or 4 bytes.
void checksum_cpu(const Block& block, int64_t* out);

#ifdef MEGARL_WITH_CUDA
// Adds the block's two sums (not reduced) to `out`, int64 [2] on the block's device, on the current stream.
void checksum_cuda(const Block& block, const at::Tensor& out);
#endif

}  // namespace megarl::verify
