// CPU kernel of the hand-over checksum: each row cut into pieces spread over threads (at::parallel_for); a piece is
// summed by Horner's rule from its last element, then moved to its position by one power of r.

#include "checksum.h"
#include "checksum_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <mutex>

namespace megarl::verify {
namespace {

// Long enough that the power per piece costs little next to the piece's multiply-adds.
constexpr int64_t kPiece = 4096;

template <typename T>
void sum_block(const Block& b, int64_t* out) {
  static const Powers powers = make_powers();
  const T* data = static_cast<const T*>(b.data);
  const int64_t pieces_per_row = (b.run + kPiece - 1) / kPiece;
  std::array<uint64_t, 2> sums{0, 0};
  std::mutex lock;
  at::parallel_for(0, b.num_rows * pieces_per_row, int64_t{16}, [&](int64_t begin, int64_t end) {
    uint64_t sum0 = 0;
    uint64_t sum1 = 0;
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t row = piece / pieces_per_row;
      const int64_t column = (piece - row * pieces_per_row) * kPiece;
      const T* x = data + b.offset + row * b.row_stride + column;
      uint64_t h0 = 0;
      uint64_t h1 = 0;
      for (int64_t j = std::min(kPiece, b.run - column) - 1; j >= 0; --j) {
        h0 = multiply_add<kFold0>(h0, kBase0, x[j]);
        h1 = multiply_add<kFold1>(h1, kBase1, x[j]);
      }
      const auto position = static_cast<uint64_t>(b.first + row * b.position_stride + column);
      sum0 = fold<kFold0>(sum0 + multiply_add<kFold0>(h0, power<0>(powers, position), 0));
      sum1 = fold<kFold1>(sum1 + multiply_add<kFold1>(h1, power<1>(powers, position), 0));
    }
    const std::lock_guard<std::mutex> guard(lock);
    sums[0] = fold<kFold0>(sums[0] + sum0);
    sums[1] = fold<kFold1>(sums[1] + sum1);
  });
  out[0] = static_cast<int64_t>(canonical<kFold0>(sums[0]));
  out[1] = static_cast<int64_t>(canonical<kFold1>(sums[1]));
}

}  // namespace

void checksum_cpu(const Block& block, int64_t* out) {
  switch (block.element_size) {
    case 1: return sum_block<uint8_t>(block, out);
    case 2: return sum_block<uint16_t>(block, out);
    default: return sum_block<uint32_t>(block, out);
  }
}

}  // namespace megarl::verify
