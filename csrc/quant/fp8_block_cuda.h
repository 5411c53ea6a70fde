#pragma once

// Host interface of fp8_block_cuda.cu in plain CUDA runtime types (no torch headers, as csrc/copy's).

#include "fp8_block_math.h"

#include <cuda_runtime.h>

namespace megarl::quant::cuda {

// Quantizes the window (all pointers on the current device) on `stream`; `bf16` says the source's element type.
cudaError_t launch(const Window& w, bool bf16, cudaStream_t stream);

}  // namespace megarl::quant::cuda
