// CPU kernel of the hand-over checksum: rows split over threads (at::parallel_for), sums kept below p.

#include "checksum.h"
#include "checksum_math.h"

#include <ATen/Parallel.h>

#include <array>
#include <mutex>

namespace megarl::verify {
namespace {

template <typename T>
void sum_block(const Block& b, int64_t* out) {
  const T* data = static_cast<const T*>(b.data);
  const int64_t total = b.num_rows * b.run;
  std::array<uint64_t, 2> sums{0, 0};
  std::mutex lock;
  at::parallel_for(0, total, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    uint64_t sum0 = 0;
    uint64_t sum1 = 0;
    int64_t row = begin / b.run;
    int64_t column = begin - row * b.run;
    for (int64_t e = begin; e < end; ++e) {
      accumulate(static_cast<int64_t>(data[b.offset + row * b.row_stride + column]),
                 static_cast<uint64_t>(b.first + row * b.position_stride + column), sum0, sum1);
      if (++column == b.run) {
        column = 0;
        ++row;
      }
    }
    const std::lock_guard<std::mutex> guard(lock);
    sums[0] = mod_prime(sums[0] + sum0);
    sums[1] = mod_prime(sums[1] + sum1);
  });
  out[0] = static_cast<int64_t>(sums[0]);
  out[1] = static_cast<int64_t>(sums[1]);
}

}  // namespace

void checksum_cpu(const Block& block, int64_t* out) {
  switch (block.element_size) {
    case 1: return sum_block<int8_t>(block, out);
    case 2: return sum_block<int16_t>(block, out);
    case 4: return sum_block<int32_t>(block, out);
    default: return sum_block<int64_t>(block, out);
  }
}

}  // namespace megarl::verify
