// CUDA kernel of the hand-over checksum: a grid-stride loop over the block's elements, sums kept below p per
// thread, reduced over each warp and added to the result with one atomic per warp.

#include "checksum_cuda.h"
#include "checksum_math.h"

#include <cstdint>

namespace megarl::verify::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void checksum_kernel(Block b, unsigned long long* out) {
  const T* data = static_cast<const T*>(b.data);
  const int64_t total = b.num_rows * b.run;
  uint64_t sum0 = 0;
  uint64_t sum1 = 0;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t row = b.num_rows == 1 ? 0 : e / b.run;  // one row (whole tensors): no division
    const int64_t column = e - row * b.run;
    accumulate(static_cast<int64_t>(data[b.offset + row * b.row_stride + column]),
               static_cast<uint64_t>(b.first + row * b.position_stride + column), sum0, sum1);
  }
  for (int lane = 16; lane > 0; lane /= 2) {  // 32 sums below p stay below 2^36
    sum0 += __shfl_down_sync(0xffffffffu, sum0, lane);
    sum1 += __shfl_down_sync(0xffffffffu, sum1, lane);
  }
  if (threadIdx.x % 32 == 0) {  // every warp's at most 2^36, far from overflowing 2^64 in total
    atomicAdd(out, static_cast<unsigned long long>(sum0));
    atomicAdd(out + 1, static_cast<unsigned long long>(sum1));
  }
}

template <typename T>
cudaError_t launch_typed(const Block& block, int device, unsigned long long* out, cudaStream_t stream) {
  int sms = 0;
  int blocks_per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, checksum_kernel<T>, kThreads, 0);
  }
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t total = block.num_rows * block.run;
  const int64_t wave = int64_t{sms} * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  const int64_t needed = (total + kThreads - 1) / kThreads;
  const int64_t grid = needed < wave ? needed : wave;
  checksum_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(block, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch(const Block& block, int device, unsigned long long* out, cudaStream_t stream) {
  switch (block.element_size) {
    case 1: return launch_typed<int8_t>(block, device, out, stream);
    case 2: return launch_typed<int16_t>(block, device, out, stream);
    case 4: return launch_typed<int32_t>(block, device, out, stream);
    default: return launch_typed<int64_t>(block, device, out, stream);
  }
}

}  // namespace megarl::verify::cuda
