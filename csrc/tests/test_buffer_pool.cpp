// C++ tests of the reshard buffer pool (run by ctest; see CMakeLists.txt): sizes whose total wraps int64 are
// refused instead of allocating a few bytes and handing out buffers far past them.

#include "reshard/buffer_pool.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <utility>

namespace {

bool refused(int64_t num_buffers, int64_t buffer_bytes) {
  try {
    const megarl::reshard::BufferPool pool(num_buffers, buffer_bytes, at::Device(at::kCPU));
  } catch (const c10::Error& e) {
    return std::string(e.what()).find("overflow") != std::string::npos;
  }
  return false;
}

}  // namespace

int main() {
  int failed = 0;
  // 4 * 2^62 wraps to 0: the pool allocated 256 bytes. INT64_MAX rounded up to 256 wraps on its own.
  for (const auto& [n, bytes] : {std::pair<int64_t, int64_t>{4, int64_t{1} << 62},
                                 {2, std::numeric_limits<int64_t>::max()}, {3, (int64_t{1} << 62) - 255}}) {
    if (!refused(n, bytes)) {
      ++failed;
      std::cout << "FAILED " << n << " buffers of " << bytes << " bytes are not refused\n";
    }
  }
  const megarl::reshard::BufferPool pool(3, 1000, at::Device(at::kCPU));
  if (pool.buffer(2).numel() != 1000 || pool.total_bytes() != 3 * 1024 + 256) {
    ++failed;
    std::cout << "FAILED a small pool's sizes\n";
  }
  std::cout << (failed == 0 ? "ok     buffer_pool_sizes\n" : "");
  return failed == 0 ? 0 : 1;
}
