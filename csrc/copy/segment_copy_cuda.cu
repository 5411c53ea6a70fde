// CUDA backend: one launch copies every segment. Segments are cut into chunks of similar size
// (chunking.h) and numbered globally. Every warp walks the chunks grid-stride; a table made on
// the host maps each chunk to its segment, so a chunk costs two dependent loads before its data,
// and a few huge segments and many tiny ones balance across the same warps. Warps rather than
// blocks take chunks because tiny segments leave most of a block idle.

#include "segment_copy_cuda.h"

#include "chunking.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace megarl::copy::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
// Enough chunks per resident warp that the last wave is short; no chunk larger than
// kMaxChunkUnits single bytes, so SmallDivider's precondition holds.
constexpr int64_t kMinChunkBytes = int64_t{2} << 10;
constexpr int64_t kMaxChunkBytes = int64_t{32} << 10;
constexpr int64_t kChunksPerWarp = 4;
static_assert(kMaxChunkBytes <= kMaxChunkUnits, "chunks must fit SmallDivider");

struct SegmentDesc {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_stride;
  int64_t dst_stride;
  ChunkGeometry geometry;    // in units of vec_bytes
  SmallDivider row_divider;  // by geometry.row_units; used only by grouped chunks
  int64_t first_chunk;
  int64_t vec_bytes;
};

template <typename T>
struct ElementPtrs {
  const T* src;
  T* dst;
};

// Loads each lane has in flight before its first store. Four 16-byte loads per lane reached
// 3.9 TB/s (read + write) on an H200; more unrolling costs registers, and the narrow paths
// share this kernel's register budget with the 16-byte one.
constexpr int kUnroll = 4;

