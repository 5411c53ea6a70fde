// CUDA kernel of block-wise FP8 quantization: one thread block per quantization block the window touches. Its warps
// read the whole block of the full source (a warp a row at a time, lanes on consecutive columns), reduce the amax over
// lanes (shuffles) and warps (shared memory), and every thread derives the same scale from it; then they write the
// block's part inside the window the same way. Not yet tuned (nor run: issue 54's GPU part). The arithmetic is fp8_block_math.h's, the CPU kernel's, in double.

#include "fp8_block_cuda.h"
#include "fp8_block_math.h"

#include <cstdint>

namespace megarl::quant::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float load(const T* p);

template <>
__device__ __forceinline__ float load<uint16_t>(const uint16_t* p) {
  return bf16_to_float(*p);
}

template <>
__device__ __forceinline__ float load<float>(const float* p) {
  return *p;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_kernel(Window w, int64_t grid_cols) {
  __shared__ float warp_amax[kThreads / kWarp];
  const T* source = static_cast<const T*>(w.source);
  const int64_t b = blockIdx.x;
  const int64_t bi = first_block_row(w) + b / grid_cols;
  const int64_t bj = first_block_col(w) + b % grid_cols;
  const int64_t r0 = bi * w.block_rows;
  const int64_t r1 = r0 + w.block_rows < w.rows ? r0 + w.block_rows : w.rows;
  const int64_t c0 = bj * w.block_cols;
  const int64_t c1 = c0 + w.block_cols < w.cols ? c0 + w.block_cols : w.cols;
  // Warp k takes rows k, k + 8, ...; its lanes consecutive columns (no 64-bit division per element).
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int lane = static_cast<int>(threadIdx.x % kWarp);

  float amax = 0.0f;
  for (int64_t r = r0 + warp; r < r1; r += kThreads / kWarp) {
    const T* row = source + r * w.source_stride;
    for (int64_t c = c0 + lane; c < c1; c += kWarp) {
      amax = max_of(amax, magnitude(load(row + c)));
    }
  }
  for (int o = kWarp / 2; o > 0; o /= 2) {
    amax = max_of(amax, __shfl_xor_sync(kFull, amax, o));
  }
  if (lane == 0) {
    warp_amax[warp] = amax;
  }
  __syncthreads();
  amax = warp_amax[0];
  for (int k = 1; k < kThreads / kWarp; ++k) {
    amax = max_of(amax, warp_amax[k]);
  }
  const float scale = block_scale(amax);
  if (threadIdx.x == 0) {
    w.scales[(bi - first_block_row(w)) * w.scale_stride + (bj - first_block_col(w))] = scale;
  }

  const int64_t wr0 = r0 > w.row_begin ? r0 : w.row_begin;
  const int64_t wr1 = r1 < w.row_begin + w.out_rows ? r1 : w.row_begin + w.out_rows;
  const int64_t wc0 = c0 > w.col_begin ? c0 : w.col_begin;
  const int64_t wc1 = c1 < w.col_begin + w.out_cols ? c1 : w.col_begin + w.out_cols;
  for (int64_t r = wr0 + warp; r < wr1; r += kThreads / kWarp) {
    const T* row = source + r * w.source_stride;
    uint8_t* out = w.out + (r - w.row_begin) * w.out_stride;
    for (int64_t c = wc0 + lane; c < wc1; c += kWarp) {
      out[c - w.col_begin] = quantize_one(load(row + c), scale);
    }
  }
}

}  // namespace

cudaError_t launch(const Window& w, bool bf16, cudaStream_t stream) {
  const int64_t grid_cols = scale_cols(w);
  const int64_t blocks = scale_rows(w) * grid_cols;
  if (blocks == 0) {
    return cudaSuccess;
  }
  if (blocks > 0x7fffffffLL) {
    return cudaErrorInvalidConfiguration;
  }
  if (bf16) {
    quantize_kernel<uint16_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, grid_cols);
  } else {
    quantize_kernel<float><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, grid_cols);
  }
  return cudaGetLastError();
}

}  // namespace megarl::quant::cuda
