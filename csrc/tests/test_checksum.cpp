// C++ tests of the hand-over checksum's CPU kernel and front end (run by ctest; see CMakeLists.txt): the sums
// against a naive evaluation in 128-bit integers, the blind spots of the 2^31 - 1 checksum it replaced, and
// blocks whose bounds overflow int64 or whose tensor has no memory.

#include "tests/run_tests.h"
#include "verify/checksum.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using megarl::verify::checksum;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(what);
  }
}

uint64_t power_mod(uint64_t base, uint64_t e, uint64_t p) {
  unsigned __int128 x = 1;
  unsigned __int128 b = base % p;
  for (; e != 0; e >>= 1) {
    if (e & 1) {
      x = x * b % p;
    }
    b = b * b % p;
  }
  return static_cast<uint64_t>(x);
}

// The definition, element by element: sum of u * r^i mod p, 8-byte elements as two halves at 2i and 2i + 1.
std::vector<int64_t> naive(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t rows, int64_t run,
                           int64_t first, int64_t position_stride) {
  const int64_t size = t.element_size();
  const auto* bytes = static_cast<const uint8_t*>(t.const_data_ptr());
  const uint64_t primes[2] = {megarl::verify::kPrime0, megarl::verify::kPrime1};
  const uint64_t bases[2] = {megarl::verify::kBase0, megarl::verify::kBase1};
  std::vector<int64_t> out;
  for (int f = 0; f < 2; ++f) {
    unsigned __int128 sum = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < run; ++c) {
        const uint8_t* e = bytes + (offset + r * row_stride + c) * size;
        const uint64_t position = static_cast<uint64_t>(first + r * position_stride + c);
        const int halves = size == 8 ? 2 : 1;
        for (int h = 0; h < halves; ++h) {
          uint64_t u = 0;
          std::memcpy(&u, e + 4 * h, size == 8 ? 4 : static_cast<size_t>(size));
          sum += static_cast<unsigned __int128>(u) * power_mod(bases[f], halves * position + h, primes[f]);
        }
      }
    }
    out.push_back(static_cast<int64_t>(sum % primes[f]));
  }
  return out;
}

std::vector<int64_t> sums(const at::Tensor& t, int64_t offset, int64_t row_stride, int64_t rows, int64_t run,
                          int64_t first, int64_t position_stride) {
  const at::Tensor c = checksum(t, offset, row_stride, rows, run, first, position_stride);
  return {c[0].item<int64_t>(), c[1].item<int64_t>()};
}

std::vector<int64_t> whole(const at::Tensor& t) {
  return sums(t, 0, t.numel(), 1, t.numel(), 0, t.numel());
}

at::Tensor random_bits(std::mt19937_64& rng, int64_t n, at::ScalarType dtype) {
  at::Tensor t = at::empty({n}, dtype);
  auto* bytes = static_cast<uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < static_cast<int64_t>(t.nbytes()); ++i) {
    bytes[i] = static_cast<uint8_t>(rng());
  }
  return t;
}

void test_blocks_equal_the_definition() {
  std::mt19937_64 rng(3);
  for (const at::ScalarType dtype : {at::kByte, at::kBFloat16, at::kFloat, at::kLong}) {
    const at::Tensor t = random_bits(rng, 40 * 23, dtype);
    // Positions far past 2^32 (and near the top that 8-byte halves leave) exercise every bit of a power.
    for (const int64_t first : {int64_t{0}, int64_t{1000}, (int64_t{1} << 40) + 7, (int64_t{1} << 61) - 99}) {
      expect(sums(t, 5, 23, 40, 12, first, 300) == naive(t, 5, 23, 40, 12, first, 300),
             "a strided block differs from the definition (dtype " + std::string(c10::toString(dtype)) +
                 ", first " + std::to_string(first) + ")");
    }
    expect(whole(t) == naive(t, 0, t.numel(), 1, t.numel(), 0, t.numel()), "a whole tensor differs");
  }
  // Rows longer than a piece, split over threads.
  const at::Tensor big = random_bits(rng, 3 * 4096 * 7 + 5, at::kBFloat16);
  expect(sums(big, 3, 4096 * 7, 3, 4096 * 7 - 1, 11, 5 << 20) == naive(big, 3, 4096 * 7, 3, 4096 * 7 - 1, 11, 5 << 20),
         "long rows differ from the definition");
}

// Two one-element rows of `t` whose positions are `distance` apart, the tensor never that large.
std::vector<int64_t> two_apart(const at::Tensor& t, int64_t distance) {
  return sums(t, 0, 1, 2, 1, 0, distance);
}

void test_a_swap_2_31_minus_1_apart_is_seen() {
  const at::Tensor t = at::tensor({int32_t{7}, int32_t{-3}});
  const at::Tensor swapped = at::tensor({int32_t{-3}, int32_t{7}});
  for (const int64_t distance : {(int64_t{1} << 31) - 1, (int64_t{1} << 31) - 2, (int64_t{1} << 32) - 6,
                                 (int64_t{1} << 32) - 18}) {
    expect(two_apart(t, distance) != two_apart(swapped, distance),
           "a swap of two elements " + std::to_string(distance) + " apart is not seen");
  }
}

