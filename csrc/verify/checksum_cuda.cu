// CUDA kernel of the hand-over checksum. Warps take tiles (up to kTile elements of one row) grid-stride; lane l
// reads elements l, l + 32, ... of a tile, so every load is coalesced, and sums them by Horner's rule with step
// r^32 from the tile's end. The tile's sum is then the lanes' sums, lane l's times r^l, times r^position of the
// tile's first element, whose 64 bits the 32 lanes share out (two each) and multiply together over the warp.
// Every lane ends with the same sums; lane 0 adds its warp's to the result with one atomic per prime.

#include "checksum_cuda.h"
#include "checksum_math.h"

#include <cstdint>

namespace megarl::verify::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
// 64 multiply-adds per lane and prime per tile, against the dozen the tile's power and reduction cost.
constexpr int64_t kTile = kWarp * 64;
constexpr unsigned kFull = 0xffffffffu;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    checksum_kernel(Block b, Powers t, int64_t tiles_per_row, int64_t num_tiles, unsigned long long* out) {
  const T* data = static_cast<const T*>(b.data);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const uint64_t step0 = t.of[0][5];  // r^32
  const uint64_t step1 = t.of[1][5];
  const uint64_t shift0 = power<0>(t, lane);
  const uint64_t shift1 = power<1>(t, lane);
  // This lane's two bits of a position select among r^(2^k) and r^(2^(k+1)), k = 2 * lane.
  const uint64_t low0 = t.of[0][2 * lane];
  const uint64_t high0 = t.of[0][2 * lane + 1];
  const uint64_t low1 = t.of[1][2 * lane];
  const uint64_t high1 = t.of[1][2 * lane + 1];
  uint64_t sum0 = 0;
  uint64_t sum1 = 0;
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  for (int64_t tile = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarp; tile < num_tiles;
       tile += warps) {
    const int64_t row = tile / tiles_per_row;
    const int64_t column = (tile - row * tiles_per_row) * kTile;
    const int64_t length = b.run - column < kTile ? b.run - column : kTile;
    const T* x = data + b.offset + row * b.row_stride + column;
    uint64_t h0 = 0;
    uint64_t h1 = 0;
    // Every lane makes the same number of steps; past the tile's end it reads nothing and adds 0.
    for (int64_t j = (length - 1) / kWarp * kWarp + lane; j >= 0; j -= kWarp) {
      const uint64_t u = j < length ? static_cast<uint64_t>(x[j]) : 0;
      h0 = multiply_add<kFold0>(h0, step0, u);
      h1 = multiply_add<kFold1>(h1, step1, u);
    }
    uint64_t s0 = multiply_add<kFold0>(h0, shift0, 0);
    uint64_t s1 = multiply_add<kFold1>(h1, shift1, 0);
    const auto position = static_cast<uint64_t>(b.first + row * b.position_stride + column);
    const uint64_t bits = (position >> (2 * lane)) & 3;
    uint64_t p0 = bits & 1 ? low0 : 1;
    uint64_t p1 = bits & 1 ? low1 : 1;
    if (bits & 2) {
      p0 = multiply_add<kFold0>(p0, high0, 0);
      p1 = multiply_add<kFold1>(p1, high1, 0);
    }
    for (int o = kWarp / 2; o > 0; o /= 2) {  // 32 sums below 2^32 stay below 2^37
      s0 += __shfl_xor_sync(kFull, s0, o);
      s1 += __shfl_xor_sync(kFull, s1, o);
      p0 = multiply_add<kFold0>(p0, __shfl_xor_sync(kFull, p0, o), 0);
      p1 = multiply_add<kFold1>(p1, __shfl_xor_sync(kFull, p1, o), 0);
    }
    sum0 = fold<kFold0>(sum0 + multiply_add<kFold0>(fold<kFold0>(s0), p0, 0));
    sum1 = fold<kFold1>(sum1 + multiply_add<kFold1>(fold<kFold1>(s1), p1, 0));
  }
  if (lane == 0) {  // every warp adds below 2^32, far from overflowing 2^64 in total
    atomicAdd(out, static_cast<unsigned long long>(sum0));
    atomicAdd(out + 1, static_cast<unsigned long long>(sum1));
  }
}

template <typename T>
cudaError_t launch_typed(const Block& block, int device, unsigned long long* out, cudaStream_t stream) {
  static const Powers powers = make_powers();
  int sms = 0;
  int blocks_per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, checksum_kernel<T>, kThreads, 0);
  }
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t tiles_per_row = (block.run + kTile - 1) / kTile;
  const int64_t num_tiles = block.num_rows * tiles_per_row;
  const int64_t wave = int64_t{sms} * (blocks_per_sm > 0 ? blocks_per_sm : 1);
  const int64_t needed = (num_tiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t grid = needed < wave ? needed : wave;
  checksum_kernel<T><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(block, powers, tiles_per_row, num_tiles,
                                                                           out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch(const Block& block, int device, unsigned long long* out, cudaStream_t stream) {
  switch (block.element_size) {
    case 1: return launch_typed<uint8_t>(block, device, out, stream);
    case 2: return launch_typed<uint16_t>(block, device, out, stream);
    default: return launch_typed<uint32_t>(block, device, out, stream);
  }
}

}  // namespace megarl::verify::cuda
