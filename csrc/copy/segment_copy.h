#pragma once

// Batched 2-D strided byte copy. Pack, unpack and layout regroup during resharding are all
// lists of segments, so one validated table and one launch serve every bucket.

#include "segment.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megarl::copy {

// What errors call each tensor: its place in srcs or dsts and, where given, its name (a parameter's).
struct Labels {
  std::vector<std::string> srcs;
  std::vector<std::string> dsts;
};

// Checks devices, contiguity, memory behind every tensor, every segment's bounds and that no two segments write
// the same byte before anything is copied, and drops empty segments. Throws c10::Error naming the offending
// tensor or segments. Names, if given, are one per tensor.
std::vector<Segment> resolve_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                                      const at::Tensor& table, const Labels& names = {});

// The device every tensor lives on (CPU when both lists are empty).
c10::Device common_device(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts);

struct CpuPlan;
struct CudaPlan;

// Validated once, replayed many times. Holds references to the tensors, so their storage
// stays alive, but the plan keeps the addresses they had at construction: run() first checks that
// every storage still has the address and size it was built with (an offload's resize_(0), a
// resize, set_ or `.data =` fail it, naming the tensor) and copies nothing if one has not; build a
// new SegmentCopy once the tensor is back.
// run() enqueues on the current CUDA stream; the device copy of the table lives on the stream
// current at construction, so destroy the object only after the runs on other streams finish.
class SegmentCopy {
 public:
  SegmentCopy(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, const at::Tensor& table,
              const Labels& names = {});
  ~SegmentCopy();
  SegmentCopy(SegmentCopy&&) noexcept;
  SegmentCopy& operator=(SegmentCopy&&) noexcept;

  void run() const;
  int64_t num_segments() const { return num_segments_; }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  // Where a tensor's memory was when the copy was built.
  struct Place {
    const void* storage;
    size_t nbytes;
    int64_t storage_offset;
  };
  void check_places() const;

  std::vector<at::Tensor> tensors_;  // srcs, then dsts
  std::vector<Place> places_;        // one per tensor
  std::vector<std::string> labels_;  // one per tensor, for errors
  int64_t num_segments_ = 0;
  int64_t total_bytes_ = 0;
  std::unique_ptr<CpuPlan> cpu_;
  std::unique_ptr<CudaPlan> cuda_;
};

// One-shot form: validates, then copies. On CUDA it does not synchronize the host.
void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                   const at::Tensor& table, const Labels& names = {});

}  // namespace megarl::copy
