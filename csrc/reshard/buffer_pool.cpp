#include "buffer_pool.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

namespace megarl::reshard {

namespace {
constexpr int64_t kAlign = 256;
}

BufferPool::BufferPool(int64_t num_buffers, int64_t buffer_bytes, const at::Device& device)
    : num_buffers_(num_buffers), buffer_bytes_(buffer_bytes) {
  TORCH_CHECK(num_buffers >= 1, "BufferPool: num_buffers must be >= 1, got ", num_buffers);
  TORCH_CHECK(buffer_bytes >= 1, "BufferPool: buffer_bytes must be >= 1, got ", buffer_bytes);
  // Divided before multiplied, and the total checked: a wrapped size would allocate a few bytes and hand out
  // buffers far past them.
  int64_t total = 0;
  TORCH_CHECK(!c10::mul_overflows(buffer_bytes / kAlign + (buffer_bytes % kAlign != 0), kAlign, &stride_) &&
                  !c10::mul_overflows(num_buffers, stride_, &total) && !c10::add_overflows(total, kAlign, &total),
              "BufferPool: ", num_buffers, " buffers of ", buffer_bytes,
              " bytes overflow a 64-bit size; lower the bucket size (rollout.reshard_bucket_mb)");
  // One allocation for all buffers, padded so the first buffer can be moved onto an aligned address.
  storage_ = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor BufferPool::buffer(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < num_buffers_, "BufferPool: buffer ", index, " out of range [0, ",
              num_buffers_, ")");
  const auto address = reinterpret_cast<uintptr_t>(storage_.data_ptr());
  const int64_t lead = static_cast<int64_t>((kAlign - address % kAlign) % kAlign);
  return storage_.narrow(0, lead + index * stride_, buffer_bytes_);
}

}  // namespace megarl::reshard