at::Tensor from_bits_32(std::vector<uint32_t> bits, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(bits.size())}, dtype);
  std::memcpy(t.data_ptr(), bits.data(), bits.size() * 4);
  return t;
}

at::Tensor from_bits_64(std::vector<uint64_t> bits, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(bits.size())}, dtype);
  std::memcpy(t.data_ptr(), bits.data(), bits.size() * 8);
  return t;
}

void test_every_bit_pattern_counts() {
  // 0x7FFFFFFF is 0 mod 2^31 - 1; 0xFFFFFFFF (-1) and 0x7FFFFFFE are both NaN payloads and were equal mod it.
  const std::vector<std::pair<uint32_t, uint32_t>> pairs32{{0x7FFFFFFF, 0}, {0xFFFFFFFF, 0x7FFFFFFE},
                                                           {0x80000000, 1}, {0xFFFFFFFB, 0}, {0xFFFFFFEF, 0}};
  for (const auto& [a, b] : pairs32) {
    for (const at::ScalarType dtype : {at::kInt, at::kFloat}) {
      expect(whole(from_bits_32({5, a, 9}, dtype)) != whole(from_bits_32({5, b, 9}, dtype)),
             "4-byte patterns " + std::to_string(a) + " and " + std::to_string(b) + " hash alike");
    }
  }
  // 8-byte patterns: 2^31 - 1 apart, and two float64 NaNs whose payloads differ by 2^31 - 1.
  const std::vector<std::pair<uint64_t, uint64_t>> pairs64{
      {0x7FFFFFFF, 0}, {0x7FF8000000000000 + 0x7FFFFFFF, 0x7FF8000000000000}, {uint64_t{1} << 32, 0}};
  for (const auto& [a, b] : pairs64) {
    for (const at::ScalarType dtype : {at::kLong, at::kDouble}) {
      expect(whole(from_bits_64({5, a, 9}, dtype)) != whole(from_bits_64({5, b, 9}, dtype)),
             "8-byte patterns " + std::to_string(a) + " and " + std::to_string(b) + " hash alike");
    }
  }
}

void test_mirrored_swaps_do_not_cancel() {
  // Weights linear in the position cancel here: sum of (i * a + 1) * v is the same for both.
  const at::Tensor t = at::tensor({int16_t{11}, int16_t{-4}, int16_t{-4}, int16_t{11}});
  const at::Tensor mirrored = at::tensor({int16_t{-4}, int16_t{11}, int16_t{11}, int16_t{-4}});
  expect(whole(t) != whole(mirrored), "[a, b, b, a] and [b, a, a, b] hash alike");
}

bool refused(const std::function<void()>& f, const std::string& words) {
  try {
    f();
  } catch (const c10::Error& e) {
    return std::string(e.what()).find(words) != std::string::npos;
  }
  return false;
}

void test_bounds_that_overflow_are_refused() {
  const at::Tensor t = at::zeros({10}, at::kFloat);
  constexpr int64_t kHuge = int64_t{1} << 62;
  // 4 * 2^62 wraps to 0, so the block's end looked like element 1 of 10 and rows 1..4 read 2^62 elements on.
  expect(refused([&] { checksum(t, 0, kHuge, 5, 1, 0, 1); }, "run past"), "a row stride that wraps is accepted");
  expect(refused([&] { checksum(t, std::numeric_limits<int64_t>::max(), 1, 1, 1, 0, 1); }, "run past"),
         "an offset that wraps is accepted");
  expect(refused([&] { checksum(t, 0, 1, 2, 1, 0, kHuge); }, "overflow"), "positions that wrap are accepted");
}

void test_a_tensor_without_memory_is_refused_by_name() {
  at::Tensor t = at::ones({1024}, at::kFloat);
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), 0);  // what an offload's resize_(0) does
  expect(refused([&] { checksum(t, 0, 1024, 1, 1024, 0, 1024, "model.norm.weight"); },
                 "`model.norm.weight` has no memory"),
         "a tensor whose storage was resized to 0 is read");
}

}  // namespace

int main() {
  return megarl::testing::run_tests({
      {"blocks_equal_the_definition", test_blocks_equal_the_definition},
      {"a_swap_2_31_minus_1_apart_is_seen", test_a_swap_2_31_minus_1_apart_is_seen},
      {"every_bit_pattern_counts", test_every_bit_pattern_counts},
      {"mirrored_swaps_do_not_cancel", test_mirrored_swaps_do_not_cancel},
      {"bounds_that_overflow_are_refused", test_bounds_that_overflow_are_refused},
      {"a_tensor_without_memory_is_refused_by_name", test_a_tensor_without_memory_is_refused_by_name},
  });
}
