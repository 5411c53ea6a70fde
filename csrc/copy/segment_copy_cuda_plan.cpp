// ATen side of the CUDA backend: device guard, current stream, the table's upload and error
// checks around the torch-free launcher in segment_copy_cuda.cu.

#include "backends.h"
#include "segment_copy_cuda.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace megarl::copy {

CudaPlan make_cuda_plan(const std::vector<Segment>& segments, c10::Device device, bool wait) {
  CudaPlan plan;
  if (segments.empty()) {
    return plan;
  }
  const c10::cuda::CUDAGuard guard(device);
  cuda::TableLayout layout;
  C10_CUDA_CHECK(
      cuda::plan_table(segments.data(), static_cast<int64_t>(segments.size()), device.index(), &layout));
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(layout.num_segments <= kMax && layout.num_chunks <= kMax, "copy_segments: ",
              layout.num_segments, " segments in ", layout.num_chunks,
              " chunks are more than one launch handles; split the table");
  // Pinned, so the upload is asynchronous and the host allocator keeps the buffer alive until the
  // upload has run.
  const at::Tensor host =
      at::empty({layout.bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  cuda::fill_table(segments.data(), layout, host.data_ptr());
  plan.table = at::empty({layout.bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  plan.table.copy_(host, /*non_blocking=*/true);
  if (wait) {
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
  }
  plan.num_segments = layout.num_segments;
  plan.num_chunks = layout.num_chunks;
  plan.grid = layout.grid;
  return plan;
}

void run_cuda_plan(const CudaPlan& plan) {
  if (plan.num_chunks == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(plan.table.device());
  C10_CUDA_CHECK(cuda::launch(plan.table.const_data_ptr(), plan.num_segments, plan.num_chunks, plan.grid,
                              c10::cuda::getCurrentCUDAStream()));
}

}  // namespace megarl::copy
