#pragma once

// Whether a tensor still has the memory its sizes describe. Offloading frees a tensor's memory by resizing its
// storage to 0 bytes (megarl/memory/offload.py) and leaves its sizes as they were: its data pointer is then null,
// and a kernel given it would read or write memory that is not the tensor's.

#include <ATen/core/Tensor.h>

namespace megarl {

// For a contiguous tensor: its bytes lie inside memory its storage holds.
inline bool holds_memory(const at::Tensor& t) {
  if (t.numel() == 0) {
    return true;
  }
  const c10::Storage& s = t.storage();
  return s.data() != nullptr &&
         (t.storage_offset() + t.numel()) * static_cast<int64_t>(t.element_size()) <= static_cast<int64_t>(s.nbytes());
}

}  // namespace megarl