// The warp copies n elements of T (n <= 2^16); locate(i) gives element i's two addresses.
template <typename T, typename Locate>
__device__ __forceinline__ void copy_elements(uint32_t n, uint32_t lane, Locate locate) {
  for (uint32_t base = 0; base < n; base += kWarp * kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * kWarp + lane;
      if (i < n) {
        v[u] = *locate(i).src;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * kWarp + lane;
      if (i < n) {
        *locate(i).dst = v[u];
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void copy_rect(const SegmentDesc& d, const ChunkRect& r, uint32_t lane) {
  const uint8_t* src = d.src + r.row_begin * d.src_stride;
  uint8_t* dst = d.dst + r.row_begin * d.dst_stride;
  if (r.num_rows == 1) {
    const T* s = reinterpret_cast<const T*>(src) + r.col_begin;
    T* t = reinterpret_cast<T*>(dst) + r.col_begin;
    copy_elements<T>(static_cast<uint32_t>(r.num_cols), lane,
                     [=](uint32_t i) { return ElementPtrs<T>{s + i, t + i}; });
    return;
  }
  const uint32_t cols = static_cast<uint32_t>(r.num_cols);
  const SmallDivider divider = d.row_divider;
  const int64_t src_stride = d.src_stride;
  const int64_t dst_stride = d.dst_stride;
  copy_elements<T>(static_cast<uint32_t>(r.num_rows) * cols, lane, [=](uint32_t i) {
    const uint32_t row = divider.div(i);
    const uint32_t col = i - row * cols;
    return ElementPtrs<T>{reinterpret_cast<const T*>(src + row * src_stride) + col,
                          reinterpret_cast<T*>(dst + row * dst_stride) + col};
  });
}

__global__ void __launch_bounds__(kThreads)
    segment_copy_kernel(const SegmentDesc* __restrict__ descs, const int32_t* __restrict__ chunk_segment,
                        int64_t num_chunks) {
  const uint32_t lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t{gridDim.x} * kWarpsPerBlock;
  for (int64_t chunk = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarp; chunk < num_chunks;
       chunk += warps) {
    const SegmentDesc d = descs[chunk_segment[chunk]];
    const ChunkRect r = chunk_rect(d.geometry, chunk - d.first_chunk);
    switch (d.vec_bytes) {
      case 16:
        copy_rect<uint4>(d, r, lane);
        break;
      case 8:
        copy_rect<uint2>(d, r, lane);
        break;
      case 4:
        copy_rect<uint32_t>(d, r, lane);
        break;
      case 2:
        copy_rect<uint16_t>(d, r, lane);
        break;
      default:
        copy_rect<uint8_t>(d, r, lane);
    }
  }
}

// The widest access every address of the segment is aligned to.
int64_t vector_bytes(const Segment& s) {
  uint64_t bits = reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) |
                  static_cast<uint64_t>(s.row_bytes);
  if (s.num_rows > 1) {
    bits |= static_cast<uint64_t>(s.src_stride) | static_cast<uint64_t>(s.dst_stride);
  }
  for (const int64_t v : {16, 8, 4, 2}) {
    if (bits % v == 0) {
      return v;
    }
  }
  return 1;
}

// Big copies get big chunks (fewer lookups per byte); small ones get small chunks so that every
// resident warp still has work.
int64_t pick_chunk_bytes(int64_t total_bytes, int64_t resident_warps) {
  int64_t chunk = kMaxChunkBytes;
  while (chunk > kMinChunkBytes && total_bytes / chunk < kChunksPerWarp * resident_warps) {
    chunk /= 2;
  }
  return chunk;
}

size_t descs_bytes(int64_t num_segments) {
  return static_cast<size_t>(num_segments) * sizeof(SegmentDesc);
}

SegmentDesc describe(const Segment& s, int64_t chunk_bytes, int64_t first_chunk) {
  const int64_t v = vector_bytes(s);
  const ChunkGeometry g = make_chunk_geometry(s.num_rows, s.row_bytes / v, chunk_bytes / v);
  const uint32_t divisor = g.rows_per_chunk != 0 ? static_cast<uint32_t>(g.row_units) : 1;
  return {s.src, s.dst, s.src_stride, s.dst_stride, g, SmallDivider::make(divisor), first_chunk, v};
}

}  // namespace

cudaError_t plan_table(const Segment* segments, int64_t num_segments, int device, TableLayout* layout) {
  int sms = 0;
  int blocks_per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, segment_copy_kernel, kThreads, 0);
  }
  if (err != cudaSuccess) {
    return err;
  }
  // One resident wave: more blocks would only queue behind the grid-stride loop.
  const int64_t max_blocks = int64_t{sms} * std::max(blocks_per_sm, 1);
  int64_t total_bytes = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    total_bytes += segments[i].num_rows * segments[i].row_bytes;
  }
  layout->chunk_bytes = pick_chunk_bytes(total_bytes, max_blocks * kWarpsPerBlock);
  layout->num_segments = num_segments;
  layout->num_chunks = 0;
  for (int64_t i = 0; i < num_segments; ++i) {
    layout->num_chunks += describe(segments[i], layout->chunk_bytes, 0).geometry.num_chunks;
  }
  layout->bytes = static_cast<int64_t>(descs_bytes(num_segments) + layout->num_chunks * sizeof(int32_t));
  layout->grid = std::min((layout->num_chunks + kWarpsPerBlock - 1) / kWarpsPerBlock, max_blocks);
  return cudaSuccess;
}

void fill_table(const Segment* segments, const TableLayout& layout, void* host) {
  auto* descs = static_cast<SegmentDesc*>(host);
  auto* chunk_segment =
      reinterpret_cast<int32_t*>(static_cast<uint8_t*>(host) + descs_bytes(layout.num_segments));
  int64_t first_chunk = 0;
  for (int64_t i = 0; i < layout.num_segments; ++i) {
    descs[i] = describe(segments[i], layout.chunk_bytes, first_chunk);
    std::fill_n(chunk_segment + first_chunk, descs[i].geometry.num_chunks, static_cast<int32_t>(i));
    first_chunk += descs[i].geometry.num_chunks;
  }
}

cudaError_t launch(const void* device_table, int64_t num_segments, int64_t num_chunks, int64_t grid,
                   cudaStream_t stream) {
  const auto* base = static_cast<const uint8_t*>(device_table);
  segment_copy_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      reinterpret_cast<const SegmentDesc*>(base),
      reinterpret_cast<const int32_t*>(base + descs_bytes(num_segments)), num_chunks);
  return cudaGetLastError();
}

}  // namespace megarl::copy::cuda
