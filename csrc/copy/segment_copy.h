#pragma once

// Batched 2-D strided byte copy. Pack, unpack and layout regroup during resharding are all
// lists of segments, so one validated table and one launch serve every bucket.

#include "segment.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace megarl::copy {

// Checks devices, contiguity and every segment's bounds before anything is copied, and drops
// empty segments. Throws c10::Error naming the offending tensor or segment.
std::vector<Segment> resolve_segments(const std::vector<at::Tensor>& srcs,
                                      const std::vector<at::Tensor>& dsts, const at::Tensor& table);

// The device every tensor lives on (CPU when both lists are empty).
c10::Device common_device(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts);

struct CpuPlan;
struct CudaPlan;

// Validated once, replayed many times. Holds references to the tensors, so their storage
// stays alive, but it reads their data pointers only at construction: anything that later
// swaps a tensor's storage (resize_, set_, `.data =`) is not seen, build a new SegmentCopy.
// run() enqueues on the current CUDA stream; the device copy of the table lives on the stream
// current at construction, so destroy the object only after the runs on other streams finish.
class SegmentCopy {
 public:
  SegmentCopy(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, const at::Tensor& table);
  ~SegmentCopy();
  SegmentCopy(SegmentCopy&&) noexcept;
  SegmentCopy& operator=(SegmentCopy&&) noexcept;

  void run() const;
  int64_t num_segments() const { return num_segments_; }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<at::Tensor> tensors_;
  int64_t num_segments_ = 0;
  int64_t total_bytes_ = 0;
  std::unique_ptr<CpuPlan> cpu_;
  std::unique_ptr<CudaPlan> cuda_;
};

// One-shot form: validates, then copies. On CUDA it does not synchronize the host.
void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                   const at::Tensor& table);

}  // namespace megarl::copy
