#pragma once

// What the front end (segment_copy.cpp) needs from each device backend: build a plan once from
// validated segments, then run it with no further validation.

#include "chunking.h"
#include "segment_copy.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace megarl::copy {

struct CpuPlan {
  std::vector<Segment> segments;
  std::vector<ChunkGeometry> geometry;
  // chunk_offsets[s] is the first chunk of segment s; the last entry is the total.
  std::vector<int64_t> chunk_offsets;
};

CpuPlan make_cpu_plan(std::vector<Segment> segments);
void run_cpu_plan(const CpuPlan& plan);

// Built only with CUDA, in segment_copy_cuda_plan.cpp; declared always so that SegmentCopy's
// layout does not depend on the build.
struct CudaPlan {
  // Device copy of the table that segment_copy_cuda.cu lays out.
  at::Tensor table;
  int64_t num_segments = 0;
  int64_t num_chunks = 0;
  int64_t grid = 0;
};

#ifdef MEGARL_WITH_CUDA
// `wait` blocks until the table is on the device, so later runs on any stream may use it.
CudaPlan make_cuda_plan(const std::vector<Segment>& segments, c10::Device device, bool wait);
void run_cuda_plan(const CudaPlan& plan);
#endif

}  // namespace megarl::copy
