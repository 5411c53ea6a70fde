#pragma once

// Host interface of checksum_cuda.cu in plain CUDA runtime types (no torch headers, as csrc/copy's).

#include "checksum_math.h"

#include <cuda_runtime.h>

namespace megarl::verify::cuda {

// Adds the block's two sums (each below 2^32, not yet reduced mod its prime) to `out` (device, zeroed) on `stream`.
cudaError_t launch(const Block& block, int device, unsigned long long* out, cudaStream_t stream);

}  // namespace megarl::verify::cuda
