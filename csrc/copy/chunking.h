#pragma once

// How a segment is cut into chunks of roughly equal work. Shared by the CPU and CUDA
// backends (and the C++ tests) so both balance work the same way: a long row is split
// into pieces, short rows are grouped, and no chunk exceeds `chunk_units` units.

#include <cstdint>

#ifdef __CUDACC__
#define MEGARL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGARL_HOST_DEVICE inline
#endif

namespace megarl::copy {

// A unit is whatever the backend moves at once: one byte for memcpy, one vector on the GPU.
struct ChunkGeometry {
  int64_t num_rows;
  int64_t row_units;
  int64_t chunk_units;
  // Exactly one of the two is non-zero for a non-empty segment.
  int64_t pieces_per_row;
  int64_t rows_per_chunk;
  int64_t num_chunks;
};

// One chunk: the rectangle [row_begin, row_begin + num_rows) x [col_begin, col_begin + num_cols).
struct ChunkRect {
  int64_t row_begin;
  int64_t col_begin;
  int64_t num_rows;
  int64_t num_cols;
};

MEGARL_HOST_DEVICE ChunkGeometry make_chunk_geometry(int64_t num_rows, int64_t row_units,
                                                     int64_t chunk_units) {
  ChunkGeometry g{num_rows, row_units, chunk_units, 0, 0, 0};
  if (num_rows == 0 || row_units == 0) {
    return g;
  }
  if (row_units >= chunk_units) {
    g.pieces_per_row = (row_units + chunk_units - 1) / chunk_units;
    g.num_chunks = num_rows * g.pieces_per_row;
  } else {
    g.rows_per_chunk = chunk_units / row_units;
    g.num_chunks = (num_rows + g.rows_per_chunk - 1) / g.rows_per_chunk;
  }
  return g;
}

MEGARL_HOST_DEVICE ChunkRect chunk_rect(const ChunkGeometry& g, int64_t chunk) {
  if (g.pieces_per_row != 0) {
    const int64_t row = chunk / g.pieces_per_row;
    const int64_t col = (chunk - row * g.pieces_per_row) * g.chunk_units;
    const int64_t left = g.row_units - col;
    return {row, col, 1, left < g.chunk_units ? left : g.chunk_units};
  }
  const int64_t row = chunk * g.rows_per_chunk;
  const int64_t left = g.num_rows - row;
  return {row, 0, left < g.rows_per_chunk ? left : g.rows_per_chunk, g.row_units};
}

// Division by a per-segment constant without a hardware divide, valid whenever
// n * divisor < 2^32. Inside a grouped chunk both n and the row length are below
// chunk_units <= 2^16, which is why the GPU keeps chunks at most 64 Ki units.
// With m = floor(2^32 / d) + 1, n * m / 2^32 = n / d + e where 0 <= e <= n / 2^32 < 1 / d,
// too small to carry n / d past the next integer.
struct SmallDivider {
  uint32_t divisor;
  uint64_t multiplier;

  MEGARL_HOST_DEVICE static SmallDivider make(uint32_t d) {
    return {d, (uint64_t{1} << 32) / d + 1};
  }
  MEGARL_HOST_DEVICE uint32_t div(uint32_t n) const {
    return static_cast<uint32_t>((n * multiplier) >> 32);
  }
};

constexpr int64_t kMaxChunkUnits = int64_t{1} << 16;

}  // namespace megarl::copy
