// A fixed set of equally sized staging buffers, allocated once and reused by every refit.
//
// The resharder double-buffers its send and receive staging (pack bucket k+1 while bucket k is on
// the wire). Allocating those buffers per refit would churn the caching allocator and, with
// engines waking up around the trainer, risks fragmentation-driven OOM; one allocation bounds the
// extra memory by the pool, whatever the model size.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace megarl::reshard {

class BufferPool {
 public:
  // `num_buffers` buffers of `buffer_bytes` each on `device`, each 256-byte aligned so the copy
  // kernels can take their widest vector path.
  BufferPool(int64_t num_buffers, int64_t buffer_bytes, const at::Device& device);

  // Buffer `index` as a uint8 tensor viewing the pool's storage; the same memory on every call.
  at::Tensor buffer(int64_t index) const;

  int64_t num_buffers() const { return num_buffers_; }
  int64_t buffer_bytes() const { return buffer_bytes_; }
  int64_t total_bytes() const { return storage_.numel(); }

 private:
  int64_t num_buffers_;
  int64_t buffer_bytes_;
  int64_t stride_;
  at::Tensor storage_;
};

}  // namespace megarl::reshard
