#pragma once

// The hand-over checksum's block and arithmetic (megarl/reshard/verify.py), shared by the CPU and CUDA kernels
// (no torch headers, so that nvcc compiles the .cu alone): an
// element's bit pattern as a signed integer v and its flat position i contribute
// (v mod p) * ((i * a mod p) + 1) mod p, summed mod p, for p = 2^31 - 1 and two multipliers a.

#include <cstdint>

#ifdef __CUDACC__
#define MEGARL_HD __host__ __device__ __forceinline__
#else
#define MEGARL_HD inline
#endif

namespace megarl::verify {

// `num_rows` rows of `run` elements, row r starting at element `offset + r * row_stride` of `data`, its
// element c at position `first + r * position_stride + c` of the engine tensor whose checksum it adds to.
struct Block {
  const void* data;
  int64_t element_size;
  int64_t offset;
  int64_t row_stride;
  int64_t num_rows;
  int64_t run;
  int64_t first;
  int64_t position_stride;
};

constexpr uint64_t kPrime = (uint64_t{1} << 31) - 1;
constexpr uint64_t kMultiplier0 = 16807;
constexpr uint64_t kMultiplier1 = 48271;

// x mod p for any 64-bit x, by p = 2^31 - 1 being a Mersenne prime (no division).
MEGARL_HD uint64_t mod_prime(uint64_t x) {
  x = (x & kPrime) + (x >> 31);  // < 2^34
  x = (x & kPrime) + (x >> 31);  // <= 2^31 + 7
  return x >= kPrime ? x - kPrime : x;
}

// v mod p in [0, p), as Python's (and torch.remainder's) modulo of a negative v.
MEGARL_HD uint64_t value_mod(int64_t v) {
  const int64_t m = v % static_cast<int64_t>(kPrime);
  return static_cast<uint64_t>(m < 0 ? m + static_cast<int64_t>(kPrime) : m);
}

// Adds the element's two terms to sums kept below p.
MEGARL_HD void accumulate(int64_t bits, uint64_t position, uint64_t& sum0, uint64_t& sum1) {
  const uint64_t value = value_mod(bits);
  const uint64_t index = mod_prime(position);
  sum0 += mod_prime(value * (mod_prime(index * kMultiplier0) + 1));
  sum1 += mod_prime(value * (mod_prime(index * kMultiplier1) + 1));
  sum0 = sum0 >= kPrime ? sum0 - kPrime : sum0;
  sum1 = sum1 >= kPrime ? sum1 - kPrime : sum1;
}

}  // namespace megarl::verify
