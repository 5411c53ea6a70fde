// CPU backend: memcpy per chunk row, chunks spread over ATen's thread pool.

#include "backends.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace megarl::copy {
namespace {

// Small enough that one large segment still spreads over every thread, large enough that the
// per-chunk bookkeeping disappears next to the memcpy.
constexpr int64_t kChunkBytes = int64_t{64} << 10;
// Below this many bytes per thread, waking the pool costs more than it saves.
constexpr int64_t kMinBytesPerThread = int64_t{1} << 20;

void copy_chunk(const Segment& s, const ChunkRect& r) {
  const uint8_t* src = s.src + r.row_begin * s.src_stride + r.col_begin;
  uint8_t* dst = s.dst + r.row_begin * s.dst_stride + r.col_begin;
  for (int64_t i = 0; i < r.num_rows; ++i) {
    std::memcpy(dst + i * s.dst_stride, src + i * s.src_stride, static_cast<size_t>(r.num_cols));
  }
}

}  // namespace

CpuPlan make_cpu_plan(std::vector<Segment> segments) {
  CpuPlan plan;
  plan.geometry.reserve(segments.size());
  plan.chunk_offsets.reserve(segments.size() + 1);
  plan.chunk_offsets.push_back(0);
  for (const Segment& s : segments) {
    plan.geometry.push_back(make_chunk_geometry(s.num_rows, s.row_bytes, kChunkBytes));
    plan.chunk_offsets.push_back(plan.chunk_offsets.back() + plan.geometry.back().num_chunks);
  }
  plan.segments = std::move(segments);
  return plan;
}

void run_cpu_plan(const CpuPlan& plan) {
  const std::vector<int64_t>& offsets = plan.chunk_offsets;
  at::parallel_for(0, offsets.back(), kMinBytesPerThread / kChunkBytes, [&](int64_t begin, int64_t end) {
    size_t s = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (int64_t c = begin; c < end; ++c) {
      while (offsets[s + 1] <= c) {
        ++s;
      }
      copy_chunk(plan.segments[s], chunk_rect(plan.geometry[s], c - offsets[s]));
    }
  });
}

}  // namespace megarl::copy
