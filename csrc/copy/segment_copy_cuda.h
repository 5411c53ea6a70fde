#pragma once

// Host interface of segment_copy_cuda.cu, in plain CUDA runtime types. The .cu includes no torch
// headers, so it compiles with nvcc alone (also where torch is a CPU build) and fast; the ATen
// side (device guard, streams, upload, errors) is segment_copy_cuda_plan.cpp.

#include "segment.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace megarl::copy::cuda {

// The launch decided on the host. The device table holds one descriptor per segment, then the
// segment index (int32) of every chunk.
struct TableLayout {
  int64_t bytes = 0;
  int64_t num_segments = 0;
  int64_t num_chunks = 0;
  int64_t chunk_bytes = 0;
  int64_t grid = 0;
};

cudaError_t plan_table(const Segment* segments, int64_t num_segments, int device, TableLayout* layout);

// Writes the table into `host`, which holds layout.bytes and is 8-byte aligned.
void fill_table(const Segment* segments, const TableLayout& layout, void* host);

// Enqueues the copy on `stream` and returns the launch's error.
cudaError_t launch(const void* device_table, int64_t num_segments, int64_t num_chunks, int64_t grid,
                   cudaStream_t stream);

}  // namespace megarl::copy::cuda
