// ATen side of the CUDA checksum: device guard and current stream around the torch-free launcher.

#include "checksum.h"
#include "checksum_cuda.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace megarl::verify {

void checksum_cuda(const Block& block, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(cuda::launch(block, out.device().index(),
                              reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()),
                              c10::cuda::getCurrentCUDAStream()));
}

}  // namespace megarl::verify
