// ATen side of the CUDA FP8 quantization: device guard and current stream around the torch-free launcher.

#include "fp8_block.h"
#include "fp8_block_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace megarl::quant {

void fp8_block_quantize_cuda(const Window& w, bool bf16, int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cuda::launch(w, bf16, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace megarl::quant
